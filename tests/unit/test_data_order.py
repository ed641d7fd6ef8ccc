"""fs.DataOrder's resume contract, and the arguments fs.ResumableSampler refuses.

Stopped after any step and resumed under another data-parallel size, the ranks together read
every sample of each epoch exactly once, in the order an uninterrupted single rank reads them.
"""

from __future__ import annotations

import functools

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
    with pytest.raises(fs.ShardingError, match=r"set_epoch: epoch=.*: a whole number of at least 0"):
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
