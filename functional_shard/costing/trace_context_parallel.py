"""Context parallel re-enacted on one rank's tokens, for a trace at its local shapes.

Under context parallel a rank runs the model on its ``seq / cp`` tokens of each sequence;
only attention sees the whole sequence: its keys and values are gathered over cp, and
the gathered copies (and one causal mask over them) are what SDPA keeps for backward.
`context_parallel_attention` does the same to fake tensors during a trace: SDPA runs over
keys and values repeated ``cp`` times along the sequence (new buffers, as a gather makes)
under a boolean mask of the local queries against every key. The flops then count this
rank's queries against the whole sequence, in the one convention
`functional_shard.costing.flops` uses (the full score matrix).

Under torch's ring (``engine="ring"``) the gathered keys and values are not kept: each
call gathers them, scores its chunks and lets them go, and SDPA keeps the local query,
keys, values, output and logsumexp; `context_parallel_attention` then keeps those and
counts the same flops.

`routing_attention` is how both this trace and the runtime engine
(`functional_shard.runtime.engines.context_parallel`) reach attention in plain modules:
``torch.nn.functional.scaled_dot_product_attention`` is swapped for a router while a step
runs. A ``TorchFunctionMode`` would not do: torch's checkpoint recomputes a module's
forward in backward with no function mode active, so a recomputed layer would attend
over its own tokens only.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["context_parallel_attention", "routing_attention"]

_SDPA = torch.nn.functional.scaled_dot_product_attention
_route: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar("_route", default=None)


def _routed(*args: Any, **kwargs: Any) -> Any:
    route = _route.get()
    if route is None:  # another thread, or the route's own call
        return _SDPA(*args, **kwargs)
    token = _route.set(None)
    try:
        return route(*args, **kwargs)
    finally:
        _route.reset(token)


@contextlib.contextmanager
def routing_attention(route: Callable[..., Any]) -> Iterator[None]:
    """Within the block, this thread's ``F.scaled_dot_product_attention`` calls go to ``route``.

    ``route`` takes SDPA's arguments; the SDPA it calls runs as usual.

    Examples:
        >>> seen = []
        >>> def route(query, key, value, **kwargs):
        ...     seen.append(tuple(key.shape))
        ...     return torch.nn.functional.scaled_dot_product_attention(query, key, value, **kwargs)
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


def _whole_sequence(cp: int, per_step: list[torch.Tensor]) -> Callable[..., Any]:
    masks: dict[tuple[int, int], torch.Tensor] = {}  # one a step, shared by every layer, as the engine's

    # F.scaled_dot_product_attention's own parameters, restated: calls reach it by name or position
    def attend(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        **options: Any,
    ) -> torch.Tensor:
        keys = torch.cat([key] * cp, dim=-2)
        values = torch.cat([value] * cp, dim=-2)
        mask = None
        if is_causal:  # a local query against every key: the shape of the engine's mask
            shape = (query.shape[-2], keys.shape[-2])
            if shape not in masks:
                masks[shape] = torch.ones(shape, dtype=torch.bool).tril()
                per_step.append(masks[shape])
            mask = masks[shape]
        return _SDPA(query, keys, values, attn_mask=mask, dropout_p=dropout_p, **options)

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


def _ring(cp: int, merged: bool) -> Callable[..., Any]:
    # F.scaled_dot_product_attention's own parameters, restated: calls reach it by name or position
    def attend(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        heads = query.shape[-3]
        if key.shape[-3] != heads:  # the ring takes as many key/value heads as query heads
            key = key.repeat_interleave(heads // key.shape[-3], dim=-3)
            value = value.repeat_interleave(heads // value.shape[-3], dim=-3)
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
