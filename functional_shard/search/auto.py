"""Choose a plan: the fastest estimated step whose peak memory fits a budget.

`search_plans` enumerates a small, explicit space (meshes over the devices, data-parallel
families, tensor and sequence parallelism within a node, activation checkpointing of the
repeated blocks, bf16 mixed precision; pipeline parallelism when nothing fits without it;
CPU offload only when nothing else fits), estimates every candidate with `estimate`, and
keeps the one with the least step time that fits. Activation traces are shared by every
candidate with the same (tp, sp, checkpointing, dtype, micro-batch, seq), plans and costs by
every candidate with the same mesh and family; pipelines share one trace of each unit of
work (embedding, each block, head) as its own stage, whatever their stages. Expert-parallel
candidates of every ep size share one trace (under balanced routing each rank runs T x k
token copies through its experts, whatever the ep size).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from functional_shard.core.errors import PlanError, PolicyError, ShardingError, one_line
from functional_shard.core.mesh import Mesh
from functional_shard.core.tree import read_model
from functional_shard.core.units import format_bytes as _bytes
from functional_shard.costing.cost import OptimizerKind, cost
from functional_shard.costing.estimate import _assemble
from functional_shard.costing.hardware import Hardware
from functional_shard.costing.hardware import hardware as _hardware
from functional_shard.costing.step_model import (
    Estimate,
    _duration,
    compute_dtype,
    parse_bytes,
    unit_gathered_bytes,
)
from functional_shard.planning.plan import Plan
from functional_shard.planning.planner import shard, with_expert_top_k
from functional_shard.planning.policy import (
    ExpertParallel,
    Policy,
    checkpointing,
    ep,
    fsdp,
    hsdp,
    mixed_precision,
    offload,
    pipeline,
    replicate,
    tp,
    zero,
)

__all__ = ["AutoReport", "Candidate", "auto", "search_plans"]

FAMILIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
_TRACES: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()
CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    """One point of the search space and what the estimate said of it."""

    mesh: Mesh
    family: str
    tensor_parallel: int
    sequence_parallel: bool
    checkpointing: str
    offload: bool
    policy_text: str
    peak_bytes: int | None = None
    step_seconds: float | None = None
    rejected: str | None = None
    """Why it was not chosen for fitting: None if it fits."""
    estimate: Estimate | None = field(default=None, compare=False, repr=False)
    pipeline: tuple[str, int, int] | None = None
    """(schedule, stages per rank, micro-batches) under pipeline parallelism."""
    expert_parallel: int = 1
    """Ranks the experts are split over by expert index (the ``ep`` axis); 1: none."""

    @property
    def fits(self) -> bool:
        """Whether it was estimated and its peak fits the budget."""
        return self.rejected is None

    def key(self) -> tuple[Any, ...]:
        """Sort key: fastest first, ties broken by smaller peak then by text (deterministic)."""
        return (
            self.step_seconds if self.step_seconds is not None else float("inf"),
            self.peak_bytes if self.peak_bytes is not None else 1 << 80,
            self.policy_text,
            repr(self.mesh),
        )


@dataclass(frozen=True)
class AutoReport:
    """Every candidate `search_plans` looked at, and the chosen plan."""

    candidates: tuple[Candidate, ...]
    best_candidate: Candidate | None
    best: Plan | None
    budget_bytes: int
    hardware: Hardware
    no_tensor_parallel: str | None = None
    """Why tensor parallelism was left out of the search (None when it was searched)."""

    @property
    def expert_parallel_candidates(self) -> tuple[Candidate, ...]:
        """For each expert-parallel size searched, its best candidate (fitting first, then fastest).

        Examples:
            >>> from functional_shard.zoo import llama
            >>> report = fs.search_plans(llama("tiny"), devices=1, memory_budget="1GiB", batch=2, seq=16)
            >>> report.expert_parallel_candidates  # a dense model: none
            ()
        """
        best: dict[int, Candidate] = {}
        for c in sorted(self.candidates, key=lambda c: (not c.fits, c.key())):
            if c.expert_parallel > 1:
                best.setdefault(c.expert_parallel, c)
        return tuple(best[size] for size in sorted(best))

    def table(self, top: int | None = 10, candidates: tuple[Candidate, ...] | None = None) -> str:
        """The candidates (by default all) as a table, fitting ones first, fastest first."""
        shown = self.candidates if candidates is None else candidates
        rows = sorted(shown, key=lambda c: (not c.fits, c.key()))
        if top is not None:
            rows = rows[:top]
        mesh_width = max([4, *(len(repr(c.mesh)) for c in rows)])
        policy_width = max([6, *(len(c.policy_text) for c in rows)])
        header = f"{'mesh':<{mesh_width}} {'policy':<{policy_width}} {'peak':>11} {'step':>10}  verdict"
        lines = [header, "-" * len(header)]
        for c in rows:
            peak = _bytes(c.peak_bytes) if c.peak_bytes is not None else "-"
            step = step_text(c.step_seconds) if c.step_seconds is not None else "-"
            verdict = "chosen" if c is self.best_candidate else (c.rejected or "fits")
            lines.append(
                f"{c.mesh!r:<{mesh_width}} {c.policy_text:<{policy_width}} {peak:>11} {step:>10}  {verdict}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        fits = sum(c.fits for c in self.candidates)
        head = (
            f"{len(self.candidates)} candidates on {self.hardware.name}, budget {_bytes(self.budget_bytes)}: "
            f"{fits} fit"
        )
        if self.no_tensor_parallel:
            head += f"\nno tensor parallelism: {self.no_tensor_parallel}"
        text = head + "\n" + self.table()
        if self.expert_parallel_candidates:
            text += "\nexpert parallel, the best of each ep size:\n" + self.table(
                None, self.expert_parallel_candidates
            )
        return text


def step_text(seconds: float) -> str:
    """A step time for the tables: milliseconds to one decimal, a tiny model's in microseconds.

    Examples:
        >>> step_text(11.3171), step_text(0.00000099)
        ('11317.1 ms', '0.99 us')
    """
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else _duration(seconds)


def head_counts(model: Any) -> tuple[int, int] | None:
    """(query heads, key/value heads) from a Hugging Face config, our zoo's config or modules.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> head_counts(llama("llama-70b"))
        (64, 8)
    """
    config = getattr(model, "config", None)
    if config is not None:
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)
        if isinstance(heads, int):
            return heads, kv if isinstance(kv, int) else heads
    if isinstance(model, nn.Module):
        for module in model.modules():
            heads = getattr(module, "num_heads", None)
            if isinstance(heads, int):
                kv = getattr(module, "num_key_value_heads", None) or getattr(module, "num_kv_heads", None)
                return heads, kv if isinstance(kv, int) else heads
            head_dim = getattr(module, "head_dim", None)
            q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
            if isinstance(head_dim, int) and isinstance(q, nn.Linear) and isinstance(k, nn.Linear):
                return q.out_features // head_dim, k.out_features // head_dim
    return None


def repeated_block(model: Any) -> type | None:
    """The class of the blocks a model repeats (the elements of its largest ModuleList)."""
    if not isinstance(model, nn.Module):
        return None
    best: nn.ModuleList | None = None
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > 1
            and (best is None or len(module) > len(best))
        ):
            best = module
    return type(best[0]) if best is not None else None


def _rules(model: Any) -> tuple[Any, str | None]:
    """The model's tensor-parallel rules, or None and why no rule set fits it."""
    from functional_shard.planning import rules

    try:
        found = rules.for_model(model)
    except PolicyError as error:  # e.g. mixture-of-experts layers: data parallelism only
        return None, one_line(error, 240)
    return found, None


