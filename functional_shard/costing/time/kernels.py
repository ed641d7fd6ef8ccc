"""What torch.compile, Float8 linears and async tensor parallel change in a step.

The estimate's default is eager bf16. Each option is a model with a public source
(docs/will-it-fit.md, "Kernels"): **compile** runs the work other than attention
`Hardware.compile_speedup` times faster; **float8** saves what torchao's roofline says per linear;
**async_tp** hides the forward's tensor-parallel collectives; **float8_all_gather** gathers and
holds the converted weights a byte an element; **compiled_loss** fuses the cross-entropy, which then
holds only the logits' gradient beside them (`loss_memory.loss_workspace`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from functional_shard.core.errors import ShardingError
from functional_shard.costing.cost.traffic import gathers_per_step

from .hardware import Hardware

if TYPE_CHECKING:
    from functional_shard.planning.plan.cost_record import Cost
    from functional_shard.planning.plan.plan import Plan

__all__ = [
    "FLOAT8",
    "Clock",
    "Kernels",
    "check_kernel_hardware",
    "check_kernels",
    "cost_with_float8_gathers",
    "float8_gathered",
    "float8_linears",
    "float8_saved",
    "float8_weights",
    "kernel_fields",
    "gathered_with_float8",
    "phase_saved",
    "saved_by_stage",
]

FLOAT8 = "float8_e4m3fn"
"""The flops key of a profile's float8 rate."""
# torchao's tensorwise casts, bytes per element (bf16 in, float8 out; roofline_utils):
# an activation's amax pass (2) then one cast writing both layouts (2 + 1 + 1); a weight's
# amax pass (2), its forward cast (2 + 1) and its backward one (2 + 1)
_ACTIVATION_CAST = 6
_WEIGHT_FORWARD_CAST, _WEIGHT_BACKWARD_CAST = 5, 3
_PHASES = ("forward", "backward", "weight", "recompute")


@dataclass(frozen=True)
class Kernels:
    """The kernels a run uses beyond eager bf16: what `fs.estimate` counts (``kernels=``).

    Attributes:
        compile: ``torch.compile`` of each block (torchtitan's ``training.compile``).
        float8: torchao's tensorwise Float8 linears, the output head left out (needs compile).
        async_tp: torch's async tensor parallel (needs compile and sequence parallel).
        float8_all_gather: FSDP gathers and holds the Float8 linears' weights in float8 (needs float8).
        compiled_loss: ``torch.compile`` of the loss too (torchtitan's ``compile.components``, "loss" by
            default since April 2025): no float32 copy of the logits, their gradient in their dtype.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp") + fs.mixed_precision())
        >>> eager = fs.estimate(model, plan, batch=2, seq=64)
        >>> compiled = fs.estimate(model, plan, batch=2, seq=64, kernels=fs.Kernels(compile=True))
        >>> compiled.compute_seconds < eager.compute_seconds
        True
    """

    compile: bool = False
    float8: bool = False
    async_tp: bool = False
    float8_all_gather: bool = False
    compiled_loss: bool = False

    def __post_init__(self) -> None:
        for name in ("compile", "float8", "async_tp", "float8_all_gather", "compiled_loss"):
            if not isinstance(getattr(self, name), bool):
                raise ShardingError(f"fs.Kernels({name}={getattr(self, name)!r}): True or False")
        if self.float8_all_gather and not self.float8:
            raise ShardingError(
                "fs.Kernels(float8_all_gather=True) without float8: only Float8 linears' weights "
                "gather in float8; set float8=True as well"
            )
        for name in ("float8", "async_tp"):
            if getattr(self, name) and not self.compile:
                raise ShardingError(
                    f"fs.Kernels({name}=True) without compile: "
                    + ("torchao's Float8 casts" if name == "float8" else "async tensor parallel")
                    + " run as compiled kernels; set compile=True as well"
                )

    @property
    def names(self) -> tuple[str, ...]:
        """The options set, as `explain` lists them."""
        labels = {
            "compile": "torch.compile",
            "float8": "Float8 linears",
            "async_tp": "async TP",
            "float8_all_gather": "Float8 all-gathers",
            "compiled_loss": "compiled loss",
        }
        return tuple(label for name, label in labels.items() if getattr(self, name))

    def for_plan(self, plan: Plan) -> Kernels:
        """These kernels less what ``plan`` has nothing for: the search's view of one candidate.

        Async TP needs sequence parallel, Float8 all-gathers FSDP, and a compiled loss is counted neither
        under loss parallel nor in a pipeline's last stage; `fs.estimate` refuses them instead.

        Examples:
            >>> from functional_shard.zoo import llama
            >>> plan = fs.shard(llama("tiny"), fs.Mesh(dp=2), fs.fsdp("dp") + fs.mixed_precision())
            >>> fs.Kernels(compile=True, float8=True, async_tp=True).for_plan(plan).names
            ('torch.compile', 'Float8 linears')
        """
        return dataclasses.replace(
            self,
            async_tp=self.async_tp and plan.config.sequence_parallel,
            float8_all_gather=self.float8_all_gather and bool(plan.config.shard_axes),
            compiled_loss=self.compiled_loss and _counts_compiled_loss(plan),
        )


