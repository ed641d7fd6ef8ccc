"""Context parallel re-enacted on one rank's tokens, for a trace at its local shapes.

Under context parallel a rank runs the model on its ``seq / cp`` tokens of each sequence;
only attention sees the whole sequence: its keys and values are gathered over cp, and
the gathered copies (and one causal mask over them) are what SDPA keeps for backward.
`context_parallel_attention` does the same to fake tensors during a trace: SDPA runs over
keys and values repeated ``cp`` times along the sequence (new buffers, as a gather makes)
under a boolean mask of the local queries against every key. The flops then count this
rank's queries against the whole sequence, in the one convention
`functional_shard.costing.time.flops` uses (the full score matrix).

Under torch's ring (``engine="ring"``) the gathered keys and values are not kept: each
call gathers them, scores its chunks and lets them go, and SDPA keeps the local query,
keys, values, output and logsumexp; `context_parallel_attention` then keeps those and
counts the same flops.

`routing_attention` is how both this trace and the runtime engine
(`functional_shard.runtime.engines.context.parallel`) reach attention in plain modules:
``torch.nn.functional.scaled_dot_product_attention`` is swapped for a router while a step
runs. A ``TorchFunctionMode`` would not do: torch's checkpoint recomputes a module's
forward in backward with no function mode active, so a recomputed layer would attend
over its own tokens only.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["AttentionCall", "context_parallel_attention", "repeat_kv_heads", "routing_attention"]

_SDPA = torch.nn.functional.scaled_dot_product_attention


@dataclass(frozen=True)
class AttentionCall:
    """One ``F.scaled_dot_product_attention`` call, its arguments bound by name.

    The fields are SDPA's parameters, in its order and with its defaults (``scale`` and
    ``enable_gqa`` keyword-only), so ``AttentionCall(*args, **kwargs)`` binds a call as
    SDPA itself does, whether it passed them by name or by position.

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


def _whole_sequence(cp: int, per_step: list[torch.Tensor]) -> Callable[[AttentionCall], torch.Tensor]:
    masks: dict[tuple[int, int], torch.Tensor] = {}  # one a step, shared by every layer, as the engine's

    def attend(call: AttentionCall) -> torch.Tensor:
        keys = torch.cat([call.key] * cp, dim=-2)
        values = torch.cat([call.value] * cp, dim=-2)
        mask = None
        if call.is_causal:  # a local query against every key: the shape of the engine's mask
            shape = (call.query.shape[-2], keys.shape[-2])
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

    Forward hands back the output the caller computed; autograd keeps the local query,
    keys, values, output and logsumexp (what SDPA saves under torch's ring). Backward
    scores the local queries against ``cp`` times the keys again, as the ring's backward
    does chunk by chunk, and hands each input the gradient of its own shape.
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
        grad_query, grad_keys, grad_values = _FLASH_BACKWARD(
            grads[0], query, keys, values, out, logsumexp, 0.0, False, scale=ctx.scale
        )
        width = key.shape[-2]
        return grad_query, grad_keys[..., :width, :], grad_values[..., :width, :], None, None, None, None


def _ring(cp: int, merged: bool) -> Callable[[AttentionCall], torch.Tensor]:
    def attend(call: AttentionCall) -> torch.Tensor:
        query, scale = call.query, call.scale
        key, value = repeat_kv_heads(query, call.key, call.value)
        # the local queries scored against every key (the flops, in the one convention), on
        # detached inputs: the gathered copies die with the call, as the ring's do; the
        # shapes are what count on fake tensors, so no mask
        keys = torch.cat([key.detach()] * cp, dim=-2)
        values = torch.cat([value.detach()] * cp, dim=-2)
        out, logsumexp = _FLASH(query.detach(), keys, values, 0.0, False, scale=scale)
        del keys, values
        if merged:
            # torch's merge rebuilds the output by concatenating its halves whenever a later
            # chunk updates only the second one (`_partial_update`, under load balancing on
            # every cp rank but the last): it leaves contiguous in (batch, heads, seq, dim),
            # not in the kernel's layout, and a model that transposes it back copies it
            out = out.contiguous()
        result: torch.Tensor = _RingKeeps.apply(query, key, value, out, logsumexp, cp, scale)
        return result

    return attend


@contextlib.contextmanager
def context_parallel_attention(
    cp: int, engine: str = "all_gather", *, cp_rank: int = 0, load_balance: bool = True
) -> Iterator[list[torch.Tensor]]:
    """Within the block, attention runs over ``cp`` times the keys and values it is given.

    ``engine="all_gather"``: as our engine runs it, keeping the gathered keys and values;
    ``"ring"``: as torch's ring runs it on cp rank ``cp_rank`` (key/value heads repeated to
    the query heads first), keeping only the local query, keys, values, output and logsumexp.
    Yields the tensors made once a step whatever the micro-batches (the all-gather engine's
    causal mask, which its step's every attention shares).
    """
    per_step: list[torch.Tensor] = []
    if cp <= 1:
        yield per_step
        return
    merged = load_balance and cp_rank < cp - 1
    with routing_attention(_ring(cp, merged) if engine == "ring" else _whole_sequence(cp, per_step)):
        yield per_step
