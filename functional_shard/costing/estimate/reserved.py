"""The reserved peak: what torch's CUDA caching allocator holds beyond the allocated peak.

``max_memory_reserved`` (what out-of-memory errors and published tables such as
torchtitan's ``max_reserved`` speak of) counts the allocator's segments, not the tensors in
them. A free cached block serves only its own stream (`caching_allocator`), and FSDP2 puts
two kinds of blocks on streams of their own:

- the reduce-scatter stream: FSDP2 allocates each unit's reduce-scatter output there
  (torch ``_fsdp_collectives.foreach_reduce``: "The RS output is allocated in the RS
  stream"); the sharded gradients are views of it. ``zero_grad()`` frees them before the
  next forward, and their blocks stay cached on that stream, where the forward's
  activations (default stream) cannot use them. So where the peak falls before any
  gradient is made, the gradients' segments are held beyond it. Measured on one H200:
  16 blocks of 232 MiB and one of 1002 MiB on that stream in every llama-1b step
  (bench/data/h200/memory-*.json.gz).
- the all-gather copy-in stream, with more than one rank sharding: ``foreach_all_gather``
  allocates each unit's all-gather output there, frees it after the copy-out to the
  unsharded parameters, and in forward keeps the previous unit's until the next copy-out
  (``FSDPParamGroup.wait_for_unshard``): two outputs at once, cached there. One rank
  skips the all-gather (``FSDPParamGroup.unshard``), so the bench's rows did not measure it.

Each stream's blocks go through `caching_allocator.CachingAllocator`, which rounds them into
segments as torch does. Under CPU offload the gradients leave the device: their
reduce-scatter outputs pass through that stream one unit at a time, not counted. Not
counted either: the default stream's own fragmentation (cached blocks split by one request
and too small for the next), which depends on the order of every allocation in the step.

``fs.estimate(..., reserved="traced")`` counts it: `traced_reserved` traces that order
(`functional_shard.costing.trace.allocations.step_allocations`) and runs three steps of it
through the simulator, for the plans whose order the trace knows (FSDP on one rank, AdamW,
token-id inputs, eager kernels); others raise. docs/will-it-fit.md holds both models to an
H200's rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from functional_shard.core.errors import PlanError
from functional_shard.core.validate import refuse
from functional_shard.costing.time.kernels import Kernels

from .caching_allocator import CachingAllocator, run

if TYPE_CHECKING:
    from functional_shard.planning.plan.cost_record import Cost, OptimizerKind
    from functional_shard.planning.plan.plan import Plan

__all__ = [
    "MODEL",
    "SIMULATED",
    "ReservedModel",
    "check_reserved_model",
    "order_known",
    "reserved_beyond",
    "simulated_peaks",
    "traced_reserved",
]

ReservedModel = Literal["streams", "traced"]
"""``fs.estimate(reserved=...)``: FSDP2's streams (fast), or the step's allocations traced in order."""

MODEL = (
    "the allocated peak plus the segments cached on FSDP2's own streams; "
    "the default stream's fragmentation not counted"
)

SIMULATED = (
    "the step's allocations in order (the whole model traced on fake tensors, FSDP2's buffers, "
    "foreach AdamW's), three steps through torch's caching-allocator rules"
)

_REDUCE_SCATTER, _ALL_GATHER = 1, 2  # stream ids for the simulator: any two but the default (0)


def _segments(blocks: list[int], stream: int) -> int:
    """Bytes of the segments torch's allocator makes for ``blocks``, all alive at once on ``stream``."""
    allocator = CachingAllocator()
    for size in blocks:
        if size > 0:
            allocator.malloc(size, stream)
    return allocator.reserved


