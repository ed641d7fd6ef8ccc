"""Memory per device, as stacked bars: what `Plan.cost` predicts for each rank, an estimate on top."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from functional_shard.core.errors import ShardingError

from .canvas import byte_unit, matplotlib_module

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from functional_shard.costing.cost.cost_model import OptimizerKind
    from functional_shard.planning.plan.plan import Plan

__all__ = ["draw_memory"]

_COST_PARTS = (
    ("params_bytes", "params"),
    ("grads_bytes", "grads"),
    ("optimizer_bytes", "optimizer"),
    ("buffers_bytes", "buffers"),
    ("gathered_bytes", "gathered (FSDP units in flight)"),
)
# parts of an estimate's memory that plan.cost() already draws
_COST_KEYS = {"params", "grads", "optimizer", "buffers", "gathered", "params_bytes", "grads_bytes"}
_MAX_BARS = 32


def _ranks_shown(size: int, ranks: Sequence[int] | None) -> list[int]:
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < size]
        if bad:
            raise ShardingError(f"ranks {bad} are outside the mesh of {size} devices")
        return list(ranks)
    if size <= _MAX_BARS:
        return list(range(size))
    step = (size - 1) / (_MAX_BARS - 1)
    return sorted({round(i * step) for i in range(_MAX_BARS)})


def _rank_memory(estimate: Any, plan: Plan, rank: int) -> Mapping[str, int] | None:
    """The estimate's peak by part for ``rank``: under a pipeline its pp coordinate's, else the estimate's."""
    pipeline = getattr(estimate, "pipeline", None)
    if pipeline is not None and pipeline.rank_memory and plan.config.pipeline is not None:
        return pipeline.rank_memory[plan.mesh.coords(rank)[plan.config.pipeline.axis]]
    memory: Mapping[str, int] | None = getattr(estimate, "memory", None)
    return memory


def _at_the_peak(memory: Mapping[str, int] | None) -> dict[str, int]:
    """An estimate's gradients and gathered units at its peak (``memory``), by `Cost` field.

    Parameters, optimizer state and buffers rest on a rank all step: each rank's own `Plan.cost`.
    Gradients and gathered units depend on the moment, which the estimate's peak fixes.
    """
    if not memory:
        return {}
    return {"grads_bytes": int(memory.get("grads", 0)), "gathered_bytes": int(memory.get("gathered", 0))}


def _estimate_parts(estimate: Any, memory: Mapping[str, int] | None) -> dict[str, int]:
    """One rank's parts of an estimate (``memory``) that `Plan.cost` does not draw (activations, ...)."""
    if estimate is None:
        return {}
    if memory:
        return {k: int(v) for k, v in memory.items() if k not in _COST_KEYS and v and "host" not in k}
    activations = getattr(estimate, "activation_bytes", None)
    if activations is None:
        raise ShardingError(f"estimate={estimate!r}: pass the result of fs.estimate(...)")
    return {"activations": int(activations)}


def draw_memory(
    axes: Axes,
    plan: Plan,
    *,
    estimate: Any = None,
    optimizer: OptimizerKind = "adamw",
    ranks: Sequence[int] | None = None,
    budget: int | None = None,
) -> None:
    """Stacked bars of each rank's predicted device memory, into matplotlib ``axes``.

    Args:
        axes: where to draw.
        plan: the plan.
        estimate: an `fs.estimate` result: every bar is then its peak (the gradients and gathered units
            it counts there, activations, logits and workspace on top), each rank's resting parts its own.
        optimizer: as for `Plan.cost`.
        ranks: the ranks to draw; by default all, or 32 spread evenly over a big mesh.
        budget: draw a line at this many bytes (the device's memory).

    Raises:
        ShardingError: a rank outside the mesh, or ``estimate`` is not an estimate.
    """
    shown = _ranks_shown(plan.mesh.size, ranks)
    costs = [plan.cost(optimizer, rank=rank) for rank in shown]
    # each rank's own peak: under a pipeline its stages' (the estimate's own is the worst stage's)
    memories = [_rank_memory(estimate, plan, rank) for rank in shown]
    extras = [_estimate_parts(estimate, memory) for memory in memories]
    parts = [
        {field: _at_the_peak(memory).get(field, getattr(c, field)) for field, _ in _COST_PARTS} | extra
        for c, memory, extra in zip(costs, memories, extras, strict=True)
    ]
    largest = max([sum(p.values()) for p in parts] + [budget or 0])
    unit, scale = byte_unit(largest)
    names = dict(_COST_PARTS) | {
        name: name.removesuffix("_bytes").replace("_", " ") for extra in extras for name in extra
    }
    stacks = {label: [p.get(field, 0) / scale for p in parts] for field, label in names.items()}
    positions = list(range(len(shown)))
    bottom = [0.0] * len(shown)
    colours = iter(matplotlib_module().colormaps["tab10"].colors)
    for label, values in stacks.items():
        colour = next(colours)
        if not any(values):
            continue
        axes.bar(positions, values, bottom=bottom, label=label, color=colour, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes.set_xticks(positions)
    if len(shown) <= 8 and len(plan.mesh.axis_names) > 1:
        labels = [
            f"{rank}\n" + ", ".join(f"{a}={i}" for a, i in plan.mesh.coords(rank).items()) for rank in shown
        ]
    else:
        labels = [str(rank) for rank in shown]
    axes.set_xticklabels(
        labels, fontsize=8 if len(shown) <= 16 else 6, rotation=0 if len(shown) <= 16 else 90
    )
    axes.set_xlabel("rank" + ("" if len(shown) == plan.mesh.size else f" ({len(shown)} of {plan.mesh.size})"))
    axes.set_ylabel(f"{unit} per device")
    top = max(bottom, default=0.0)
    subtitle = repr(plan.mesh)
    # a budget far above the bars would flatten them: past 3x the tallest it is only named
    if budget is not None and budget / scale <= 3 * top:
        label = f"budget {budget / scale:.3g} {unit}"
        axes.axhline(budget / scale, color="black", linestyle="--", linewidth=1, label=label)
        top = max(top, budget / scale)
    elif budget is not None:
        subtitle += f"; budget {budget / scale:.3g} {unit}, off the scale"
    axes.set_ylim(0, top * 1.3 or 1)
    title = "memory per device (predicted)" + (" with activations" if any(extras) else "")
    axes.set_title(f"{title}\n{subtitle}", fontsize=10)
    axes.legend(fontsize=8, loc="upper right", ncols=2)
    axes.grid(axis="y", alpha=0.3)
