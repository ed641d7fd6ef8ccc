"""Peak memory and step time of a pipeline-parallel plan, stage by stage. Pure.

A pp rank holds its stages' states, one micro-batch's activations per stage per micro-batch in
flight (`schedules.held_peak_parts`), torch's receive buffers, and on the last stage the loss's
workspace. Compute time is the makespan of torch's action lists on a clock (`schedules.simulate`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from functional_shard.core.errors import ShardingError
from functional_shard.core.tree import dtype_from_name
from functional_shard.costing.cost.census import census_of
from functional_shard.costing.cost.cost_model import Cost, OptimizerKind, cost, unit_gathered
from functional_shard.costing.time.context_engines import recompute_beyond, with_ring_workspace
from functional_shard.costing.time.kernel_time import optimizer_bytes, trained_shares
from functional_shard.costing.time.kernels import (
    cost_with_float8_gathers,
    gathered_with_float8,
    saved_by_stage,
)
from functional_shard.costing.time.step_model import (
    Assembly,
    StepParts,
    gathered_in_flight,
    in_share,
)
from functional_shard.planning.pipeline.schedules import check_pipeline, held_peak_parts, in_flight, simulate
from functional_shard.planning.pipeline.stage_plans import stage_plan
from functional_shard.planning.pipeline.stages import rank_stages, stage_finder
from functional_shard.planning.plan.config import PipelineConfig

from .loss_memory import pipeline_loss_workspace
from .peak_moment import step_held, with_optimizer_step
from .record import PipelineEstimate, StageEstimate
from .stage_time import StageSeconds, rank_work, stage_seconds, stage_works

if TYPE_CHECKING:
    from functional_shard.costing.trace.results import ActivationTrace
    from functional_shard.planning.pipeline.schedules import Timeline
    from functional_shard.planning.plan.plan import Plan

__all__ = [
    "microbatch_size",
    "pipeline_parts",
    "stage_costs",
    "with_schedule",
]


def microbatch_size(plan: Plan, batch: int) -> int:
    """Sequences per micro-batch: ``batch`` cut into the plan's micro-batches (``batch`` without pp).

    Raises:
        ShardingError: the micro-batch count does not divide ``batch``.
    """
    m = plan.config.pipeline.microbatches if plan.config.pipeline else 1
    if not m or batch % m:
        raise ShardingError(
            f"estimate(batch={batch}): pipeline(microbatches={m}) cuts each step's batch into {m} "
            f"equal micro-batches (torch splits the batch dim evenly), and {m} does not divide {batch}. "
            f"Use a batch that is a multiple of {m}, or change microbatches"
        )
    return batch // m


@functools.lru_cache(maxsize=256)
def _in_flight(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> tuple[int, ...]:
    # a search asks it of each schedule for every tensor-parallel size and checkpointing
    return in_flight(schedule, pp, microbatches, stages_per_rank)


def _rank_of_coordinate(plan: Plan, pp_coordinate: int, rank: int | None) -> int:
    return _pipeline(plan).moved(plan.mesh, rank or 0, pp_coordinate)


def _pipeline(plan: Plan) -> PipelineConfig:
    pipeline = plan.config.pipeline
    if pipeline is None:
        raise ShardingError("a pipeline estimate of a plan without a pipeline: use fs.estimate(plan, ...)")
    return pipeline


def _stage_units(plan: Plan, units: Mapping[str, int], mine: set[int]) -> dict[str, int]:
    stage_of = stage_finder(_pipeline(plan).stages)
    return {unit: nbytes for unit, nbytes in units.items() if stage_of(unit, module=True) in (*mine, None)}


def _accumulated_grads(plan: Plan, units: Mapping[str, int], trained: Mapping[str, float]) -> int:
    """Bytes of a rank's stages' whole (unsharded) gradients, kept across micro-batches.

    torch's ``PipelineStage`` reduce-scatters once, after the last micro-batch: until then each gradient
    stays whole, in the reduce dtype if set, else the gathered dtype. ``units``: gathered bytes per unit;
    ``trained``: `trained_shares` (a frozen parameter has no gradient).
    """
    config = plan.config
    whole = int(sum(nbytes * trained.get(unit, 1.0) for unit, nbytes in units.items()))
    if not config.param_dtype or not config.reduce_dtype:
        return whole
    gathered = dtype_from_name(config.param_dtype).itemsize
    reduced = dtype_from_name(config.reduce_dtype).itemsize
    return whole * reduced // gathered


def _recomputing_stages(plan: Plan, stages: int) -> list[bool]:
    """Per stage, whether its backward recomputes: a checkpointed module is in it or holds it."""
    stage_of = stage_finder(_pipeline(plan).stages)
    homes = {stage_of(path, module=True) for path in plan.config.checkpointed}
    return [None in homes or s in homes for s in range(stages)]


def _signature(plan: Plan) -> tuple[Any, ...]:
    # shard() gives alike blocks one TensorSpec and one ParamSharding object each: stages
    # of alike blocks cost the same, and a 64-stage pipeline needs a few costs, not 64
    return (
        tuple((id(plan.tensors[path]), id(spec)) for path, spec in plan.params.items()),
        tuple((id(plan.tensors[path]), id(spec)) for path, spec in plan.buffers.items()),
        tuple((style, kind) for _, style, kind in plan.config.tp_styles),
        len(plan.config.fsdp.units) if plan.config.fsdp else 0,
        len(plan.config.checkpointed),
    )


def stage_costs(
    plan: Plan, optimizer: OptimizerKind, tokens: int, rank: int | None = None
) -> tuple[Cost, ...]:
    """Per pp coordinate, `cost` of what a rank there holds (`stage_plan` of its stages)."""
    pipeline = _pipeline(plan)
    pp, per_rank, schedule = pipeline.size(plan.mesh), pipeline.stages_per_rank, pipeline.schedule
    seen: dict[tuple[Any, ...], Cost] = {}
    out = []
    for c in range(pp):
        sub = stage_plan(plan, set(rank_stages(c, pp, per_rank, schedule)))
        key = _signature(sub)
        if key not in seen:
            seen[key] = cost(sub, optimizer, rank=_rank_of_coordinate(plan, c, rank), tokens=tokens)
        out.append(dataclasses.replace(seen[key], rank=_rank_of_coordinate(plan, c, rank)))
    return tuple(out)


def pipeline_parts(assembly: Assembly) -> StepParts:
    """The worst pp rank's step (or ``assembly.rank``'s) from a trace of one micro-batch with ``stages=``.

    ``assembly.costs`` (one per pp coordinate, at `_rank_of_coordinate`) may be given when known.
    """
    plan, trace, rank = assembly.plan, assembly.trace, assembly.rank
    layout = _layout(plan)
    m, micro = layout.microbatches, assembly.batch // layout.microbatches
    tokens = micro * assembly.seq // plan.config.cp_size(plan.mesh)  # of one micro-batch, on a cp rank
    saved = saved_by_stage(trace, assembly.float8_linears, tokens, assembly.hardware, layout.stages)
    holdings = _holdings(assembly, layout)
    works = stage_works(assembly, layout.owner, layout.microbatches, holdings.units, holdings.stage_gathered)
    seconds = stage_seconds(assembly, saved, works)
    stage_bytes = _stage_bytes(trace, layout, assembly.keep_outputs)
    timeline = _timeline(assembly, layout, seconds, stage_bytes.sends)
    costs = assembly.costs or stage_costs(plan, assembly.optimizer, assembly.batch * assembly.seq, rank)
    memories, peak_at = _rank_memories(assembly, layout, stage_bytes, holdings, costs)
    peaks = [sum(memory.values()) for memory in memories]
    if rank is not None:
        chosen = plan.mesh.coords(rank)[layout.axis]
    else:
        chosen = max(range(layout.pp), key=lambda c: (peaks[c], -c))
    ours = sorted(layout.ranks_stages[chosen])
    flops = {
        key: m * sum(getattr(trace, f"stage_{key}_flops")[s] for s in ours)
        for key in ("forward", "backward", "recompute")
    }
    stages = _stage_estimates(plan, layout, seconds, stage_bytes, holdings.whole_grads)
    float8_gathered = {
        unit: b for unit, b in assembly.float8_gathered.items() if unit in holdings.units[chosen]
    }
    return StepParts(
        plan=holdings.plans[chosen],
        # its units' Float8 all-gathers, where counted, a byte an element
        cost=cost_with_float8_gathers(costs[chosen], plan, float8_gathered),
        memory=memories[chosen],
        forward_flops=flops["forward"],
        backward_flops=flops["backward"],
        recompute_flops=flops["recompute"],
        units=holdings.gathered[chosen],
        # the rank's stages' attention, in the share of the trace's flops they run
        attention_flops=_attention_share(trace, sum(flops.values())),
        compute_seconds=timeline.makespan,
        sends=_crossings(assembly, layout, stage_bytes.sends),
        pipeline=PipelineEstimate(
            layout.schedule,
            m,
            micro,
            stages,
            tuple(peaks),
            timeline,
            kept_output_bytes=stage_bytes.to_end[-1],
            rank_memory=tuple(memories),
        ),
        peak_at=peak_at[chosen],
        saved={phase: m * sum(saved[s].get(phase, 0.0) for s in ours) for phase in saved[0]},
        work=rank_work(works, ours, m, optimizer_bytes(costs[chosen].params_bytes, assembly.optimizer)),
    )


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a pipeline's stages run: torch's schedule, and the pp coordinate of each stage."""

    axis: str
    schedule: str
    pp: int
    microbatches: int
    per_rank: int
    owner: tuple[int, ...]  # per stage, the pp coordinate that runs it
    ranks_stages: tuple[set[int], ...]  # per pp coordinate, the stages it runs

    @property
    def stages(self) -> int:
        return len(self.owner)

    @property
    def schedule_args(self) -> tuple[str, int, int, int]:
        """``(schedule, pp, microbatches, stages per rank)``, as `schedules`' functions take them first."""
        return self.schedule, self.pp, self.microbatches, self.per_rank

    def turn(self, stage: int) -> bool:
        """Whether the stage after ``stage`` runs on the same rank: a V's turn."""
        return stage < self.stages - 1 and self.owner[stage + 1] == self.owner[stage]

    def on_last_rank(self, stage: int) -> bool:
        """Whether ``stage`` runs on the rank that runs the last stage (and the loss)."""
        return self.stages - 1 in self.ranks_stages[self.owner[stage]]


