"""Pipeline schedules as torch runs them: each pp rank's actions, what they keep, how long. Pure.

The action lists come from torch's own schedule classes, made with stand-in stages and no process
group; the compute actions are kept: ``F``, ``B`` (full backward), ``I`` (the input's) and ``W`` (the
weights'), a DualPipeV overlapped pair as one `Step`. From them: the micro-batches each stage holds
(`in_flight`), and when every action runs (`simulate`), hence the makespan and the bubble.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

from functional_shard.core.errors import PolicyError, one_line
from functional_shard.core.validate import positive_int

from .stages import SCHEDULES, SINGLE_STAGE, check_schedule, stage_rank

__all__ = [
    "Action",
    "HeldAtPeak",
    "Timeline",
    "check_pipeline",
    "held_peak_parts",
    "in_flight",
    "schedule_actions",
    "simulate",
]


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action of a schedule: ``kind`` (F, B, I or W) of ``stage`` on ``microbatch``."""

    stage: int
    kind: str
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


_Key = tuple[int, str, int]
Step = tuple[Action, ...]
"""What a rank runs at once: one action, or DualPipeV's overlapped forward and backward."""


class _StandInStage:
    """What a schedule's constructor reads of a ``PipelineStage`` to compute its order."""

    def __init__(self, pp: int, stages: int) -> None:
        self.group_rank = 0
        self.group_size = pp
        self.num_stages = stages
        self.stage_index = 0
        self.submod = None


def _torch_order(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> dict[int, list]:
    """The schedule's ``pipeline_order`` per rank, or torch's ValueError when it refuses the counts."""
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, SCHEDULES[schedule])
    stages = pp * stages_per_rank
    try:
        if schedule in SINGLE_STAGE:
            made = cls(_StandInStage(pp, stages), microbatches)
        else:
            made = cls([_StandInStage(pp, stages) for _ in range(stages_per_rank)], microbatches)
    except (AttributeError, TypeError):  # pragma: no cover - a torch whose schedules read more
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

        ops = get_schedule_ops(cls, pp, microbatches, stages_per_rank)
        return dict(enumerate(ops))
    return {rank: list(made.pipeline_order[rank]) for rank in range(pp)}


@functools.lru_cache(maxsize=256)
def _actions_or_reason(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int
) -> tuple[tuple[Step, ...], ...] | str:
    try:
        order = _torch_order(schedule, pp, microbatches, stages_per_rank)
    except ValueError as error:
        return one_line(error)
    ranks: list[tuple[Step, ...]] = []
    for rank in range(pp):
        steps: list[Step] = []
        for action in order[rank]:
            if action is None:
                continue
            subs = action.sub_actions or (action,)
            step = tuple(
                Action(sub.stage_index, sub.computation_type.value, sub.microbatch_index)
                for sub in subs
                if sub.computation_type.value in ("F", "B", "I", "W")
            )
            if step:
                steps.append(step)
        ranks.append(tuple(_renumbered(steps) if schedule == "1f1b" else steps))
    return tuple(ranks)


def _renumbered(steps: list[Step]) -> list[Step]:
    # torch's Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1 while its
    # step() runs micro-batches 0, 1, 2...: renumber by order of appearance
    seen: dict[tuple[int, str], int] = {}
    out: list[Step] = []
    for (action,) in steps:
        key = (action.stage, action.kind)
        index = seen.get(key, 0)
        seen[key] = index + 1
        out.append((Action(action.stage, action.kind, index),))
    return out


