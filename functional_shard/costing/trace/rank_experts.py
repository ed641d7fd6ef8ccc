"""Experts modules on fake tensors as one rank of an expert- or tensor-parallel plan runs them.

A plan that splits the experts runs `engines.experts`' forwards, re-enacted here op for op on the
rank's local shapes. torchtitan's grouped experts split by tensor parallel run their own forward
(`routing.titan_experts`) on the rank's slice of each expert, their output all-reduced. Under
expert parallel every rank routes alike (`routing.expert_loads`), so local expert ``e`` receives
``ep × loads[e]`` copies; the hot expert 0 lives on ep rank 0. A collective
becomes a stand-in that makes a tensor of the real one's shape and saves nothing; its bytes are the
cost model's (`functional_shard.costing.cost.expert_traffic`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from functional_shard.planning.tp.hf_plans import expert_top_k

from .routing import expert_loads, is_traced_titan_experts, routed_experts, titan_experts, titan_loads

__all__ = ["rank_experts"]


class _Exchange(torch.autograd.Function):
    """A collective's stand-in: ``rows`` rows out (its gradient: the input's shape back)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.shape = tensor.shape
        return tensor.new_empty((rows, *tensor.shape[1:]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.new_empty(ctx.shape), None


def _tie(out: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    # as the engine's: zero times a slice of each weight, so every rank's backward reaches them
    return out + sum(0 * w.reshape(-1)[:1].sum() for w in weights)


def _run_local(module: Any, rows: torch.Tensor, loads: list[int], gate_up: Any, down: Any) -> torch.Tensor:
    # the engine's loop: rows gathered once in expert order and split, experts taken by unbind,
    # outputs added in place (its bincount is left out: a fake tensor cannot size it)
    with torch.no_grad():
        order = torch.argsort(torch.empty(rows.shape[0], dtype=torch.long, device=rows.device), stable=True)
    out = rows.new_zeros(rows.shape[0], down.shape[1])
    pieces = zip(rows[order].split(loads), order.split(loads), gate_up.unbind(0), down.unbind(0), strict=True)
    for piece, index, expert_gate_up, expert_down in pieces:
        if index.numel() == 0:
            continue
        gate, up = F.linear(piece, expert_gate_up).chunk(2, dim=-1)
        out.index_add_(0, index, F.linear(module.act_fn(gate) * up, expert_down))
    return out


@dataclass(frozen=True, slots=True)
class _SplitExperts:
    """An experts module the plan splits, as one rank runs it: ``forward`` stands in for its own.

    ``dispatched``: expert parallel, this rank holding the ``ep_index``-th ``E / ep`` experts; else
    tensor parallel inside each expert (``ep`` 1).
    """

    module: Any
    imbalance: float
    dispatched: bool
    ep: int = 1
    ep_index: int = 0

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """The engine's forward for the router's picks, its experts' loads by `expert_loads`."""
        gate_up, down = self.module.gate_up_proj, self.module.down_proj
        tokens, top_k = top_k_index.shape
        local = gate_up.shape[0]
        loads = expert_loads(tokens, top_k, local * self.ep, self.imbalance)
        if not self.dispatched:  # every token copy through this rank's slice of each expert
            token = torch.arange(tokens, device=hidden_states.device).repeat_interleave(top_k)
            y = _run_local(self.module, hidden_states[token], loads, gate_up, down)
            y = y * top_k_weights.reshape(-1, 1).to(y.dtype)
            out = _tie(
                torch.zeros_like(hidden_states).index_add(0, token, y.to(hidden_states.dtype)), gate_up, down
            )
            return _Exchange.apply(out, tokens)  # the partial sums all-reduced
        # the copies sorted by expert, sent to the ranks holding theirs, run there and sent back
        received = [self.ep * load for load in loads[self.ep_index * local : (self.ep_index + 1) * local]]
        order = torch.argsort(top_k_index.reshape(-1), stable=True)
        token = order // top_k
        arrived = _Exchange.apply(hidden_states[token].contiguous(), sum(received))
        done = _tie(_run_local(self.module, arrived, received, gate_up, down), arrived, gate_up, down)
        back = _Exchange.apply(done, tokens * top_k)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))


@dataclass(frozen=True, slots=True)
class _SplitTitanExperts:
    """torchtitan's grouped experts split by tensor parallel, as one rank runs them.

    The engine's (``engines.experts``): every routed copy, whole, through the rank's slice of each
    expert's hidden features; the partial output all-reduced. ``top_k`` as `routing.titan_loads` takes it.
    """

    module: Any
    imbalance: float
    top_k: int

    def forward(self, rows: Tensor, *counts: Any) -> Tensor:
        """The experts' own forward for the loads of `routing.titan_loads`, its output all-reduced."""
        loads = titan_loads(self.module, rows.shape[0], self.top_k, self.imbalance)
        return _Exchange.apply(titan_experts(self.module, rows, loads), rows.shape[0])


def _split_forward(module: Any, dispatched: bool, setup: tuple[float, int, int, int]) -> Any:
    """The forward one rank runs for ``module``, split by expert (``dispatched``) or inside each expert.

    ``setup``: the imbalance, each token's copies (top-k, 0 unknown), ep and this rank's ep index.
    """
    imbalance, top_k, ep, ep_index = setup
    if is_traced_titan_experts(module):  # tensor parallel only (the trace refuses them under ep)
        return _SplitTitanExperts(module, imbalance, top_k).forward
    if dispatched:
        return _SplitExperts(module, imbalance, dispatched=True, ep=ep, ep_index=ep_index).forward
    return _SplitExperts(module, imbalance, dispatched=False).forward


@contextlib.contextmanager
def rank_experts(
    modules: Mapping[str, nn.Module], imbalance: float, plan: Any, rank: int = 0
) -> Iterator[None]:
    """Within the block, experts modules run as ``rank`` of ``plan`` runs them, routed by `expert_loads`.

    Modules the plan leaves whole are routed by `functional_shard.costing.trace.routing.routed_experts`.

    Examples:
        >>> import torch.nn as nn, functional_shard as fs
        >>> model = nn.Linear(2, 2)
        >>> with rank_experts(dict(model.named_modules()), 1.0, fs.shard(model, fs.Mesh(dp=1), fs.fsdp())):
        ...     pass
    """
    config = plan.config
    experts = config.experts
    dispatched = set(experts.modules if experts else ())
    split = set(config.tensor_parallel_experts)
    ep = experts.size(plan.mesh) if experts else 1
    ep_index = plan.mesh.coords(rank)[experts.axis] if experts and experts.axis else 0
    # the plan knows each token's top-k where it splits experts; for whole ones the model says it
    top_k = (experts.top_k if experts else 0) or expert_top_k(modules.get(""))
    replaced: list[tuple[nn.Module, Any]] = []
    try:
        for path in dispatched | split:
            module = modules.get(path)
            if module is None:
                continue
            replaced.append((module, module.__dict__.get("forward")))
            forward = _split_forward(module, path in dispatched, (imbalance, top_k, ep, ep_index))
            module.forward = forward  # type: ignore[method-assign]
        whole = [module for path, module in modules.items() if path not in dispatched | split]
        with routed_experts(whole, imbalance, top_k):
            yield
    finally:
        for module, previous in replaced:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous  # type: ignore[method-assign]
