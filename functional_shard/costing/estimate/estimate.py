"""Will it fit, and how fast: peak memory and step time of a plan, before any device is rented.

`estimate` adds to the cost model (`cost`) the activations autograd keeps (traced on fake tensors),
the loss's workspace, the FSDP units in flight, and time. docs/will-it-fit.md states the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from functional_shard.core.errors import PlanError, ShardingError, bullets
from functional_shard.core.sequence import check_step_tokens
from functional_shard.core.units import parse_bytes
from functional_shard.core.validate import entry_point, refuse
from functional_shard.costing.cost.cost_model import OptimizerKind, check_plan_and_optimizer
from functional_shard.costing.time.context_engines import for_hardware
from functional_shard.costing.time.documents import RowDocuments, cp_rank_of, row_documents
from functional_shard.costing.time.hardware import Hardware
from functional_shard.costing.time.hardware import hardware as _hardware
from functional_shard.costing.time.kernels import Kernels, kernel_fields
from functional_shard.costing.time.step_model import compute_dtype, unit_gathered_bytes
from functional_shard.costing.trace.model_inputs import check_model_and_plan, fitted_inputs
from functional_shard.planning.context_checks import context_parallel_problems
from functional_shard.planning.tp.module_splits import head_problems

from .from_trace import Assembly, assemble
from .pipeline_estimate import microbatch_size
from .record import Estimate
from .reserved import SIMULATED, ReservedModel, check_reserved_model, traced_reserved

if TYPE_CHECKING:
    from functional_shard.planning.plan.plan import Plan

__all__ = ["Estimate", "compare_schedules", "estimate", "parse_bytes", "with_traced_reserved"]


def _trace(model: Any, plan: Plan, **options: Any) -> Any:
    """`trace_activations` (its keywords: batch, seq, rank, ...) with torch's own log captured.

    A plan that splits attention heads is refused first (`_check_splits`): the forward
    cannot run it, and the trace would only say that it failed.
    """
    from functional_shard.core.quiet import captured
    from functional_shard.costing.trace.activations import (
        trace_activations,  # lazily: it loads torch's fake-tensor machinery
    )

    _check_splits(model, plan)
    _check_context(model, plan)

    # a failing fake kernel makes torch log its traceback before raising: our error says it
    with captured():
        return trace_activations(model, plan, **options)


def _check_splits(model: Any, plan: Plan) -> None:
    """Refuse, before tracing, attention projections split into parts of heads (`head_problems`)."""
    if isinstance(model, nn.Module) and (problems := head_problems(plan, model)):
        raise PlanError(
            bullets(
                f"estimate: {type(model).__name__} cannot run the tensor-parallel split of this plan "
                f"on {plan.mesh!r}:",
                problems,
                "Choose a tensor-parallel size that divides the heads, or leave those modules unsplit.",
            )
        )


def _check_context(model: Any, plan: Plan) -> None:
    """Refuse, before tracing, a cp plan whose attention the engine cannot split, as `check_runnable` does."""
    if isinstance(model, nn.Module) and (problems := context_parallel_problems(plan, model)):
        raise PlanError(
            bullets(
                f"estimate: context parallel cannot split {type(model).__name__}'s attention:",
                problems,
                "fs.apply refuses the plan too: leave out fs.cp(...) for this model, or give it attention "
                "that cp can split.",
            )
        )


@entry_point
def estimate(
    model: Any,
    plan: Plan,
    *,
    batch: int,
    seq: int,
    optimizer: OptimizerKind = "adamw",
    hardware: str | Hardware | None = None,
    rank: int | None = None,
    inputs: Any = None,
    expert_imbalance: float = 1.0,
    keep_outputs: bool = False,
    kernels: Kernels | None = None,
    documents: Any = None,
    reserved: ReservedModel = "streams",
) -> Estimate:
    """Estimate a training step's peak memory and time for ``plan`` on ``hardware``.

    Pure: the model may live on the meta device and no process group is needed.
    docs/will-it-fit.md states the model behind each part.

    Args:
        model: the module the plan was made from (meta device is enough).
        plan: its plan.
        batch: sequences per data-parallel rank per step; under a pipeline, the step's batch.
        seq: tokens per sequence.
        optimizer: as for `cost`.
        hardware: a profile name (`fs.hardware`) or a `Hardware`; ``None`` is ``"h100"``; ``"local"`` is
            measured with as many processes as the plan's mesh has devices.
        rank: the rank to estimate; by default the worst (`Estimate.rank` says which).
        inputs: the model's inputs when they are not token ids ``(batch, seq)`` (meta allowed).
        expert_imbalance: the most loaded expert's tokens over an even share (1 to E / k).
        keep_outputs: under a pipeline, the last stage keeps every micro-batch's output to the step's end.
        kernels: `fs.Kernels` (compile, Float8, async tensor parallel); by default eager bf16.
        documents: packed rows' document lengths (a `PackedBatch`, a list per row, or one row's for every
            row): attention counted per document, as a kernel that runs them apart does. Under context
            parallel each row is cut as the runtime cuts it (`functional_shard.core.sequence.document_ranges`)
            and run by the all-gather engine; the model flops are ``rank``'s share (by default the busiest
            cp rank's), the kernel's every pair of its queries and the row's keys (a boolean mask).
        reserved: how `Estimate.reserved_peak_bytes` counts the caching allocator: ``"streams"``, the
            segments cached on FSDP2's own streams beyond the allocated peak (fast); ``"traced"``, the
            step's allocations traced in order through torch's allocator rules, its fragmentation
            counted (seconds; FSDP on one rank with AdamW, token-id inputs, eager kernels).

    Returns:
        An `Estimate`.

    Raises:
        ShardingError: an argument of the wrong type or value, named with its fix; ``documents`` of
            more than ``seq`` tokens in a row (each named), or a cp size that does not divide ``seq``.
        PlanError: a split the model cannot run (heads tp does not divide, cp over attention it cannot split);
            ``reserved="traced"`` for a plan whose allocation order the trace does not know (its kind named).

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp") + fs.mixed_precision())
        >>> est = fs.estimate(model, plan, batch=2, seq=16, hardware="h100")
        >>> est.memory["params"] == plan.cost().params_bytes, est.peak_bytes > est.activation_bytes > 0
        (True, True)
        >>> packed = fs.estimate(model, plan, batch=2, seq=16, hardware="h100", documents=[8, 8])
        >>> packed.model_flops < est.model_flops, packed.peak_bytes == est.peak_bytes
        (True, True)
    """
    check_model_and_plan(model, plan, "estimate")
    check_plan_and_optimizer(plan, optimizer)
    check_step_tokens(batch, seq)
    if keep_outputs and plan.config.pipeline is None:
        what = "only a pipeline's last stage keeps its outputs to the step's end"
        refuse(
            "keep_outputs", "True", what, meaning="the plan has no fs.pipeline(...); leave keep_outputs out"
        )
    check_reserved_model(reserved, inputs=inputs, documents=documents, kernels=kernels)
    rows = None if documents is None else _rows(documents, plan, seq, rank)
    found = assemble(
        _assembly(
            model,
            plan,
            hardware,
            kernels,
            batch,
            seq,
            optimizer=optimizer,
            keep_outputs=keep_outputs,
            rank=rank,
            inputs=inputs,
            expert_imbalance=expert_imbalance,
            documents=rows,
        )
    )
    if reserved == "traced":
        found = with_traced_reserved(found, model, plan, batch=batch, seq=seq, optimizer=optimizer)
    return found if rows is None else dataclasses.replace(found, documents=rows)


def with_traced_reserved(
    found: Estimate, model: Any, plan: Plan, *, batch: int, seq: int, optimizer: OptimizerKind
) -> Estimate:
    """``found`` with its reserved peak from the step's traced allocations (`traced_reserved`)."""
    beyond = traced_reserved(model, plan, found.peak_bytes, batch=batch, seq=seq, optimizer=optimizer)
    return dataclasses.replace(found, reserved=beyond, reserved_model=SIMULATED)


