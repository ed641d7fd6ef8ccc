"""Packed rows' documents, as the estimate counts attention for them: each document attends to itself.

A row of ``seq`` tokens holding documents of lengths ``d₁ … d_k`` (then padding, a segment of its own,
as `functional_shard.core.packing.PackedBatch.cu_seqlens` hands it to a varlen kernel) does the attention
of each segment alone. In the convention of `functional_shard.costing.time.flops` (a full score matrix,
causal or not) that is ``Σ dᵢ²`` query-key pairs where the whole row is ``seq²``; a fused causal kernel
that runs the documents apart (flash attention's varlen, flex attention with a document mask) computes
``Σ dᵢ(dᵢ + 1) / 2`` of them.

Under context parallel each row is cut over the cp ranks as the runtime cuts it
(`functional_shard.core.sequence.document_ranges`), and a rank's share of the model flops is that of
its queries: each query pairs with every token of its document, so the ranks' shares add up to the
row's ``Σ dᵢ²``. The all-gather engine runs them with SDPA reading a boolean mask over the rank's
queries and the whole row's keys, a kernel that skips no masked pair.

Examples:
    >>> rows = row_documents([[4, 4], [8]], seq=8)
    >>> rows.model_share, rows.causal_share
    (0.75, 0.4375)
    >>> cut = row_documents([12, 2, 2], seq=16, cp=2)
    >>> cut.rank_pairs(0) + cut.rank_pairs(1) == 12 * 12 + 2 * 2 + 2 * 2
    True
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from functional_shard.core.errors import ShardingError, bullets
from functional_shard.core.packing import PackedBatch
from functional_shard.core.sequence import check_sequence_length, document_ranges

__all__ = ["RowDocuments", "cp_rank_of", "row_documents"]


@dataclass(frozen=True)
class RowDocuments:
    """Rows of ``seq`` tokens and the document lengths each holds (its padding left out).

    Attributes:
        seq: tokens in each row.
        rows: each row's document lengths, in order; every row's sum at most ``seq``.
        cp: the context-parallel ranks each row is cut over (`document_ranges`); 1 without.
        cp_rank: the cp rank whose share of each row is counted (`rank_model_share`).
    """

    seq: int
    rows: tuple[tuple[int, ...], ...]
    cp: int = 1
    cp_rank: int = 0

    def segments(self, row: int) -> tuple[int, ...]:
        """Row ``row``'s documents, then its padding (if any) as one segment more.

        Examples:
            >>> RowDocuments(8, ((3, 2),)).segments(0)
            (3, 2, 3)
        """
        lengths = self.rows[row]
        padding = self.seq - sum(lengths)
        return (*lengths, padding) if padding else lengths

    @property
    def model_share(self) -> float:
        """Query-key pairs of the documents over the whole row's (``Σ dᵢ² / seq²``), mean of the rows."""
        pairs = [sum(n * n for n in self.segments(row)) for row in range(len(self.rows))]
        return sum(pairs) / len(pairs) / self.seq**2

    @property
    def causal_share(self) -> float:
        """Pairs a causal kernel runs inside the documents over the row's ``seq²`` (mean of the rows)."""
        pairs = [sum(n * (n + 1) // 2 for n in self.segments(row)) for row in range(len(self.rows))]
        return sum(pairs) / len(pairs) / self.seq**2

    def rank_ranges(self, row: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Each cp rank's ``[start, stop)`` tokens of row ``row``, as the runtime cuts it (`document_ranges`).

        Examples:
            >>> RowDocuments(8, ((4, 4),), cp=2).rank_ranges(0)  # each document's head-tail chunks
            (((0, 1), (3, 5), (7, 8)), ((1, 3), (5, 7)))
        """
        return document_ranges(self.segments(row), self.cp)

    def rank_pairs(self, cp_rank: int) -> float:
        """Query-key pairs of cp rank ``cp_rank``'s queries in their documents, mean of the rows.

        Each query pairs with every token of its document (the full-score-matrix convention).

        Examples:
            >>> RowDocuments(8, ((6, 2),), cp=2).rank_pairs(0)  # 3 + 1 queries of the 6, 0 of the 2
            24.0
        """
        return self._pairs_by_rank[cp_rank]

    @functools.cached_property
    def _pairs_by_rank(self) -> tuple[float, ...]:
        # cut once: the trace asks for it at every attention call
        totals = [0] * self.cp
        for row in range(len(self.rows)):
            segments = self.segments(row)
            for rank, held in enumerate(self.rank_ranges(row)):
                start = 0
                for length in segments:
                    for low, high in held:
                        totals[rank] += max(0, min(high, start + length) - max(low, start)) * length
                    start += length
        return tuple(total / len(self.rows) for total in totals)

    @functools.cached_property
    def rank_model_share(self) -> float:
        """`cp_rank`'s pairs in their documents over those of its queries and the whole row's keys.

        The share of a traced cp attention call (``seq / cp`` queries, ``seq`` keys) that is model
        flops; without context parallel, `model_share`.

        Examples:
            >>> RowDocuments(8, ((6, 2),), cp=2, cp_rank=0).rank_model_share  # 24 of 4 x 8
            0.75
        """
        if self.cp == 1:
            return self.model_share
        return self.rank_pairs(self.cp_rank) / (self.seq // self.cp * self.seq)

    def busiest_rank(self) -> int:
        """The cp rank whose queries pair with the most keys in their documents (the lowest on ties).

        Examples:
            >>> RowDocuments(8, ((6, 2),), cp=2).busiest_rank()
            0
        """
        pairs = [self.rank_pairs(rank) for rank in range(self.cp)]
        return pairs.index(max(pairs))

    @property
    def mean_documents(self) -> float:
        """Documents in a row, on average (padding not counted)."""
        return sum(len(lengths) for lengths in self.rows) / len(self.rows)

    @property
    def padding_share(self) -> float:
        """Padding tokens over all tokens of the rows."""
        return sum(self.seq - sum(lengths) for lengths in self.rows) / (len(self.rows) * self.seq)

    def describe(self) -> str:
        r"""One line: the documents a row, the padding, and attention's model flops against the whole row's.

        Examples:
            >>> line = RowDocuments(8, ((4, 4),)).describe()
            >>> print(*line.split("; "), sep="\n")
            packed documents: 2.0 a row of 8 tokens (1 row given), padding 0.0%
            attention counted per document, 50.0% of the whole row's model flops
        """
        noun = "row" if len(self.rows) == 1 else "rows"
        line = (
            f"packed documents: {self.mean_documents:.1f} a row of {self.seq} tokens "
            f"({len(self.rows)} {noun} given), padding {self.padding_share:.1%}; "
            f"attention counted per document, {self.model_share:.1%} of the whole row's model flops"
        )
        if self.cp == 1:
            return line
        pairs = [self.rank_pairs(rank) for rank in range(self.cp)]
        return (
            f"{line}; cut over cp={self.cp} ranks by attention work, cp rank {self.cp_rank}'s share counted "
            f"({pairs[self.cp_rank] / sum(pairs):.1%} of the model flops, busiest over mean "
            f"{max(pairs) * self.cp / sum(pairs):.2f}); the all-gather engine's SDPA reads a boolean mask "
            "over its queries and the whole row's keys, skipping no pair"
        )


def cp_rank_of(plan: Any, rank: int | None) -> int | None:
    """``rank``'s coordinate along ``plan``'s cp axis, whose share of packed rows is counted; None if none.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(dp=2, cp=2), fs.fsdp(("dp", "cp")) + fs.cp("cp"))
        >>> cp_rank_of(plan, 3), cp_rank_of(plan, None)
        (1, None)
    """
    context = plan.config.context
    return None if rank is None or context is None else plan.mesh.coords(rank)[context.axis]


def row_documents(
    documents: Any, seq: int, *, cp: int = 1, cp_rank: int | None = None, who: str = "estimate"
) -> RowDocuments:
    """``documents`` as `RowDocuments` of rows of ``seq`` tokens, checked.

    Args:
        documents: a `PackedBatch` (its rows' documents), a sequence of rows (each a sequence of document
            lengths), or one row's document lengths (the same in every row).
        seq: tokens in each row.
        cp: the plan's context-parallel size: each row is cut over that many ranks (`document_ranges`).
        cp_rank: the cp rank whose share is counted; ``None``: that of ``documents`` if it is a
            `RowDocuments` cut alike, else the busiest (`RowDocuments.busiest_rank`).
        who: the caller, as errors name it.

    Raises:
        ShardingError: no rows, a length that is not a positive int, a row of more than ``seq`` tokens
            (each such row named), a `PackedBatch` of rows of another length, or ``cp`` not dividing ``seq``.

    Examples:
        >>> row_documents([512, 512], seq=2048).rows
        ((512, 512),)
        >>> row_documents([[1024, 1024], [2000, 100]], seq=2048)
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: estimate(documents=...): 1 row holds more than seq=2048 tokens:
        * row 1: documents [2000, 100] hold 2100 tokens
        Pass each row's document lengths (at most seq tokens a row), or pack a sample of them: ...
        >>> row_documents([[30, 2], [4] * 8], seq=32, cp=2).cp_rank  # the rank holding most pairs
        1
    """
    if cp > 1:
        # the runtime cuts packed rows into cp equal shares (`document_ranges`), whatever load balancing
        check_sequence_length(seq, cp, load_balance=False, what="packed rows' length")
    if (
        isinstance(documents, RowDocuments)
        and documents.seq == seq
        and documents.cp == cp
        and cp_rank is None
    ):
        cp_rank = documents.cp_rank
    if isinstance(documents, RowDocuments):
        rows = documents.rows
    elif isinstance(documents, PackedBatch):
        if documents.seq_len != seq:
            raise ShardingError(
                f"{who}(documents=PackedBatch): its rows hold {documents.seq_len} tokens, but seq={seq}; "
                f"pass seq={documents.seq_len}, or pack with seq_len={seq}"
            )
        rows = tuple(
            tuple(end - start for start, end in itertools.pairwise(offsets)) for offsets in documents.offsets
        )
    else:
        rows = _rows(documents, who)
    problems = [
        f"row {index}: documents {list(lengths)} hold {sum(lengths)} tokens"
        for index, lengths in enumerate(rows)
        if sum(lengths) > seq
    ]
    if problems:
        noun = "row holds" if len(problems) == 1 else "rows hold"
        shown = problems[:5] + ([f"... and {len(problems) - 5} rows more"] if len(problems) > 5 else [])
        raise ShardingError(
            bullets(
                f"{who}(documents=...): {len(problems)} {noun} more than seq={seq} tokens:",
                shown,
                "Pass each row's document lengths (at most seq tokens a row), or pack a sample of them: "
                "documents=fs.pack([[0] * n for n in lengths], seq_len=seq, long='split').",
            )
        )
    found = RowDocuments(seq, rows, cp=cp)
    if cp == 1:
        return found
    return dataclasses.replace(found, cp_rank=found.busiest_rank() if cp_rank is None else cp_rank)


def _rows(documents: Any, who: str) -> tuple[tuple[int, ...], ...]:
    """A sequence of rows of lengths, or one row's lengths, as a tuple of rows; malformed ones refused."""

    def is_length(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    def is_sequence(value: Any) -> bool:
        return isinstance(value, Sequence) and not isinstance(value, str | bytes)

    what = (
        "a PackedBatch, a sequence of rows (each a sequence of document lengths, positive ints), "
        "or one row's document lengths"
    )
    if not is_sequence(documents) or len(documents) == 0:
        shown = type(documents).__name__ if not is_sequence(documents) else "[]"
        raise ShardingError(f"{who}(documents={shown}): pass {what}")
    if all(is_length(n) for n in documents):
        return (tuple(documents),)
    problems = []
    if not any(is_sequence(n) for n in documents):  # one row's lengths, not rows
        bad = [f"length {index} is {n!r}" for index, n in enumerate(documents) if not is_length(n)]
        raise ShardingError(
            bullets(
                f"{who}(documents=...): one row's lengths {list(documents)!r}, not all positive ints:",
                bad[:5],
                f"Pass {what}.",
            )
        )
    for index, row in enumerate(documents):
        if not is_sequence(row) or len(row) == 0:
            problems.append(f"row {index} is {row!r}, not a non-empty sequence of document lengths")
        elif not all(is_length(n) for n in row):
            problems.append(f"row {index} holds {list(row)!r}: each length must be a positive int")
    if problems:
        raise ShardingError(
            bullets(f"{who}(documents=...): {len(problems)} malformed:", problems[:5], f"Pass {what}.")
        )
    return tuple(tuple(row) for row in documents)
