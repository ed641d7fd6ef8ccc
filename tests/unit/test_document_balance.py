"""`document_ranges`: a packed row cut over cp ranks by attention work, not by tokens.

Every token is held by exactly one rank, every rank holds as many tokens, and with one long
document among many short ones the ranks' work is within 10% of each other, where cutting the
row by tokens (`token_ranges`, contiguous or head-tail chunks) is far off: each of the two by
accident of where the long document falls, never both (table below: both).
"""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.core.sequence import (
    document_imbalance,
    document_ranges,
    document_work,
    held_positions,
    segment_lengths,
    token_ranges,
)

from ..strategies import documents, skewed_rows


def _spread(work: list[int]) -> float:
    """The busiest rank's work over the idlest's: 1.0 balanced."""
    return max(work) / max(1, min(work))


@st.composite
def rows(draw: st.DrawFn) -> tuple[tuple[int, ...], int]:
    """Any packed row's segments, padded to a multiple of a drawn cp, and that cp."""
    cp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    lengths = draw(st.lists(st.integers(1, 80), min_size=1, max_size=30))
    padding = -sum(lengths) % cp
    return tuple(lengths + ([padding] if padding else [])), cp


@given(row=rows())
def test_every_token_once_and_equal_shares(row: tuple[tuple[int, ...], int]) -> None:
    lengths, cp = row
    held = document_ranges(lengths, cp)
    tokens = [held_positions(ranges) for ranges in held]
    assert sorted(p for mine in tokens for p in mine) == list(range(sum(lengths)))
    assert {len(mine) for mine in tokens} == {sum(lengths) // cp}
    for ranges in held:  # sorted, disjoint and merged
        assert all(a < b < c for (a, b), (c, _) in itertools.pairwise(ranges))
    total = document_work(lengths, [(0, sum(lengths))])
    assert sum(document_work(lengths, ranges) for ranges in held) == total


@pytest.mark.parametrize("cp", [2, 4, 8])
@given(data=st.data())
def test_skewed_rows_balance_by_work_where_tokens_do_not(cp: int, data: st.DataObject) -> None:
    lengths = data.draw(skewed_rows(cp))
    seq = sum(lengths)
    by_work = [document_work(lengths, ranges) for ranges in document_ranges(lengths, cp)]
    contiguous, head_tail = (
        [document_work(lengths, token_ranges(seq, cp, r, load_balance=lb)) for r in range(cp)]
        for lb in (False, True)
    )
    print(
        f"cp={cp} seq={seq}: busiest/idlest by work {_spread(by_work):.3f}, by tokens contiguous "
        f"{_spread(contiguous):.2f}, head-tail chunks {_spread(head_tail):.2f}"
    )
    assert _spread(by_work) <= 1.10
    # either token cut is near even only where the long document happens to fall just so
    # (contiguous: its end shared out; head-tail: its dear part on the chunks paired with cheap
    # ones), never both at once
    assert max(_spread(contiguous), _spread(head_tail)) > 1.5


# one long document among short ones: (segments, cp, busiest/idlest by work, contiguous, head-tail)
SKEWED = [
    ((3,) * 8 + (40,) + (3,) * 8, 2, 1.0, 2.55, 9.41),
    ((2000,) + (20,) * 100, 4, 1.0, 142.9, 6.75),
    ((20,) * 100 + (2000,), 4, 1.0, 142.9, 6.75),
    ((20,) * 50 + (2000,) + (20,) * 50, 8, 1.0, 166.7, 95.3),
]


@pytest.mark.parametrize(("lengths", "cp", "work", "contiguous", "head_tail"), SKEWED)
def test_skewed_table(
    lengths: tuple[int, ...], cp: int, work: float, contiguous: float, head_tail: float
) -> None:
    seq = sum(lengths)
    by_work = [document_work(lengths, ranges) for ranges in document_ranges(lengths, cp)]
    by_tokens = [
        [document_work(lengths, token_ranges(seq, cp, r, load_balance=lb)) for r in range(cp)]
        for lb in (False, True)
    ]
    assert _spread(by_work) == pytest.approx(work, abs=0.01)
    assert _spread(by_tokens[0]) == pytest.approx(contiguous, rel=0.01)
    assert _spread(by_tokens[1]) == pytest.approx(head_tail, rel=0.01)


def test_hand_checked_cuts() -> None:
    # 12 tokens of one document in 4 chunks of 3, head-tail; the two short ones one each
    assert document_ranges((12, 2, 2), 2) == (((0, 3), (9, 14)), ((3, 9), (14, 16)))
    assert [document_work((12, 2, 2), r) for r in document_ranges((12, 2, 2), 2)] == [42, 42]
    assert document_ranges((2, 2, 2, 2), 2) == (((0, 2), (4, 6)), ((2, 4), (6, 8)))
    # 14 tokens: the first 14 % 4 = 2 are dealt as a short piece, the other 12 cut in 4 chunks
    assert document_ranges((14, 2), 2) == (((0, 5), (11, 14)), ((5, 11), (14, 16)))
    assert document_ranges((5, 3), 1) == (((0, 8),),)
    assert document_imbalance((12, 2, 2), 2) == 1.0


@given(docs=documents(max_documents=12), seq_len=st.integers(20, 40))
def test_segments_of_a_packed_batch(docs: list[list[int]], seq_len: int) -> None:
    batch = fs.pack(docs, seq_len, long="split")
    for row, offsets in enumerate(batch.offsets):
        lengths = segment_lengths(offsets, seq_len)
        assert sum(lengths) == seq_len
        ids = batch.document_ids[row].tolist()
        assert lengths == tuple(ids.count(i) for i in range(ids[-1] + 1))


def test_refusals() -> None:
    with pytest.raises(fs.ShardingError, match=re.escape("cuts each sequence into 4 equal chunks")):
        document_ranges((5, 2), 4)
    with pytest.raises(fs.ShardingError, match="a document length"):
        document_ranges((5, 0, 3), 2)
    with pytest.raises(fs.ShardingError, match="cp="):
        document_ranges((4,), 0)