def _rows(documents: Any, plan: Plan, seq: int, rank: int | None) -> RowDocuments:
    """``documents`` checked, each row cut over the cp ranks: ``rank``'s share counted, or the busiest."""
    return row_documents(documents, seq, cp=plan.config.cp_size(plan.mesh), cp_rank=cp_rank_of(plan, rank))


# rank, inputs, expert_imbalance and documents are `trace_activations`' own keywords, passed on as it takes
# them: `estimate` gives the caller's, `compare_schedules` the defaults
def _assembly(
    model: Any,
    plan: Plan,
    hardware: str | Hardware | None,
    kernels: Kernels | None,
    batch: int,
    seq: int,
    *,
    optimizer: OptimizerKind,
    keep_outputs: bool,
    rank: int | None = None,
    inputs: Any = None,
    expert_imbalance: float = 1.0,
    documents: RowDocuments | None = None,
) -> Assembly:
    """``plan`` on ``hardware`` (an ``"auto"`` cp engine chosen), traced once, ready to `assemble`."""
    hw = _hardware(hardware, processes=plan.mesh.size)  # "local": measured on the plan's devices
    dtype = compute_dtype(plan)
    hw.peak_flops(dtype)  # fail early, before tracing
    with_kernels = kernel_fields(model, plan, kernels, hw, dtype)
    # "auto" cp: the engine the hardware runs; packed rows, the all-gather engine's masks
    plan = for_hardware(plan, hw, packed=documents is not None)
    stages = (plan.config.pipeline.stages if plan.config.pipeline else ()) or None
    micro = microbatch_size(plan, batch)
    mine = seq // plan.config.cp_size(plan.mesh)  # a cp rank's tokens of each sequence
    trace = _trace(
        model,
        plan,
        batch=micro,
        seq=seq,
        rank=rank,
        inputs=fitted_inputs(inputs, batch=batch, seq=seq, traced_batch=micro, traced_seq=mine),
        expert_imbalance=expert_imbalance,
        stages=stages,
        cuda=hw.cuda,
        documents=documents,
    )
    units = unit_gathered_bytes(plan)
    return Assembly(
        plan=plan,
        trace=trace,
        hardware=hw,
        dtype=dtype,
        batch=batch,
        seq=seq,
        units=units,
        optimizer=optimizer,
        rank=rank,
        keep_outputs=keep_outputs,
        documents=documents,
        **with_kernels,
    )


