"""A step's seconds: its compute, and the communication the engines cannot hide behind it.

docs/will-it-fit.md states the model; the counts it reads come from `step_model`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from functional_shard.planning.plan.cost_record import Cost

from .context_engines import ring_exposed_seconds
from .hardware import Hardware
from .kernel_time import FLOAT8_PART, PHASES, Work
from .kernels import Clock, phase_saved
from .step_model import RecomputedCollectives, collective_counts, in_share, optimizer_seconds

if TYPE_CHECKING:
    from functional_shard.planning.plan.plan import Plan

__all__ = ["StepTime", "step_time"]


@dataclass(frozen=True)
class StepTime:
    """What `step_time` finds: a step's compute and the communication it does not hide.

    Attributes:
        compute_seconds: the step's flops, timed by its clock.
        exposed_seconds: what compute does not hide, by reason.
        comm_seconds: each collective's seconds, ``"<kind> over <axes> (<link>)"``.
        compute_parts: the compute seconds by kind of kernel where the hardware has `KernelRates`,
            with what Float8 saves (`kernel_time.FLOAT8_PART`, negative): they sum to the compute.
    """

    compute_seconds: float
    exposed_seconds: dict[str, float]
    comm_seconds: dict[str, float]
    compute_parts: dict[str, float] = field(default_factory=dict)


def step_time(
    plan: Plan,
    plan_cost: Cost,
    hw: Hardware,
    *,
    dtype: str,
    forward_flops: float,
    backward_flops: float,
    recompute_flops: float,
    units: Mapping[str, int],
    recomputed: RecomputedCollectives | None = None,
    attention_flops: float = 0.0,
    causal_imbalance: float = 1.0,
    clock: Clock | None = None,
    saved: Mapping[str, float] | None = None,
    ring_merges: float = 0.0,
    work: Work | None = None,
) -> StepTime:
    """A step's `StepTime`: compute seconds, exposed communication by reason, each collective's seconds.

    Tensor-parallel collectives (``recomputed`` ones too) and expert all-to-alls sit on the critical
    path; FSDP's gathers and reduce-scatters and DDP's all-reduce run under compute; ZeRO-1's
    broadcasts follow the optimizer step; torch's ring hides only under its attention chunks
    (`functional_shard.costing.time.context_engines.ring_exposed_seconds`). Without overlap (gloo on
    CPUs) every collective is exposed. Each collective also pays the hardware's latency.

    Args:
        plan: the plan (or, under a pipeline, the rank's stages' plan).
        plan_cost: its `cost`.
        hw: the hardware profile.
        dtype: the compute dtype.
        forward_flops: the rank's forward flops per step.
        backward_flops: its backward flops per step.
        recompute_flops: what recomputation adds.
        units: the FSDP units it gathers, with their bytes.
        recomputed: the tensor-parallel collectives recomputation re-issues (`RecomputedCollectives`).
        attention_flops: of the flops, attention's.
        causal_imbalance: the cp group's busiest rank's causal attention over the mean; the excess is exposed.
        clock: times the flops under `Kernels`; by default the achievable rate.
        saved: Float8's seconds saved, by phase.
        ring_merges: seconds of torch's ring's own passes (`context_engines.ring_merge_seconds`).
        work: what the step asks of each kind of kernel; timed kind by kind on hardware with `KernelRates`.
    """
    clock = clock or Clock(hw.achievable_flops(dtype))
    rate, saved = clock.rate, saved or {}
    total = forward_flops + backward_flops + recompute_flops
    backward_saved = phase_saved(saved, "backward", "weight", "recompute")
    parts: dict[str, float] = {}
    rates = hw.kernel_rates
    if work is not None and rates is not None and dtype in ("bfloat16", "float16"):
        parts = work.seconds(rates, PHASES, clock.speedup)
        if float8 := phase_saved(saved, *saved):
            parts[FLOAT8_PART] = -float8  # so that the parts sum to the compute
        compute = sum(parts.values())
        backward = sum(work.seconds(rates, PHASES[1:], clock.speedup).values()) - backward_saved
        attention_seconds = parts["attention"]
    else:
        compute = clock.seconds(total, attention_flops, phase_saved(saved, *saved))
        back = backward_flops + recompute_flops
        # attention in its share of the work
        backward = clock.seconds(back, in_share(attention_flops, back, total), backward_saved)
        attention_seconds = attention_flops / rate
    comm = _comm_seconds(plan, plan_cost, hw, recomputed or RecomputedCollectives())
    if clock.async_tp and hw.overlap_communication:
        # async TP hides the forward's half of them; the published gains are the forward's
        # (docs/will-it-fit.md, "Kernels")
        forward_attention = in_share(attention_flops, forward_flops, total)
        forward_work = clock.seconds(forward_flops, forward_attention, phase_saved(saved, "forward"))
        hidden = min(comm.tensor_parallel / 2, forward_work - forward_attention / rate)
        comm = replace(comm, tensor_parallel=comm.tensor_parallel - hidden)
    exposed: dict[str, float] = {}
    # attention_seconds is the cp group's mean rank's (flops.torch_ring_call), which every rank runs
    # under load balancing: torch's ring without it runs causal_imbalance times that on its busiest
    # rank (1.0 for masked all-gather SDPA)
    if hw.skips_masked_attention and causal_imbalance > 1 and attention_flops:
        exposed["unbalanced causal attention"] = attention_seconds * (causal_imbalance - 1)
    if ring_merges:  # on the stream of the ring's kernels: not hidden, whatever overlaps
        exposed["context parallel ring merges"] = ring_merges
    if not hw.overlap_communication:
        if comm.total:
            exposed["communication (no overlap)"] = comm.total
    else:
        exposed |= _overlapped_exposed(
            plan, plan_cost, hw, comm, units=units, compute=compute, backward=backward
        )
        exposed |= _context_exposed(plan, plan_cost, hw, comm.context, compute, attention_seconds)
    optimizer = work.memory.get("step", 0.0) / rates.bandwidth if parts and work and rates else None
    return StepTime(compute, _with_step_tail(exposed, plan_cost, hw, optimizer), comm.per_collective, parts)


@dataclass(frozen=True, kw_only=True)
class _CommSeconds:
    """A step's collectives' seconds, latencies in, summed by what hides them (`step_time`)."""

    per_collective: dict[str, float]
    tensor_parallel: float
    recompute: float  # the tensor-parallel collectives recomputation re-issues
    expert: float
    context: float
    sharded: float  # FSDP/ZeRO's gathers and reduce-scatters
    all_reduce: float
    broadcast: float

    @property
    def total(self) -> float:
        return (
            self.tensor_parallel
            + self.recompute
            + self.sharded
            + self.all_reduce
            + self.broadcast
            + self.expert
            + self.context
        )


def _collective_group(plan: Plan, kind: str, axes: tuple[str, ...]) -> str | None:
    """Which of `collective_counts`' groups a collective of ``kind`` over ``axes`` is in.

    ``None`` for a pipeline's sends between stages: the schedule's timeline times them
    (`pipeline_estimate`), inside the step's compute seconds.
    """
    if kind == "send_recv":
        return None
    tp_axes = set(plan.config.tensor_parallel_axes)
    if tp_axes and set(axes) <= tp_axes:
        return "tensor parallel"
    if plan.config.context is not None and axes == (plan.config.context.axis,):
        return "context parallel"
    if kind == "all_to_all":
        return "expert"
    if kind in ("broadcast", "all_reduce"):
        return kind
    return "sharded"


def _comm_seconds(
    plan: Plan, plan_cost: Cost, hw: Hardware, recomputed: RecomputedCollectives
) -> _CommSeconds:
    tp_axes = tuple(set(plan.config.tensor_parallel_axes))
    per_collective: dict[str, float] = {}
    counts = collective_counts(plan, plan_cost.grads_bytes)
    tp_latency = hw.collective_latency if hw.tensor_parallel_latency is None else hw.tensor_parallel_latency
    groups = {
        group: n * (tp_latency if group == "tensor parallel" else hw.collective_latency)
        for group, n in counts.items()
    }
    for kind, by_axes in plan_cost.comm_bytes.items():
        for axes_text, nbytes in by_axes.items():
            axes = tuple(axes_text.split(","))
            seconds = nbytes / hw.bandwidth(plan.mesh, axes, point_to_point=kind == "all_to_all")
            per_collective[f"{kind} over {axes_text} ({hw.link_of(plan.mesh, axes)})"] = seconds
            if (group := _collective_group(plan, kind, axes)) is not None:
                groups[group] += seconds
    tp_link = hw.link_of(plan.mesh, tp_axes) if tp_axes else "intra"
    recompute = recomputed.count * tp_latency
    for what, nbytes in recomputed.sent.items():
        seconds = nbytes / hw.bandwidth(plan.mesh, tp_axes)
        per_collective[f"{what} ({tp_link}, recompute)"] = seconds
        recompute += seconds
    return _CommSeconds(
        per_collective=per_collective,
        tensor_parallel=groups["tensor parallel"],
        recompute=recompute,
        expert=groups["expert"],
        context=groups["context parallel"],
        sharded=groups["sharded"],
        all_reduce=groups["all_reduce"],
        broadcast=groups["broadcast"],
    )


def _overlapped_exposed(
    plan: Plan,
    plan_cost: Cost,
    hw: Hardware,
    comm: _CommSeconds,
    *,
    units: Mapping[str, int],
    compute: float,
    backward: float,
) -> dict[str, float]:
    """What of the step's data-, tensor- and expert-parallel communication compute does not hide."""
    exposed: dict[str, float] = {}
    if comm.tensor_parallel:
        exposed["tensor parallel"] = comm.tensor_parallel
    if comm.recompute:
        exposed["tensor parallel recompute"] = comm.recompute
    if comm.expert:
        # the experts wait for their tokens, and the layer for the results: on the critical path
        exposed["expert all-to-all"] = comm.expert
    if comm.sharded:
        # nothing runs before the first unit (root and largest block) is gathered
        axes = plan.config.shard_axes
        n = plan.mesh.axes_size(axes) if axes else 1
        biggest = max((b for u, b in units.items() if u), default=0)
        first = (units.get("", 0) + biggest) * (n - 1) / n / hw.bandwidth(plan.mesh, axes) if n > 1 else 0.0
        first = min(first, comm.sharded)
        exposed["first all-gather"] = first
        rest = max(0.0, comm.sharded - first + comm.all_reduce - compute, comm.all_reduce - backward)
        if rest:
            exposed["fsdp not overlapped"] = rest
    elif comm.all_reduce:
        rest = max(0.0, comm.all_reduce - backward)
        if rest:
            exposed["grad all-reduce"] = rest
    if comm.broadcast:
        exposed["broadcast after step"] = comm.broadcast
    return exposed


