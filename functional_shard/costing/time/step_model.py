"""What a training step takes, given a trace: the time model.

The pieces `assemble` builds its `Estimate` from: the compute dtype, FSDP units in flight, collective
counts, checkpointing's recomputed collectives and the optimizer step. docs/will-it-fit.md states the model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from functional_shard.core.tree import dtype_from_name, within
from functional_shard.costing.cost.census import param_units
from functional_shard.costing.cost.cost_model import unit_gathered
from functional_shard.costing.cost.expert_traffic import first_expert_weight, tp_forward_copies
from functional_shard.costing.cost.traffic import key_value_features, ring_passes
from functional_shard.costing.estimate.record import PipelineEstimate
from functional_shard.planning.plan.config import TpConfig
from functional_shard.planning.plan.cost_record import Cost, OptimizerKind
from functional_shard.planning.tp.rules import sequence_gathers

from .documents import RowDocuments
from .hardware import Hardware
from .kernel_time import Work
from .kernels import Kernels

if TYPE_CHECKING:
    from functional_shard.planning.plan.plan import Plan

__all__ = [
    "Assembly",
    "RecomputedCollectives",
    "StepParts",
    "compute_dtype",
    "in_share",
    "gathered_in_flight",
    "recomputed_collectives",
    "unit_gathered_bytes",
]


@dataclass(frozen=True, kw_only=True)
class Assembly:
    """What turning a trace into an `Estimate` needs (`functional_shard.costing.estimate.from_trace`).

    Attributes:
        plan: the plan.
        trace: its `ActivationTrace` (of one micro-batch, per stage, under a pipeline).
        hardware: the profile.
        dtype: the compute dtype (`compute_dtype`).
        batch: sequences per data-parallel rank per step (under a pipeline, the step's).
        seq: tokens per sequence.
        units: each FSDP unit's gathered bytes (`unit_gathered_bytes`).
        optimizer: as for `cost`.
        rank: the rank to estimate; ``None``: the worst.
        costs: `cost` of what each pp coordinate holds, when already known.
        checkpointed: the modules checkpointing re-runs, when they differ from the plan's.
        keep_outputs: under a pipeline, whether the last stage keeps every output to the step's end.
        kernels: compile, Float8 and async TP (`functional_shard.costing.time.kernels`).
        float8_linears: with Float8, the linears converted (`kernels.float8_linears`).
        float8_gathered: each unit's gathered bytes Float8 all-gathers save (`kernels.float8_gathered`).
        documents: packed rows (``estimate(documents=...)``), whose attention the trace counted per document.
    """

    plan: Plan
    trace: Any
    hardware: Hardware
    dtype: str
    batch: int
    seq: int
    units: Mapping[str, int]
    optimizer: OptimizerKind = "adamw"
    rank: int | None = None
    costs: Sequence[Cost] | None = None
    checkpointed: tuple[str, ...] | None = None
    keep_outputs: bool = False
    kernels: Kernels = field(default_factory=Kernels)
    float8_linears: tuple[tuple[int, int, int], ...] = ()
    float8_gathered: Mapping[str, int] = field(default_factory=dict)
    documents: RowDocuments | None = None


@dataclass(frozen=True, kw_only=True)
class StepParts:
    """One rank's step before the step model times it.

    Attributes:
        plan: what the rank holds (under a pipeline, its stages' plan).
        cost: `cost` of that, on the rank (its ``rank``).
        memory: its peak by part (see `Estimate`).
        forward_flops: its forward flops per step.
        backward_flops: its backward flops per step.
        recompute_flops: what recomputation adds.
        units: the FSDP units it gathers, with their bytes.
        attention_flops: of those flops (forward, backward and recompute), attention's.
        compute_seconds: a pipeline's makespan; ``None``: the flops at the achievable rate.
        sends: a pipeline's point-to-point sends, ``"send/recv ..."`` -> seconds.
        pipeline: the pipeline's record.
        peak_at: when in the step the peak falls.
        saved: per phase, the seconds Float8 saves in the rank's step (`kernels.float8_saved`).
        work: what the step asks of each kind of kernel (`kernel_time.Work`); ``None``: flops alone.
        activations: what the forward keeps for backward, where the peak falls after backward freed
            it (``memory["activations"]`` is then 0); ``None``: ``memory["activations"]``.
    """

    plan: Plan
    cost: Cost
    memory: Mapping[str, int]
    forward_flops: float
    backward_flops: float
    recompute_flops: float
    units: Mapping[str, int]
    attention_flops: float = 0.0
    compute_seconds: float | None = None
    sends: Mapping[str, float] = field(default_factory=dict)
    pipeline: PipelineEstimate | None = None
    peak_at: str = "the start of backward"
    saved: Mapping[str, float] = field(default_factory=dict)
    work: Work | None = None
    activations: int | None = None

    @property
    def rank(self) -> int:
        """The rank: the one its `cost` is of."""
        return self.cost.rank


def compute_dtype(plan: Plan) -> str:
    """The dtype matmuls run in: mixed precision's, else the parameters' most common one."""
    if plan.config.param_dtype:
        return plan.config.param_dtype
    counts: dict[str, int] = defaultdict(int)
    for path in plan.params:
        tensor = plan.tensors[path]
        counts[str(tensor.dtype).removeprefix("torch.")] += tensor.numel
    return max(counts, key=lambda k: counts[k]) if counts else "float32"


def unit_gathered_bytes(plan: Plan) -> dict[str, int]:
    """Bytes each FSDP unit ("" is the root) holds while all-gathered, in the gather dtype."""
    return unit_gathered(plan)


def gathered_in_flight(plan: Plan, units: Mapping[str, int] | None = None) -> int:
    """Gathered parameter bytes at the peak: the root, the running unit and the one prefetched.

    FSDP2 prefetches the next unit while one runs; without resharding after forward every unit stays.
    """
    units = dict(unit_gathered_bytes(plan) if units is None else units)
    root = units.pop("", 0)
    if not plan.config.reshard_after_forward:
        return root + sum(units.values())
    return root + sum(sorted(units.values(), reverse=True)[:2])


_DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def collective_counts(plan: Plan, grads_bytes: int) -> dict[str, int]:
    """How many collectives a step issues, by the groups `step_time` times them in.

    Latency is paid per collective: per FSDP unit its gathers and one reduce-scatter, DDP's 25 MiB
    buckets, ZeRO-1's per-parameter broadcasts, one per tensor-parallel module (two under sp).
    """
    config, fsdp, tp = plan.config, plan.config.fsdp, plan.config.tp
    counts = {
        "tensor parallel": 0,
        "sharded": 0,
        "all_reduce": 0,
        "broadcast": 0,
        "expert": 0,
        "context parallel": 0,
    }
    if config.context is not None and config.context.engine == "ring":
        # torch's ring, each attention call: K and V gathered together in forward (again in
        # a full recompute) and backward, cp permutes of their gradients; the loss averaged once
        ring_gathers, ring_permutes = ring_passes(plan)
        counts["context parallel"] = (ring_gathers + ring_permutes) * len(key_value_features(plan)) + 1
    elif config.context is not None:
        # each attention layer: K and V gathered forward (again in a recompute), their
        # gradients scattered backward; the loss averaged once
        per_layer = 4 + 2 * bool(config.checkpointed)
        counts["context parallel"] = per_layer * len(key_value_features(plan)) + 1
    # an expert-parallel experts module: counts, dispatch and combine forward, the last two
    # again backward (and its forward three again where checkpointing recomputes it)
    for path in config.expert_modules:
        counts["expert"] += 5 + 3 * within(path, config.checkpointed)
    if fsdp is not None and fsdp.shard_axes:
        units = _units(plan)
        for unit in units:
            counts["sharded"] += (2 if fsdp.reshard_after_forward and unit else 1) + 1
        if fsdp.replicate_axes:
            counts["all_reduce"] += len(units)
    elif fsdp is not None and fsdp.replicate_axes:
        counts["all_reduce"] += max(1, -(-grads_bytes // _DDP_BUCKET_BYTES))
    if config.data_parallel == "zero1":
        counts["broadcast"] += len(plan.params)
    if tp is not None:
        _count_tensor_parallel(tp, counts)
    return counts


def _count_tensor_parallel(tp: TpConfig, counts: dict[str, int]) -> None:
    # under sequence parallel a module that gathers its input for the column-split layers
    # inside (rules.sequence_gathers) issues the all-gather and its reduce-scatter, once
    gathers = set(sequence_gathers(tp.styles)) if tp.sequence_parallel else set()
    counts["tensor parallel"] += 2 * len(gathers)
    for path, style, kind in tp.styles:
        if style == "sequence":
            counts["tensor parallel"] += tp.sequence_parallel  # its weight's gradient all-reduce
        elif path.rpartition(".")[0] in gathers and style in ("colwise", "colwise_gather"):
            # a head's output all-gather; under loss parallel the loss's three all-reduces
            counts["tensor parallel"] += (3 if tp.loss_parallel else 1) if style == "colwise_gather" else 0
        elif kind == "experts":  # output all-reduce; input and routing-weight gradients' in backward
            counts["tensor parallel"] += 3
        elif style != "replicate":
            counts["tensor parallel"] += 2 if tp.sequence_parallel else 1
            counts["tensor parallel"] += 2 * (style == "colwise_gather" and tp.loss_parallel)


def _units(plan: Plan) -> frozenset[str]:
    return frozenset(param_units(plan).values())


def recomputed_collectives(plan: Plan, checkpointed: tuple[str, ...], tokens: int) -> dict[str, float]:
    """Bytes each rank sends again when checkpointed modules re-run their forward in backward.

    The forward's tensor-parallel collectives, as `cost` counts them, of the styled modules inside
    checkpointed ones (selective checkpointing keeps matmul outputs, not collective ones).

    Returns:
        ``"kind over axes"`` -> bytes sent per rank per step.

    Examples:
        >>> from functional_shard import rules
        >>> from functional_shard.zoo import Block, llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(tp=2), fs.tp(rules.llama, "tp") + fs.checkpointing(Block))
        >>> recomputed_collectives(plan, plan.config.checkpointed, tokens=32)
        {'all_reduce over tp': 32768.0}
    """
    return dict(_recomputed(plan, checkpointed, tokens).sent)


@dataclass(frozen=True)
class RecomputedCollectives:
    """The tensor-parallel collectives recomputation re-issues in a step.

    Attributes:
        sent: bytes each rank sends again, as `recomputed_collectives` gives them.
        count: how many collectives.
    """

    sent: Mapping[str, float] = field(default_factory=dict)
    count: int = 0


def _recomputed(plan: Plan, checkpointed: tuple[str, ...], tokens: int) -> RecomputedCollectives:
    # ``tokens`` of whole sequences: under context parallel a rank recomputes a cp-th of them
    return _recomputed_now(plan, checkpointed, tokens // plan.config.cp_size(plan.mesh))


def _recomputed_now(plan: Plan, checkpointed: tuple[str, ...], tokens: int) -> RecomputedCollectives:
    tp = plan.config.tp
    if not checkpointed or tp is None or not tp.axes:
        return RecomputedCollectives()
    prefixes = tuple(f"{path}." for path in checkpointed)
    sequence = tp.sequence_parallel
    gathers = set(sequence_gathers(tp.styles)) if sequence else set()
    entered: set[str] = set()
    sent: dict[str, float] = defaultdict(float)
    count = 0
    for module_path, style, kind in tp.styles:
        if not module_path.startswith(prefixes) or style in (
            "sequence",
            "replicate",
            "replicate_grad_allreduce",
        ):
            continue
        if kind == "experts":  # its output all-reduce (`expert_traffic`), run again
            gate_up = plan.tensors[plan.canonical(first_expert_weight(plan, module_path))]
            axes = tp.axes
            n = tp.size(plan.mesh)
            dtype = plan.config.param_dtype
            size = dtype_from_name(dtype).itemsize if dtype else gate_up.itemsize
            if n > 1:
                copies = tp_forward_copies(plan, module_path)
                hidden_bytes = gate_up.shape[2] * size * tokens * copies
                sent[f"all_reduce over {','.join(axes)}"] += 2 * (n - 1) / n * hidden_bytes
                count += 1
            continue
        weight = plan.canonical(f"{module_path}.weight")
        tensor = plan.tensors[weight]
        axes = plan.sharding(weight).compute.axes
        n = plan.mesh.axes_size(tuple(axes))
        if n <= 1:
            continue
        per_token = (
            dtype_from_name(plan.config.param_dtype).itemsize if plan.config.param_dtype else tensor.itemsize
        ) * tokens
        out_features, in_features = tensor.shape[::-1] if kind == "conv1d" else tensor.shape
        moves: list[tuple[str, int]] = []
        if kind == "embedding":
            if style == "rowwise":
                moves.append(("reduce_scatter" if sequence else "all_reduce", in_features))
            else:
                moves.append(("all_gather", -(-in_features // n) * n))
        else:
            parent = module_path.rpartition(".")[0]
            if style in ("rowwise", "rowwise_split_input"):
                moves.append(("reduce_scatter" if sequence else "all_reduce", out_features))
            elif sequence and (parent not in gathers or parent not in entered):
                moves.append(("all_gather", in_features))  # once per gathering module
                entered.add(parent)
            if style == "colwise_gather" and not tp.loss_parallel:
                moves.append(("all_gather", -(-out_features // n) * n))
        for what, features in moves:
            factor = 2 if what == "all_reduce" else 1
            sent[f"{what} over {','.join(axes)}"] += factor * (n - 1) / n * features * per_token
            count += 1
    return RecomputedCollectives(dict(sent), count)


def in_share(total: float, part: float, whole: float) -> float:
    """``total`` in the share ``part`` is of ``whole`` (0 when ``whole`` is)."""
    return total * part / whole if whole else 0.0


def optimizer_seconds(plan_cost: Cost, hw: Hardware) -> float:
    """Seconds of the optimizer step, which is bound by memory bandwidth.

    0 if the profile has no memory bandwidth; offloaded parts run on the host and are not counted.
    """
    if not hw.memory_bandwidth:
        return 0.0
    touched = 2 * plan_cost.params_bytes + plan_cost.grads_bytes + 2 * plan_cost.optimizer_bytes
    return touched / hw.memory_bandwidth
