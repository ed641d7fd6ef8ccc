"""A step's compute timed by kernel kind: matmuls, fused attention, memory-bound work.

Each kind has its own rate (`KernelRates`, measured by `fs.measure_rates`): matmuls their flops,
fused attention the flops the kernel runs (`functional_shard.costing.time.flops.attention_kernel_flops`),
memory-bound ops the bytes they move. MFU still counts model flops (docs/cost-model.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from functional_shard.core.tree import dtype_from_name
from functional_shard.costing.cost.census import census_of
from functional_shard.costing.cost.traffic import gathers_per_step

from .hardware import KernelRates

if TYPE_CHECKING:
    from functional_shard.costing.trace.results import ActivationTrace
    from functional_shard.planning.plan.plan import Plan

__all__ = [
    "FLOAT8_PART",
    "IDLE_PART",
    "KINDS",
    "PHASES",
    "Work",
    "fsdp_copy_bytes",
    "loss_bytes",
    "optimizer_bytes",
    "trained_shares",
    "work_of",
]

KINDS = ("matmul", "attention", "memory-bound")
PHASES = ("forward", "backward", "recompute")  # a step's phases, as `Work` counts them
# `Estimate.compute_parts` beside the kinds, so that the parts sum to the compute: what Float8's
# GEMMs save net of their casts (negative), and a pipeline rank's wait in its schedule
FLOAT8_PART = "float8"
IDLE_PART = "pipeline idle"

# Bytes read and written per parameter element by each optimizer's step as torch runs it
# on CUDA by default (``foreach``: one pass per list operation, fp32 state). AdamW, per
# ``torch.optim.adam._multi_tensor_adam``: decay the weights (read and write the
# parameters, 8), ``lerp_`` the first moment toward the gradient (12), scale the second
# moment (8), ``addcmul_`` the squared gradient into it (12), its square root into a new
# list (8), divided (8) and shifted by eps (8) in place, and ``addcdiv_`` into the
# parameters (16): 80.
_OPTIMIZER_BYTES = {"adamw": 80, "adam": 80, "sgd": 24, "sgd_momentum": 24, "none": 0}


@dataclass(frozen=True)
class Work:
    """What one rank's step asks of each kind of kernel, by phase.

    Attributes:
        matmul: matmul flops, ``{"forward", "backward", "recompute"}``.
        attention: attention flops as fused kernels run them, by phase.
        memory: bytes memory-bound ops move, by phase; ``"step"`` for the optimizer's.
    """

    matmul: Mapping[str, float]
    attention: Mapping[str, float]
    memory: Mapping[str, float]

    def seconds(self, rates: KernelRates, phases: tuple[str, ...], speedup: float = 1.0) -> dict[str, float]:
        """Seconds of each kind in ``phases`` at ``rates``; ``speedup`` for all but attention (compile).

        Examples:
            >>> w = Work({"forward": 2e12}, {"forward": 1e12}, {"forward": 4e9})
            >>> w.seconds(KernelRates(matmul=1e15, attention=5e14, bandwidth=4e12), ("forward",))
            {'matmul': 0.002, 'attention': 0.002, 'memory-bound': 0.001}
        """
        return {
            "matmul": sum(self.matmul.get(p, 0.0) for p in phases) / rates.matmul / speedup,
            "attention": sum(self.attention.get(p, 0.0) for p in phases) / rates.attention,
            "memory-bound": sum(self.memory.get(p, 0.0) for p in phases) / rates.bandwidth / speedup,
        }


def loss_bytes(output_bytes: int, output_numel: int, *, compiled: bool = False) -> int:
    """Bytes ``F.cross_entropy(logits.float(), targets)`` moves, forward and backward.

    The upcast (none for fp32 logits), the log-softmax, the dense zeroed gradient, the log-softmax's
    backward and the cast back. ``compiled``: Inductor's two kernels, which read the logits twice in
    forward (their maximum, then the sum of exponentials) and once in backward, writing the gradient.

    Examples:
        >>> loss_bytes(2 * 1000, 1000), loss_bytes(4 * 1000, 1000), loss_bytes(2 * 1000, 1000, compiled=True)
        (36000, 24000, 8000)
    """
    if compiled:
        return 4 * output_bytes
    fp32 = 4 * output_numel
    casts = 0 if output_bytes >= fp32 else 2 * (output_bytes + fp32)
    return casts + 2 * fp32 + fp32 + 3 * fp32


def trained_shares(plan: Plan) -> dict[str, float]:
    """Per FSDP unit that holds frozen parameters, the share of its bytes that get gradients.

    Examples:
        >>> model = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        >>> _ = model[0].weight.requires_grad_(False)
        >>> trained_shares(fs.shard(model, fs.Mesh(dp=2), fs.fsdp()))
        {'0': 0.2}
    """
    if not any(tensor.frozen for tensor in plan.tensors.values()):
        return {}
    whole: dict[str, int] = defaultdict(int)
    trained: dict[str, int] = defaultdict(int)
    for tensor, _, units, _, count in census_of(plan, {}):
        for unit in units:
            whole[unit] += count * tensor.nbytes
            trained[unit] += count * tensor.nbytes if tensor.differentiable else 0
    return {unit: trained[unit] / n for unit, n in whole.items() if n and trained[unit] < n}


def fsdp_copy_bytes(
    plan: Plan, units: Mapping[str, int], trained: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Bytes FSDP2's copies around its collectives move in a step, by phase.

    A gather casts the local shard, copies it into the gather's input and the result out to each
    parameter; a reduce-scatter copies the gradients into its input (reduce dtype) and adds the shard:
    of the parameters that get gradients only (a frozen one, LoRA's base weights, is gathered alone).

    Args:
        plan: the plan (its compute and reduce dtypes, its FSDP axes).
        units: gathered bytes of each FSDP unit ("" is the root), in the compute dtype.
        trained: `trained_shares` of the plan, where known.
    """
    trained = trained_shares(plan) if trained is None else trained
    config = plan.config
    n = plan.mesh.axes_size(config.shard_axes) if config.shard_axes else 1
    param = 4  # the sharded parameters' dtype: the model's, fp32 under mixed precision
    # FSDP's ``param_dtype`` is the compute dtype the gathered copies are cast to
    compute = dtype_from_name(config.param_dtype).itemsize if config.param_dtype else param
    reduce = dtype_from_name(config.reduce_dtype).itemsize if config.reduce_dtype else compute
    cast = param / compute + 1 if param != compute else 0.0
    forward = backward = 0.0
    for unit, size in units.items():
        gather = size * ((cast + 2) / n + 2)
        forward += gather
        backward += gather * (gathers_per_step(plan, (unit,)) - 1)
        backward += size * trained.get(unit, 1.0) * (1 + reduce / compute + 2 * reduce / compute / n)
    return {"forward": forward, "backward": backward}


