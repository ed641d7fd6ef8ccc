"""What a trace found: `ActivationTrace`, its counts per pipeline stage, and `regroup`.

Traced once per unit of work, a trace is regrouped into each cut of the model into stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .counting import Flops

__all__ = ["PER_STEP", "ActivationTrace", "counts_of", "regroup"]

PER_STEP = -2
"""The owner (`Births.owner`) of a storage made once a step and shared by every micro-batch."""


@dataclass(frozen=True, slots=True)
class ActivationTrace:
    """What one rank's forward keeps for backward, and the flops of one micro-batch step.

    Attributes:
        rank: the rank traced.
        activation_bytes: unique storages' bytes kept for backward (not parameters, their casts, the output).
        output_bytes: bytes of the model's output (logits, say).
        output_numel: elements of the model's output, whatever its dtype.
        forward_flops: flops of the forward (`functional_shard.costing.time.flops`' convention).
        backward_flops: flops of the backward, recompute excluded.
        recompute_flops: flops of checkpointed modules run again in backward.
        batch: sequences per data-parallel rank.
        seq: sequence length (global, before sequence parallel splits it).
        stage_activation_bytes: with ``stages``, what each stage keeps, what no stage's modules made included.
        stage_forward_flops: per stage, forward flops inside its modules (those outside: in every stage).
        stage_backward_flops: per stage, backward flops, shared out as the forward's are.
        stage_recompute_flops: per stage, recompute flops shared out the same way.
        backward_weight_flops: of ``backward_flops``, the weights' gradients (zero-bubble schedules' ``W``).
        stage_backward_weight_flops: per stage, shared out as the backward's.
        stage_output_bytes: per stage, its last module's output: what it sends the next stage.
        stage_shared_bytes: of each stage's activation bytes, those made outside every stage's modules.
        stage_shared_flops: of each stage's forward flops, those run outside them.
        stage_memory_bound_bytes: per stage, bytes the forward's memory-bound ops move inside its
            modules (those outside: in every stage).
        stage_shared_memory_bytes: of each stage's memory-bound bytes, those moved outside them.
        step_bytes: of ``activation_bytes``, those made once a step, shared by every micro-batch.
        attention_flops: of ``forward_flops``, attention's (`flops.is_attention`).
        attention_backward_flops: of ``backward_flops``, attention's.
        attention_recompute_flops: of ``recompute_flops``, attention's.
        recompute_bytes: the most one checkpointed call's recompute holds (`counting.recomputed_bytes`).
        attention_kernel_flops: attention's forward flops as fused kernels run them.
        attention_kernel_backward_flops: the same of the backward (the scores recomputed).
        attention_kernel_recompute_flops: the same of checkpointing's recompute.
        memory_bound_bytes: bytes the forward's memory-bound ops read and write.
        memory_bound_backward_bytes: the same of the backward.
        memory_bound_recompute_bytes: the same of checkpointing's recompute.
    """

    rank: int
    activation_bytes: int
    output_bytes: int
    output_numel: int
    forward_flops: int
    backward_flops: int
    recompute_flops: int
    batch: int
    seq: int
    stage_activation_bytes: tuple[int, ...] = ()
    stage_forward_flops: tuple[int, ...] = ()
    stage_backward_flops: tuple[int, ...] = ()
    stage_recompute_flops: tuple[int, ...] = ()
    backward_weight_flops: int = 0
    stage_backward_weight_flops: tuple[int, ...] = ()
    stage_output_bytes: tuple[int, ...] = ()
    stage_shared_bytes: int = 0
    stage_shared_flops: int = 0
    stage_memory_bound_bytes: tuple[int, ...] = ()
    stage_shared_memory_bytes: int = 0
    step_bytes: int = 0
    attention_flops: int = 0
    attention_backward_flops: int = 0
    attention_recompute_flops: int = 0
    recompute_bytes: int = 0
    attention_kernel_flops: float = 0.0
    attention_kernel_backward_flops: float = 0.0
    attention_kernel_recompute_flops: float = 0.0
    memory_bound_bytes: int = 0
    memory_bound_backward_bytes: int = 0
    memory_bound_recompute_bytes: int = 0

    @property
    def step_flops(self) -> int:
        """Forward + backward + recompute flops."""
        return self.forward_flops + self.backward_flops + self.recompute_flops


def regroup(trace: ActivationTrace, groups: list[list[int]]) -> ActivationTrace:
    """A trace with ``stages=`` seen through coarser stages: new stage ``i`` is the old ``groups[i]``.

    One trace with each unit of work as a stage serves every cut into whole units; what is made
    outside every stage's modules counts once per new stage.

    Examples:
        >>> trace = ActivationTrace(0, 30, 1, 1, 30, 60, 0, 1, 8, stage_activation_bytes=(11, 11, 11),
        ...     stage_forward_flops=(10, 10, 10), stage_backward_flops=(20, 20, 20),
        ...     stage_recompute_flops=(0, 0, 0), stage_output_bytes=(4, 4, 4), stage_shared_bytes=1)
        >>> merged = regroup(trace, [[0, 1], [2]])
        >>> merged.stage_activation_bytes, merged.stage_forward_flops, merged.stage_output_bytes
        ((21, 11), (20, 10), (4, 4))
    """
    shared_bytes, shared_flops = trace.stage_shared_bytes, trace.stage_shared_flops
    activation = tuple(
        sum(trace.stage_activation_bytes[u] - shared_bytes for u in group) + shared_bytes for group in groups
    )
    forward = [
        sum(trace.stage_forward_flops[u] - shared_flops for u in group) + shared_flops for group in groups
    ]
    shared_memory = trace.stage_shared_memory_bytes
    memory = tuple(
        sum(trace.stage_memory_bound_bytes[u] - shared_memory for u in group) + shared_memory
        for group in (groups if trace.stage_memory_bound_bytes else ())
    )
    return dataclasses.replace(
        trace,
        stage_activation_bytes=activation,
        stage_memory_bound_bytes=memory,
        stage_forward_flops=tuple(forward),
        stage_backward_flops=tuple(_shared_out(sum(trace.stage_backward_flops), forward)),
        stage_recompute_flops=tuple(_shared_out(sum(trace.stage_recompute_flops), forward)),
        stage_backward_weight_flops=tuple(_shared_out(sum(trace.stage_backward_weight_flops), forward)),
        stage_output_bytes=tuple(trace.stage_output_bytes[group[-1]] for group in groups),
    )


def _per_stage(by_owner: Mapping[int, int], stages: int) -> list[int]:
    # what no stage's module made (inputs, the model's code between its modules) every stage makes
    shared = by_owner.get(-1, 0)
    return [by_owner.get(stage, 0) + shared for stage in range(stages)]


def _shared_out(total: int, weights: list[int]) -> list[int]:
    whole = sum(weights)
    if not whole:
        return [total // max(len(weights), 1)] * len(weights)
    return [round(total * w / whole) for w in weights]


def counts_of(
    flops: Flops,
    kept: Mapping[int, int],
    *,
    recomputed: int = 0,
    output: tuple[int, int],
    stages: int,
    stage_output_bytes: list[int],
) -> dict[str, Any]:
    """One run's counts, by `ActivationTrace`'s field names (lists where it has tuples).

    Args:
        flops: the run's flop counter, the recompute filled in.
        kept: bytes kept for backward by the stage that made them (-1: outside every stage).
        recomputed: the most one checkpointed call's recompute holds (`recompute_bytes`).
        output: the model output's bytes and elements.
        stages: how many pipeline stages to count for (0: none).
        stage_output_bytes: the bytes of each stage's last module's output.

    Examples:
        >>> from functional_shard.costing.trace.counting import Flops
        >>> counts = counts_of(Flops(), {-1: 8, 0: 24}, output=(16, 4), stages=1, stage_output_bytes=[16])
        >>> counts["activation_bytes"], counts["stage_activation_bytes"], counts["stage_shared_bytes"]
        (32, [32], 8)
    """
    counts: dict[str, Any] = {
        "activation_bytes": sum(kept.values()),
        "step_bytes": kept.get(PER_STEP, 0),
        "output_bytes": output[0],
        "output_numel": output[1],
        "backward_weight_flops": flops.counts["weight"],
        "recompute_bytes": recomputed,
    }
    # each count by phase: forward_flops, attention_backward_flops, memory_bound_recompute_bytes...
    for phase in ("forward", "backward", "recompute"):
        counts[f"{phase}_flops"] = flops.counts[phase]
        infix = "" if phase == "forward" else f"_{phase}"
        counts[f"attention{infix}_flops"] = flops.attention[phase]
        counts[f"attention_kernel{infix}_flops"] = flops.attention_kernel[phase]
        counts[f"memory_bound{infix}_bytes"] = flops.memory[phase]
    if stages:
        forward = _per_stage(flops.by_stage, stages)
        counts["stage_activation_bytes"] = _per_stage(kept, stages)
        counts["stage_forward_flops"] = forward
        counts["stage_backward_weight_flops"] = _shared_out(flops.counts["weight"], forward)
        for key in ("backward", "recompute"):
            counts[f"stage_{key}_flops"] = _shared_out(flops.counts[key], forward)
        counts["stage_output_bytes"] = stage_output_bytes
        counts["stage_shared_bytes"] = kept.get(-1, 0)
        counts["stage_shared_flops"] = flops.by_stage.get(-1, 0)
        counts["stage_memory_bound_bytes"] = _per_stage(flops.memory_by_stage, stages)
        counts["stage_shared_memory_bytes"] = flops.memory_by_stage.get(-1, 0)
    return counts
