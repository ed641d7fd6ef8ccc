"""One trace to one `Estimate`, for every plan: a pipeline is its stages on torch's schedule.

The rank's `StepParts` (under a pipeline the worst pp rank's, `pipeline_estimate.pipeline_parts`) are
timed the same way for both (`step_seconds.step_time`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from functional_shard.core.sequence import causal_imbalance, engine_that_runs
from functional_shard.costing.cost.cost_model import cost
from functional_shard.costing.time.context_engines import (
    recompute_beyond,
    ring_merge_seconds,
    with_engine,
    with_ring_workspace,
)
from functional_shard.costing.time.kernel_time import IDLE_PART, fsdp_copy_bytes, optimizer_bytes, work_of
from functional_shard.costing.time.kernels import (
    Clock,
    cost_with_float8_gathers,
    gathered_with_float8,
    saved_by_stage,
)
from functional_shard.costing.time.step_model import (
    Assembly,
    StepParts,
    _recomputed,
    gathered_in_flight,
)
from functional_shard.costing.time.step_seconds import step_time

from .loss_memory import loss_workspace
from .peak_moment import peak_moment
from .pipeline_estimate import pipeline_parts
from .record import Estimate
from .reserved import reserved_beyond

if TYPE_CHECKING:
    from functional_shard.costing.time.hardware import Hardware
    from functional_shard.planning.plan.plan import Plan

__all__ = ["Assembly", "assemble"]


def _flat_parts(assembly: Assembly) -> StepParts:
    plan, trace = assembly.plan, assembly.trace
    tokens = assembly.batch * assembly.seq
    units = gathered_with_float8(assembly.units, assembly.float8_gathered)
    compiled_loss = assembly.kernels.compiled_loss
    plan_cost = (
        assembly.costs[0]
        if assembly.costs
        else cost(plan, assembly.optimizer, rank=assembly.rank, tokens=tokens)
    )
    plan_cost = cost_with_float8_gathers(plan_cost, plan, assembly.float8_gathered)
    memory = {
        "params": plan_cost.params_bytes,
        "grads": plan_cost.grads_bytes,
        "optimizer": plan_cost.optimizer_bytes,
        "buffers": plan_cost.buffers_bytes,
        "gathered": gathered_in_flight(plan, units),
        "activations": int(trace.activation_bytes),
        "loss_workspace": loss_workspace(
            trace.output_bytes, trace.output_numel, plan.config.loss_parallel, compiled=compiled_loss
        ),
    }
    memory = with_ring_workspace(memory, plan, tokens)  # under cp, what torch's ring adds
    # a checkpointed block's recompute, held through its backward, after the loss's
    if recompute := recompute_beyond(plan, tokens, trace.recompute_bytes, memory["loss_workspace"]):
        memory["recompute"] = recompute
    kept = memory["activations"]
    memory, peak_at = peak_moment(memory, assembly.optimizer)
    return StepParts(
        plan=plan,
        cost=plan_cost,
        memory=memory,
        forward_flops=trace.forward_flops,
        backward_flops=trace.backward_flops,
        recompute_flops=trace.recompute_flops,
        units=units,
        attention_flops=trace.attention_flops
        + trace.attention_backward_flops
        + trace.attention_recompute_flops,
        peak_at=peak_at,
        saved=saved_by_stage(
            trace, assembly.float8_linears, tokens // plan.config.cp_size(plan.mesh), assembly.hardware
        )[0],
        work=work_of(
            trace,
            fsdp_bytes=fsdp_copy_bytes(plan, units),
            step_bytes=optimizer_bytes(plan_cost.params_bytes, assembly.optimizer),
            compiled_loss=compiled_loss,
        ),
        activations=kept,
    )


def _with_idle(compute_parts: dict[str, float], makespan: float | None) -> dict[str, float]:
    """A pipeline rank's parts with its wait in the schedule, so that they sum to the makespan."""
    if makespan is None or not compute_parts:
        return compute_parts
    return compute_parts | {IDLE_PART: max(0.0, makespan - sum(compute_parts.values()))}


