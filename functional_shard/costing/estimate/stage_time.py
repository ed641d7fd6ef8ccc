"""A pipeline's stages timed: each stage's forward, backward and weight gradients for one micro-batch.

By kernel kind where the hardware has `KernelRates` (as a step without a pipeline is), else
their flops at the achievable rate. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from functional_shard.costing.time.kernel_time import (
    PHASES,
    Work,
    fsdp_copy_bytes,
    loss_bytes,
    trained_shares,
    work_of,
)
from functional_shard.costing.time.kernels import Clock, phase_saved
from functional_shard.costing.time.step_model import Assembly, in_share

__all__ = ["StageSeconds", "rank_work", "stage_seconds", "stage_works"]


@dataclasses.dataclass(frozen=True)
class StageSeconds:
    """Per stage, the seconds of one micro-batch's forward, backward and weight gradients."""

    forward: list[float]
    backward: list[float]  # the whole backward, and the recompute before it
    weight: list[float]  # the weights' gradients alone (W), which zero-bubble schedules split off


def stage_works(
    assembly: Assembly,
    owner: Sequence[int],
    microbatches: int,
    rank_units: Sequence[Mapping[str, int]],
    stage_params: Sequence[int],
) -> list[Work] | None:
    """Per stage, one micro-batch's `Work`; ``None`` where the hardware has no `KernelRates`.

    The traced micro-batch's work by kind, shared out among the stages: matmuls and attention as
    their flops are, memory-bound bytes as their forwards' are (the trace counts kinds for the
    whole model), with the loss on the last stage; and each rank's FSDP copies (``rank_units``:
    its units' gathered bytes) spread over its stages as their parameters are (``stage_params``,
    per stage; evenly where a rank's are all zero) and over the step's ``microbatches``. ``owner``: per stage,
    the pp coordinate that runs it.
    """
    trace, plan = assembly.trace, assembly.plan
    if assembly.hardware.kernel_rates is None or assembly.dtype not in ("bfloat16", "float16"):
        return None
    compiled_loss = assembly.kernels.compiled_loss
    whole = work_of(trace, fsdp_bytes={}, step_bytes=0.0, compiled_loss=compiled_loss)
    loss = loss_bytes(trace.output_bytes, trace.output_numel, compiled=compiled_loss)
    flops = {
        "forward": trace.stage_forward_flops,
        "backward": trace.stage_backward_flops,
        "recompute": trace.stage_recompute_flops,
    }
    totals = {p: sum(f) for p, f in flops.items()}
    # memory-bound work follows the bytes each stage's forward moves, not its flops: a stage of
    # an embedding alone runs no flops, yet gathers its rows and scatters their gradients
    moved = list(trace.stage_memory_bound_bytes) or list(flops["forward"])
    # a stage's backward runs its recompute's memory-bound work too: the trace's split of those
    # bytes between the two depends on how it was traced (the search's shortcut), their sum does not
    back_memory = whole.memory["backward"] - loss + whole.memory["recompute"]
    # each rank's copies of a step, once per rank (its stages share them)
    copies: dict[int, dict[str, float]] = {}
    if plan.config.fsdp:
        trained = trained_shares(plan)
        copies = {rank: fsdp_copy_bytes(plan, rank_units[rank], trained) for rank in set(owner)}
    works = []
    for s in range(len(owner)):
        share = {p: flops[p][s] / totals[p] if totals[p] else 0.0 for p in PHASES}
        moved_share = moved[s] / sum(moved) if sum(moved) else 1 / len(owner)
        memory = {
            "forward": whole.memory["forward"] * moved_share,
            "backward": back_memory * moved_share,
            "recompute": 0.0,
        }
        if s == len(owner) - 1:
            memory["backward"] += loss
        for phase, nbytes in copies.get(owner[s], {}).items():
            memory[phase] += nbytes * _rank_share(s, owner, stage_params) / microbatches
        works.append(
            Work(
                matmul={p: whole.matmul[p] * share[p] for p in PHASES},
                attention={p: whole.attention[p] * share[p] for p in PHASES},
                memory=memory,
            )
        )
    return works


def _rank_share(stage: int, owner: Sequence[int], weights: Sequence[int]) -> float:
    """``stage``'s share of its rank's ``weights`` (evenly where they are all zero)."""
    theirs = [t for t in range(len(owner)) if owner[t] == owner[stage]]
    total = sum(weights[t] for t in theirs)
    return weights[stage] / total if total else 1 / len(theirs)


def rank_work(works: Sequence[Work] | None, ours: Sequence[int], m: int, step_bytes: float) -> Work | None:
    """A rank's step of ``m`` micro-batches through its stages, and its optimizer's step."""
    if works is None:
        return None

    def total(kind: str) -> dict[str, float]:
        return {p: m * sum(getattr(works[s], kind)[p] for s in ours) for p in PHASES}

    return Work(total("matmul"), total("attention"), total("memory") | {"step": step_bytes})


def stage_seconds(
    assembly: Assembly, saved: Sequence[Mapping[str, float]], works: Sequence[Work] | None = None
) -> StageSeconds:
    """Per stage, one micro-batch's seconds, less what Float8 saves (``saved``).

    By kernel kind from ``works`` (`stage_works`); without them, the stages' traced flops at
    the achievable rate.
    """
    trace = assembly.trace
    clock = Clock.of(assembly.kernels, assembly.hardware, assembly.dtype)
    rates = assembly.hardware.kernel_rates
    if works is not None and rates is not None:
        # by kernel kind, as a step without a pipeline is timed; the weights' gradients are matmuls
        def timed(s: int, *phases: str) -> float:
            return sum(works[s].seconds(rates, phases, clock.speedup).values())

        return StageSeconds(
            [timed(s, "forward") - saved[s]["forward"] for s in range(len(works))],
            [
                timed(s, "backward", "recompute") - phase_saved(saved[s], "backward", "weight", "recompute")
                for s in range(len(works))
            ],
            [
                w / (rates.matmul * clock.speedup) - saved[s]["weight"]
                for s, w in enumerate(trace.stage_backward_weight_flops)
            ],
        )
    # each stage's attention in its share of the phase's work (the trace counts it whole)
    forward = [
        clock.seconds(f, in_share(trace.attention_flops, f, trace.forward_flops), saved[s]["forward"])
        for s, f in enumerate(trace.stage_forward_flops)
    ]
    backward = [
        clock.seconds(
            b + r,
            in_share(trace.attention_backward_flops, b, trace.backward_flops)
            + in_share(trace.attention_recompute_flops, r, trace.recompute_flops),
            phase_saved(saved[s], "backward", "weight", "recompute"),
        )
        for s, (b, r) in enumerate(zip(trace.stage_backward_flops, trace.stage_recompute_flops, strict=True))
    ]
    # zero-bubble schedules split the backward: the weights' gradients (W) as the trace
    # counted them; the inputs' (I) and the recompute before them are the rest
    weight = [
        clock.seconds(w, 0.0, saved[s]["weight"]) for s, w in enumerate(trace.stage_backward_weight_flops)
    ]
    return StageSeconds(forward, backward, weight)
