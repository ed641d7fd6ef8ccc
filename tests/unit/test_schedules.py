"""Pipeline schedules: the action lists are torch's, the clock runs them, refusals are torch's."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

import functional_shard as fs
from functional_shard.planning.pipeline.schedules import (
    check_pipeline,
    held_peak_parts,
    in_flight,
    schedule_actions,
    simulate,
)
from functional_shard.planning.pipeline.stages import SCHEDULES, SINGLE_STAGE, V_SHAPED, stage_rank
from functional_shard.zoo import llama

# (schedule, stages per rank): every schedule torch has, with the stage counts it runs
EVERY = [(name, 1 if name in SINGLE_STAGE else 2) for name in SCHEDULES]
SPLIT_BACKWARD = frozenset({"interleaved_zb", "zbv"})


def _torch_compute(name: str, pp: int, m: int, per_rank: int) -> list[list[str]]:
    """torch's own visualizer's lists (mocked stages), compute actions only, as text."""
    torch_name = SCHEDULES[name].removeprefix("Schedule")
    ops = get_schedule_ops(torch_name, pp, m, None if name in SINGLE_STAGE else per_rank)
    out = []
    for rank in ops:
        steps = []
        for action in rank:
            if action is None or action.computation_type.value == "REDUCE_GRAD":
                continue
            steps.append(repr(action))
        out.append(steps)
    return out


def _ours(name: str, pp: int, m: int, per_rank: int) -> list[list[str]]:
    out = []
    for steps in schedule_actions(name, pp, m, per_rank):
        rank = []
        for step in steps:
            rank.append(repr(step[0]) if len(step) == 1 else "(" + ";".join(map(repr, step)) + ")OVERLAP_F_B")
        out.append(rank)
    return out


@pytest.mark.parametrize(("name", "per_rank"), EVERY)
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8)])
def test_lists_are_torchs(name, per_rank, pp, m):
    ours, theirs = _ours(name, pp, m, per_rank), _torch_compute(name, pp, m, per_rank)
    if name != "1f1b":
        assert ours == theirs
        return
    # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards from
    # 1 (m is out of range); its step() runs them 0..m-1: the same list, renumbered
    assert ours[:-1] == theirs[:-1]
    assert [a[:-1] for a in ours[-1]] == [a[:-1] for a in theirs[-1]]
    assert theirs[-1][0] == f"{pp - 1}F1"
    assert ours[-1][0] == f"{pp - 1}F0"


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_warmup_is_what_its_step_runs(pp):
    # Schedule1F1B._step_microbatches: min(m, pp - stage) forwards before the first backward
    m = 2 * pp
    for rank, steps in enumerate(schedule_actions("1f1b", pp, m)):
        kinds = [step[0].kind for step in steps]
        assert kinds.index("B") == min(m, pp - rank)


@pytest.mark.parametrize(("name", "per_rank"), EVERY)
def test_every_stage_runs_every_microbatch_once_on_its_rank(name, per_rank):
    pp, m = 4, 8
    seen: dict[tuple[int, str, int], int] = {}
    for rank, steps in enumerate(schedule_actions(name, pp, m, per_rank)):
        for step in steps:
            for action in step:
                assert stage_rank(action.stage, pp, per_rank, name) == rank
                key = (action.stage, action.kind, action.microbatch)
                seen[key] = seen.get(key, 0) + 1
    kinds = ("F", "I", "W") if name in SPLIT_BACKWARD else ("F", "B")
    if name == "dualpipev":  # B for most, I + W for the last micro-batches of a stage
        kinds = ("F",)
    expected = {(s, k, mb) for s in range(pp * per_rank) for k in kinds for mb in range(m)}
    assert expected <= set(seen)
    assert set(seen.values()) == {1}


# the textbook bubble: GPipe and 1F1B idle (p - 1)(F + B) of (m + p - 1)(F + B) per rank,
# interleaving v stages per rank cuts the ramp to (p - 1)/v of a stage's time
BUBBLES = [
    ("gpipe", 1, 4, 8, 3 / 11),
    ("1f1b", 1, 4, 8, 3 / 11),
    ("1f1b", 1, 2, 2, 1 / 3),
    ("1f1b", 1, 8, 32, 7 / 39),
    ("interleaved1f1b", 2, 4, 8, 3 / 19),
    ("interleaved1f1b", 2, 4, 16, 3 / 35),
    ("looped_bfs", 2, 4, 8, 3 / 19),
]


@pytest.mark.parametrize(("name", "per_rank", "pp", "m", "bubble"), BUBBLES)
def test_textbook_bubble_where_it_holds(name, per_rank, pp, m, bubble):
    # F and B of a whole rank's share: one per stage split over its stages
    line = simulate(name, pp, m, per_rank, forward=1.0 / per_rank, backward=2.0 / per_rank)
    assert line.bubble == pytest.approx(bubble)
    assert line.makespan == pytest.approx(3 * m / (1 - bubble) / 1)


def test_zero_bubble_schedules_beat_1f1b():
    # with F = I = W (arXiv 2401.10241's setting) the split backward fills the ramp
    one = simulate("1f1b", 4, 8, forward=1.0, backward=2.0)
    for name in ("interleaved_zb", "zbv"):
        split = simulate(name, 4, 8, 2, forward=0.5, backward=1.0, weight=0.5)
        assert split.bubble < one.bubble / 2
        assert split.makespan < one.makespan


@pytest.mark.parametrize(
    ("name", "per_rank", "pp", "m", "expected"),
    [
        ("gpipe", 1, 4, 8, (8, 8, 8, 8)),
        ("1f1b", 1, 4, 8, (4, 3, 2, 1)),
        ("1f1b", 1, 4, 4, (4, 3, 2, 1)),
        ("looped_bfs", 2, 2, 4, (4, 4, 4, 4)),
    ],
)
def test_in_flight(name, per_rank, pp, m, expected):
    assert in_flight(name, pp, m, per_rank) == expected


def activations(parts):
    return [held.activations for held in parts]


def test_held_peak_weights_stages():
    assert activations(held_peak_parts("1f1b", 4, 8, 1, [1, 10, 100, 1000])) == [4, 30, 200, 1000]
    # a rank's stages peak together at most: never more than the sum of their own peaks
    flight = in_flight("interleaved1f1b", 2, 4, 2)
    peaks = activations(held_peak_parts("interleaved1f1b", 2, 4, 2, [1, 10, 100, 1000]))
    assert peaks[0] <= flight[0] * 1 + flight[2] * 100
    assert peaks[1] <= flight[1] * 10 + flight[3] * 1000


def _runs(name: str, pp: int, per_rank: int, m: int) -> bool:
    # whether torch's schedule runs these sizes (drawn sizes it refuses are skipped)
    try:
        check_pipeline(name, pp, per_rank, m)
    except fs.ShardingError:
        return False
    return True


@given(
    st.sampled_from(EVERY),
    st.integers(1, 4),
    st.integers(1, 8),
    st.lists(st.integers(0, 50), min_size=32, max_size=32),
)
def test_what_stays_to_the_end_and_what_a_forward_or_backward_holds_add_within_bounds(schedule, pp, m, sizes):
    # invariant: bytes a forward keeps to the step's end (kept_to_end) and bytes it holds only
    # while it runs (during_forward) only add to a rank's peak: at least the largest of
    # them, at most every micro-batch's kept bytes and the largest transient together.
    # Bytes a backward holds only while it runs (during_backward: a checkpointed block's
    # recompute) add at most the largest of the rank's stages'; where one stage a rank and
    # every backward whole (GPipe, 1F1B), its first backward starts with every micro-batch
    # in flight, so the peak rises by exactly its stage's
    name, per_rank = schedule
    if not _runs(name, pp, per_rank, m):
        return
    n = pp * per_rank
    kept, to_end, during, working = sizes[:n], sizes[8 : 8 + n], sizes[16 : 16 + n], sizes[24 : 24 + n]
    plain = held_peak_parts(name, pp, m, per_rank, kept)
    base = activations(plain)
    both = activations(
        held_peak_parts(name, pp, m, per_rank, kept, kept_to_end=to_end, during_forward=during)
    )
    assert held_peak_parts(name, pp, m, per_rank, kept, kept_to_end=[0] * n, during_forward=[0] * n) == plain
    backward = held_peak_parts(name, pp, m, per_rank, kept, during_backward=working)
    for rank in range(pp):
        mine = [s for s in range(n) if stage_rank(s, pp, per_rank, name) == rank]
        ends = m * sum(to_end[s] for s in mine)
        assert base[rank] <= both[rank] <= base[rank] + ends + max(during[s] for s in mine)
        # every forward done, its kept bytes all stay: the peak holds them all at the end
        assert both[rank] >= ends
        assert base[rank] <= sum(backward[rank]) <= base[rank] + max(working[s] for s in mine)
        if name in ("gpipe", "1f1b"):
            assert sum(backward[rank]) == in_flight(name, pp, m)[rank] * kept[rank] + working[rank]


@given(
    st.sampled_from(EVERY),
    st.integers(1, 5),
    st.integers(1, 12),
    st.lists(st.floats(0.1, 3.0), min_size=3, max_size=3),
)
def test_clock_respects_every_dependency(schedule, pp, m, times):
    name, per_rank = schedule
    if not _runs(name, pp, per_rank, m):
        return
    f, b, hop = times
    line = simulate(name, pp, m, per_rank, forward=f, backward=b, p2p=hop)
    stages = pp * per_rank
    end = {}
    for rank, spans in enumerate(line.spans):
        last = 0.0
        for start, stop, step in spans:
            assert start >= last - 1e-9  # one thing at a time per rank
            last = stop
            for action in step:
                end[(action.stage, action.kind, action.microbatch)] = (rank, stop)
        assert line.busy[rank] == pytest.approx(m * per_rank * (f + b))
    for (s, kind, mb), (rank, stop) in end.items():
        if kind == "F" and s > 0:
            before_rank, before = end[(s - 1, "F", mb)]
            hop_here = hop if before_rank != rank else 0.0
            assert stop >= before + hop_here + f - 1e-9
    # nothing beats one micro-batch's trip through every stage and back (a split backward
    # leaves the weight half, W, off that path)
    trip = f + (b / 2 if name in SPLIT_BACKWARD or name == "dualpipev" else b)
    assert line.makespan >= stages * trip - 1e-9
    assert 0 <= line.bubble < 1


def test_check_pipeline_passes_torchs_reason_on():
    message = (
        "pipeline(schedule='1f1b', microbatches=2) on pp=4 with 1 stage(s) per rank: torch's "
        "Schedule1F1B refuses 2 micro-batches over 4 stages: Number of microbatches (2) must be greater "
        "than or equal to the number of stages (4). Change microbatches (micro-batch counts that work "
        "here: [4, 5, 6])"
    )
    with pytest.raises(fs.PolicyError, match=re.escape(message)):
        check_pipeline("1f1b", 4, 1, 2)
    with pytest.raises(fs.PolicyError, match=r"multiple of the number of rounds \(2\), but got 9"):
        check_pipeline("interleaved1f1b", 4, 2, 9)
    with pytest.raises(fs.PolicyError, match=r"as many microbatches as stages.*work here: \[8, 9, 10\]"):
        check_pipeline("dualpipev", 4, 2, 7)
    with pytest.raises(fs.PolicyError, match=r"microbatches=0"):
        check_pipeline("gpipe", 2, 1, 0)


def test_shard_refuses_before_anything_runs():
    model = llama("tiny")
    with pytest.raises(
        fs.PolicyError, match=r"Schedule1F1B refuses 1 micro-batches over 2 stages: Number of microbatches"
    ):
        fs.shard(model, fs.Mesh(pp=2, dp=2), fs.pipeline("pp", microbatches=1) + fs.fsdp("dp"))
    plan = fs.shard(model, fs.Mesh(pp=2, dp=2), fs.pipeline("pp", microbatches=2) + fs.fsdp("dp"))
    assert plan.config.pipeline.microbatches == 2


def test_v_shaped_first_and_last_stage_share_rank_zero():
    for name in V_SHAPED:
        steps = schedule_actions(name, 2, 4, 2)[0]
        assert {a.stage for step in steps for a in step} == {0, 3}
