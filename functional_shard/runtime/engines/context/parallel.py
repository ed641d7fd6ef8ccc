"""Context parallel on any backend: each rank's queries attend over the whole sequence. Effects.

Each cp rank holds chunks of every sequence (`functional_shard.core.sequence`). Attention
all-gathers keys and values along the sequence dim (the backward reduce-scatters their
gradients) and runs SDPA under a causal mask built from global positions, so the balanced
chunk order needs no reordering; grouped-query attention gathers only the key/value heads.

Packed rows (`functional_shard.core.packing`) are cut by attention work instead
(`functional_shard.core.sequence.document_ranges`), each row its own way, and the mask keeps
each query inside its document as well: a key of the same document, at or before it.

Attention is reached without patching the model: a plain module's
``F.scaled_dot_product_attention`` call is routed while a step runs
(`functional_shard.costing.trace.context_attention.routing_attention`); a Hugging Face model
gets an attention function registered in transformers' ``AttentionInterface`` (`hf`). Plain
collectives run on gloo and NCCL alike; a plan whose engine is torch's ring goes to
`ring` instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from functional_shard.core.document_masks import document_mask
from functional_shard.core.errors import ShardingError
from functional_shard.core.sequence import (
    check_sequence_length,
    document_ranges,
    held_positions,
    token_positions,
)
from functional_shard.core.validate import entry_point, positive_int
from functional_shard.costing.trace.context_attention import AttentionCall, routing_attention
from functional_shard.planning.context_checks import attention_problems  # pure: fs.estimate asks it too
from functional_shard.planning.plan.plan import Plan

from .arguments import chunk_rank, plan_given, sequence_dim
from .ring import ring_attention, ring_dispatch, runs_ring

__all__ = [
    "SequenceShard",
    "attention_problems",
    "check_attention_split",
    "context_chunks",
    "current_sequence_group",
    "cut_tensors",
    "packed_positions",
    "sequence_attention",
    "sequence_context",
    "splitting_attention",
]

_SDPA = torch.nn.functional.scaled_dot_product_attention


@dataclass(frozen=True)
class SequenceShard:
    """What one step's attention needs to know of this rank's share of the sequence."""

    group: dist.ProcessGroup
    size: int
    seq_len: int
    positions: torch.Tensor
    """Global positions of this rank's tokens, in the order it holds them (packed: ``[rows, local]``)."""
    key_positions: torch.Tensor
    """Global positions of every rank's tokens, in the order a gather along cp lays them."""
    load_balance: bool = True
    ring: DeviceMesh | None = None
    """The cp mesh torch's ring attention runs over (``None``: the all-gather engine)."""
    query_documents: torch.Tensor | None = None
    """Packed rows: the document of each of this rank's tokens (``[rows, local]``); ``None``: one a row."""
    key_documents: torch.Tensor | None = None
    """Packed rows: the document of each key, in the order a gather along cp lays them."""

    @classmethod
    def of(
        cls,
        mesh: DeviceMesh,
        seq_len: int,
        *,
        load_balance: bool,
        device: torch.device,
        engine: str,
        name: str = "seq_len",
    ) -> SequenceShard:
        """This rank's share of a ``seq_len``-token sequence cut over the 1-D cp ``mesh``.

        ``name``: the caller's argument ``seq_len`` comes from, as its refusal names it.

        Raises:
            ShardingError: the chunks do not divide ``seq_len`` (the nearest lengths named).
        """
        group = mesh.get_group()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        check_sequence_length(seq_len, size, load_balance=load_balance, name=name)
        every = [token_positions(seq_len, size, r, load_balance=load_balance) for r in range(size)]
        positions = torch.tensor(every[rank], device=device)
        keys = torch.tensor([p for held in every for p in held], device=device)
        return cls(
            group=group,
            size=size,
            seq_len=seq_len,
            positions=positions,
            key_positions=keys,
            load_balance=load_balance,
            ring=mesh if runs_ring(engine, mesh.device_type) else None,
        )

    @classmethod
    def packed(cls, mesh: DeviceMesh, document_ids: torch.Tensor) -> SequenceShard:
        """This rank's share of packed rows (``document_ids``: the whole rows' ids) cut by attention work.

        Each row is cut its own way (`document_ranges`); the all-gather engine runs it, whatever
        the plan's engine: torch's ring has no mask that keeps attention inside documents.

        Raises:
            ShardingError: the cp degree does not divide the rows' length.
        """
        group = mesh.get_group()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        positions, keys = packed_positions(document_ids, size, rank)
        return cls(
            group=group,
            size=size,
            seq_len=int(document_ids.shape[1]),
            positions=positions,
            key_positions=keys,
            query_documents=document_ids.gather(1, positions),
            key_documents=document_ids.gather(1, keys),
        )

    @functools.cached_property
    def causal_mask(self) -> torch.Tensor:
        """Which keys each of this rank's queries sees (``[local, whole]``), made once for every layer.

        Packed: ``[rows, 1, local, whole]``, a key of the query's document at or before it.
        """
        if self.query_documents is None or self.key_documents is None:
            return self.key_positions[None, :] <= self.positions[:, None]
        causal = self.key_positions[:, None, :] <= self.positions[:, :, None]
        same = self.key_documents[:, None, :] == self.query_documents[:, :, None]
        return (causal & same)[:, None]

    @functools.cached_property
    def local_document_mask(self) -> torch.Tensor | None:
        """Packed: the mask a model makes from this rank's share of the ids (`document_mask`)."""
        return None if self.query_documents is None else document_mask(self.query_documents)


