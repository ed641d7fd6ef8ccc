"""Experts modules on fake tensors as one rank of an expert- or tensor-parallel plan runs them.

`functional_shard.costing.routing` re-enacts transformers' own experts implementations, which a
data-parallel plan runs. A plan that splits the experts runs `engines.experts`' forwards
instead, and the trace re-enacts those, op for op, on the rank's local shapes:

* **expert parallel** (``E / ep`` experts whole on each rank): the token copies sorted by
  expert, sent (an all-to-all) to the ranks holding their experts; the rank runs each of
  its local experts on what arrives, sends the results back, and weights and sums them
  per token. Every rank routes alike (`routing.expert_loads`), so a local expert ``e``
  receives ``ep × loads[e]`` copies: ``T·k`` rows in all under balanced routing; with
  ``expert_imbalance`` the hot expert 0 lives on ep rank 0, whose trace is the heaviest.
* **tensor parallel inside the experts**: every token copy through the rank's ``f / tp``
  slice of its experts, the partial outputs summed (an all-reduce).

A collective becomes a stand-in autograd function that makes a new tensor of the shape
the real one returns and saves nothing (as torch's autograd-aware all-to-all saves
nothing): its bytes and time are the cost model's (`functional_shard.costing.expert_cost`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from .routing import expert_loads, routed_experts

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
    # the engine's per-expert loop (its index of each expert's rows, an out-of-place index_add)
    out = rows.new_zeros(rows.shape[0], down.shape[1])
    for expert, load in enumerate(loads):
        if not load:
            continue
        with torch.no_grad():
            index = torch.empty(load, dtype=torch.long, device=rows.device)
        gate, up = F.linear(rows[index], gate_up[expert]).chunk(2, dim=-1)
        out = out.index_add(0, index, F.linear(module.act_fn(gate) * up, down[expert]))
    return out


def _dispatched(
    module: Any,
    ep: int,
    ep_index: int,
    imbalance: float,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    gate_up, down = module.gate_up_proj, module.down_proj
    local = gate_up.shape[0]
    tokens, top_k = top_k_index.shape
    loads = expert_loads(tokens, top_k, local * ep, imbalance)
    received = [ep * load for load in loads[ep_index * local : (ep_index + 1) * local]]
    order = torch.argsort(top_k_index.reshape(-1), stable=True)
    token = order // top_k
    arrived = _Exchange.apply(hidden_states[token].contiguous(), sum(received))
    done = _tie(_run_local(module, arrived, received, gate_up, down), arrived, gate_up, down)
    back = _Exchange.apply(done, tokens * top_k)
    weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))


def _tensor_parallel(
    module: Any,
    imbalance: float,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    gate_up, down = module.gate_up_proj, module.down_proj
    tokens, top_k = top_k_index.shape
    loads = expert_loads(tokens, top_k, gate_up.shape[0], imbalance)
    token = torch.arange(tokens, device=hidden_states.device).repeat_interleave(top_k)
    y = _run_local(module, hidden_states[token], loads, gate_up, down)
    y = y * top_k_weights.reshape(-1, 1).to(y.dtype)
    out = _tie(torch.zeros_like(hidden_states).index_add(0, token, y.to(hidden_states.dtype)), gate_up, down)
    return _Exchange.apply(out, tokens)  # the partial sums all-reduced


@contextlib.contextmanager
def rank_experts(
    modules: Mapping[str, nn.Module], imbalance: float, plan: Any, rank: int = 0
) -> Iterator[None]:
    """Within the block, experts modules run as ``rank`` of ``plan`` runs them, routed by `expert_loads`.

    The modules the plan splits (``plan.config.expert_modules``, and those whose
    tensor-parallel style kind is ``experts``) re-enact `engines.experts`' forwards on the
    rank's local shapes; transformers' experts modules the plan leaves whole are routed
    by `functional_shard.costing.routing.routed_experts`.

    Examples:
        >>> import torch.nn as nn, functional_shard as fs
        >>> model = nn.Linear(2, 2)
        >>> with rank_experts(dict(model.named_modules()), 1.0, fs.shard(model, fs.Mesh(dp=1), fs.fsdp())):
        ...     pass
    """
    config = plan.config
    dispatched = set(config.expert_modules)
    split = set(config.tensor_parallel_experts)
    axis = config.expert_axis
    ep = plan.mesh[axis] if axis else 1
    ep_index = plan.mesh.coords(rank)[axis] if axis else 0
    replaced: list[tuple[nn.Module, Any]] = []
    try:
        for path in dispatched | split:
            module = modules.get(path)
            if module is None:
                continue
            replaced.append((module, module.__dict__.get("forward")))
            if path in dispatched:
                forward = functools.partial(_dispatched, module, ep, ep_index, imbalance)
            else:
                forward = functools.partial(_tensor_parallel, module, imbalance)
            module.forward = forward  # type: ignore[method-assign]
        whole = [module for path, module in modules.items() if path not in dispatched | split]
        with routed_experts(whole, imbalance):
            yield
    finally:
        for module, previous in replaced:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous  # type: ignore[method-assign]
