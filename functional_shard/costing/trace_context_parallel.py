"""Context parallel re-enacted on one rank's tokens, for a trace at its local shapes.

Under context parallel a rank runs the model on its ``seq / cp`` tokens of each sequence;
only attention sees the whole sequence: its keys and values are gathered over cp, and
the gathered copies (and one causal mask over them) are what SDPA keeps for backward.
`context_parallel_attention` does the same to fake tensors during a trace: SDPA runs over
keys and values repeated ``cp`` times along the sequence (new buffers, as a gather makes)
under a boolean mask of the local queries against every key. The flops then count this
rank's queries against the whole sequence, in the one convention
`functional_shard.costing.flops` uses (the full score matrix).

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


def _whole_sequence(cp: int) -> Callable[..., Any]:
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
            mask = masks[shape]
        return _SDPA(query, keys, values, attn_mask=mask, dropout_p=dropout_p, **options)

    return attend


@contextlib.contextmanager
def context_parallel_attention(cp: int) -> Iterator[None]:
    """Within the block, attention runs over ``cp`` times the keys and values it is given."""
    if cp <= 1:
        yield
        return
    with routing_attention(_whole_sequence(cp)):
        yield