def packed_positions(document_ids: torch.Tensor, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cp rank ``rank``'s tokens of each packed row (`document_ranges`), and every rank's as gathered.

    Returns ``[rows, seq / cp]`` global positions, and ``[rows, seq]``: rank 0's, then rank 1's, ...

    Examples:
        >>> ids = torch.tensor([[0] * 12 + [1, 1, 2, 2]])
        >>> [t.tolist() for t in packed_positions(ids, 2, 1)][0]
        [[3, 4, 5, 6, 7, 8, 14, 15]]
    """
    held = [document_ranges(_segments(row), cp) for row in document_ids.tolist()]
    device = document_ids.device
    positions = torch.tensor([held_positions(row[rank]) for row in held], device=device)
    keys = torch.tensor(
        [[p for ranges in row for p in held_positions(ranges)] for row in held], device=device
    )
    return positions, keys


def _segments(ids: list[int]) -> tuple[int, ...]:
    """A row's segment lengths from its document ids (the same id on a document's tokens, in a run)."""
    return tuple(len(list(run)) for _, run in itertools.groupby(ids))


_current: contextvars.ContextVar[SequenceShard | None] = contextvars.ContextVar("_current", default=None)
# how many attention calls the engine split during the current step (None: not counting)
_splits: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("_splits", default=None)


def current_sequence_group() -> dist.ProcessGroup | None:
    """The cp group the attention of the step now running is split over (``None``: no cp step).

    Examples:
        >>> current_sequence_group() is None  # outside fs.sequence_context
        True
    """
    shard = _current.get()
    return None if shard is None else shard.group


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over ``group``; backward reduce-scatters (sums) back."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        size = dist.get_world_size(group)
        moved = tensor.movedim(dim, 0).contiguous()
        gathered = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
        dist.all_gather_single(gathered, moved, group=group)
        return gathered.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        size = dist.get_world_size(ctx.group)
        moved = grad.movedim(ctx.dim, 0).contiguous()
        mine = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
        dist.reduce_scatter_single(mine, moved, group=ctx.group)
        return mine.movedim(0, ctx.dim), None, None


def sequence_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """SDPA of this rank's queries (``[batch, heads, local_seq, dim]``) over the whole sequence.

    Keys and values are gathered over the cp group of the step under way (`sequence_context`);
    outside a step it is plain SDPA over what it is given (whole sequences, for evaluation).

    Raises:
        ShardingError: query tokens that are not this rank's share of the step's sequence.
    """
    shard = _current.get()
    if shard is None:  # outside a step (evaluation on whole sequences): plain attention
        return _SDPA(
            query,
            key,
            value,
            dropout_p=dropout_p,
            is_causal=causal and query.shape[-2] > 1,
            scale=scale,
            enable_gqa=key.shape[-3] != query.shape[-3],
        )
    if query.shape[-2] != shard.positions.shape[-1]:
        raise ShardingError(
            f"context parallel: attention got {query.shape[-2]} query tokens, but this rank holds "
            f"{shard.positions.shape[-1]} of the {shard.seq_len}-token sequence; pass the rank's chunks "
            "(fs.forward_backward cuts them)"
        )
    if shard.query_documents is not None and not causal:
        raise ShardingError(
            "context parallel on packed rows: a non-causal attention call, which would attend across "
            "documents; the engine keeps causal attention inside each document only"
        )
    counted = _splits.get()
    if counted is not None:
        counted[0] += 1
    if shard.ring is not None:
        return ring_attention(
            query,
            key,
            value,
            shard.ring,
            causal=causal,
            scale=scale,
            dropout_p=dropout_p,
            load_balance=shard.load_balance,
        )
    keys = _GatherSequence.apply(key, key.dim() - 2, shard.group)
    values = _GatherSequence.apply(value, value.dim() - 2, shard.group)
    mask = shard.causal_mask if causal else None
    return _SDPA(
        query,
        keys,
        values,
        attn_mask=mask,
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=keys.shape[-3] != query.shape[-3],
    )


def _split(call: AttentionCall) -> torch.Tensor:
    """An SDPA call, run by `sequence_attention` (which finds GQA from the shapes).

    On packed rows the model's mask is its share's `document_mask`: the engine runs the same
    mask over the whole rows' keys (`SequenceShard.causal_mask`).
    """
    shard = _current.get()
    if call.attn_mask is not None and shard is not None and _is_share_mask(shard, call.attn_mask):
        return sequence_attention(
            call.query, call.key, call.value, causal=True, scale=call.scale, dropout_p=call.dropout_p
        )
    if call.attn_mask is not None:
        raise ShardingError(
            "context parallel: F.scaled_dot_product_attention was called with attn_mask; the engine "
            "splits causal or full attention only (is_causal=True, or no mask)"
        )
    return sequence_attention(
        call.query, call.key, call.value, causal=call.is_causal, scale=call.scale, dropout_p=call.dropout_p
    )


def _is_share_mask(shard: SequenceShard, mask: torch.Tensor) -> bool:
    """Whether ``mask`` keeps this rank's packed queries inside their documents, as the engine will."""
    local = shard.local_document_mask
    if local is None or mask.dtype != torch.bool or mask.shape[-2:] != local.shape[-2:]:
        return False
    return bool(torch.equal(mask.expand_as(local), local.to(mask.device)))