def _layout(plan: Plan) -> _Layout:
    """The plan's pipeline, checked against what torch's schedule can run."""
    pipeline = _pipeline(plan)
    axis, pp = pipeline.axis, pipeline.size(plan.mesh)
    schedule, m, per_rank = pipeline.schedule, pipeline.microbatches, pipeline.stages_per_rank
    check_pipeline(schedule, pp, per_rank, m)
    owner = tuple(pipeline.coordinate_of(s, plan.mesh) for s in range(pp * per_rank))
    ranks_stages = tuple({s for s in range(len(owner)) if owner[s] == c} for c in range(pp))
    return _Layout(axis, schedule, pp, m, per_rank, owner, ranks_stages)


def _timeline(assembly: Assembly, layout: _Layout, seconds: StageSeconds, sends: Sequence[int]) -> Timeline:
    """The step on torch's action lists, run on a clock; each boundary's sends at the pp axis's link speed."""
    hw = assembly.hardware
    link = hw.bandwidth(assembly.plan.mesh, (layout.axis,), point_to_point=True)
    p2p = [nbytes / link + hw.collective_latency for nbytes in sends] or [0.0]
    return simulate(
        *layout.schedule_args,
        forward=seconds.forward,
        backward=seconds.backward,
        weight=seconds.weight,
        p2p=p2p,
    )


