"""A step's compute timed by kernel kind: matmuls, fused attention, memory-bound work.

Each kind is bound by something else, so each has its own rate (`KernelRates`, measured
by `fs.measure_rates`):

- **matmuls** run their flops (torch's ``FlopCounterMode`` count) at the matmul rate;
- **fused attention** runs the flops the kernel itself runs: the causal half of the score
  matrix, and in backward the scores again (`functional_shard.costing.time.flops.attention_kernel_flops`),
  at the attention rate;
- **memory-bound** ops (norms, element-wise ops, rotary, softmax and cross-entropy, the
  optimizer's step, FSDP's casts and copies) move bytes at the memory bandwidth: those a
  trace counts op by op (`functional_shard.costing.trace.counting.moved_bytes`), the loss's
  (`loss_bytes`), FSDP's copies around each collective (`fsdp_copy_bytes`) and the
  optimizer's passes (`optimizer_bytes`).

MFU still counts model flops (attention's full score matrix, no recompute): time and MFU
count attention differently on purpose (docs/cost-model.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from functional_shard.core.tree import dtype_from_name
from functional_shard.costing.cost.traffic import gathers_per_step

from .hardware import KernelRates

if TYPE_CHECKING:
    from functional_shard.costing.trace.results import ActivationTrace
    from functional_shard.planning.plan.plan import Plan

__all__ = ["KINDS", "Work", "fsdp_copy_bytes", "loss_bytes", "optimizer_bytes", "work_of"]

KINDS = ("matmul", "attention", "memory-bound")

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


def loss_bytes(output_bytes: int, output_numel: int) -> int:
    """Bytes ``F.cross_entropy(logits.float(), targets)`` moves, forward and backward.

    Forward: the upcast (read the logits, write fp32; nothing when they are fp32 already)
    and the log-softmax (read, write). Backward: the zeroed dense gradient of ``nll_loss``
    (write), the log-softmax's backward (read the gradient and the saved output, write),
    and the cast back (read fp32, write the logits' dtype).

    Examples:
        >>> loss_bytes(2 * 1000, 1000), loss_bytes(4 * 1000, 1000)
        (36000, 24000)
    """
    fp32 = 4 * output_numel
    casts = 0 if output_bytes >= fp32 else 2 * (output_bytes + fp32)
    return casts + 2 * fp32 + fp32 + 3 * fp32


def fsdp_copy_bytes(plan: Plan, units: Mapping[str, int]) -> dict[str, float]:
    """Bytes FSDP2's copies around its collectives move in a step, by phase.

    Each gather of a unit of ``b`` bytes (in the compute dtype) over ``n`` ranks casts the
    local shard from the parameter dtype (``p/c`` of ``b/n`` read, ``b/n`` written),
    copies it into the gather's input (``2·b/n``) and copies the gathered result out to
    each parameter (``2·b``). Each reduce-scatter copies the gradients into its input,
    cast to the reduce dtype (``b`` read, ``r/c·b`` written), and adds the reduced shard
    into the sharded gradient (``2·r/c·b/n``).

    Args:
        plan: the plan (its compute and reduce dtypes, its FSDP axes).
        units: gathered bytes of each FSDP unit ("" is the root), in the compute dtype; each
            is gathered as often as `traffic.gathers_per_step` says.
    """
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
        backward += size * (1 + reduce / compute + 2 * reduce / compute / n)
    return {"forward": forward, "backward": backward}


def optimizer_bytes(params_bytes: int, optimizer: str | float) -> float:
    """Bytes the optimizer's step moves over a rank's ``params_bytes`` of fp32 parameters.

    ``optimizer`` is a name, or the state's bytes per parameter element (as for `cost`):
    then one pass reads and writes the parameters and the state and reads the gradients.

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
) -> Work:
    """The `Work` of a traced step, with FSDP's copies and the optimizer's step added."""
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
        + loss_bytes(trace.output_bytes, trace.output_numel)
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