def expert_count(model: Any, tree: Any) -> int:
    """Experts per mixture-of-experts layer (dim 0 of its 3-D expert tensors); 0 for a dense model.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> from functional_shard.core.tree import read_model
        >>> expert_count(llama("tiny"), read_model(llama("tiny")))
        0
    """
    from functional_shard.core.tree import matches
    from functional_shard.planning.hf import expert_patterns

    try:
        patterns = expert_patterns(model)
    except (PolicyError, TypeError, AttributeError):
        return 0
    for path, tensor in tree.params.items():
        if tensor.ndim == 3 and any(matches(pattern, path) for pattern in patterns):
            return int(tensor.shape[0])
    return 0


def _splits_experts(rules: Any, tree: Any) -> bool:
    # tensor parallel reaching inside the experts: apply runs it without sequence parallel only
    return rules is not None and any(
        tensor.ndim == 3 and (rule := rules.match(path)) is not None and rule.target != "replicate"
        for path, tensor in tree.params.items()
    )


def _checkpoint_options(block: type | None) -> tuple[str, ...]:
    return ("none",) if block is None else CHECKPOINTING


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_devices(devices: Any, batch: Any, seq: Any) -> None:
    for name, value in (("devices", devices), ("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ShardingError(f"auto({name}={value!r}): a positive int")


@dataclass(frozen=True)
class _Point:
    mesh: Mesh
    family: str
    tp: int
    sp: bool
    offload: bool
    pipeline: tuple[str, int, int] | None = None
    ep: int = 1

    @property
    def dp(self) -> int:
        pp = self.mesh["pp"] if "pp" in self.mesh else 1  # noqa: SIM401 - a Mesh has no .get
        return self.mesh.size // self.tp // pp


MAX_PIPELINE = 16
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved1f1b", 2))
"""What the search tries under pp: torchtitan's default and its interleaved variant."""


def _pipeline_points(
    devices: int,
    batch: int,
    hw: Hardware,
    heads: tuple[int, int] | None,
    units: int,
    tensor_parallel: bool,
) -> Iterator[_Point]:
    # torchtitan's layout (pp outermost, then FSDP, tensor parallel within a node with
    # sequence parallel). Micro-batches: as many as the batch allows, up to 8 per stage
    # (the bubble of 1F1B is then under a tenth of the step); pipelines of up to 16 ranks,
    # as torchtitan and Megatron run 405B-class models
    from functional_shard.planning.schedules import check_pipeline

    for pp in _divisors(devices)[1:]:
        if pp > MAX_PIPELINE:
            break
        for tp_size in _divisors(devices // pp):
            if tp_size > 1 and (
                not tensor_parallel
                or tp_size > hw.devices_per_node
                or (heads and (heads[0] % tp_size or heads[1] % tp_size))
            ):
                continue
            dp = devices // (pp * tp_size)
            if batch % dp:
                continue
            local = batch // dp
            for schedule, per_rank in PIPELINE_SCHEDULES:
                if pp * per_rank > units:
                    continue
                microbatches = max(m for m in _divisors(local) if m <= 8 * pp * per_rank)
                try:
                    check_pipeline(schedule, pp, per_rank, microbatches)
                except PolicyError:
                    continue
                mesh = Mesh(pp=pp, dp=dp, **({"tp": tp_size} if tp_size > 1 else {}))
                yield _Point(mesh, "fsdp", tp_size, tp_size > 1, False, (schedule, per_rank, microbatches))


def _points(
    devices: int,
    batch: int,
    hw: Hardware,
    heads: tuple[int, int] | None,
    offload_: bool,
    tensor_parallel: bool = True,
    experts: int = 0,
    experts_split_by_tp: bool = False,
) -> Iterator[_Point]:
    for tp_size in _divisors(devices):
        if tp_size > 1 and (
            not tensor_parallel
            or tp_size > hw.devices_per_node
            or (heads and (heads[0] % tp_size or heads[1] % tp_size))
        ):
            continue
        dp = devices // tp_size
        if batch % dp:
            continue
        tp_axes = {"tp": tp_size} if tp_size > 1 else {}
        for sp in (False, True) if tp_size > 1 and not experts_split_by_tp else (False,):
            families = ("ddp",) if dp == 1 else FAMILIES
            for family in families:
                if offload_ and family not in ("zero2", "fsdp", "hsdp"):
                    continue
                if family == "hsdp":
                    for shard_size in _divisors(dp)[1:-1]:
                        mesh = Mesh(replicate=dp // shard_size, shard=shard_size, **tp_axes)
                        yield _Point(mesh, family, tp_size, sp, offload_)
                else:
                    yield _Point(Mesh(dp=dp, **tp_axes), family, tp_size, sp, offload_)
        if tp_size == 1 and dp > 1 and not offload_:
            # expert parallelism borrows its axis from the data-parallel ranks, as torchtitan
            # does: dense tensors FSDP-sharded over all of them, experts over the rest. (apply
            # splits an experts module one way: with tp it would reach inside them too)
            for ep_size in _divisors(experts)[1:]:
                if dp % ep_size == 0:
                    yield _Point(Mesh(dp=dp // ep_size, ep=ep_size), "fsdp", 1, False, False, ep=ep_size)


def _pipeline_units(tree: Any) -> tuple[tuple[str, ...], ...]:
    """Each unit of work torchtitan's cut deals out (embedding, each block, norm + head); () if none."""
    from functional_shard.planning.stages import _outer, split_stages

    before, blocks, after = _outer(tree)
    if not blocks:
        return ()
    return split_stages(tree, bool(before) + len(blocks) + bool(after))


def _policy(
    point: _Point,
    rules: Any,
    block: type | None,
    how: str,
    dtype: str | None,
    experts: tuple[str, ...] | None = None,
) -> Policy:
    data = {
        "ddp": lambda: replicate("dp"),
        "zero1": lambda: zero(1, "dp"),
        "zero2": lambda: zero(2, "dp"),
        "fsdp": lambda: fsdp("dp"),
        "hsdp": lambda: hsdp("replicate", "shard"),
    }[point.family]()
    policy = fsdp(("dp", "ep")) + ep("ep", experts=experts) if point.ep > 1 else data
    if point.pipeline is not None:
        schedule, per_rank, microbatches = point.pipeline
        policy = (
            pipeline("pp", microbatches=microbatches, schedule=schedule, stages_per_rank=per_rank) + policy
        )
    if point.tp > 1:
        policy = policy + tp(rules, "tp", sequence_parallel=point.sp)
    if dtype:
        policy = policy + mixed_precision(dtype)
    if how != "none" and block is not None:
        policy = policy + checkpointing(block, policy=how)
    if point.offload:
        policy = policy + offload()
    return policy


def _text(policy: Policy) -> str:
    # ep's expert patterns are what ep(axis) finds in the model again: left out of the text
    layers = tuple(
        dataclasses.replace(layer, experts=None) if isinstance(layer, ExpertParallel) else layer
        for layer in policy.layers
    )
    policy = Policy(layers, policy.options)
    try:
        from functional_shard.planning.policy_text import format_policy

        return format_policy(policy)
    except Exception:  # a policy the text form cannot spell: fall back to layer names
        pipe = policy.pipeline
        if pipe is not None:  # until the text form spells pipelines: the rest spelled out
            rest = Policy(tuple(layer for layer in policy.layers if layer is not pipe), policy.options)
            return f"{pipe.name} + {_text(rest)}"
        return " + ".join(layer.name for layer in policy.layers)


def search_plans(
    model: Any,
    *,
    devices: int,
    memory_budget: int | str,
    optimizer: OptimizerKind = "adamw",
    batch: int,
    seq: int,
    hardware: str | Hardware = "h100",
) -> AutoReport:
    """Estimate every plan in the search space; report them and the fastest that fits.

    The space: meshes ``dp x tp`` (and ``replicate x shard x tp`` for HSDP) over
    ``devices``, with ``tp`` inside one node and dividing the query and key/value heads;
    DDP, ZeRO-1, ZeRO-2, FSDP and HSDP; tensor parallelism with the model's rules, with and
    without sequence parallelism; no, selective or full checkpointing of the repeated
    blocks; bf16 mixed precision (fp32 when the hardware has no bf16 rate). When nothing
    fits that way (or no such mesh divides the batch), pipelines: meshes ``pp x dp x tp``
    for every pp size that divides the devices, FSDP over ``dp`` (the pipeline engine keeps a
    stage's units gathered across micro-batches, as torchtitan), tensor parallelism with sequence
    parallelism, the 1F1B and interleaved 1F1B (two stages per rank) schedules, one
    sequence per micro-batch. CPU offload (with ZeRO-2, FSDP or HSDP) is tried only when
    nothing else fits. A mixture-of-experts model also gets expert-parallel candidates,
    as torchtitan lays them out: for every ep size dividing the expert count and the
    data-parallel size, ``Mesh(dp=dp/ep, ep=ep)`` with ``fsdp(dp, ep) + ep(ep)`` (dense
    tensors FSDP-sharded over every data rank, experts split by index over ``ep`` and
    FSDP-sharded over ``dp``; ``AutoReport.expert_parallel_candidates``); its tensor-parallel
    candidates split inside the experts (transformers' plan), without sequence parallel,
    as apply runs them. A model no
    tensor-parallel rule set fits (`fs.rules.for_model` refuses it) gets data-parallel
    candidates only, and the report says why (``AutoReport.no_tensor_parallel``). Torch's
    own logging while tracing is held back; a candidate that cannot be traced keeps the
    reason in its row.

    Args:
        model: the module (meta device is enough).
        devices: number of devices.
        memory_budget: bytes per device, an int or text like ``"80GiB"``.
        optimizer: as for `cost`.
        batch: the global batch, in sequences per step, split over the data-parallel ranks.
        seq: tokens per sequence.
        hardware: a profile name or `Hardware`.

    Returns:
        An `AutoReport`; ``best`` is None when nothing fits.

    Raises:
        ShardingError: bad devices, batch, budget or hardware, or no mesh the batch divides.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> report = fs.search_plans(llama("tiny"), devices=1, memory_budget="1GiB", batch=2, seq=16)
        >>> report.best is not None and report.best_candidate.fits
        True
    """
    _check_devices(devices, batch, seq)
    budget = parse_bytes(memory_budget)
    hw = _hardware(hardware)
    heads = head_counts(model)
    block = repeated_block(model)
    rules, no_tensor_parallel = _rules(model)
    dtype = "bfloat16" if "bfloat16" in hw.flops else None
    tree = read_model(model)
    experts = expert_count(model, tree)
    split_by_tp = _splits_experts(rules, tree)
    points = list(_points(devices, batch, hw, heads, False, rules is not None, experts, split_by_tp))
    units = _pipeline_units(tree)

    def pipelines() -> list[_Point]:
        if not units:
            return []
        return list(_pipeline_points(devices, batch, hw, heads, len(units), rules is not None))

    pipe_points = [] if points else pipelines()
    if not points and not pipe_points:
        raise ShardingError(
            f"auto(devices={devices}, batch={batch}): no data-parallel size divides the batch for any "
            "tensor-parallel size that fits a node and divides the heads; choose a batch that is a "
            "multiple of the device count"
        )
    search = _Search(model, hw, optimizer, batch, seq, block, rules, dtype, budget, tree, units)
    candidates = search.run(points)
    if not any(c.fits for c in candidates):
        candidates += search.run(pipe_points or pipelines())
    if not any(c.fits for c in candidates):
        offloaded = _points(devices, batch, hw, heads, True, rules is not None, experts, split_by_tp)
        candidates += search.run(list(offloaded))
    fitting = [c for c in candidates if c.fits]
    best_candidate = min(fitting, key=Candidate.key) if fitting else None
    best = search.final_plan(best_candidate) if best_candidate else None
    return AutoReport(tuple(candidates), best_candidate, best, budget, hw, no_tensor_parallel)


class _Search:
    def __init__(
        self,
        model: Any,
        hw: Hardware,
        optimizer: OptimizerKind,
        batch: int,
        seq: int,
        block: type | None,
        rules: Any,
        dtype: str | None,
        budget: int,
        tree: Any = None,
        units: tuple[tuple[str, ...], ...] = (),
    ) -> None:
        self.model, self.hw, self.optimizer = model, hw, optimizer
        self.batch, self.seq, self.block, self.rules = batch, seq, block, rules
        self.dtype, self.budget = dtype, budget
        self.rules_text = repr(rules)
        # the model's tensors and modules, read once for the many plans of the search
        self.tree = tree if tree is not None else read_model(model)
        self.experts: tuple[str, ...] | None = None  # the expert tensors' patterns, read once
        if expert_count(model, self.tree):
            from functional_shard.planning.hf import expert_patterns

            self.experts = expert_patterns(model)
        self.units = units
        # the modules fs.checkpointing(block) selects, as the planner selects them
        self.block_paths: tuple[str, ...] = ()
        if block is not None and isinstance(model, nn.Module):
            self.block_paths = tuple(p for p, m in model.named_modules() if p and isinstance(m, block))
        try:  # traces depend on the model, not the budget: later searches reuse them
            self.traces = _TRACES.setdefault(model, {})
        except TypeError:  # not weak-referenceable: keep them for this search only
            self.traces = {}

    def _trace(self, point: _Point, plan: Plan, how: str, micro: int) -> Any:
        # what a trace reads of the plan is the same for every data-parallel family
        # (tests/test_auto.py checks it): the first point of a key traces its own plan, with
        # the checkpointing fs.checkpointing(block, policy=how) would add
        # Under balanced routing every ep size runs the same local work: a rank's E/ep experts
        # get ep times each expert's share, T*k rows in all (trace_experts): one trace for all
        key = (
            point.tp,
            point.sp,
            how,
            self.dtype,
            micro,
            self.seq,
            self.rules_text,
            self.block,
            point.ep > 1,
        )
        if key not in self.traces:
            from functional_shard.costing.estimate import (
                _trace,  # looked up per call: tests substitute the tracer
            )

            try:
                if how == "none":
                    self.traces[key] = _trace(self.model, plan, batch=micro, seq=self.seq)
                else:
                    self.traces[key] = self._checkpointed_trace(point, plan, how, micro, _trace)
            except Exception as error:  # reported in the candidate's row, never silently dropped
                self.traces[key] = one_line(error, 160)
        return self.traces[key]

    def _checkpointed_trace(self, point: _Point, plan: Plan, how: str, micro: int, trace: Any) -> Any:
        # Checkpointing changes what the forward keeps and adds recomputation; the backward's
        # own kernels are those of the same plan without it. Full checkpointing re-runs each
        # block up to the last op that saved a tensor, which the forward notes (torch stops
        # recomputing there). Selective checkpointing keeps the outputs of the ops that have
        # flops (matmuls, attention): when the forward shows no flops in the others,
        # recomputation runs none. Then the backward's flops are the plan's without
        # checkpointing; otherwise the trace runs its own backward.
        config = dataclasses.replace(plan.config, checkpointed=self.block_paths, checkpoint_policy=how)
        checkpointed = dataclasses.replace(plan, config=config)
        plain = self._trace(point, plan, "none", micro)
        if isinstance(plain, str):
            return trace(self.model, checkpointed, batch=micro, seq=self.seq)
        forward = trace(self.model, checkpointed, batch=micro, seq=self.seq, backward=False)
        if (how == "selective" and forward.recompute_flops) or forward.forward_flops != plain.forward_flops:
            return trace(self.model, checkpointed, batch=micro, seq=self.seq)
        return dataclasses.replace(
            forward, backward_flops=plain.backward_flops, backward_weight_flops=plain.backward_weight_flops
        )

    def run(self, points: list[_Point]) -> list[Candidate]:
        out = []
        for point in points:
            if point.pipeline is not None:
                out += self._run_pipeline(point)
                continue
            base_policy = _policy(point, self.rules, self.block, "none", self.dtype, self.experts)
            try:
                plan = self._shard(point.mesh, base_policy)
            except ShardingError as error:
                first = one_line(error, 160)
                out.append(
                    Candidate(
                        point.mesh,
                        point.family,
                        point.tp,
                        point.sp,
                        "none",
                        point.offload,
                        _text(base_policy),
                        rejected=f"cannot plan: {first}",
                        expert_parallel=point.ep,
                    )
                )
                continue
            plan_cost = cost(plan, self.optimizer, tokens=self.batch // point.dp * self.seq)
            units = unit_gathered_bytes(plan)
            micro = self.batch // point.dp
            for how in _checkpoint_options(self.block):
                policy = _policy(point, self.rules, self.block, how, self.dtype, self.experts)
                trace = self._trace(point, plan, how, micro)
                if isinstance(trace, str):
                    fields = (point.mesh, point.family, point.tp, point.sp, how, point.offload, _text(policy))
                    out.append(
                        Candidate(*fields, rejected=f"cannot trace: {trace}", expert_parallel=point.ep)
                    )
                    continue
                est = _assemble(
                    plan,
                    plan_cost,
                    trace,
                    self.hw,
                    compute_dtype(plan),
                    micro,
                    self.seq,
                    units,
                    self.block_paths if how != "none" else (),
                )
                over = est.peak_bytes - self.budget
                out.append(
                    Candidate(
                        point.mesh,
                        point.family,
                        point.tp,
                        point.sp,
                        how,
                        point.offload,
                        _text(policy),
                        est.peak_bytes,
                        est.step_seconds,
                        None if over <= 0 else f"needs {_bytes(over)} more",
                        est,
                        expert_parallel=point.ep,
                    )
                )
        return out

    def _shard(self, mesh: Mesh, policy: Policy) -> Plan:
        # planned from the tree, read once; what only the model says (experts per token) added
        return with_expert_top_k(shard(self.tree, mesh, policy), self.model)

    def _with_checkpointing(self, plan: Plan, how: str) -> Plan:
        if how == "none":
            return plan
        config = dataclasses.replace(plan.config, checkpointed=self.block_paths, checkpoint_policy=how)
        return dataclasses.replace(plan, config=config)

    def _unit_trace(self, point: _Point, plan: Plan, how: str, micro: int) -> Any:
        # each unit of work traced as its own stage: one trace serves every cut into stages
        key = ("units", point.tp, point.sp, how, self.dtype, micro, self.seq, self.rules_text, self.block)
        if key not in self.traces:
            from functional_shard.costing.estimate import _trace

            plain = self._unit_trace(point, plan, "none", micro) if how != "none" else None
            plan = self._with_checkpointing(plan, how)
            try:
                if plain is None or isinstance(plain, str):
                    found = _trace(self.model, plan, batch=micro, seq=self.seq, stages=self.units)
                else:
                    found = self._checkpointed_units(plan, how, micro, plain, _trace)
                self.traces[key] = found
            except Exception as error:  # reported in the candidate's row
                self.traces[key] = one_line(error, 160)
        return self.traces[key]

    def _checkpointed_units(self, plan: Plan, how: str, micro: int, plain: Any, trace: Any) -> Any:
        # as _checkpointed_trace, stage by stage: each stage's backward is the plan's without
        # checkpointing when each stage's forward is
        forward = trace(self.model, plan, batch=micro, seq=self.seq, stages=self.units, backward=False)
        if (
            (how == "selective" and forward.recompute_flops)
            or forward.forward_flops != plain.forward_flops
            or forward.stage_forward_flops != plain.stage_forward_flops
        ):
            return trace(self.model, plan, batch=micro, seq=self.seq, stages=self.units)
        return dataclasses.replace(
            forward,
            **{
                name: getattr(plain, name)
                for name in (
                    "backward_flops",
                    "backward_weight_flops",
                    "stage_backward_flops",
                    "stage_backward_weight_flops",
                )
            },
        )

    def _run_pipeline(self, point: _Point) -> list[Candidate]:
        from functional_shard.costing.activations import regroup
        from functional_shard.costing.pipeline_estimate import pipeline_assemble, stage_costs

        out: list[Candidate] = []
        base_policy = _policy(point, self.rules, self.block, "none", self.dtype)
        fields = (point.mesh, point.family, point.tp, point.sp)
        try:
            plan = shard(self.tree, point.mesh, base_policy)
        except ShardingError as error:
            first = one_line(error, 160)
            text = _text(base_policy)
            why = f"cannot plan: {first}"
            return [Candidate(*fields, "none", False, text, rejected=why, pipeline=point.pipeline)]
        unit_of = {module: index for index, unit in enumerate(self.units) for module in unit}
        groups = [sorted({unit_of[m] for m in stage}) for stage in plan.config.pipeline_stages]
        costs = stage_costs(plan, self.optimizer, self.batch // point.dp * self.seq)
        units = unit_gathered_bytes(plan)
        micro = self.batch // point.dp // plan.config.microbatches
        for how in _checkpoint_options(self.block):
            if out and out[-1].fits:
                break  # checkpointing more only adds recomputation
            policy = _policy(point, self.rules, self.block, how, self.dtype)
            trace = self._unit_trace(point, plan, how, micro)
            if isinstance(trace, str):
                why = f"cannot trace: {trace}"
                out.append(
                    Candidate(*fields, how, False, _text(policy), rejected=why, pipeline=point.pipeline)
                )
                continue
            est = pipeline_assemble(
                self._with_checkpointing(plan, how),
                regroup(trace, groups),
                self.hw,
                compute_dtype(plan),
                self.batch // point.dp,
                self.seq,
                self.optimizer,
                units,
                costs=costs,
            )
            over = est.peak_bytes - self.budget
            out.append(
                Candidate(
                    *fields,
                    how,
                    False,
                    _text(policy),
                    est.peak_bytes,
                    est.step_seconds,
                    None if over <= 0 else f"needs {_bytes(over)} more",
                    est,
                    point.pipeline,
                )
            )
        return out

    def final_plan(self, candidate: Candidate) -> Plan:
        point = _Point(
            candidate.mesh,
            candidate.family,
            candidate.tensor_parallel,
            candidate.sequence_parallel,
            candidate.offload,
            candidate.pipeline,
            candidate.expert_parallel,
        )
        return shard(
            self.model,
            point.mesh,
            _policy(point, self.rules, self.block, candidate.checkpointing, self.dtype, self.experts),
        )


def auto(
    model: Any,
    *,
    devices: int,
    memory_budget: int | str,
    optimizer: OptimizerKind = "adamw",
    batch: int,
    seq: int,
    hardware: str | Hardware = "h100",
) -> Plan:
    """The plan with the least estimated step time whose peak fits ``memory_budget``.

    Arguments as for `search_plans`.

    Returns:
        The chosen `Plan`.

    Raises:
        PlanError: nothing fits; names the closest candidate and how much it misses by.
        ShardingError: bad devices, batch, budget or hardware.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.auto(llama("tiny"), devices=1, memory_budget="1GiB", batch=2, seq=16)
        >>> plan.mesh.size
        1
    """
    report = search_plans(
        model,
        devices=devices,
        memory_budget=memory_budget,
        optimizer=optimizer,
        batch=batch,
        seq=seq,
        hardware=hardware,
    )
    if report.best is None:
        estimated = [c for c in report.candidates if c.peak_bytes is not None]
        if not estimated:
            raise PlanError(f"auto: no candidate could be planned for this model on {devices} devices")
        closest = min(estimated, key=lambda c: (c.peak_bytes, c.key()))
        assert closest.peak_bytes is not None
        raise PlanError(
            f"auto: nothing fits {_bytes(report.budget_bytes)} per device on {devices} "
            f"{report.hardware.name}; "
            f"the closest is {closest.mesh!r} {closest.policy_text} at {_bytes(closest.peak_bytes)}, "
            f"{_bytes(closest.peak_bytes - report.budget_bytes)} over; use more devices, a smaller batch "
            "or seq, or a larger budget"
        )
    return report.best