def _crossings(assembly: Assembly, layout: _Layout, sends: Sequence[int]) -> dict[str, float]:
    """The step's sends between ranks, ``"send/recv ..."`` -> seconds: each activation and its gradient."""
    plan, hw, axis, owner = assembly.plan, assembly.hardware, layout.axis, layout.owner
    link, link_name = hw.bandwidth(plan.mesh, (axis,), point_to_point=True), hw.link_of(plan.mesh, (axis,))
    return {
        f"send/recv stage {s}->{s + 1} over {axis} ({link_name})": 2 * layout.microbatches * sends[s] / link
        for s in range(layout.stages - 1)
        if owner[s] != owner[s + 1]
    }


@dataclasses.dataclass(frozen=True)
class _StageBytes:
    """Per stage, the activation bytes its rank holds (`held_peak_parts` places them in time)."""

    sends: list[int]  # per stage boundary, what one micro-batch sends across it
    buffers: list[int]  # torch's receive buffers, kept from step to step
    kept: list[int]  # per micro-batch, until its backward
    to_end: list[int]  # to the step's end: the last stage's outputs, where they are kept
    during_forward: list[int]  # during the forward only: what a V's turn replaces


def _stage_bytes(trace: ActivationTrace, layout: _Layout, keep_outputs: bool) -> _StageBytes:
    n, m, turn = layout.stages, layout.microbatches, layout.turn
    output = list(trace.stage_output_bytes)  # per stage, its last module's output
    sends = output[: n - 1]
    # torch's PipelineStage receives each micro-batch into a buffer of its own, kept from step to
    # step: m inputs (not on the first stage), m output gradients (not on the last)
    buffers = [m * ((output[s - 1] if s else 0) + (output[s] if s < n - 1 else 0)) for s in range(n)]
    # at a V's turn the next stage's buffer holds the output; the input received is its buffer
    kept = [trace.stage_activation_bytes[s] - (output[s] if turn(s) else 0) for s in range(n)]
    # the last stage keeps the logits (torch's stage caches its output) and the fp32 log-softmax
    # per micro-batch until its backward (tests/dist/test_pipeline_memory.py)
    kept[n - 1] += trace.output_bytes + 4 * trace.output_numel
    # step(return_outputs=True) keeps every micro-batch's output to the step's end, then concatenates
    to_end = [0] * n
    if keep_outputs:
        kept[n - 1] -= trace.output_bytes
        to_end[n - 1] = trace.output_bytes
    # at a V's turn the next stage's buffer holds the last step's tensor until the new one
    # replaces it, just after the forward
    during = [output[s] if turn(s) else 0 for s in range(n)]
    return _StageBytes(sends, buffers, kept, to_end, during)