def optimizer_bytes(params_bytes: int, optimizer: str | float) -> float:
    """Bytes the optimizer's step moves over a rank's ``params_bytes`` of fp32 parameters.

    ``optimizer``: a name, or the state's bytes per element (one pass over parameters, state, gradients).

    Examples:
        >>> optimizer_bytes(4 * 1000, "adamw"), optimizer_bytes(4 * 1000, 8.0)
        (80000.0, 28000.0)
    """
    per_element = (
        _OPTIMIZER_BYTES.get(optimizer, _OPTIMIZER_BYTES["adamw"])
        if isinstance(optimizer, str)
        else 12 + 2 * float(optimizer)
    )
    return per_element * params_bytes / 4


def work_of(
    trace: ActivationTrace,
    *,
    fsdp_bytes: Mapping[str, float],
    step_bytes: float,
    compiled_loss: bool = False,
) -> Work:
    """The `Work` of a traced step, with FSDP's copies, the loss and the optimizer's step added."""
    attention_model = {
        "forward": trace.attention_flops,
        "backward": trace.attention_backward_flops,
        "recompute": trace.attention_recompute_flops,
    }
    totals = {
        "forward": trace.forward_flops,
        "backward": trace.backward_flops,
        "recompute": trace.recompute_flops,
    }
    memory = {
        "forward": trace.memory_bound_bytes + fsdp_bytes.get("forward", 0.0),
        "backward": trace.memory_bound_backward_bytes
        + loss_bytes(trace.output_bytes, trace.output_numel, compiled=compiled_loss)
        + fsdp_bytes.get("backward", 0.0),
        "recompute": float(trace.memory_bound_recompute_bytes),
        "step": step_bytes,
    }
    return Work(
        matmul={phase: float(totals[phase] - attention_model[phase]) for phase in totals},
        attention={
            "forward": trace.attention_kernel_flops,
            "backward": trace.attention_kernel_backward_flops,
            "recompute": trace.attention_kernel_recompute_flops,
        },
        memory=memory,
    )
