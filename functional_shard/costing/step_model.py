"""What a training step takes, given a trace: the `Estimate` record and the time model.

The pieces `estimate` (one step) and `pipeline_estimate` (a pipeline's stages on torch's
schedules) both assemble their answer from: the compute dtype, FSDP units in flight,
collective counts and the recomputed collectives of checkpointing, the optimizer step,
and `step_time` (compute plus the communication the engines cannot hide). Pure: the
tracing itself happens in `estimate`. docs/will-it-fit.md states the model.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from functional_shard.core.errors import ShardingError
from functional_shard.core.tree import dtype_from_name, within
from functional_shard.core.units import format_bytes as _bytes
from functional_shard.planning.rules import sequence_gathers

from .cost import Cost, unit_gathered
from .hardware import Hardware

if TYPE_CHECKING:
    from functional_shard.planning.plan import Plan

    from .pipeline_estimate import PipelineEstimate

__all__ = ["Estimate", "parse_bytes", "step_time"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | str) -> int:
    """A memory size from an int or text: ``"80GiB"``, ``"80 GB"``, ``"1.5TiB"``, ``"512"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB ... TiB) of 1024.

    Raises:
        ShardingError: not a size.

    Examples:
        >>> parse_bytes("80GiB"), parse_bytes("80 GB"), parse_bytes(1024)
        (85899345920, 80000000000, 1024)
        >>> parse_bytes("80 parsecs")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: memory size '80 parsecs': a number of bytes or text like ...
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ShardingError(f"memory size {value!r}: an int of bytes or text like '80GiB'")
    if isinstance(value, int):
        if value <= 0:
            raise ShardingError(f"memory size {value!r}: a positive number of bytes")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ShardingError(
            f"memory size {value!r}: a number of bytes or text like '80GiB', '80GB', '512MiB' "
            "(units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return round(float(match.group(1)) * _UNITS[unit])


def _duration(seconds: float) -> str:
    """Milliseconds to two decimals; a tiny model's steps in microseconds, not "0.00 ms"."""
    if 0 < seconds < 1e-5:
        return f"{seconds * 1e6:.2f} us"
    return f"{seconds * 1e3:.2f} ms"


@dataclass(frozen=True)
class Estimate:
    """Peak device memory and step time of one training step, on one rank.

    ``memory`` holds the parts of the peak (bytes): ``params``, ``grads``, ``optimizer``,
    ``buffers``, ``gathered`` (FSDP units in flight), ``activations`` and
    ``loss_workspace`` (logits plus cross-entropy's fp32 copies). ``flops`` is per device
    per step, recomputation included; ``model_flops`` without it (what MFU counts).
    Under pipeline parallelism ``batch`` is the step's batch (all micro-batches), the parts
    are those of the pp rank with the highest peak, ``compute_seconds`` is the schedule's
    makespan (bubble and point-to-point sends included) and ``pipeline`` has each stage.
    """

    rank: int
    batch: int
    seq: int
    hardware: Hardware
    dtype: str
    memory: Mapping[str, int]
    host_bytes: int
    flops: float
    model_flops: float
    compute_seconds: float
    exposed_seconds: Mapping[str, float]
    """Communication that compute does not hide, by reason."""
    comm_seconds: Mapping[str, float]
    """Every collective's time at its link's bandwidth, ``"kind over axes (link)"`` -> s."""
    tensor_parallel: int = 1
    cost: Cost | None = field(default=None, compare=False, repr=False)
    pipeline: PipelineEstimate | None = field(default=None, compare=False, repr=False)

    @property
    def activation_bytes(self) -> int:
        """Bytes autograd keeps for backward during the model call."""
        return self.memory["activations"]

    @property
    def peak_bytes(self) -> int:
        """Device memory at the step's peak (the start of backward): every part together."""
        return sum(self.memory.values())

    @property
    def step_seconds(self) -> float:
        """Compute at the achievable rate plus exposed communication."""
        return self.compute_seconds + sum(self.exposed_seconds.values())

    @property
    def tokens_per_second(self) -> float:
        """Tokens per second per device (a tensor-parallel group, and a pipeline, share their tokens)."""
        pp = self.pipeline.pp if self.pipeline is not None else 1
        return self.batch * self.seq / self.tensor_parallel / pp / self.step_seconds

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recompute) per second over the datasheet's peak in the compute dtype."""
        return self.model_flops / self.step_seconds / self.hardware.peak_flops(self.dtype)

    def fits(self, budget: int | str) -> bool:
        """Whether the peak fits in ``budget`` (bytes or text, see `parse_bytes`)."""
        return self.peak_bytes <= parse_bytes(budget)

    def explain(self) -> str:
        """A readable breakdown of memory and time."""
        hw = self.hardware
        batch = "batch" if self.pipeline is not None else "micro-batch"
        lines = [
            f"estimate on rank {self.rank}, {hw.name}, {batch} {self.batch} x {self.seq} tokens, "
            f"compute in {self.dtype}",
            f"peak memory {_bytes(self.peak_bytes)} (at the start of backward)"
            + (f"; host {_bytes(self.host_bytes)}" if self.host_bytes else ""),
        ]
        lines += [f"  {part:<15} {_bytes(nbytes)}" for part, nbytes in self.memory.items()]
        lines.append(
            f"step {_duration(self.step_seconds)}: compute {_duration(self.compute_seconds)} "
            f"({self.flops / 1e12:.3f} TFLOP at {hw.achievable_flops(self.dtype) / 1e12:.1f} TFLOP/s)"
        )
        why_width = max([22, *(len(why) for why in self.exposed_seconds)])
        what_width = max([34, *(len(what) for what in self.comm_seconds)])
        lines += [f"  exposed {why:<{why_width}} {_duration(s)}" for why, s in self.exposed_seconds.items()]
        lines += [
            f"  collective {what:<{what_width}} {_duration(s)}" for what, s in self.comm_seconds.items()
        ]
        lines.append(f"tokens/s per device {self.tokens_per_second:,.0f}, MFU {self.mfu:.1%}")
        if self.pipeline is not None:
            lines.append(self.pipeline.explain())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def to_dict(self) -> dict[str, Any]:
        """The numbers as JSON-ready data."""
        return {
            "rank": self.rank,
            "hardware": self.hardware.name,
            "batch": self.batch,
            "seq": self.seq,
            "dtype": self.dtype,
            "memory": dict(self.memory),
            "peak_bytes": self.peak_bytes,
            "host_bytes": self.host_bytes,
            "flops": self.flops,
            "model_flops": self.model_flops,
            "compute_seconds": self.compute_seconds,
            "exposed_seconds": dict(self.exposed_seconds),
            "comm_seconds": dict(self.comm_seconds),
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            **({"pipeline": self._pipeline_dict()} if self.pipeline is not None else {}),
        }

    def _pipeline_dict(self) -> dict[str, Any]:
        pipe = self.pipeline
        assert pipe is not None
        return {
            "schedule": pipe.schedule,
            "microbatches": pipe.microbatches,
            "microbatch": pipe.microbatch,
            "bubble": pipe.bubble,
            "makespan": pipe.timeline.makespan,
            "rank_peak_bytes": list(pipe.rank_peak_bytes),
            "stages": [dataclasses.asdict(stage) for stage in pipe.stages],
        }


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

    FSDP2 prefetches the next unit's all-gather while one runs, so two non-root units are
    gathered at once; without resharding after forward (ZeRO-2) every unit stays gathered.
    """
    units = dict(unit_gathered_bytes(plan) if units is None else units)
    root = units.pop("", 0)
    if not plan.config.reshard_after_forward:
        return root + sum(units.values())
    return root + sum(sorted(units.values(), reverse=True)[:2])


_DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def collective_counts(plan: Plan, grads_bytes: int) -> dict[str, int]:
    """How many collectives a step issues, by the groups `step_time` times them in.

    Latency is paid per collective: FSDP2 gathers each unit (twice when it reshards after
    forward; the root once) and reduce-scatters it once; HSDP all-reduces each unit's
    shard; DDP all-reduces 25 MiB buckets; ZeRO-1 broadcasts each parameter; each
    tensor-parallel module issues one collective per step, two under sequence parallelism.
    """
    config = plan.config
    counts = {"tensor parallel": 0, "sharded": 0, "all_reduce": 0, "broadcast": 0, "expert": 0}
    # an expert-parallel experts module: counts, dispatch and combine forward, the last two
    # again backward (and its forward three again where checkpointing recomputes it)
    for path in config.expert_modules:
        counts["expert"] += 5 + 3 * within(path, config.checkpointed)
    if config.shard_axes:
        units = _units(plan)
        for unit in units:
            counts["sharded"] += (2 if config.reshard_after_forward and unit else 1) + 1
        if config.replicate_axes:
            counts["all_reduce"] += len(units)
    elif config.replicate_axes:
        counts["all_reduce"] += max(1, -(-grads_bytes // _DDP_BUCKET_BYTES))
    if config.data_parallel == "zero1":
        counts["broadcast"] += len(plan.params)
    # under sequence parallel a module that gathers its input for the column-split layers
    # inside (rules.sequence_gathers) issues the all-gather and its reduce-scatter, once
    gathers = set(sequence_gathers(config.tp_styles)) if config.sequence_parallel else set()
    counts["tensor parallel"] += 2 * len(gathers)
    for path, style, kind in config.tp_styles:
        if style == "sequence":
            counts["tensor parallel"] += config.sequence_parallel  # its weight's gradient all-reduce
        elif path.rpartition(".")[0] in gathers and style in ("colwise", "colwise_gather"):
            counts["tensor parallel"] += style == "colwise_gather"  # its output all-gather
        elif kind == "experts":  # output all-reduce; input and routing-weight gradients' in backward
            counts["tensor parallel"] += 3
        elif style != "replicate":
            counts["tensor parallel"] += 2 if config.sequence_parallel else 1
    return counts


_PER_PLAN: dict[int, tuple[Plan, dict[Hashable, Any]]] = {}


def _per_plan(plan: Plan, key: Hashable, compute: Callable[[], Any]) -> Any:
    # a search estimates each plan once per checkpointing option: what depends on the
    # plan alone is worked out once (the few plans last seen, held by identity)
    held = _PER_PLAN.get(id(plan))
    if held is None or held[0] is not plan:
        if len(_PER_PLAN) >= 8:
            _PER_PLAN.clear()
        held = _PER_PLAN[id(plan)] = (plan, {})
    memo = held[1]
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _units(plan: Plan) -> frozenset[str]:
    return _per_plan(plan, "units", lambda: frozenset(plan.unit_of(path) for path in plan.params))


def recomputed_collectives(plan: Plan, checkpointed: tuple[str, ...], tokens: int) -> dict[str, float]:
    """Bytes each rank sends again when checkpointed modules re-run their forward in backward.

    Recomputation re-issues the forward's tensor-parallel collectives of the styled
    modules inside checkpointed ones (full and selective alike: selective checkpointing
    keeps matmul outputs, not collective ones). Forward collectives, as `cost` counts them:
    a rowwise Linear's output all-reduce (a reduce-scatter under sequence parallelism), a
    colwise Linear's input all-gather under sequence parallelism, a colwise_gather
    Linear's output all-gather, and an embedding's output reduction or gather.

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
    return dict(_recomputed(plan, checkpointed, tokens)[0])