@dataclasses.dataclass(frozen=True)
class _Holdings:
    """Per pp coordinate, its stages' plan and FSDP units; per stage, its gradients kept whole."""

    plans: list[Plan]
    units: list[dict[str, int]]  # its stages' units, in gathered bytes where they live
    gathered: list[dict[str, int]]  # what is held gathered: less with Float8 all-gathers
    whole_grads: list[int]  # per stage, from the end of its first backward in the step
    stage_gathered: list[int]  # per stage, its own parameters' gathered bytes


def _holdings(assembly: Assembly, layout: _Layout) -> _Holdings:
    plan, rank = assembly.plan, assembly.rank
    plans, units, gathered = [], [], []
    whole_grads, stage_gathered = [0] * layout.stages, [0] * layout.stages
    census = census_of(plan, {})
    for c, mine in enumerate(layout.ranks_stages):
        plans.append(stage_plan(plan, mine))
        # each pp coordinate's units, gathered where they live (``units`` are pp rank 0's)
        coords = plan.mesh.coords(_rank_of_coordinate(plan, c, rank))
        units.append(_stage_units(plan, unit_gathered(plan, census, coords), mine))
        gathered.append(gathered_with_float8(units[c], assembly.float8_gathered))
        for s in mine:
            # a rank's stages are separate modules, the root unit's parameters (embedding,
            # head) split among them: each stage's own cut of the plan says which it holds
            cut = plans[c] if len(mine) == 1 else stage_plan(plan, {s})
            own = units[c] if len(mine) == 1 else unit_gathered(cut, coords=coords)
            whole_grads[s] = _accumulated_grads(plan, own, trained_shares(cut))
            stage_gathered[s] = sum(own.values())
    return _Holdings(plans, units, gathered, whole_grads, stage_gathered)


def _recompute_held(assembly: Assembly, layout: _Layout, loss: int) -> list[int]:
    """Per stage, what its backward holds while it runs: a checkpointed block's recompute.

    Beyond what its rank's loss workspace and torch's ring count already (as for a flat
    plan); the same for every stage but the last rank's, which holds the loss's workspace.
    """
    plan, trace = assembly.plan, assembly.trace
    tokens = assembly.batch // layout.microbatches * assembly.seq
    beyond = {held: recompute_beyond(plan, tokens, trace.recompute_bytes, held) for held in (0, loss)}
    recomputing = _recomputing_stages(plan, layout.stages)
    return [
        beyond[loss if layout.on_last_rank(s) else 0] if recomputing[s] else 0 for s in range(layout.stages)
    ]


