"""Flops of one op, with attention counted on every path and in one convention.

`op_flops` counts matrix multiplies by torch's ``FlopCounterMode`` formulas, and attention by the
formulas here, whichever kernel torch dispatches to (flash on CPU, flash, memory-efficient, cuDNN,
the overrideable hook, flex attention, their backwards).

The convention is PaLM's, Megatron-LM's and torchtitan's for MFU: attention costs its **full**
score matrix, causal or not. Per layer, for ``h`` query heads, ``s_q`` queries, ``s_k`` keys,
query/key width ``d`` and value width ``d_v``:

- forward: ``Q Kᵀ`` and ``P V``, ``2·b·h·s_q·s_k·(d + d_v)``;
- backward: twice the forward (``dP = dO Vᵀ``, ``dV = Pᵀ dO``, ``dQ = dS K``, ``dK = dSᵀ Q``),
  ``4·b·h·s_q·s_k·(d + d_v)``: what autograd runs for eager attention.

Neither the masked half fused kernels skip nor their recomputed scores is counted, so model flops
are the same whichever kernel runs (`attention_kernel_flops` counts what a kernel runs; a trace's
stand-in for torch's ring attention says so with `torch_ring_call`).
Over packed rows (``fs.estimate(documents=...)``) each document's score matrix is counted instead of
the row's (`document_attention_flops`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .documents import RowDocuments

__all__ = [
    "ATTENTION_BACKWARD",
    "ATTENTION_FORWARD",
    "attention_backward",
    "attention_forward",
    "attention_kernel_flops",
    "causal_fraction",
    "document_attention_flops",
    "is_attention",
    "op_flops",
    "torch_ring_call",
]

_aten = torch.ops.aten
_Formula = Callable[..., int]


def _shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in tensor.shape)


def attention_forward(query: Sequence[int], key: Sequence[int], value: Sequence[int]) -> int:
    """Forward flops of attention on ``(batch, heads, seq, dim)`` shapes, full score matrix.

    Each query head multiplies a whole score matrix, however few the key/value heads.

    Examples:
        >>> attention_forward((1, 8, 1024, 64), (1, 2, 1024, 64), (1, 2, 1024, 64)) == 4 * 8 * 1024**2 * 64
        True
    """
    batch, heads, s_q, d = query
    s_k, d_v = key[-2], value[-1]
    return 2 * batch * heads * s_q * s_k * (d + d_v)


def attention_backward(query: Sequence[int], key: Sequence[int], value: Sequence[int]) -> int:
    """Backward flops of attention: twice the forward (four matmuls, no recompute of the scores).

    Examples:
        >>> attention_backward((1, 8, 1024, 64), (1, 2, 1024, 64), (1, 2, 1024, 64)) == 8 * 8 * 1024**2 * 64
        True
    """
    return 2 * attention_forward(query, key, value)


def _bhsd_forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return attention_forward(_shape(query), _shape(key), _shape(value))


def _bhsd_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return attention_backward(_shape(query), _shape(key), _shape(value))


def _lengths(offsets: Any, longest: Any) -> list[int]:
    # fake or meta offsets have no values: every sequence is taken at the longest length
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(offsets, FakeTensor) or offsets.device.type == "meta":
        return [int(longest)] * (offsets.shape[0] - 1)
    return [int(n) for n in offsets.diff().tolist()]


def _varlen_shapes(query: Any, key: Any, value: Any, lengths: Sequence[Any]) -> list[Any]:
    # the lower-level flash/efficient kernels take (batch, seq, heads, dim), or sequences packed
    # along one dim with offsets (``lengths``); torch's own unpacking
    # (flop_counter._unpack_flash_attention_nested_shapes) swaps heads and sequence in the
    # unpacked case (docs/torch-versions.md), so the shapes are rebuilt here
    cum_q, cum_k, max_q, max_k = lengths
    q, k, v = _shape(query), _shape(key), _shape(value)
    if cum_q is None:

        def bhsd(shape: tuple[int, ...]) -> tuple[int, ...]:
            return (shape[0], shape[2], shape[1], shape[3])

        return [(bhsd(q), bhsd(k), bhsd(v))]
    heads_q, d, heads_k, d_v = q[-2], q[-1], k[-2], v[-1]
    return [
        ((1, heads_q, len_q, d), (1, heads_k, len_k, d), (1, heads_k, len_k, d_v))
        for len_q, len_k in zip(_lengths(cum_q, max_q), _lengths(cum_k, max_k), strict=True)
    ]


def _varlen(
    formula: Callable[[Sequence[int], Sequence[int], Sequence[int]], int], query_at: int, lengths_at: int
) -> _Formula:
    """The flops formula of a lower-level flash or memory-efficient kernel, forward or backward.

    Its schema has ``query, key, value`` at ``query_at`` and ``cum_seq_q, cum_seq_k, max_q, max_k``
    at ``lengths_at``.
    """

    def count(*args: Any, **kwargs: Any) -> int:
        query, key, value = args[query_at : query_at + 3]
        lengths = args[lengths_at : lengths_at + 4]
        return sum(formula(*shapes) for shapes in _varlen_shapes(query, key, value, lengths))

    return count


def _flex_backward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return attention_backward(_shape(query), _shape(key), _shape(value))


def _packets(names: Sequence[str]) -> list[Any]:
    return [packet for name in names if (packet := getattr(_aten, name, None)) is not None]


ATTENTION_FORWARD: dict[Any, _Formula] = {
    **dict.fromkeys(
        _packets(
            (
                "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_fused_attention_overrideable",
            )
        ),
        _bhsd_forward,
    ),
    # (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, ...)
    **dict.fromkeys(_packets(("_flash_attention_forward",)), _varlen(attention_forward, 0, 3)),
    # (out, query, key, value, cum_seq_q, ...)
    **dict.fromkeys(
        _packets(("_flash_attention_forward_no_dropout_inplace",)), _varlen(attention_forward, 1, 4)
    ),
    # (query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
    **dict.fromkeys(_packets(("_efficient_attention_forward",)), _varlen(attention_forward, 0, 4)),
}
"""Attention forward ops (``OpOverloadPacket`` or higher-order operator) -> flops formula."""

ATTENTION_BACKWARD: dict[Any, _Formula] = {
    **dict.fromkeys(
        _packets(
            (
                "_scaled_dot_product_flash_attention_for_cpu_backward",
                "_scaled_dot_product_flash_attention_backward",
                "_scaled_dot_product_efficient_attention_backward",
                "_scaled_dot_product_cudnn_attention_backward",
                "_scaled_dot_product_fused_attention_overrideable_backward",
            )
        ),
        _bhsd_backward,
    ),
    # (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, ...)
    **dict.fromkeys(_packets(("_flash_attention_backward",)), _varlen(attention_backward, 1, 6)),
    # (grad_out, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, ...)
    **dict.fromkeys(_packets(("_efficient_attention_backward",)), _varlen(attention_backward, 1, 6)),
}
"""Attention backward ops -> flops formula (twice the forward's)."""

try:  # flex attention's operators are higher-order operators, not aten ops
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward
except ImportError:  # pragma: no cover - every supported torch has them
    pass
else:
    ATTENTION_FORWARD[flex_attention] = _bhsd_forward
    ATTENTION_BACKWARD[flex_attention_backward] = _flex_backward


def is_attention(func: Any) -> bool:
    """Whether ``func`` (as a dispatch mode sees it) is an attention kernel, forward or backward.

    Examples:
        >>> is_attention(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
        True
        >>> is_attention(torch.ops.aten.mm.default)
        False
    """
    packet = getattr(func, "_overloadpacket", func)
    return packet in ATTENTION_FORWARD or packet in ATTENTION_BACKWARD


def _argument(func: Any, args: Sequence[Any], kwargs: dict[str, Any], name: str) -> Any:
    """The value of ``func``'s argument ``name`` in this call (its default when left out)."""
    if name in kwargs:
        return kwargs[name]
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    for index, argument in enumerate(schema.arguments):
        if argument.name == name:
            return args[index] if index < len(args) else argument.default_value
    return None


def causal_fraction(seq_q: int, seq_k: int) -> float:
    """The share of a causal score matrix a fused kernel computes: the diagonal and below.

    Examples:
        >>> causal_fraction(4, 4)
        0.625
    """
    if seq_q != seq_k:  # torch's causal mask is upper-left: query i sees keys up to i
        seen = sum(min(i + 1, seq_k) for i in range(min(seq_q, seq_k))) + max(0, seq_q - seq_k) * seq_k
        return seen / (seq_q * seq_k)
    return (seq_q + 1) / (2 * seq_q)


_TORCH_RING: contextvars.ContextVar[bool] = contextvars.ContextVar("_TORCH_RING", default=False)


@contextlib.contextmanager
def torch_ring_call() -> Iterator[None]:
    """Within the block, a call of a cp rank's queries against a whole causal sequence's keys is torch's ring.

    A trace stands in for torch's ring attention with one call without a mask (its model flops, the
    rank's queries against every key, the MFU convention). The ring runs it chunk pair by chunk pair
    (``_templated_ring_attention`` and its backward): a causal kernel on the rank's own chunks, a full
    one on the chunks its queries see and none on the others (``_is_causal_behavior``; under load
    balancing, the half of each pair's chunks that is seen). Over the cp group that is exactly the
    sequence's causal pairs, a cp-th of them each on average: ``causal_fraction(seq, seq)`` of each
    rank's call, every rank alike when balanced (unbalanced, `fs.estimate` adds the busiest rank's
    excess as ``"unbalanced causal attention"``).

    Examples:
        >>> q, k = torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 8, 4)  # cp 2: 4 queries, 8 keys
        >>> sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        >>> with torch_ring_call():
        ...     ring = attention_kernel_flops(sdpa, (q, k, k), {}, 1000)
        >>> ring, attention_kernel_flops(sdpa, (q, k, k), {}, 1000)
        (562.5, 1000.0)
    """
    token = _TORCH_RING.set(True)
    try:
        yield
    finally:
        _TORCH_RING.reset(token)


def attention_kernel_flops(func: Any, args: Sequence[Any], kwargs: dict[str, Any], model_flops: int) -> float:
    """The flops an attention kernel runs, from its model flops (`op_flops`).

    A fused causal kernel skips the blocks above the diagonal (`causal_fraction`); its backward
    recomputes the scores (2.5 times the forward, not 2). Inside `torch_ring_call`, a cp rank's share
    of the causal pairs torch's ring runs.

    Examples:
        >>> q = torch.zeros(1, 2, 8, 4)
        >>> sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        >>> attention_kernel_flops(sdpa, (q, q, q), {"is_causal": True}, 1000)
        562.5
    """
    packet = getattr(func, "_overloadpacket", func)
    backward = packet in ATTENTION_BACKWARD
    flops = model_flops * (1.25 if backward else 1.0)
    query = next((a for a in args[1 if backward else 0 :] if isinstance(a, torch.Tensor)), None)
    key = next((a for a in args[2 if backward else 1 :] if isinstance(a, torch.Tensor)), None)
    if query is None or key is None or query.dim() != 4:
        return flops
    if _TORCH_RING.get():
        return flops * causal_fraction(int(key.shape[-2]), int(key.shape[-2]))
    causal = _argument(func, args, kwargs, "is_causal") and _argument(func, args, kwargs, "attn_mask") is None
    if causal:
        return flops * causal_fraction(int(query.shape[-2]), int(key.shape[-2]))
    return flops


def document_attention_flops(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], model_flops: int, documents: RowDocuments
) -> tuple[int, float] | None:
    """Model flops and kernel flops of an attention call over packed rows, each document alone.

    For a self-attention call over whole rows (queries and keys ``documents.seq`` long, batch-heads-seq-dim
    kernels): model flops the documents' share (`RowDocuments.model_share`). A call without a mask runs as a
    kernel that runs the documents apart would (causal: `RowDocuments.causal_share`); one with a mask reads
    it over the whole row and runs what it did. A cp rank's call (its ``seq / cp`` queries, the row's
    ``seq`` keys, `RowDocuments.cp`): model flops its queries' pairs in their documents
    (`RowDocuments.rank_model_share`), kernel flops every pair, as the all-gather engine's mask-reading
    SDPA runs them. None for other calls (cross attention), which stay as counted.

    Examples:
        >>> from functional_shard.costing.time.documents import RowDocuments
        >>> q = torch.zeros(1, 2, 8, 4)
        >>> sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        >>> document_attention_flops(sdpa, (q, q, q), {"is_causal": True}, 1000, RowDocuments(8, ((4, 4),)))
        (500, 312.5)
    """
    packet = getattr(func, "_overloadpacket", func)
    formula = ATTENTION_FORWARD.get(packet) or ATTENTION_BACKWARD.get(packet)
    if formula not in (_bhsd_forward, _bhsd_backward, _flex_backward):
        return None
    backward = packet in ATTENTION_BACKWARD
    query = next((a for a in args[1 if backward else 0 :] if isinstance(a, torch.Tensor)), None)
    key = next((a for a in args[2 if backward else 1 :] if isinstance(a, torch.Tensor)), None)
    if query is None or key is None or query.dim() != 4 or key.dim() != 4:
        return None
    queries, keys = int(query.shape[-2]), int(key.shape[-2])
    if documents.cp > 1 and queries == documents.seq // documents.cp and keys == documents.seq:
        # a cp rank's queries against the whole row's keys, under the engine's mask: every pair is run
        model = round(model_flops * documents.rank_model_share)
        return model, attention_kernel_flops(func, args, kwargs, model_flops)
    if not queries == keys == documents.seq:
        return None
    model = round(model_flops * documents.model_share)
    if any(_argument(func, args, kwargs, name) is not None for name in ("attn_mask", "attn_bias")):
        return model, attention_kernel_flops(func, args, kwargs, model_flops)
    share = documents.causal_share if _argument(func, args, kwargs, "is_causal") else documents.model_share
    return model, model_flops * (1.25 if backward else 1.0) * share


def op_flops(func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    """Flops of one dispatched op: attention by this module's formulas, others by torch's.

    Args:
        func: the op as a ``TorchDispatchMode`` sees it (an ``OpOverload`` or a higher-order operator).
        args: its positional arguments.
        kwargs: its keyword arguments.
        out: what it returned.

    Returns:
        The op's flops; 0 for ops without a formula (element-wise ops, copies).

    Examples:
        >>> q = torch.zeros(2, 4, 16, 8)  # (batch, heads, seq, dim)
        >>> out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, is_causal=True)
        >>> op_flops(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q), {}, out)
        65536
        >>> a = torch.zeros(3, 5)
        >>> op_flops(torch.ops.aten.mm.default, (a, a.t()), {}, a @ a.t())
        90
    """
    packet = getattr(func, "_overloadpacket", func)
    formula = ATTENTION_FORWARD.get(packet) or ATTENTION_BACKWARD.get(packet)
    if formula is not None:
        return formula(*args, **kwargs)
    from torch.utils.flop_counter import flop_registry

    count = flop_registry.get(packet)
    return 0 if count is None else int(count(*args, **kwargs, out_val=out))
