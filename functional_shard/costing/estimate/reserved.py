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
and too small for the next), which depends on the order of every allocation in the step
(`simulated_peaks` traces that order and runs it through the simulator, for the plans an
H200 measured); docs/will-it-fit.md lists the rows where it shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .caching_allocator import CachingAllocator, run

if TYPE_CHECKING:
    from functional_shard.planning.plan.cost_record import Cost
    from functional_shard.planning.plan.plan import Plan

__all__ = ["MODEL", "SIMULATED", "reserved_beyond", "simulated_peaks"]

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
    fsdp = plan.config.fsdp
    sharding = plan.mesh.axes_size(fsdp.shard_axes) if fsdp is not None and fsdp.shard_axes else 1
    if sharding > 1:
        beyond["all-gather stream"] = _segments(sorted(units.values(), reverse=True)[:2], _ALL_GATHER)
    return beyond


def simulated_peaks(
    model: Any, plan: Plan, *, batch: int, seq: int, optimizer: str = "adamw"
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
    from functional_shard.costing.trace.allocations import step_allocations  # fake-tensor machinery

    allocator = CachingAllocator()
    for _ in run(allocator, step_allocations(model, plan, batch=batch, seq=seq, optimizer=optimizer)):
        pass
    return allocator.peak_allocated, allocator.peak_reserved