def check_attention_split(split: list[int], axis: str) -> None:
    """Refuse a cp forward with no attention call split (``split``: `splitting_attention`'s count).

    Its queries then attended to their own rank's chunks only: every rank's output would be wrong, silently.

    Raises:
        ShardingError: no call was split.
    """
    if not split[0]:
        raise ShardingError(
            f"context parallel over {axis!r}: the model's forward made no attention call the engine could "
            "split (it computes attention by hand?); call F.scaled_dot_product_attention, or use a Hugging "
            "Face model"
        )


@contextlib.contextmanager
def splitting_attention(shard: SequenceShard) -> Iterator[list[int]]:
    """Within it, attention runs over ``shard``'s whole sequence; yields the count of calls split."""
    counted = [0]
    tokens = (_current.set(shard), _splits.set(counted))
    ring = (
        ring_dispatch(load_balance=shard.load_balance) if shard.ring is not None else contextlib.nullcontext()
    )
    try:
        with routing_attention(_split), ring:
            yield counted
    finally:
        _splits.reset(tokens[1])
        _current.reset(tokens[0])


def cut_tensors(shard: SequenceShard, *tensors: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, ...]:
    """This rank's chunks of each of ``tensors`` along ``dim``.

    Raises:
        ShardingError: a tensor whose ``dim`` is not the sequence's length.
    """
    return _chunks("context parallel", tensors, shard.positions, shard.seq_len, dim)


def _chunks(
    who: str, tensors: tuple[torch.Tensor, ...], positions: torch.Tensor, seq_len: int, dim: int
) -> tuple[torch.Tensor, ...]:
    """``positions`` of each of ``tensors`` along ``dim``, each checked to hold ``seq_len`` there.

    Packed rows' ``positions`` are one row each (``[rows, local]``): ``(rows, seq)`` tensors, ``dim=1``.
    """
    cut = []
    for index, tensor in enumerate(tensors):
        if tensor.shape[dim] != seq_len:
            raise ShardingError(
                f"{who}: tensor {index} has shape {tuple(tensor.shape)}, but the sequence is {seq_len} "
                f"tokens along dim {dim}; pass tensors of the same whole sequences (inputs, targets)"
            )
        if positions.dim() == 2:
            cut.append(tensor.gather(dim, positions.to(tensor.device)))
        else:
            cut.append(tensor.index_select(dim, positions.to(tensor.device)))
    return tuple(cut)


