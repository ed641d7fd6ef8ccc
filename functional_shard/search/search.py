"""Running the search's points: each planned, costed, traced (through its `TraceCache`) and estimated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from functional_shard.core.errors import PlanError, ShardingError, one_line
from functional_shard.core.units import format_bytes as _bytes
from functional_shard.costing.cost.cost_model import OptimizerKind, cost
from functional_shard.costing.estimate.estimate import with_traced_reserved
from functional_shard.costing.estimate.from_trace import Assembly, assemble
from functional_shard.costing.estimate.record import Estimate
from functional_shard.costing.estimate.reserved import order_known
from functional_shard.costing.time.context_engines import for_hardware
from functional_shard.costing.time.hardware import Hardware
from functional_shard.costing.time.kernels import Kernels, check_kernel_hardware, kernel_fields
from functional_shard.costing.time.step_model import compute_dtype, unit_gathered_bytes
from functional_shard.planning.engine_limits import engine_config_problems
from functional_shard.planning.plan.plan import Plan
from functional_shard.planning.planner import shard, with_expert_top_k
from functional_shard.planning.policy.types import Policy

from .candidates import ModelFacts, Point, Policies, checkpoint_options, policy_text
from .report import Candidate
from .traces import TraceCache, TraceKey

__all__ = ["Search", "SearchInputs"]


@dataclass(frozen=True, kw_only=True)
class SearchInputs:
    """What a search estimates its points for: the model, the hardware, the step and the budget."""

    facts: ModelFacts
    """What the search read of the model."""
    hardware: Hardware
    optimizer: OptimizerKind
    batch: int
    """The global batch, in sequences per step."""
    seq: int
    budget: int
    """Bytes per device a candidate's peak must fit."""
    kernels: Kernels | None = None
    """The kernels every candidate runs where it can (`Kernels.for_plan`); None: eager."""


def _candidate(point: Point, how: str, policy: Policy, **outcome: Any) -> Candidate:
    return Candidate(
        point.mesh,
        point.family,
        point.tp,
        point.sp,
        how,
        point.offload,
        policy_text(policy),
        pipeline=point.pipeline,
        expert_parallel=point.ep,
        context_parallel=point.cp,
        **outcome,
    )