def reserved_beyond(
    plan: Plan, cost: Cost, memory: Mapping[str, int], units: Mapping[str, int]
) -> dict[str, int]:
    """What the caching allocator holds beyond the allocated peak ``memory``, by stream.

    ``units``: each FSDP unit's gathered bytes (none without FSDP: gradients then live on
    the default stream, where the next forward reuses their blocks).
    """
    beyond: dict[str, int] = {}
    gathered = sum(units.values())
    if not units or gathered == 0:
        return beyond
    if memory.get("grads", 0) == 0 and cost.grads_bytes:  # the peak falls before any gradient is made
        # each unit's reduce-scatter output holds its share of the rank's gradients
        shares = [cost.grads_bytes * part // gathered for part in units.values()]
        beyond["reduce-scatter stream"] = _segments(shares, _REDUCE_SCATTER)
        if step := memory.get("optimizer_step", 0):
            # the peak is the optimizer step, which holds the gradients: beyond it, the rest of
            # their segments, and the default stream's segments cached at the start of
            # backward, which held grads - optimizer_step more there than the step does
            beyond["reduce-scatter stream"] -= cost.grads_bytes
            beyond["default stream"] = max(0, cost.grads_bytes - step)
    fsdp = plan.config.fsdp
    sharding = plan.mesh.axes_size(fsdp.shard_axes) if fsdp is not None and fsdp.shard_axes else 1
    if sharding > 1:
        beyond["all-gather stream"] = _segments(sorted(units.values(), reverse=True)[:2], _ALL_GATHER)
    return beyond


def simulated_peaks(
    model: Any, plan: Plan, *, batch: int, seq: int, optimizer: OptimizerKind = "adamw"
) -> tuple[int, int]:
    """(allocated, reserved) peaks of three steps of ``plan`` through the allocator simulator.

    The step's own order (`functional_shard.costing.trace.allocations.step_allocations`),
    warm-up included, counts what `reserved_beyond` leaves out: the default stream's
    fragmentation. It traces the whole model (seconds, not the estimate's fraction of one)
    and only plans of the kind an H200 measured; others raise `PlanError`.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(dp=1), fs.fsdp("dp") + fs.mixed_precision())
        >>> allocated, reserved = simulated_peaks(model, plan, batch=2, seq=16)
        >>> reserved >= allocated > 0
        True
    """
    allocator = _simulated(model, plan, batch=batch, seq=seq, optimizer=optimizer)
    return allocator.peak_allocated, allocator.peak_reserved


def order_known(plan: Plan, optimizer: OptimizerKind, kernels: Kernels | None = None) -> bool:
    """Whether `traced_reserved` knows ``plan``'s allocation order (token-id inputs assumed)."""
    from functional_shard.costing.trace.allocations import order_problems  # fake-tensor machinery

    return (kernels is None or kernels == Kernels()) and not order_problems(plan, optimizer)


def _simulated(model: Any, plan: Plan, *, batch: int, seq: int, optimizer: OptimizerKind) -> CachingAllocator:
    from functional_shard.costing.trace.allocations import step_allocations  # fake-tensor machinery

    allocator = CachingAllocator()
    for _ in run(allocator, step_allocations(model, plan, batch=batch, seq=seq, optimizer=optimizer)):
        pass
    return allocator


def check_reserved_model(
    reserved: object, *, inputs: object, documents: object, kernels: Kernels | None
) -> None:
    """Refuse a ``reserved`` `fs.estimate` does not know, or ``"traced"`` with what the trace cannot run.

    The trace feeds the model token ids and runs eager kernels in their order: other inputs,
    packed documents (another attention kernel) or compiled and Float8 kernels allocate in
    another order.

    Raises:
        ShardingError: as above, named with the fix.
    """
    if reserved not in ("streams", "traced"):
        refuse("reserved", repr(reserved), '"streams" or "traced"', meaning=_MEANING)
    if reserved == "streams":
        return
    given = {"inputs": inputs, "documents": documents}
    for name, value in given.items():
        if value is not None:
            refuse(
                "reserved",
                '"traced"',
                f"the trace feeds token ids, without {name}",
                meaning=f'leave {name} out, or use reserved="streams"',
            )
    if kernels is not None and kernels != Kernels():
        refuse(
            "reserved",
            '"traced"',
            f"the trace runs eager kernels in their order, not {kernels}",
            meaning='leave kernels out, or use reserved="streams"',
        )


_MEANING = (
    'how the reserved peak is counted: "streams" adds the segments cached on FSDP2\'s own streams '
    '(fast); "traced" runs the step\'s traced allocations through the caching allocator (seconds)'
)


def traced_reserved(
    model: Any, plan: Plan, peak_bytes: int, *, batch: int, seq: int, optimizer: OptimizerKind
) -> dict[str, int]:
    """What the caching allocator holds beyond ``peak_bytes``, by stream, from the step's traced order.

    The simulator's segments after three steps (none is released: their sum is the reserved
    peak): the reduce-scatter stream's, and the default stream's beyond ``peak_bytes`` (its
    fragmentation, and where the traced allocated peak differs from ``peak_bytes``, that too).

    Raises:
        PlanError: a plan whose allocation order the trace does not know, its kind named.
    """
    try:
        allocator = _simulated(model, plan, batch=batch, seq=seq, optimizer=optimizer)
    except PlanError as error:
        raise PlanError(f'reserved="traced": {error}; reserved="streams" counts any plan') from error
    by_stream: dict[int, int] = {}
    for segment in allocator.segments:
        by_stream[segment.stream] = by_stream.get(segment.stream, 0) + segment.size
    beyond = {"default stream": by_stream.pop(0, 0) - peak_bytes}
    if by_stream:
        beyond["reduce-scatter stream"] = sum(by_stream.values())
    return beyond
