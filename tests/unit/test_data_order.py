"""fs.DataOrder's resume contract, and the arguments fs.ResumableSampler refuses.

Stopped after any step and resumed under another data-parallel size, the ranks together read
every sample of each epoch exactly once, in the order an uninterrupted single rank reads them.
"""

from __future__ import annotations

import functools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs


@functools.cache
def _plan(ranks: int) -> fs.Plan:
    return fs.shard(nn.Linear(2, 2), fs.Mesh(dp=ranks), fs.replicate())


def _loaders(length: int, batch: int, ranks: int, **options) -> list[fs.ResumableLoader]:
    plan = _plan(ranks) if ranks > 1 else None
    return [
        fs.ResumableSampler(length, plan=plan, rank=rank, batch_size=batch, **options).loader(range(length))
        for rank in range(ranks)
    ]


def _steps(loaders: list[fs.ResumableLoader], steps: int) -> list[list[int]]:
    """``steps`` global batches, every rank in step, into the next epochs as each ends."""
    found: list[list[int]] = []
    while len(found) < steps:
        for shares in zip(*loaders, strict=True):
            found.append([sample for share in shares for sample in share.tolist()])
            if len(found) == steps:
                break
    return found


@settings(max_examples=25, deadline=None)
@given(
    length=st.integers(1, 30),
    before=st.sampled_from([1, 2, 4]),
    after=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 5),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_a_run_resumed_on_other_ranks_reads_each_sample_once_per_epoch_in_order(
    length, before, after, seed, shuffle, data
):
    batch = 4 * data.draw(st.integers(1, max(1, length // 4)), label="batch / 4")
    if batch > length:
        return
    order = fs.DataOrder(length, batch, seed, shuffle)
    steps = 2 * order.steps_per_epoch + 1
    stop = data.draw(st.integers(0, steps), label="stop")

    first = _loaders(length, batch, before, seed=seed, shuffle=shuffle)
    read = _steps(first, stop) if stop else []
    resumed = _loaders(length, batch, after, seed=seed + 1, shuffle=not shuffle)  # the saved order wins
    for loader in resumed:
        loader.load_state_dict(first[0].state_dict())
    read += _steps(resumed, steps - stop)

    for epoch in range(2):
        at = epoch * order.steps_per_epoch
        epoch_samples = [s for step in read[at : at + order.steps_per_epoch] for s in step]
        assert epoch_samples == order.epoch(epoch)
        assert len(set(epoch_samples)) == order.steps_per_epoch * batch
    assert read[-1] == order.epoch(2)[:batch]


@pytest.mark.parametrize("epoch", [-1, 1.5, "3", True])
def test_set_epoch_refuses_what_is_no_epoch(epoch):
    # before: -1 was taken and saved, then the saved state would not load; the others failed
    # inside torch's generator at the next iteration
    sampler = fs.ResumableSampler(10, batch_size=2)
    with pytest.raises(fs.ShardingError, match=r"set_epoch: epoch=.*: an int of at least 0"):
        sampler.set_epoch(epoch)
    assert sampler.epoch == 0


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_cannot_take_is_refused_up_front(seed):
    # before: a raw ValueError ("Overflow when unpacking long long") at the first iteration
    with pytest.raises(fs.ShardingError, match=r"seed=.*: a whole number from .* \(a torch seed\)"):
        fs.DataOrder(10, 4, seed=seed)
    state = fs.ResumableSampler(10, batch_size=2).state_dict()
    with pytest.raises(fs.ShardingError, match=r"seed="):
        fs.ResumableSampler(10, batch_size=2).load_state_dict({**state, "seed": seed})


def test_the_widest_seeds_torch_takes_still_walk():
    assert len(fs.DataOrder(10, 4, seed=2**64 - 1).epoch(0)) == 8
    assert len(fs.DataOrder(10, 4, seed=-(2**63)).epoch(0)) == 8


@pytest.mark.parametrize(("seed", "epoch", "same_as"), [(2**64 - 1, 1, 0), (2**64 - 2, 5, 3), (-1, 1, 0)])
def test_a_seed_accepted_walks_every_epoch_wrapping_as_torch_does(seed, epoch, same_as):
    # before: seed + epoch past 2**64 - 1 raised torch's raw "Overflow when unpacking long long"
    order = fs.DataOrder(10, 4, seed=seed)
    assert order.epoch(epoch) == fs.DataOrder(10, 4, seed=same_as).epoch(0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # before: ZeroDivisionError, [] (a rank past the last read nothing), [] (a step past the
        # epoch's end), torch's "manual_seed expected a long, but got float"
        (
            lambda o: o.rank_slice(0, step=0, index=0, count=0),
            "count=0: a positive int (the data-parallel ranks)",
        ),
        (
            lambda o: o.rank_slice(0, step=0, index=5, count=2),
            "rank_slice(step=0, index=5, count=2): an epoch has",
        ),
        (lambda o: o.rank_slice(0, step=2, index=0, count=2), "an epoch has 2 steps (0 to 1) and 2 ranks"),
        (lambda o: o.epoch(1.5), "epoch=1.5: an int of at least 0 (epochs count from 0)"),
    ],
)
def test_a_slice_of_no_rank_step_or_epoch_is_refused_by_name(call, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        call(fs.DataOrder(10, 4))


def test_a_rank_without_a_plan_is_refused_not_fed_every_sample():
    # before: rank=1 was ignored without a plan, so every process read the whole dataset
    with pytest.raises(
        fs.ShardingError, match=re.escape("ResumableSampler(rank=1): without a plan there is one")
    ):
        fs.ResumableSampler(10, rank=1, batch_size=2)


def test_a_dataset_without_a_length_is_refused_by_name():
    # before: TypeError "object of type 'range_iterator' has no len()" from inside the loader
    with pytest.raises(fs.ShardingError, match=re.escape("the dataset (range_iterator) has no len()")):
        fs.ResumableSampler(10, batch_size=2).loader(iter(range(10)))