# the same keywords as `estimate`, spelled out rather than forwarded: each is typed and
# documented where users read it
def compare_schedules(
    model: Any,
    plan: Plan,
    *,
    batch: int,
    seq: int,
    schedules: Sequence[str] | None = None,
    optimizer: OptimizerKind = "adamw",
    hardware: str | Hardware | None = None,
    keep_outputs: bool = False,
    kernels: Kernels | None = None,
) -> dict[str, Estimate]:
    """`estimate` of ``plan`` under each schedule that runs its stages, placed as they are.

    One trace serves them all: the stages, and what each keeps and computes per micro-batch,
    do not depend on the schedule; in-flight counts, the bubble and the step time do.

    Args:
        model: the module the plan was made from.
        plan: a plan with a pipeline.
        batch: the step's batch per data-parallel rank.
        seq: tokens per sequence.
        schedules: names to compare; by default every schedule torch can run here.
        optimizer: as for `cost`.
        hardware: as for `estimate`.
        keep_outputs: as for `estimate`.
        kernels: as for `estimate`.

    Returns:
        Schedule name -> its `Estimate`.

    Raises:
        ShardingError: the plan has no pipeline, ``schedules`` is one name (not a list), or a named
            schedule cannot run it.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(pp=2), fs.pipeline("pp", microbatches=4))
        >>> found = compare_schedules(model, plan, batch=8, seq=16, hardware="h100")
        >>> sorted(found), found["gpipe"].peak_bytes > found["1f1b"].peak_bytes
        (['1f1b', 'gpipe'], True)
    """
    from functional_shard.planning.pipeline.schedules import _actions_or_reason
    from functional_shard.planning.pipeline.stages import SCHEDULES, SINGLE_STAGE, V_SHAPED

    from .pipeline_estimate import with_schedule

    pipeline = plan.config.pipeline
    if pipeline is None:
        raise ShardingError("compare_schedules(): the plan has no pipeline; add fs.pipeline(...)")
    if isinstance(schedules, str):  # else compared letter by letter
        refuse("schedules", repr(schedules), "a list of schedule names", meaning=f"[{schedules!r}] for one")
    pp, per_rank, m = pipeline.size(plan.mesh), pipeline.stages_per_rank, pipeline.microbatches
    if schedules is None:
        fitting = [
            name
            for name in SCHEDULES
            if (name in SINGLE_STAGE) == (per_rank == 1)
            and (name in V_SHAPED) == (pipeline.schedule in V_SHAPED)
            and not isinstance(_actions_or_reason(name, pp, m, per_rank), str)
        ]
        schedules = fitting
    # one trace for every schedule: the stages, and what each keeps per micro-batch, are the same
    traced = _assembly(
        model, plan, hardware, kernels, batch, seq, optimizer=optimizer, keep_outputs=keep_outputs
    )
    return {
        name: assemble(dataclasses.replace(traced, plan=with_schedule(traced.plan, name)))
        for name in schedules
    }