def _counts_compiled_loss(plan: Plan) -> bool:
    # measured where the loss takes the whole logits of one step; loss parallel's DTensor loss and a
    # pipeline's per-micro-batch loss inside torch's schedule were not
    return not plan.config.loss_parallel and plan.config.pipeline is None


def check_kernels(kernels: Kernels, plan: Plan, hw: Hardware, dtype: str) -> None:
    """Refuse kernels the plan or the hardware profile cannot count, naming the fix.

    Raises:
        ShardingError: the profile lacks the option's figures, or the plan what the option needs.
    """
    check_kernel_hardware(kernels, hw, dtype)
    if kernels.float8_all_gather and not plan.config.shard_axes:
        raise ShardingError(
            "estimate(kernels=...float8_all_gather=True): the plan gathers no parameters; it needs "
            "FSDP (fs.fsdp, fs.hsdp or fs.zero(3))"
        )
    if kernels.compiled_loss and not _counts_compiled_loss(plan):
        raise ShardingError(
            "estimate(kernels=...compiled_loss=True): a compiled loss is counted where it takes a step's "
            "whole logits; under loss parallel or a pipeline it is not: leave compiled_loss out there"
        )
    if kernels.async_tp and not plan.config.sequence_parallel:
        raise ShardingError(
            "estimate(kernels=...async_tp=True): async tensor parallel overlaps sequence parallel's "
            "all-gathers and reduce-scatters; the plan has none: use fs.tp(..., sequence_parallel=True)"
        )


def check_kernel_hardware(kernels: Kernels, hw: Hardware, dtype: str, caller: str = "estimate") -> None:
    """Refuse kernels the hardware profile has no figures for, or a compute dtype float8 cannot replace.

    ``caller`` names the function in the message (``"estimate"``, ``"auto"``).

    Raises:
        ShardingError: not a `Kernels`, a profile without the option's figures, or float8 outside bf16.

    Examples:
        >>> check_kernel_hardware(fs.Kernels(compile=True), fs.hardware("a100"), "bfloat16", "auto")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: auto(kernels=...compile=True): hardware 'a100' has no ...
    """
    if not isinstance(kernels, Kernels):
        raise ShardingError(f"{caller}(kernels={kernels!r}): an fs.Kernels(...)")
    if kernels.compile and hw.compile_speedup is None:
        raise ShardingError(
            f"{caller}(kernels=...compile=True): hardware {hw.name!r} has no compile_speedup (no public "
            "compiled run to take it from); give one with hw.replace(compile_speedup=...)"
        )
    if not kernels.float8:
        return
    missing = [
        what
        for what, value in (
            (f"flops[{FLOAT8!r}]", hw.flops.get(FLOAT8)),
            ("gemm_efficiency", hw.gemm_efficiency),
            ("memory_efficiency", hw.memory_efficiency),
        )
        if not value
    ]
    if missing:
        raise ShardingError(
            f"{caller}(kernels=...float8=True): hardware {hw.name!r} has no {', '.join(missing)}; "
            "it has no float8 tensor cores, or give them with hw.replace(...)"
        )
    if dtype != "bfloat16":
        raise ShardingError(
            f"{caller}(kernels=...float8=True): the plan computes in {dtype}; Float8 linears "
            "replace bf16 matmuls: add fs.mixed_precision()"
        )


def kernel_fields(
    model: Any, plan: Plan, kernels: Kernels | None, hw: Hardware, dtype: str
) -> dict[str, Any]:
    """`Assembly`'s kernel fields for ``kernels`` (``None``: eager), refused first if unfit.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp") + fs.mixed_precision())
        >>> fast = fs.Kernels(compile=True, float8=True)
        >>> fields = kernel_fields(model, plan, fast, fs.hardware("h100"), "bfloat16")
        >>> sorted(fields), len(fields["float8_linears"]) > 0
        (['float8_gathered', 'float8_linears', 'kernels'], True)
    """
    kernels = Kernels() if kernels is None else kernels
    check_kernels(kernels, plan, hw, dtype)
    if not kernels.float8:
        return {"kernels": kernels, "float8_linears": (), "float8_gathered": {}}
    shapes = _computed_shapes(plan, float8_weights(model, plan))  # once for both (the search's many plans)
    return {
        "kernels": kernels,
        "float8_linears": _linears(plan, shapes),
        "float8_gathered": _gathered(plan, shapes, dtype) if kernels.float8_all_gather else {},
    }


