"""Context parallel re-enacted on one rank's tokens, for a trace at its local shapes.

A rank runs its ``seq / cp`` tokens of each sequence; attention runs over keys and values repeated
``cp`` times (as a gather makes them), keeping them under our engine and only the local ones under
torch's ring. `routing_attention` swaps ``F.scaled_dot_product_attention`` for a router, for this trace
and the runtime engine alike: a ``TorchFunctionMode`` would not do, since torch's checkpoint
recomputes with no function mode active.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from functional_shard.costing.time.flops import torch_ring_call

__all__ = ["AttentionCall", "context_parallel_attention", "repeat_kv_heads", "routing_attention"]

_SDPA = torch.nn.functional.scaled_dot_product_attention


@dataclass(frozen=True)
class AttentionCall:
    """One ``F.scaled_dot_product_attention`` call, its arguments bound by name.

    The fields are SDPA's parameters in its order, so ``AttentionCall(*args, **kwargs)`` binds as SDPA does.

    Examples:
        >>> x = torch.ones(1, 1, 4, 2)
        >>> AttentionCall(x, x, x, None, 0.0, True).is_causal
        True
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = field(default=None, kw_only=True)
    enable_gqa: bool = field(default=False, kw_only=True)


_route: contextvars.ContextVar[Callable[[AttentionCall], Any] | None] = contextvars.ContextVar(
    "_route", default=None
)


def _routed(*args: Any, **kwargs: Any) -> Any:
    route = _route.get()
    if route is None:  # another thread, or the route's own call
        return _SDPA(*args, **kwargs)
    token = _route.set(None)
    try:
        return route(AttentionCall(*args, **kwargs))
    finally:
        _route.reset(token)


def repeat_kv_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query keys and values repeated to the query's heads (dim -3), as torch's ring takes them.

    Examples:
        >>> q, kv = torch.ones(1, 4, 3, 2), torch.ones(1, 2, 3, 2)
        >>> [tuple(t.shape) for t in repeat_kv_heads(q, kv, kv)]
        [(1, 4, 3, 2), (1, 4, 3, 2)]
    """
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if kv_heads == heads:
        return key, value
    return key.repeat_interleave(heads // kv_heads, dim=-3), value.repeat_interleave(
        heads // kv_heads, dim=-3
    )


@contextlib.contextmanager
def routing_attention(route: Callable[[AttentionCall], Any]) -> Iterator[None]:
    """Within the block, this thread's ``F.scaled_dot_product_attention`` calls go to ``route``.

    ``route`` takes the call's arguments bound (`AttentionCall`); the SDPA it calls runs as usual.

    Examples:
        >>> seen = []
        >>> def route(call):
        ...     seen.append(tuple(call.key.shape))
        ...     return torch.nn.functional.scaled_dot_product_attention(call.query, call.key, call.value)
        >>> x = torch.ones(1, 1, 4, 2)
        >>> with routing_attention(route):
        ...     out = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        >>> seen
        [(1, 1, 4, 2)]
    """
    functional = torch.nn.functional
    token = _route.set(route)
    patched = functional.scaled_dot_product_attention is not _routed
    if patched:
        functional.scaled_dot_product_attention = _routed
    try:
        yield
    finally:
        _route.reset(token)
        if patched:
            functional.scaled_dot_product_attention = _SDPA


def _whole_sequence(
    cp: int, per_step: list[torch.Tensor], *, packed: bool = False
) -> Callable[[AttentionCall], torch.Tensor]:
    masks: dict[tuple[int, ...], torch.Tensor] = {}  # one a step, shared by every layer, as the engine's

    def attend(call: AttentionCall) -> torch.Tensor:
        keys = torch.cat([call.key] * cp, dim=-2)
        values = torch.cat([call.value] * cp, dim=-2)
        mask = None
        # a local query against every key: the shape of the engine's mask; packed rows, a mask a row
        # (whatever mask the model made of its share, which the engine replaces)
        if call.is_causal or packed:
            shape: tuple[int, ...] = (call.query.shape[-2], keys.shape[-2])
            if packed:
                shape = (call.query.shape[0], 1, *shape)
            if shape not in masks:
                masks[shape] = torch.ones(shape, dtype=torch.bool).tril()
                per_step.append(masks[shape])
            mask = masks[shape]
        return _SDPA(
            call.query,
            keys,
            values,
            attn_mask=mask,
            dropout_p=call.dropout_p,
            scale=call.scale,
            enable_gqa=call.enable_gqa,
        )

    return attend


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _RingKeeps(torch.autograd.Function):
    """What torch's ring attention keeps for backward, and its backward's work, on fake tensors.

    Autograd keeps the local query, keys, values, output and logsumexp; backward scores the local
    queries against ``cp`` times the keys again, as the ring's backward does chunk by chunk (its
    kernels the causal pairs: `torch_ring_call`).
    """

    @staticmethod
    def forward(ctx: Any, *args: Any) -> torch.Tensor:
        query, key, value, out, logsumexp, cp, scale = args
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.cp, ctx.scale = cp, scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        query, key, value, out, logsumexp = ctx.saved_tensors
        keys, values = torch.cat([key] * ctx.cp, dim=-2), torch.cat([value] * ctx.cp, dim=-2)
        with torch_ring_call():  # its kernels run the causal pairs only
            grad_query, grad_keys, grad_values = _FLASH_BACKWARD(
                grads[0], query, keys, values, out, logsumexp, 0.0, False, scale=ctx.scale
            )
        width = key.shape[-2]
        return grad_query, grad_keys[..., :width, :], grad_values[..., :width, :], None, None, None, None


def _ring(cp: int, merged: bool) -> Callable[[AttentionCall], torch.Tensor]:
    def attend(call: AttentionCall) -> torch.Tensor:
        query, scale = call.query, call.scale
        key, value = repeat_kv_heads(query, call.key, call.value)
        # detached: the gathered copies die with the call, as the ring's do; shapes only, so no mask
        keys = torch.cat([key.detach()] * cp, dim=-2)
        values = torch.cat([value.detach()] * cp, dim=-2)
        with torch_ring_call():  # its kernels run the causal pairs only
            out, logsumexp = _FLASH(query.detach(), keys, values, 0.0, False, scale=scale)
        del keys, values
        if merged:
            # torch's `_partial_update` concatenates the output's halves (load balancing, every
            # cp rank but the last), leaving it contiguous in (batch, heads, seq, dim)
            out = out.contiguous()
        result: torch.Tensor = _RingKeeps.apply(query, key, value, out, logsumexp, cp, scale)
        return result

    return attend


@contextlib.contextmanager
def context_parallel_attention(
    cp: int, engine: str = "all_gather", *, cp_rank: int = 0, load_balance: bool = True, packed: bool = False
) -> Iterator[list[torch.Tensor]]:
    """Within the block, attention runs over ``cp`` times the keys and values it is given.

    ``"all_gather"`` keeps the gathered keys and values; ``"ring"`` (on cp rank ``cp_rank``) only the
    local ones. Yields the tensors made once a step (the all-gather engine's shared causal mask).
    ``packed``: rows of packed documents, which the all-gather engine runs (whatever ``engine``) under
    a boolean mask a row, ``[batch, 1, local, whole]``.
    """
    per_step: list[torch.Tensor] = []
    if cp <= 1:
        yield per_step
        return
    merged = load_balance and cp_rank < cp - 1
    route = (
        _ring(cp, merged) if engine == "ring" and not packed else _whole_sequence(cp, per_step, packed=packed)
    )
    with routing_attention(route):
        yield per_step