def _nearest_working(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> list[int]:
    working = [
        m
        for m in range(1, 4 * max(microbatches, pp * stages_per_rank) + 1)
        if not isinstance(_actions_or_reason(schedule, pp, m, stages_per_rank), str)
    ]
    above = [m for m in working if m > microbatches][:3]
    below = [m for m in working if m < microbatches][-2:]
    return below + above


def check_pipeline(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> None:
    """Refuse a schedule, stage count or micro-batch count torch's schedule cannot run.

    Torch's schedule is made for these counts and its refusal passed on, with counts nearby that work.

    Raises:
        PolicyError: an unknown schedule, or a stage or micro-batch count it cannot run.

    Examples:
        >>> check_pipeline("1f1b", 4, 1, 8)
        >>> check_pipeline("1f1b", 4, 1, 2)
        Traceback (most recent call last):
        ...
        functional_shard.PolicyError: pipeline(schedule='1f1b', microbatches=2) on pp=4 ...
    """
    check_schedule(schedule, stages_per_rank)
    positive_int(microbatches, "microbatches", meaning="micro-batches per step", error=PolicyError)
    positive_int(pp, "pp", meaning="the pipeline axis' size", error=PolicyError)
    reason = _actions_or_reason(schedule, pp, microbatches, stages_per_rank)
    if isinstance(reason, str):
        working = _nearest_working(schedule, pp, microbatches, stages_per_rank)
        fix = f"micro-batch counts that work here: {working}" if working else "use another schedule"
        raise PolicyError(
            f"pipeline(schedule={schedule!r}, microbatches={microbatches}) on pp={pp} with "
            f"{stages_per_rank} stage(s) per rank: torch's {SCHEDULES[schedule]} refuses "
            f"{microbatches} micro-batches over {pp * stages_per_rank} stages: {reason} "
            f"Change microbatches ({fix})"
        )


def schedule_actions(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1
) -> tuple[tuple[Step, ...], ...]:
    """Each pp rank's compute steps, in the order torch's schedule runs them.

    Raises:
        PolicyError: as `check_pipeline`.

    Examples:
        >>> schedule_actions("1f1b", 2, 3)[1]
        ((1F0,), (1B0,), (1F1,), (1B1,), (1F2,), (1B2,))
    """
    check_pipeline(schedule, pp, stages_per_rank, microbatches)
    actions = _actions_or_reason(schedule, pp, microbatches, stages_per_rank)
    if isinstance(actions, str):  # pragma: no cover - check_pipeline refused that
        raise PolicyError(actions)
    return actions


# B frees a micro-batch's activations; I keeps the graph for W (torch's stage_backward_input
# retains it), which frees them
_RELEASES = frozenset({"B", "W"})


class HeldAtPeak(NamedTuple):
    """What one pp rank holds, in bytes, at the moment the three together peak (`held_peak_parts`)."""

    activations: float
    """What its stages keep of the micro-batches in flight (and what stays to the step's end)."""
    gradients: float
    """Whole gradients held from each stage's first backward (``after_first_backward``)."""
    working: float
    """What the backward running then holds only while it runs (``during_backward``)."""


def held_peak_parts(
    schedule: str,
    pp: int,
    microbatches: int,
    stages_per_rank: int,
    stage_bytes: Sequence[float],
    *,
    kept_to_end: Sequence[float] | None = None,
    during_forward: Sequence[float] | None = None,
    after_first_backward: Sequence[float] | None = None,
    during_backward: Sequence[float] | None = None,
) -> tuple[HeldAtPeak, ...]:
    """Per rank, as its list orders them: what it holds when the sum peaks (`HeldAtPeak`).

    ``stage_bytes[s]``: what stage ``s`` keeps for one micro-batch, from its forward to the backward that
    frees it. ``kept_to_end[s]``: what a forward adds that stays to the step's end. ``during_forward[s]``:
    what a forward holds only while it runs. ``after_first_backward[s]``: what stage ``s`` holds from the
    end of its first backward to the step's end (FSDP2's whole gradients). ``during_backward[s]``: what a
    backward holds while it runs (a recompute), ``working`` where the peak falls in one.

    Examples:
        Activations alone: the most each rank's stages hold at once.

        >>> [held.activations for held in held_peak_parts("interleaved1f1b", 2, 4, 2, [1, 10, 100, 1000])]
        [203.0, 1020.0]
        >>> [held.activations for held in held_peak_parts("1f1b", 2, 4, 1, [10, 10], kept_to_end=[0, 1])]
        [20.0, 14.0]
        >>> [held.activations for held in held_peak_parts("1f1b", 2, 4, 1, [10, 10], during_forward=[5, 0])]
        [25.0, 10.0]

        With FSDP2's whole gradients:

        >>> held_peak_parts("1f1b", 2, 4, 1, [10, 10], after_first_backward=[100, 100])
        (HeldAtPeak(activations=20.0, gradients=100.0, working=0.0),
         HeldAtPeak(activations=10.0, gradients=100.0, working=0.0))
        >>> parts = held_peak_parts("interleaved1f1b", 2, 4, 2, [1] * 4, after_first_backward=[5] * 4)
        >>> [tuple(held) for held in parts]
        [(5.0, 10.0, 0.0), (3.0, 10.0, 0.0)]

        A backward's recompute peaks above the forward before it:

        >>> grads = [100, 100]
        >>> held_peak_parts("1f1b", 2, 4, 1, [10, 10], after_first_backward=grads, during_backward=[4, 4])[0]
        HeldAtPeak(activations=20.0, gradients=100.0, working=4.0)
    """
    to_end = kept_to_end or [0.0] * len(stage_bytes)
    during = during_forward or [0.0] * len(stage_bytes)
    gradients = after_first_backward or [0.0] * len(stage_bytes)
    working = during_backward or [0.0] * len(stage_bytes)
    out = []
    for steps in schedule_actions(schedule, pp, microbatches, stages_per_rank):
        held = whole = 0.0
        best = HeldAtPeak(0.0, 0.0, 0.0)
        backed: set[int] = set()
        for step in steps:
            # DualPipeV's overlapped step runs its forward, then its backward: the peak
            # is between the two
            for action in step:
                moments: list[HeldAtPeak] = []
                if action.kind == "F":
                    held += stage_bytes[action.stage] + to_end[action.stage]
                    moments.append(HeldAtPeak(held + during[action.stage], whole, 0.0))
                elif action.kind != "W":
                    # B or I, as it starts: its micro-batch still held, the recompute made
                    moments.append(HeldAtPeak(held, whole, float(working[action.stage])))
                if action.kind in _RELEASES:
                    held -= stage_bytes[action.stage]
                    if action.stage not in backed:
                        backed.add(action.stage)
                        whole += gradients[action.stage]
                    moments.append(HeldAtPeak(held, whole, 0.0))
                best = max([best, *moments], key=sum)
        out.append(best)
    return tuple(out)


def in_flight(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """The most micro-batches whose activations each stage holds at once, by stage index.

    A forward adds one; ``B``, or ``W`` of a split backward, takes it away.

    Examples:
        >>> in_flight("1f1b", 4, 8), in_flight("gpipe", 4, 8)
        ((4, 3, 2, 1), (8, 8, 8, 8))
    """
    peak = [0] * (pp * stages_per_rank)
    for steps in schedule_actions(schedule, pp, microbatches, stages_per_rank):
        held: dict[int, int] = {}
        for step in steps:
            for action in step:
                if action.kind == "F":
                    held[action.stage] = held.get(action.stage, 0) + 1
                    peak[action.stage] = max(peak[action.stage], held[action.stage])
                elif action.kind in _RELEASES:
                    held[action.stage] -= 1
    return tuple(peak)


@dataclass(frozen=True)
class Timeline:
    """When each rank runs what, in seconds from the step's start.

    Attributes:
        makespan: the step's compute span, first forward to the last backward's end.
        busy: per rank, seconds computing.
        spans: per rank, ``(start, end, step)`` of each step it runs, in order.
    """

    schedule: str
    pp: int
    microbatches: int
    stages_per_rank: int
    makespan: float
    busy: tuple[float, ...]
    spans: tuple[tuple[tuple[float, float, Step], ...], ...]

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank, seconds within the makespan spent waiting."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble(self) -> float:
        """Idle time over all ranks' time: the share of the step the pipeline wastes."""
        if not self.makespan:
            return 0.0
        return sum(self.idle) / (self.pp * self.makespan)


def _per_stage(name: str, values: float | Sequence[float], stages: int) -> tuple[float, ...]:
    if isinstance(values, int | float):
        return (float(values),) * stages
    out = tuple(float(v) for v in values)
    if len(out) != stages:
        raise PolicyError(f"simulate({name}=...): {len(out)} values for {stages} stages")
    return out


def simulate(
    schedule: str,
    pp: int,
    microbatches: int,
    stages_per_rank: int = 1,
    *,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    weight: float | Sequence[float] | None = None,
    p2p: float | Sequence[float] = 0.0,
) -> Timeline:
    """Run torch's action lists on a clock: each rank in its order, each action once its inputs arrive.

    A forward waits for the previous stage's, a backward for the next stage's (the last stage: its own
    forward), ``W`` for its ``I``; crossing ranks over boundary ``s → s + 1`` takes ``p2p[s]`` seconds.

    Args:
        schedule: our schedule name (`functional_shard.planning.pipeline.stages.SCHEDULES`).
        pp: ranks along the pipeline axis.
        microbatches: micro-batches per step.
        stages_per_rank: stages each rank runs.
        forward: seconds of one micro-batch's forward, per stage (or one value for all).
        backward: seconds of its full backward (``B``), per stage.
        weight: of that, the weight-gradient part (``W``); ``I`` is the rest. Default half.
        p2p: seconds to send one micro-batch's activation across each boundary.

    Returns:
        A `Timeline`.

    Examples:
        >>> line = simulate("gpipe", 4, 8, forward=1.0, backward=1.0)
        >>> line.makespan, round(line.bubble, 4), round(3 / (8 + 3), 4)
        (22.0, 0.2727, 0.2727)
    """
    actions = schedule_actions(schedule, pp, microbatches, stages_per_rank)
    n = pp * stages_per_rank
    f = _per_stage("forward", forward, n)
    b = _per_stage("backward", backward, n)
    w = _per_stage("weight", weight, n) if weight is not None else tuple(x / 2 for x in b)
    link = _per_stage("p2p", p2p, max(n - 1, 1)) if n > 1 else (0.0,)
    rank_of = [stage_rank(s, pp, stages_per_rank, schedule) for s in range(n)]
    duration = {"F": f, "B": b, "I": tuple(x - y for x, y in zip(b, w, strict=True)), "W": w}
    done: dict[tuple[int, str, int], float] = {}

    def ready(action: Action) -> tuple[float | None, tuple[_Key, ...]]:
        """When the action's inputs are in, or None and the actions it waits for."""
        s, kind, m = action.stage, action.kind, action.microbatch
        if kind == "F":
            if s == 0:
                return 0.0, ()
            end = done.get((s - 1, "F", m))
            if end is None:
                return None, ((s - 1, "F", m),)
            return end + (link[s - 1] if rank_of[s - 1] != rank_of[s] else 0.0), ()
        if kind == "W":
            end = done.get((s, "I", m))
            return (end, ()) if end is not None else (None, ((s, "I", m),))
        own = done.get((s, "F", m))
        if own is None:
            return None, ((s, "F", m),)
        if s == n - 1:
            return own, ()
        nxt = done.get((s + 1, "B", m), done.get((s + 1, "I", m)))
        if nxt is None:
            return None, ((s + 1, "B", m), (s + 1, "I", m))
        return max(own, nxt + (link[s] if rank_of[s + 1] != rank_of[s] else 0.0)), ()

    clock = [0.0] * pp
    busy = [0.0] * pp
    position = [0] * pp
    spans: list[list[tuple[float, float, Step]]] = [[] for _ in range(pp)]
    left = sum(len(steps) for steps in actions)
    # each rank runs until an action waits on another rank's; it is woken when that is done
    runnable = deque(range(pp))
    waiting: dict[_Key, list[int]] = {}
    while runnable:
        rank = runnable.popleft()
        steps = actions[rank]
        while position[rank] < len(steps):
            step = steps[position[rank]]
            start, blocked = clock[rank], cast("tuple[_Key, ...]", ())
            for action in step:
                at, blocked = ready(action)
                if at is None:
                    break
                start = max(start, at)
            if blocked:
                for key in blocked:
                    waiting.setdefault(key, []).append(rank)
                break
            end = start
            for action in step:
                end += duration[action.kind][action.stage]
                key = (action.stage, action.kind, action.microbatch)
                done[key] = end
                for woken in waiting.pop(key, ()):
                    if woken != rank:
                        runnable.append(woken)
            spans[rank].append((start, end, step))
            busy[rank] += end - start
            clock[rank] = end
            position[rank] += 1
            left -= 1
    if left:  # pragma: no cover - torch's lists always run
        raise PolicyError(f"simulate({schedule!r}, pp={pp}, microbatches={microbatches}): lists deadlock")
    return Timeline(
        schedule=schedule,
        pp=pp,
        microbatches=microbatches,
        stages_per_rank=stages_per_rank,
        makespan=max(clock),
        busy=tuple(busy),
        spans=tuple(tuple(s) for s in spans),
    )
