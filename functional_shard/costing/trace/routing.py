"""Mixture-of-experts layers on fake tensors: which experts each token visits, decided up front.

Fake tensors have no values to route by: `routed_experts` runs each experts module as its
implementation would, for loads fixed in advance by `expert_loads` (balanced, or one hot expert):
transformers' experts modules, and torchtitan's grouped experts as its main branch names them.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import refuse
from functional_shard.planning.tp.styles import TITAN_EXPERT_WEIGHTS, titan_expert_names

from .counting import fused_kernel

__all__ = [
    "check_expert_imbalance",
    "expert_loads",
    "is_traced_titan_experts",
    "routed_experts",
    "titan_experts",
    "titan_loads",
]


def check_expert_imbalance(imbalance: Any) -> float:
    """``imbalance`` if it is a finite number >= 1, else a `ShardingError` saying what it means."""
    if isinstance(imbalance, bool) or not isinstance(imbalance, int | float) or not 1 <= imbalance < math.inf:
        refuse(
            "expert_imbalance",
            repr(imbalance),
            "a finite number >= 1",
            meaning="1.0 is balanced routing; 2.0 gives the most loaded expert of each mixture-of-experts "
            "layer twice an even share of the tokens",
        )
    return float(imbalance)


def expert_loads(tokens: int, top_k: int, experts: int, imbalance: float = 1.0) -> list[int]:
    """Tokens each of ``experts`` experts gets when ``tokens`` tokens each visit ``top_k`` of them.

    Evenly, the remainder to the lowest-numbered experts; ``imbalance`` > 1 gives expert 0
    ``ceil(imbalance * tokens * top_k / experts)`` (at most ``tokens``) and shares the rest evenly.

    Raises:
        ShardingError: ``imbalance`` below 1, or more than the tokens there are.

    Examples:
        >>> expert_loads(tokens=10, top_k=2, experts=8)
        [3, 3, 3, 3, 2, 2, 2, 2]
        >>> expert_loads(tokens=10, top_k=2, experts=8, imbalance=2.0)
        [5, 3, 2, 2, 2, 2, 2, 2]
    """
    visits = tokens * top_k
    check_expert_imbalance(imbalance)
    # rounded first, so that 1.0 * 20 / 8 is not pushed up by float error
    hot = math.ceil(round(imbalance * visits / experts, 9))
    if hot > tokens:
        raise ShardingError(
            f"expert_imbalance={imbalance!r}: the most loaded of {experts} experts would get {hot} tokens, "
            f"but {tokens} tokens visit {top_k} experts each and a token visits an expert once: "
            f"use at most {experts / top_k:g} (experts / top-k) for this model"
        )
    if experts == 1 or hot == -(-visits // experts):
        share, extra = divmod(visits, experts)
        return [share + (expert < extra) for expert in range(experts)]
    share, extra = divmod(visits - hot, experts - 1)
    return [hot] + [share + (expert < extra) for expert in range(experts - 1)]


def _is_routed_experts(module: nn.Module) -> bool:
    # transformers' experts (Mixtral, Qwen2-MoE, Qwen3-MoE, ...): gate and up projections
    # concatenated in one [E, 2f, d] parameter, down [E, d, f], no biases
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.ndim == down.ndim == 3
        and isinstance(getattr(module, "num_experts", None), int)
        and callable(getattr(module, "act_fn", None))
        and getattr(module, "has_gate", True)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "is_transposed", False)
        and getattr(module, "is_concatenated", True)
    )


def _experts_implementation(module: nn.Module) -> str:
    # set by transformers' use_experts_implementation from the config ("grouped_mm" by default)
    return getattr(getattr(module, "config", None), "_experts_implementation", None) or "eager"


def _eager_experts(
    module: Any, loads: list[int], hidden_states: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    # transformers' eager loop, for the given loads: per expert, the rows `where` picks
    final = torch.zeros_like(hidden_states)
    for expert, load in enumerate(loads):
        if not load:
            continue  # the loop skips experts no token chose
        with torch.no_grad():  # `where` on the expert's mask: one (load, 2) index storage
            top_k_pos, token_idx = torch.empty(load, 2, dtype=torch.long, device=final.device).unbind(1)
        gate, up = F.linear(hidden_states[token_idx], module.gate_up_proj[expert]).chunk(2, dim=-1)
        out = F.linear(module.act_fn(gate) * up, module.down_proj[expert])
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


class _GroupedLinear(torch.autograd.Function):
    """transformers' ``grouped_mm`` of ``x``'s row blocks by their experts' weights, as one kernel.

    Each block ``loads[e]`` rows long goes through ``weight[e]`` (``[E, out, in]``). The flops are
    the blocks' matmuls, forward and backward; the bytes are the kernel's own, none memory-bound:
    it writes its output, the input's gradient and the weight's whole ``[E, out, in]`` gradient
    once. Autograd through per-expert views would instead write a dense zero-filled gradient of
    ``x`` and of ``weight`` per expert and add them up (``slice_backward``, ``select_backward``).
    It saves what ``torch._grouped_mm`` saves: its input, weight and ``offsets`` (the int32 end
    of each block, one tensor for every grouped matmul of the layer).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, loads: list[int], offsets: torch.Tensor
    ) -> torch.Tensor:
        ctx.loads = loads
        ctx.save_for_backward(x, weight, offsets)
        with fused_kernel(0):
            return torch.cat([F.linear(block, weight[e]) for e, block in enumerate(x.split(loads))])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight, _ = ctx.saved_tensors
        grad_x = grad_weight = None
        with fused_kernel(0):
            pairs = list(zip(grad.split(ctx.loads), x.split(ctx.loads), strict=True))
            if ctx.needs_input_grad[0]:
                grad_x = torch.cat([g.mm(weight[e]) for e, (g, _) in enumerate(pairs)])
            if ctx.needs_input_grad[1]:
                grad_weight = torch.stack([g.t().mm(rows) for g, rows in pairs])
        return grad_x, grad_weight, None, None