def _causal_imbalance(plan: Plan, seq: int, hardware: Hardware, *, packed: bool = False) -> float:
    """The cp group's busiest rank's causal attention work over the mean (1.0 without cp).

    Only torch's ring follows the ranks' chunks: per chunk pair it runs a causal kernel on its own
    chunk, a full one on an earlier rank's and none on a later one's. The all-gather engine (and
    packed rows, which it runs whatever the plan's engine) calls SDPA with a boolean mask, which
    skips no pair: every rank's kernel runs its queries against every key, as the trace counts.
    """
    context = plan.config.context
    if context is None or context.size(plan.mesh) == 1 or packed:
        return 1.0
    if engine_that_runs(context.engine, cuda=hardware.cuda) != "ring":
        return 1.0
    return causal_imbalance(seq, context.size(plan.mesh), load_balance=context.load_balance)


def assemble(assembly: Assembly) -> Estimate:
    """The `Estimate` of ``assembly.plan`` from its trace, pipelined or not.

    Examples:
        >>> from functional_shard.costing.estimate.estimate import _trace
        >>> from functional_shard.costing.time.hardware import hardware
        >>> from functional_shard.costing.time.step_model import compute_dtype, unit_gathered_bytes
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp())
        >>> trace = _trace(model, plan, batch=2, seq=16)
        >>> hw, dtype, units = hardware("h100"), compute_dtype(plan), unit_gathered_bytes(plan)
        >>> found = Assembly(plan=plan, trace=trace, hardware=hw, dtype=dtype, batch=2, seq=16, units=units)
        >>> assemble(found).peak_bytes > 0
        True
    """
    plan, hw = assembly.plan, assembly.hardware
    parts = pipeline_parts(assembly) if plan.config.pipeline else _flat_parts(assembly)
    checkpointed = plan.config.checkpointed if assembly.checkpointed is None else assembly.checkpointed
    clock = Clock.of(assembly.kernels, hw, assembly.dtype)
    timed = step_time(
        parts.plan,
        parts.cost,
        hw,
        dtype=assembly.dtype,
        forward_flops=parts.forward_flops,
        backward_flops=parts.backward_flops,
        recompute_flops=parts.recompute_flops,
        units=parts.units,
        recomputed=_recomputed(parts.plan, checkpointed, assembly.batch * assembly.seq),
        attention_flops=parts.attention_flops,
        causal_imbalance=_causal_imbalance(plan, assembly.seq, hw, packed=assembly.documents is not None),
        clock=clock,
        saved=parts.saved,
        ring_merges=ring_merge_seconds(parts.plan, parts.attention_flops, assembly.seq, hw, clock.speedup),
        work=parts.work,
    )
    found = Estimate(
        rank=parts.rank,
        batch=assembly.batch,
        seq=assembly.seq,
        hardware=hw,
        dtype=assembly.dtype,
        memory=parts.memory,
        host_bytes=parts.cost.host_bytes,
        flops=parts.forward_flops + parts.backward_flops + parts.recompute_flops,
        model_flops=parts.forward_flops + parts.backward_flops,
        compute_seconds=timed.compute_seconds if parts.compute_seconds is None else parts.compute_seconds,
        exposed_seconds=timed.exposed_seconds,
        comm_seconds=timed.comm_seconds | dict(parts.sends),
        tensor_parallel=plan.config.tp_size(plan.mesh),
        context_parallel=plan.config.cp_size(plan.mesh),
        cost=parts.cost,
        pipeline=parts.pipeline,
        peak_at=parts.peak_at,
        kernels=assembly.kernels,
        compute_parts=_with_idle(timed.compute_parts, parts.compute_seconds),
        reserved=reserved_beyond(parts.plan, parts.cost, parts.memory, parts.units),
        activations=parts.activations,
    )
    return with_engine(found, plan)