def _rank_memories(
    assembly: Assembly, layout: _Layout, stage_bytes: _StageBytes, holdings: _Holdings, costs: Sequence[Cost]
) -> tuple[list[dict[str, int]], list[str]]:
    """Per pp coordinate, its peak by part (`Estimate.memory`), and when in the step it falls."""
    plan, trace = assembly.plan, assembly.trace
    m, last = layout.microbatches, layout.stages - 1
    loss = pipeline_loss_workspace(trace.output_numel, plan.config.loss_parallel)
    held = held_peak_parts(
        *layout.schedule_args,
        stage_bytes.kept,
        kept_to_end=stage_bytes.to_end,
        during_forward=stage_bytes.during_forward,
        after_first_backward=holdings.whole_grads,
        during_backward=_recompute_held(assembly, layout, loss),
    )
    memories = []
    for c, mine in enumerate(layout.ranks_stages):
        plan_cost = costs[c]
        memories.append(
            {
                "params": plan_cost.params_bytes,
                "grads": plan_cost.grads_bytes,
                "optimizer": plan_cost.optimizer_bytes,
                "buffers": plan_cost.buffers_bytes,
                "gathered": gathered_in_flight(holdings.plans[c], holdings.gathered[c]),
                # at the activations' peak, the stages that ran a backward hold them whole
                "accumulated_grads": int(held[c].gradients),
                # and once per rank, whatever is in flight, what every micro-batch shares
                "activations": int(held[c].activations + trace.step_bytes),
                "pipeline_buffers": sum(stage_bytes.buffers[s] for s in mine),
                # one micro-batch's loss beyond its logits and log-softmax (those are in kept)
                "loss_workspace": loss if last in mine else 0,
            }
        )
        if held[c].working:
            # where the peak falls in a backward: its checkpointed block's recompute
            memories[c]["recompute"] = int(held[c].working)
    # torch's ring adds its backward's buffers before the worst rank is chosen
    tokens = assembly.batch // m * assembly.seq
    memories = [with_ring_workspace(memory, plan, tokens) for memory in memories]
    peak_at = ["the start of backward"] * layout.pp
    if assembly.keep_outputs:
        tail = layout.owner[last]  # the rank that keeps the outputs
        ending = _concatenating(memories[tail], 2 * m * trace.output_bytes)
        if sum(ending.values()) > sum(memories[tail].values()):
            memories[tail], peak_at[tail] = ending, "the step's end (its kept outputs concatenated)"
    moments = [
        with_optimizer_step(memory, at, step_held(memory, assembly.optimizer))
        for memory, at in zip(memories, peak_at, strict=True)
    ]
    return [memory for memory, _ in moments], [at for _, at in moments]


def _stage_estimates(
    plan: Plan, layout: _Layout, seconds: StageSeconds, stage_bytes: _StageBytes, whole_grads: list[int]
) -> tuple[StageEstimate, ...]:
    flight = _in_flight(*layout.schedule_args)
    return tuple(
        StageEstimate(
            stage=s,
            rank=layout.owner[s],
            modules=tuple(_pipeline(plan).stages[s]),
            activation_bytes=int(stage_bytes.kept[s]),
            in_flight=flight[s],
            forward_seconds=seconds.forward[s],
            backward_seconds=seconds.backward[s],
            send_bytes=int(stage_bytes.sends[s]) if s < layout.stages - 1 else 0,
            buffer_bytes=stage_bytes.buffers[s],
            whole_grad_bytes=whole_grads[s],
        )
        for s in range(layout.stages)
    )


def _concatenating(memory: Mapping[str, int], outputs: int) -> dict[str, int]:
    """The last stage's rank when torch concatenates its kept outputs, after the step's backward.

    The gradients are reduced and the gathered parameters freed by then (torch reduces
    before it returns); ``outputs``: the kept outputs and their concatenation.
    """
    kept = ("params", "grads", "optimizer", "buffers", "pipeline_buffers")
    return {part: nbytes if part in kept else 0 for part, nbytes in memory.items()} | {"activations": outputs}


def _attention_share(trace: ActivationTrace, rank_flops: float) -> float:
    attention = trace.attention_flops + trace.attention_backward_flops + trace.attention_recompute_flops
    return in_share(attention, rank_flops, trace.step_flops)


def with_schedule(plan: Plan, schedule: str) -> Plan:
    """``plan`` run by another schedule with the same stages per rank and the same placement.

    Raises:
        ShardingError: the plan has no pipeline, or the schedule places stages on other ranks.
        PolicyError: the schedule cannot run the plan's stages per rank or micro-batches.
    """
    from functional_shard.planning.pipeline.stages import V_SHAPED

    pipeline = plan.config.pipeline
    if pipeline is None:
        raise ShardingError(f"with_schedule({schedule!r}): the plan has no pipeline axis")
    if (schedule in V_SHAPED) != (pipeline.schedule in V_SHAPED):
        raise ShardingError(
            f"with_schedule({schedule!r}): it places stages on other ranks than "
            f"{pipeline.schedule!r} does; plan again with fs.pipeline(schedule={schedule!r})"
        )
    check_pipeline(schedule, pipeline.size(plan.mesh), pipeline.stages_per_rank, pipeline.microbatches)
    config = dataclasses.replace(plan.config, pipeline=dataclasses.replace(pipeline, schedule=schedule))
    return dataclasses.replace(plan, config=config)