class Search:
    """Estimates points into candidates for one model, sharing traces between them.

    Examples:
        >>> from functional_shard.search.candidates import Point, model_facts
        >>> from functional_shard.zoo import llama
        >>> inputs = SearchInputs(
        ...     facts=model_facts(llama("tiny")), hardware=fs.hardware("h100"), optimizer="adamw",
        ...     batch=2, seq=16, budget=2**30,
        ... )
        >>> [c.checkpointing for c in Search(inputs).run([Point(fs.Mesh(dp=1), "fsdp", 1, False, False)])]
        ['none', 'selective', 'full']
    """

    def __init__(self, inputs: SearchInputs) -> None:
        self.inputs = inputs
        facts = inputs.facts
        # bf16 mixed precision where the hardware has a bf16 rate
        dtype = "bfloat16" if "bfloat16" in inputs.hardware.flops else None
        if inputs.kernels is not None:  # what every candidate shares, checked once, before any is made
            check_kernel_hardware(inputs.kernels, inputs.hardware, dtype or "float32", "auto")
        self.policies = Policies(facts, dtype)
        checkpointed: tuple[str, ...] = ()  # the modules fs.checkpointing(block) selects, as the planner does
        if facts.block is not None and isinstance(facts.model, nn.Module):
            checkpointed = tuple(
                p for p, m in facts.model.named_modules() if p and isinstance(m, facts.block)
            )
        self.checkpointed = checkpointed
        self.traces = TraceCache(
            facts.model,
            seq=inputs.seq,
            checkpointed=checkpointed,
            units=facts.units,
            cuda=inputs.hardware.cuda,
        )

    def run(self, points: list[Point]) -> list[Candidate]:
        """Each point's candidates: one per checkpointing (a pipeline's until one fits)."""
        out: list[Candidate] = []
        for point in points:
            out += self._run_pipeline(point) if point.pipeline is not None else self._run_flat(point)
        return out

    def final_plan(self, candidate: Candidate) -> Plan:
        """The plan of ``candidate``, planned from the model itself."""
        point = Point(
            candidate.mesh,
            candidate.family,
            candidate.tensor_parallel,
            candidate.sequence_parallel,
            candidate.offload,
            candidate.pipeline,
            candidate.expert_parallel,
            candidate.context_parallel,
        )
        return shard(self.inputs.facts.model, point.mesh, self.policies.of(point, candidate.checkpointing))

    def _kernel_fields(self, plan: Plan) -> dict[str, Any]:
        """`Assembly`'s kernel fields for ``plan``: the search's kernels, as far as it has them."""
        kernels = self.inputs.kernels
        fitted = kernels.for_plan(plan) if kernels is not None else None
        return kernel_fields(self.inputs.facts.model, plan, fitted, self.inputs.hardware, compute_dtype(plan))

    def _confirmed(self, point: Point, how: str, estimate: Estimate) -> Estimate:
        """``estimate``, its reserved peak traced where it fits and the trace knows the plan's allocations.

        The fast model leaves out the default stream's fragmentation and misses under on long
        sequences (docs/will-it-fit.md): a fitting plan of the kind an H200 measured is checked
        against the allocator's simulation of its step before it can be chosen.
        """
        inputs = self.inputs
        if estimate.reserved_peak_bytes > inputs.budget or not isinstance(inputs.facts.model, nn.Module):
            return estimate
        plan = shard(inputs.facts.tree, point.mesh, self.policies.of(point, how))
        if not order_known(plan, inputs.optimizer, inputs.kernels):
            return estimate
        micro = inputs.batch // point.dp
        try:
            return with_traced_reserved(
                estimate, inputs.facts.model, plan, batch=micro, seq=inputs.seq, optimizer=inputs.optimizer
            )
        except PlanError:  # a step the trace cannot run (no logits): the fast model's figure, which it names
            return estimate

    def _estimated(self, point: Point, how: str, estimate: Estimate) -> Candidate:
        estimate = self._confirmed(point, how, estimate)
        # the budget holds the caching allocator's segments, not only the tensors in them
        over = estimate.reserved_peak_bytes - self.inputs.budget
        return _candidate(
            point,
            how,
            self.policies.of(point, how),
            peak_bytes=estimate.reserved_peak_bytes,
            step_seconds=estimate.step_seconds,
            rejected=None if over <= 0 else f"needs {_bytes(over)} more",
            estimate=estimate,
        )

    def _failed(self, point: Point, how: str, error: Exception, what: str) -> Candidate:
        policy = self.policies.of(point, how)
        return _candidate(point, how, policy, rejected=f"cannot {what}: {one_line(error, 160)}")

    def _unrunnable(self, point: Point, plan: Plan) -> list[Candidate]:
        """``point``'s one candidate, rejected, where fs.apply would refuse its plan; else none.

        A plan the search returns is one to run: a point apply() cannot run (DDP or ZeRO-1 beside
        mixed precision or tensor parallel) is neither estimated nor chosen.
        """
        if not (problems := engine_config_problems(plan.config)):
            return []
        why = f"apply() cannot run it: {one_line('; '.join(problems), 160)}"
        return [_candidate(point, "none", self.policies.of(point, "none"), rejected=why)]

    def _run_flat(self, point: Point) -> list[Candidate]:
        inputs = self.inputs
        try:  # planned from the tree, read once; what only the model says (experts per token) added
            plan = with_expert_top_k(
                shard(inputs.facts.tree, point.mesh, self.policies.of(point, "none")), inputs.facts.model
            )
        except ShardingError as error:
            return [self._failed(point, "none", error, "plan")]
        if unrunnable := self._unrunnable(point, plan):
            return unrunnable
        plan = for_hardware(plan, inputs.hardware)  # "auto" cp: the engine the hardware runs
        micro = inputs.batch // point.dp
        plan_cost = cost(plan, inputs.optimizer, tokens=micro * inputs.seq)
        units = unit_gathered_bytes(plan)
        with_kernels = self._kernel_fields(plan)
        out = []
        for how in checkpoint_options(inputs.facts.block):
            key = TraceKey(
                point.tp, point.sp, how, micro, expert_parallel=point.ep > 1, context_parallel=point.cp
            )
            trace = self.traces.trace(plan, key)
            if isinstance(trace, Exception):
                out.append(self._failed(point, how, trace, "trace"))
                continue
            estimate = assemble(
                Assembly(
                    plan=plan,
                    costs=(plan_cost,),
                    trace=trace,
                    hardware=inputs.hardware,
                    dtype=compute_dtype(plan),
                    batch=micro,
                    seq=inputs.seq,
                    units=units,
                    checkpointed=self.checkpointed if how != "none" else (),
                    **with_kernels,
                )
            )
            out.append(self._estimated(point, how, estimate))
        return out

    def _run_pipeline(self, point: Point) -> list[Candidate]:
        from functional_shard.costing.estimate.pipeline_estimate import stage_costs
        from functional_shard.costing.trace.activations import regroup

        inputs = self.inputs
        try:  # as in _run_flat: the stages' expert traffic needs the experts per token
            plan = with_expert_top_k(
                shard(inputs.facts.tree, point.mesh, self.policies.of(point, "none")), inputs.facts.model
            )
        except ShardingError as error:
            return [self._failed(point, "none", error, "plan")]
        if unrunnable := self._unrunnable(point, plan):
            return unrunnable
        plan = for_hardware(plan, inputs.hardware)
        pipeline = plan.config.pipeline
        assert pipeline is not None  # (a point with pp > 1 plans a pipeline)
        unit_of = {module: index for index, unit in enumerate(inputs.facts.units) for module in unit}
        groups = [sorted({unit_of[m] for m in stage}) for stage in pipeline.stages]
        local = inputs.batch // point.dp
        costs = stage_costs(plan, inputs.optimizer, local * inputs.seq)
        units = unit_gathered_bytes(plan)
        micro = local // pipeline.microbatches
        with_kernels = self._kernel_fields(plan)
        out: list[Candidate] = []
        for how in checkpoint_options(inputs.facts.block):
            if out and out[-1].fits:
                break  # checkpointing more only adds recomputation
            trace = self.traces.trace(plan, TraceKey(point.tp, point.sp, how, micro, by_unit=True))
            if isinstance(trace, Exception):
                out.append(self._failed(point, how, trace, "trace"))
                continue
            estimate = assemble(
                Assembly(
                    plan=self.traces.with_checkpointing(plan, how),
                    trace=regroup(trace, groups),
                    hardware=inputs.hardware,
                    dtype=compute_dtype(plan),
                    batch=local,
                    seq=inputs.seq,
                    optimizer=inputs.optimizer,
                    units=units,
                    costs=costs,
                    **with_kernels,
                )
            )
            out.append(self._estimated(point, how, estimate))
        return out