def float8_weights(model: Any, plan: Plan) -> tuple[str, ...]:
    """The weight paths of the linears torchao converts.

    Every ``nn.Linear`` but the output head (``get_output_embeddings()``, else a last linear as wide as
    the vocabulary) and `fs.ep`'s experts.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp"))
        >>> weights = float8_weights(model, plan)
        >>> weights[:2], "lm_head.weight" in weights
        (('layers.0.self_attn.q_proj.weight', 'layers.0.self_attn.k_proj.weight'), False)
    """
    from torch import nn

    linears = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.Linear)]
    output = getattr(model, "get_output_embeddings", None)
    head = output() if callable(output) else None
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    if head is None and linears and linears[-1][1].out_features in vocab:
        head = linears[-1][1]
    experts = plan.config.expert_modules
    return tuple(
        f"{path}.weight"
        for path, module in linears
        if module is not head and not any(path == e or path.startswith(e + ".") for e in experts)
    )


def float8_linears(model: Any, plan: Plan) -> tuple[tuple[int, int, int], ...]:
    """``(stage, in_features, out_features)`` of each `float8_weights` linear, as its stage computes it.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(tp=2), fs.tp(fs.rules.llama, "tp"))
        >>> float8_linears(model, plan)[0]
        (0, 64, 32)
    """
    return _linears(plan, _computed_shapes(plan, float8_weights(model, plan)))


def _linears(plan: Plan, shapes: Mapping[str, tuple[int, ...]]) -> tuple[tuple[int, int, int], ...]:
    return tuple((plan.stage_of(weight), shape[1], shape[0]) for weight, shape in shapes.items())


def _computed_shapes(plan: Plan, weights: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Each weight's compute shape on its stage's first rank (tp shards differ by a row at most).

    Weights alike in shape and compute spec share one answer.
    """
    first: dict[int, int] = {}
    seen: dict[tuple[Any, ...], tuple[int, ...]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for weight in weights:
        stage = plan.stage_of(weight)
        if stage not in first:
            first[stage] = plan.ranks_of_stage(stage)[0]
        key = (plan.tensors[weight].shape, plan.sharding(weight).compute, first[stage])
        if key not in seen:
            seen[key] = plan.local_shape(weight, first[stage], "compute")
        shapes[weight] = seen[key]
    return shapes


def float8_gathered(model: Any, plan: Plan, dtype: str) -> dict[str, int]:
    """FSDP unit -> the gathered bytes Float8 all-gathers save: a byte an element, not ``dtype``'s.

    Per unit, its converted weights' compute-shape elements times (``dtype``'s size - 1).

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp") + fs.mixed_precision())
        >>> float8_gathered(model, plan, "bfloat16")["layers.0"]
        46080
    """
    return _gathered(plan, _computed_shapes(plan, float8_weights(model, plan)), dtype)


def _gathered(plan: Plan, shapes: Mapping[str, tuple[int, ...]], dtype: str) -> dict[str, int]:
    from functional_shard.core.tree import dtype_from_name

    spare = dtype_from_name(dtype).itemsize - 1
    saved: dict[str, int] = {}
    for weight, shape in shapes.items():
        if plan.sharding(weight).at_rest_axes:
            unit = plan.unit_of(weight)
            saved[unit] = saved.get(unit, 0) + math.prod(shape) * spare
    return saved


def gathered_with_float8(units: Mapping[str, int], saved: Mapping[str, int]) -> dict[str, int]:
    """``units``' gathered bytes less what Float8 all-gathers save (`float8_gathered`)."""
    return {unit: nbytes - saved.get(unit, 0) for unit, nbytes in units.items()}


def cost_with_float8_gathers(plan_cost: Cost, plan: Plan, saved: Mapping[str, int]) -> Cost:
    """``plan_cost`` with FSDP's all-gathers carrying the Float8 linears' weights a byte an element.

    ``saved``: `float8_gathered`'s, for the units this rank holds; reduce-scatters are unchanged.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp") + fs.mixed_precision())
        >>> before = plan.cost(tokens=64)
        >>> after = cost_with_float8_gathers(before, plan, {"layers.0": 1000})
        >>> before.comm_bytes["all_gather"]["dp"] - after.comm_bytes["all_gather"]["dp"]  # 2 x 1000 x 1/2
        1000.0
    """
    axes = plan.config.shard_axes
    if not saved or not axes:
        return plan_cost
    n = plan.mesh.axes_size(axes)
    less = sum(nbytes * gathers_per_step(plan, (unit,)) for unit, nbytes in saved.items()) * (n - 1) / n
    comm = {kind: dict(by_axes) for kind, by_axes in plan_cost.comm_bytes.items()}
    key = ",".join(axes)
    comm["all_gather"][key] = comm["all_gather"][key] - less
    return dataclasses.replace(plan_cost, comm_bytes=comm)