def _recomputed(plan: Plan, checkpointed: tuple[str, ...], tokens: int) -> tuple[dict[str, float], int]:
    return _per_plan(
        plan, ("recomputed", checkpointed, tokens), lambda: _recomputed_now(plan, checkpointed, tokens)
    )


def _recomputed_now(plan: Plan, checkpointed: tuple[str, ...], tokens: int) -> tuple[dict[str, float], int]:
    if not checkpointed or not plan.config.tensor_parallel_axes:
        return {}, 0
    prefixes = tuple(f"{path}." for path in checkpointed)
    sequence = plan.config.sequence_parallel
    gathers = set(sequence_gathers(plan.config.tp_styles)) if sequence else set()
    entered: set[str] = set()
    sent: dict[str, float] = defaultdict(float)
    count = 0
    for module_path, style, kind in plan.config.tp_styles:
        if not module_path.startswith(prefixes) or style in (
            "sequence",
            "replicate",
            "replicate_grad_allreduce",
        ):
            continue
        if kind == "experts":  # its output all-reduce (`expert_cost`), run again
            gate_up = plan.tensors[plan.canonical(f"{module_path}.gate_up_proj")]
            axes = plan.config.tensor_parallel_axes
            n = plan.mesh.axes_size(axes)
            dtype = plan.config.param_dtype
            size = dtype_from_name(dtype).itemsize if dtype else gate_up.itemsize
            if n > 1:
                hidden_bytes = gate_up.shape[2] * size * tokens
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
            if style == "colwise_gather":
                moves.append(("all_gather", -(-out_features // n) * n))
        for what, features in moves:
            factor = 2 if what == "all_reduce" else 1
            sent[f"{what} over {','.join(axes)}"] += factor * (n - 1) / n * features * per_token
            count += 1
    return dict(sent), count


def optimizer_seconds(plan_cost: Cost, hw: Hardware) -> float:
    """Seconds of the optimizer step, which is bound by memory bandwidth.

    It reads the parameters, gradients and state on the device and writes the parameters
    and state back (0 if the profile has no memory bandwidth; offloaded parts run on the
    host and are not counted).
    """
    if not hw.memory_bandwidth:
        return 0.0
    touched = 2 * plan_cost.params_bytes + plan_cost.grads_bytes + 2 * plan_cost.optimizer_bytes
    return touched / hw.memory_bandwidth


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
    recomputed: tuple[Mapping[str, float], int] = ({}, 0),
) -> tuple[float, dict[str, float], dict[str, float]]:
    """Compute seconds, exposed communication by reason, and each collective's seconds.

    Tensor-parallel collectives and expert parallelism's all-to-alls (the experts wait
    for their tokens, the layer for the results) sit on the critical path; FSDP/ZeRO gathers and
    reduce-scatters run under compute (all but the first gather); DDP's and HSDP's
    gradient all-reduce runs under backward; ZeRO-1's parameter broadcasts follow the
    optimizer step and are exposed (DDP, run by torch's composable ``replicate``, sends
    no buffers). On hardware that does not
    overlap communication with compute (gloo on CPUs) every collective is exposed. Each
    collective also costs the hardware's ``collective_latency`` (a tensor-parallel one its
    ``tensor_parallel_latency``). ``recomputed`` (bytes
    as `recomputed_collectives` gives them, and how many collectives) are the
    tensor-parallel collectives recomputation re-issues: on the critical path too.
    """
    rate = hw.achievable_flops(dtype)
    compute = (forward_flops + backward_flops + recompute_flops) / rate
    backward = (backward_flops + recompute_flops) / rate
    tp_axes = set(plan.config.tensor_parallel_axes)
    per_collective: dict[str, float] = {}
    counts = collective_counts(plan, plan_cost.grads_bytes)
    tp_latency = hw.collective_latency if hw.tensor_parallel_latency is None else hw.tensor_parallel_latency
    latency = {
        group: n * (tp_latency if group == "tensor parallel" else hw.collective_latency)
        for group, n in counts.items()
    }
    tensor_parallel, expert = latency["tensor parallel"], latency["expert"]
    sharded, all_reduce, broadcast = latency["sharded"], latency["all_reduce"], latency["broadcast"]
    for kind, by_axes in plan_cost.comm_bytes.items():
        for axes_text, nbytes in by_axes.items():
            axes = tuple(axes_text.split(","))
            seconds = nbytes / hw.bandwidth(plan.mesh, axes)
            per_collective[f"{kind} over {axes_text} ({hw.link_of(plan.mesh, axes)})"] = seconds
            if tp_axes and set(axes) <= tp_axes:
                tensor_parallel += seconds
            elif kind == "all_to_all":
                expert += seconds
            elif kind == "broadcast":
                broadcast += seconds
            elif kind == "all_reduce":
                all_reduce += seconds
            else:
                sharded += seconds
    tp_link = hw.link_of(plan.mesh, tuple(tp_axes)) if tp_axes else "intra"
    recomputed_bytes, recomputed_count = recomputed
    recompute = recomputed_count * tp_latency
    for what, nbytes in recomputed_bytes.items():
        seconds = nbytes / hw.bandwidth(plan.mesh, tuple(tp_axes))
        per_collective[f"{what} ({tp_link}, recompute)"] = seconds
        recompute += seconds
    exposed: dict[str, float] = {}
    if not hw.overlap_communication:
        total = tensor_parallel + recompute + sharded + all_reduce + broadcast + expert
        if total:
            exposed["communication (no overlap)"] = total
        return compute, _with_step_tail(exposed, plan_cost, hw), per_collective
    if tensor_parallel:
        exposed["tensor parallel"] = tensor_parallel
    if recompute:
        exposed["tensor parallel recompute"] = recompute
    if expert:
        # the experts wait for their tokens, and the layer for the results: on the critical path
        exposed["expert all-to-all"] = expert
    if sharded:
        # nothing runs before the first unit (root and largest block) is gathered
        axes = plan.config.shard_axes
        n = plan.mesh.axes_size(axes) if axes else 1
        biggest = max((b for u, b in units.items() if u), default=0)
        first = (units.get("", 0) + biggest) * (n - 1) / n / hw.bandwidth(plan.mesh, axes) if n > 1 else 0.0
        first = min(first, sharded)
        exposed["first all-gather"] = first
        rest = max(0.0, sharded - first + all_reduce - compute, all_reduce - backward)
        if rest:
            exposed["fsdp not overlapped"] = rest
    elif all_reduce:
        rest = max(0.0, all_reduce - backward)
        if rest:
            exposed["grad all-reduce"] = rest
    if broadcast:
        exposed["broadcast after step"] = broadcast
    return compute, _with_step_tail(exposed, plan_cost, hw), per_collective


def _with_step_tail(exposed: dict[str, float], plan_cost: Cost, hw: Hardware) -> dict[str, float]:
    """``exposed`` plus what no plan overlaps: host transfers and the optimizer step."""
    if plan_cost.host_bytes:
        # offloaded state crosses the host link twice a step (to the device and back)
        exposed["host transfers"] = 2 * plan_cost.host_bytes / hw.host_bandwidth
    step = optimizer_seconds(plan_cost, hw)
    if step:
        exposed["optimizer step"] = step
    return exposed