def _context_exposed(
    plan: Plan, plan_cost: Cost, hw: Hardware, context: float, compute: float, attention_seconds: float
) -> dict[str, float]:
    """What of context parallel's communication (``context`` seconds) compute does not hide."""
    cp = plan.config.context
    if not context:
        return {}
    if cp is not None and cp.engine == "ring":
        # torch's ring hides its collectives under the attention op's own chunks only
        rest = ring_exposed_seconds(plan, plan_cost.comm_bytes, hw, attention_seconds)
        return {"context parallel ring not overlapped": rest} if rest else {}
    # our engine's gathers and scatters are issued as the layers run, beside their
    # compute: hidden under the step's compute, exposed beyond it
    rest = max(0.0, context - compute)
    return {"context parallel not overlapped": rest} if rest else {}


def _with_step_tail(
    exposed: dict[str, float], plan_cost: Cost, hw: Hardware, optimizer: float | None = None
) -> dict[str, float]:
    """``exposed`` plus what no plan overlaps: host transfers and the optimizer step.

    ``optimizer``: the optimizer step's seconds, when counted by its passes (`kernel_time`).
    """
    if plan_cost.host_bytes:
        # offloaded state crosses the host link twice a step (to the device and back)
        exposed["host transfers"] = 2 * plan_cost.host_bytes / hw.host_bandwidth
    step = optimizer_seconds(plan_cost, hw) if optimizer is None else optimizer
    if step:
        exposed["optimizer step"] = step
    return exposed