def _offsets(loads: list[int], like: torch.Tensor) -> torch.Tensor:
    # the grouped matmuls' int32 offsets (a cumsum of the loads; its values play no part here)
    with torch.no_grad():
        return torch.empty(len(loads), dtype=torch.int32, device=like.device)


def _grouped_experts(
    module: Any,
    loads: list[int],
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    # transformers' grouped_mm path: the visits sorted by expert, two grouped matmuls
    top_k = top_k_index.shape[-1]
    with torch.no_grad():
        _, perm = torch.sort(top_k_index.reshape(-1))
    rows = hidden_states[perm // top_k]
    weights = top_k_weights.reshape(-1)[perm]
    offsets = _offsets(loads, rows)
    gate_up = _GroupedLinear.apply(rows.to(module.gate_up_proj.dtype), module.gate_up_proj, loads, offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (module.act_fn(gate) * up).to(module.down_proj.dtype)
    out = _GroupedLinear.apply(hidden, module.down_proj, loads, offsets)
    weighted = out * weights.unsqueeze(-1)
    with torch.no_grad():
        inverse = torch.empty_like(perm)
    weighted = weighted[inverse]
    return weighted.view(hidden_states.shape[0], top_k, -1).sum(dim=1).to(hidden_states.dtype)


# torchtitan's main branch names its grouped experts by their dims (w1_EFD, w2_EDF, w3_EFD) and
# runs them unpadded; 0.3.0's (w1, w2, w3) first pad each expert's rows to a multiple of 8
# through generate_permute_indices, which the trace does not re-enact
_TRACED_TITAN_NAMES = TITAN_EXPERT_WEIGHTS[1]


def is_traced_titan_experts(module: Any) -> bool:
    """Whether ``module`` holds torchtitan's grouped experts under the names the trace runs (main's)."""
    return titan_expert_names(module) == _TRACED_TITAN_NAMES


def titan_experts(module: Any, rows: torch.Tensor, loads: list[int]) -> torch.Tensor:
    """What torchtitan's ``GroupedExperts.forward`` runs for ``rows`` sorted by expert, ``loads`` a group.

    As its kernels run it: three ``torch._grouped_mm`` in bfloat16 whatever the weights' dtype (each
    call casts its operands, so float32 rows are copied once per matmul that reads them), the output
    cast back to the rows' dtype. Its ``[E, f, d]`` and ``[E, d, f]`` weights are `_GroupedLinear`'s
    ``[E, out, in]`` as they are.
    """
    w1, w2, w3 = (getattr(module, name) for name in _TRACED_TITAN_NAMES)
    offsets = _offsets(loads, rows)
    h = F.silu(_GroupedLinear.apply(rows.bfloat16(), w1.bfloat16(), loads, offsets))
    h = h * _GroupedLinear.apply(rows.bfloat16(), w3.bfloat16(), loads, offsets)
    return _GroupedLinear.apply(h, w2.bfloat16(), loads, offsets).type_as(rows)


def titan_loads(module: Any, rows: int, top_k: int, imbalance: float) -> list[int]:
    """`expert_loads` of the ``rows`` token copies torchtitan's grouped experts ``module`` receives.

    Without expert parallelism they are every token's ``top_k`` copies; ``top_k`` 0 (unknown) takes
    each copy for a token, which routes alike and only loosens `expert_loads`' bound on imbalance.
    """
    top_k = top_k if top_k > 0 and rows % top_k == 0 else 1
    experts = getattr(module, _TRACED_TITAN_NAMES[0]).shape[0]
    return expert_loads(rows // top_k, top_k, experts, imbalance)


def _routed_forward(module: nn.Module, imbalance: float, top_k: int) -> Any:
    """The stand-in for ``module``'s forward that routes by `expert_loads`; None if it needs none."""

    # transformers' eager loop needs values (`nonzero`, `where`) and grouped_mm has no float32
    # fake kernel nor flop formula: the router still runs, its choice replaced by the loads.
    # batched_mm runs on fake tensors as it is.
    def routed(
        module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: Any
    ) -> Any:
        loads = expert_loads(hidden_states.shape[0], top_k_index.shape[-1], module.num_experts, imbalance)
        if _experts_implementation(module) == "grouped_mm":
            return _grouped_experts(module, loads, hidden_states, top_k_index, top_k_weights)
        return _eager_experts(module, loads, hidden_states, top_k_weights)

    # torchtitan's experts take the copies sorted by expert and the counts (whose values size the
    # grouped matmuls' groups): the rows run for the loads instead
    def titan_routed(module: Any, rows: torch.Tensor, *counts: Any) -> torch.Tensor:
        return titan_experts(module, rows, titan_loads(module, rows.shape[0], top_k, imbalance))

    if _is_routed_experts(module) and _experts_implementation(module) in ("eager", "grouped_mm"):
        return functools.partial(routed, module)
    if is_traced_titan_experts(module):
        return functools.partial(titan_routed, module)
    return None


@contextlib.contextmanager
def routed_experts(modules: Iterable[nn.Module], imbalance: float, top_k: int = 0) -> Iterator[None]:
    """Within the block, the experts modules among ``modules`` route by `expert_loads`.

    transformers' experts modules, and torchtitan's grouped experts (main's names), each token's
    copies ``top_k`` (0: unknown) of the rows they receive.

    Examples:
        >>> with routed_experts(nn.Linear(2, 2).modules(), 1.0):  # no experts: nothing changes
        ...     pass
    """
    forwards = [(module, _routed_forward(module, imbalance, top_k)) for module in modules]
    replaced = [(module, forward) for module, forward in forwards if forward is not None]
    previous = [module.__dict__.get("forward") for module, _ in replaced]
    try:
        for module, forward in replaced:
            module.forward = forward  # type: ignore[method-assign]
        yield
    finally:
        for (module, _), forward in zip(replaced, previous, strict=True):
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward  # type: ignore[method-assign]