@entry_point
def context_chunks(
    plan: Plan, *tensors: torch.Tensor, rank: int | None = None, dim: int = 1
) -> tuple[torch.Tensor, ...]:
    """A rank's chunks of each of ``tensors`` (whole sequences along ``dim``), then their positions.

    For loops that cut batches themselves (`forward_backward` does it for you): the last tensor
    returned is the chunks' global positions (``position_ids`` for RoPE). Run the model on the
    chunks inside `sequence_context`.

    Args:
        plan: a plan with a cp axis (`fs.cp`).
        tensors: tensors with the whole sequence along ``dim`` (inputs, targets, masks).
        rank: the global rank; by default this process's.
        dim: the sequence dim.

    Raises:
        ShardingError: a plan without cp, a length the chunks do not divide, tensors of another
            length or without ``dim``, or no ``rank`` outside a process group.

    Examples:
        >>> plan = fs.shard(nn.Linear(2, 2), fs.Mesh(cp=2), fs.replicate() + fs.cp("cp"))
        >>> tokens = torch.arange(8)[None]
        >>> fs.context_chunks(plan, tokens, rank=1)
        (tensor([[2, 3, 4, 5]]), tensor([2, 3, 4, 5]))
    """
    plan_given(plan)
    context = plan.config.context
    if context is None:
        raise ShardingError(
            "fs.context_chunks: the plan has no context-parallel axis (plan it with fs.cp(...))"
        )
    if not tensors:
        raise ShardingError("fs.context_chunks: pass the tensors to cut (inputs, targets, ...)")
    sequence_dim("fs.context_chunks", tensors, dim)
    rank = chunk_rank(plan, rank, dist.get_rank() if dist.is_initialized() else None)
    seq = tensors[0].shape[dim]
    cp = context.size(plan.mesh)
    # named by the argument the length comes from: context_chunks takes no length of its own
    check_sequence_length(seq, cp, load_balance=context.load_balance, name=f"tensors[0].shape[{dim}]")
    positions = torch.tensor(
        token_positions(
            seq,
            cp,
            plan.mesh.coords(rank)[context.axis],
            load_balance=context.load_balance,
        ),
        device=tensors[0].device,
    )
    return (*_chunks("fs.context_chunks", tensors, positions, seq, dim), positions)


@entry_point
def sequence_context(
    plan: Plan, module: nn.Module, seq_len: int
) -> contextlib.AbstractContextManager[torch.Tensor]:
    """Within it, ``module``'s attention runs over whole ``seq_len``-token sequences from this rank's chunks.

    Yields this rank's global positions. Run the backward inside it too: a checkpointed layer
    recomputes its attention there.

    Raises:
        ShardingError: ``module`` not applied with ``plan``, a plan without cp or with a pipeline,
            a ``seq_len`` that is not a positive int or that the chunks do not divide, or (on leaving)
            a body that made no attention call the engine could split.

    Examples:
        >>> # inputs, targets, positions = fs.context_chunks(plan, inputs, targets)
        >>> # with fs.sequence_context(plan, model, seq_len):
        >>> #     loss_fn(model(inputs, position_ids=positions[None]), targets).backward()
    """
    from functional_shard.runtime.engines.applied import applied_with

    positive_int(seq_len, "seq_len", meaning="the whole sequences' length in tokens")
    applied = applied_with(plan, module, "fs.sequence_context")
    context = plan.config.context
    if context is None:
        raise ShardingError(
            "fs.sequence_context: the plan has no context-parallel axis (plan it with fs.cp(...))"
        )
    if plan.config.pipeline is not None:
        # a rank holds its stages only: the model's forward run by hand would be one stage's
        raise ShardingError(
            "fs.sequence_context under a pipeline plan is not built: each rank holds its own stages, "
            "which the pipeline's schedule runs; train with fs.forward_backward(plan, model, loss_fn), "
            "whose stages attend over the whole sequences from each rank's chunks"
        )
    device = next(module.parameters(), torch.empty(0)).device
    shard = SequenceShard.of(
        applied.device_mesh[context.axis],
        seq_len,
        load_balance=context.load_balance,
        device=device,
        engine=context.engine,
    )
    return _positions_while_splitting(shard, context.axis)


@contextlib.contextmanager
def _positions_while_splitting(shard: SequenceShard, axis: str) -> Iterator[torch.Tensor]:
    with splitting_attention(shard) as split:
        yield shard.positions
        check_attention_split(split, axis)
