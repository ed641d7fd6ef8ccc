"""Packed rows walk through `fs.DataOrder`'s loader, and a stopped walk resumes exactly.

A `PackedBatch` is a dataset of its rows: `fs.ResumableLoader` hands out each step's rows as one
`PackedBatch` (`fs.collate_packed`), every field cut alike, and stopping after any ``k`` steps and
resuming from the saved state gives the very batches an uninterrupted walk gives, across epochs,
and across a change of data-parallel size.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs

from ..strategies import documents


def _walk(loader: fs.ResumableLoader, steps: int) -> list[fs.PackedBatch]:
    """``steps`` batches from ``loader``, into the next epochs as each ends."""
    found: list[fs.PackedBatch] = []
    while len(found) < steps:
        for batch in loader:
            found.append(batch)
            if len(found) == steps:
                break
    return found


def _fields(batch: fs.PackedBatch) -> tuple:
    tensors = (batch.tokens, batch.positions, batch.document_ids, batch.labels)
    return (*(t.tolist() for t in tensors), batch.offsets, batch.sources, batch.pad_id)


def _loader(rows: fs.PackedBatch, batch_size: int, seed: int, **options) -> fs.ResumableLoader:
    return fs.ResumableSampler(len(rows), batch_size=batch_size, seed=seed, **options).loader(rows)


@settings(max_examples=10)
@given(
    docs=documents(max_documents=24, max_length=10),
    seq_len=st.integers(4, 12),
    seed=st.integers(0, 3),
    data=st.data(),
)
def test_a_resumed_walk_hands_out_the_batches_an_uninterrupted_walk_does(docs, seq_len, seed, data):
    rows = fs.pack(docs, seq_len, long="split")
    batch_size = data.draw(st.integers(1, len(rows)), label="batch_size")
    order = fs.DataOrder(len(rows), batch_size, seed)
    steps = 2 * order.steps_per_epoch + 1  # into a third epoch
    k = data.draw(st.integers(0, steps), label="k")

    whole = _walk(_loader(rows, batch_size, seed), steps)
    for step, batch in enumerate(whole):
        epoch, at = divmod(step, order.steps_per_epoch)
        expected = rows[order.rank_slice(epoch, step=at, index=0, count=1)]
        assert isinstance(batch, fs.PackedBatch)
        assert _fields(batch) == _fields(expected)

    first = _loader(rows, batch_size, seed)
    before = _walk(first, k) if k else []
    state = first.state_dict()
    resumed = _loader(rows, batch_size, seed=seed + 1)  # the saved seed wins: it is the run's order
    resumed.load_state_dict(state)
    after = _walk(resumed, steps - k)
    assert [_fields(b) for b in before + after] == [_fields(b) for b in whole]


def test_a_walk_resumed_on_two_data_parallel_ranks_reads_the_same_rows():
    rows = fs.pack([[1] * n for n in (3, 5, 2, 7, 1, 4, 6, 2, 3, 8, 5, 1)], seq_len=8)
    whole = _walk(_loader(rows, 4, seed=7), 3)
    first = _loader(rows, 4, seed=7)
    _walk(first, 1)
    plan = fs.shard(nn.Linear(2, 2), fs.Mesh(dp=2), fs.replicate())
    ranks = []
    for rank in (0, 1):
        loader = fs.ResumableSampler(len(rows), plan=plan, rank=rank, batch_size=4, seed=7).loader(rows)
        loader.load_state_dict(first.state_dict())
        ranks.append(_walk(loader, 2))
    for step, (mine, theirs) in enumerate(zip(*ranks, strict=True), start=1):
        assert _fields(fs.collate_packed([mine, theirs])) == _fields(whole[step])


def test_rows_index_and_collate_back_alike():
    rows = fs.pack([[1, 2, 3], [4], [5, 6], [7, 8, 9]], seq_len=4)
    assert len(rows) == 3
    assert _fields(fs.collate_packed([rows[0], rows[1:]])) == _fields(rows)
    assert _fields(rows[-1]) == _fields(rows[2]) == _fields(rows[[2]])
    assert torch.equal(rows[[2, 0]].labels, rows.labels[[2, 0]])
    assert fs.collate_packed([torch.ones(2), torch.zeros(2)]).tolist() == [[1.0, 1.0], [0.0, 0.0]]


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (
            [fs.pack([[1]], seq_len=2), fs.pack([[1]], seq_len=3)],
            "collate_packed: the rows differ in (seq_len, pad_id): [(2, 0), (3, 0)]",
        ),
        (
            [fs.pack([[1]], seq_len=2), fs.pack([[1]], seq_len=2, pad_id=5)],
            "collate_packed: the rows differ in (seq_len, pad_id): [(2, 0), (2, 5)]",
        ),
        ([fs.pack([[1]], seq_len=2), torch.ones(2)], "collate_packed: a batch mixes PackedBatch rows"),
        ([], "collate_packed(items=[]): a non-empty list of dataset items"),
        (None, "collate_packed(items=NoneType): a non-empty list"),
    ],
)
def test_collate_refuses_rows_that_do_not_go_together(items, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.collate_packed(items)


@pytest.mark.parametrize(
    ("index", "message"),
    [(3, "PackedBatch[3]: the batch has 3 rows (0 to 2)"), ("0", "PackedBatch[str]: index its rows by")],
)
def test_rows_out_of_range_are_refused(index, message):
    rows = fs.pack([[1, 2, 3], [4, 5], [6, 7, 8]], seq_len=3)
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        rows[index]