def _gemm_seconds(m: int, k: int, n: int, hw: Hardware, *, float8: bool) -> float:
    """One ``m x k @ k x n`` GEMM by torchao's roofline: bound by its flops or by its bytes."""
    assert hw.gemm_efficiency
    assert hw.memory_efficiency
    peak = hw.flops[FLOAT8] if float8 else hw.peak_flops("bfloat16")
    operand = 1 if float8 else 2
    compute = 2 * m * k * n / (peak * hw.gemm_efficiency)
    traffic = (operand * (m * k + k * n) + 2 * m * n) / (hw.memory_bandwidth * hw.memory_efficiency)
    return max(compute, traffic)


def float8_saved(
    linears: Iterable[tuple[int, int, int]], tokens: int, recompute: float, hw: Hardware, stages: int = 1
) -> tuple[dict[str, float], ...]:
    """Per stage, phase -> seconds Float8 saves in one micro-batch of ``tokens`` tokens.

    Saved: bf16 GEMM time less float8 GEMM time and the casts, each linear at torchao's roofline.

    Examples:
        >>> saved = float8_saved([(0, 4096, 4096)], 8192, 1.0, fs.hardware("h100"))[0]
        >>> sorted(saved), all(s > 0 for s in saved.values())
        (['backward', 'forward', 'recompute', 'weight'], True)
    """
    assert hw.memory_efficiency
    bandwidth = hw.memory_bandwidth * hw.memory_efficiency
    out = [dict.fromkeys(_PHASES, 0.0) for _ in range(stages)]

    def gemm(m: int, k: int, n: int) -> float:
        return _gemm_seconds(m, k, n, hw, float8=False) - _gemm_seconds(m, k, n, hw, float8=True)

    m = tokens
    for stage, k, n in linears:
        forward = gemm(m, k, n) - (_ACTIVATION_CAST * m * k + _WEIGHT_FORWARD_CAST * k * n) / bandwidth
        saved = out[stage]
        saved["forward"] += forward
        backward_casts = _ACTIVATION_CAST * m * n + _WEIGHT_BACKWARD_CAST * k * n
        saved["backward"] += gemm(m, n, k) - backward_casts / bandwidth
        saved["weight"] += gemm(k, m, n)
        saved["recompute"] += recompute * forward
    return tuple(out)


@dataclass(frozen=True)
class Clock:
    """Compute seconds from flops under `Kernels`.

    Attention runs at the achievable rate, the other work ``speedup`` times faster
    (compile), less what Float8 saves.

    Examples:
        >>> Clock(rate=100.0, speedup=2.0).seconds(300.0, attention=100.0)
        2.0
    """

    rate: float
    speedup: float = 1.0
    async_tp: bool = False

    def seconds(self, flops: float, attention: float = 0.0, saved: float = 0.0) -> float:
        """Seconds of ``flops``, ``attention`` of them attention's, less ``saved`` seconds."""
        return attention / self.rate + (flops - attention) / (self.rate * self.speedup) - saved

    @staticmethod
    def of(kernels: Kernels, hw: Hardware, dtype: str) -> Clock:
        """The clock of ``kernels`` on ``hw`` in ``dtype``."""
        speedup = hw.compile_speedup if kernels.compile and hw.compile_speedup else 1.0
        return Clock(hw.achievable_flops(dtype), speedup, kernels.async_tp)


def phase_saved(saved: Mapping[str, float], *phases: str) -> float:
    """The seconds ``saved`` holds for ``phases`` together."""
    return sum(saved.get(phase, 0.0) for phase in phases)


def saved_by_stage(
    trace: Any, linears: tuple[tuple[int, int, int], ...], tokens: int, hw: Hardware, stages: int = 1
) -> tuple[dict[str, float], ...]:
    """`float8_saved` of a traced micro-batch: the recompute share as the trace counted it.

    The share: the recomputed work other than attention over the converted linears' forward GEMMs (≤ 1).
    """
    if not linears:
        return tuple(dict.fromkeys(_PHASES, 0.0) for _ in range(stages))
    forward = sum(2 * tokens * k * n for _, k, n in linears)
    redone = trace.recompute_flops - trace.attention_recompute_flops
    share = min(1.0, redone / forward) if forward else 0.0
    return float8_saved(linears, tokens, share, hw, stages)
