"""Pipelines in pictures: which pp rank holds which stage, and a schedule on a clock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from functional_shard.core.errors import ShardingError

from .canvas import byte_unit, matplotlib_module, new_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from functional_shard.costing.cost.cost_model import OptimizerKind
    from functional_shard.planning.plan.plan import Plan

__all__ = ["draw_schedule", "draw_schedule_figure", "draw_stages"]


def _modules_label(modules: Sequence[str]) -> str:
    """``('embed', 'layers.0', 'layers.1', 'layers.2')`` -> ``embed, layers.0-2``."""
    parts: list[str] = []
    run: tuple[str, int, int] | None = None
    for module in [*modules, ""]:
        prefix, _, index = module.rpartition(".")
        if run is not None and index.isdigit() and prefix == run[0] and int(index) == run[2] + 1:
            run = (run[0], run[1], int(index))
            continue
        if run is not None:
            parts.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
            run = None
        if index.isdigit() and prefix:
            run = (prefix, int(index), int(index))
        elif module:
            parts.append(module)
    return ", ".join(parts)


def draw_stages(axes: Axes, plan: Plan, optimizer: OptimizerKind = "adamw") -> None:
    """Draw which pp rank holds which pipeline stage, into matplotlib ``axes``.

    One row per pp coordinate; each stage a box as wide as its parameter bytes, labelled
    with its index and modules.

    Args:
        axes: where to draw.
        plan: a plan with a pipeline.
        optimizer: as for `Plan.cost`.

    Raises:
        ShardingError: the plan has no pipeline.

    Examples:
        >>> from functional_shard import zoo
        >>> plan = fs.shard(zoo.llama("tiny"), fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2))
        >>> figure = plan.visualize()
        >>> figure.axes[2].get_title().splitlines()[0]
        "pipeline stages over 'pp' (schedule 1f1b, 2 micro-batches)"
    """
    pipeline = plan.config.pipeline
    if pipeline is None:
        raise ShardingError("draw_stages: the plan has no pipeline; make one with fs.pipeline(...)")
    axis, pp = pipeline.axis, pipeline.size(plan.mesh)
    stage_bytes = plan.cost(optimizer).stage_bytes
    largest = max(sum(stage_bytes[s]["params"] for s in pipeline.stages_at(plan.mesh, r)) for r in range(pp))
    unit, scale = byte_unit(largest)
    colours = matplotlib_module().colormaps["tab10" if len(stage_bytes) <= 10 else "tab20"].colors
    for rank in range(pp):
        left = 0.0
        for stage in pipeline.stages_at(plan.mesh, rank):
            width = stage_bytes[stage]["params"] / scale
            axes.barh(
                rank, width, left=left, color=colours[stage % len(colours)], edgecolor="white", height=0.7
            )
            label = f"stage {stage}\n{_modules_label(pipeline.stages[stage])}"
            axes.text(
                left + width / 2,
                rank,
                label if len(label) < 60 else label[:58] + "…",
                ha="center",
                va="center",
                fontsize=8 if pp <= 8 else 6,
            )
            left += width
    axes.set_yticks(range(pp), [f"{axis}={r}" for r in range(pp)], fontsize=8)
    axes.set_ylim(pp - 0.5, -0.5)
    axes.set_xlabel(f"{unit} of parameters (on the stage's first rank)")
    axes.set_title(
        f"pipeline stages over {axis!r} (schedule {pipeline.schedule}, "
        f"{pipeline.microbatches} micro-batches)\n{len(pipeline.stages)} stages, "
        f"{pipeline.stages_per_rank} per rank",
        fontsize=10,
    )
    axes.grid(axis="x", alpha=0.3)


_KIND_COLOURS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#b279a2"}


def draw_schedule(axes: Axes, timeline: Any) -> None:
    """Draw a pipeline schedule: which rank runs which micro-batch when, into ``axes``.

    One row per pp rank; each of torch's actions is a box on the clock of
    `functional_shard.planning.pipeline.schedules.simulate` (forward blue, backward red,
    input-gradient orange, weight-gradient purple), labelled with its micro-batch. The white
    gaps are the bubble.

    Args:
        axes: where to draw.
        timeline: a `functional_shard.planning.pipeline.schedules.Timeline`.

    Examples:
        >>> from functional_shard.planning.pipeline.schedules import simulate
        >>> figure = draw_schedule_figure(simulate("1f1b", 4, 8))
        >>> figure.axes[0].get_title().splitlines()[0]
        '1f1b: 4 ranks, 8 micro-batches, 1 stage per rank'
    """
    pp = timeline.pp
    several = timeline.stages_per_rank > 1
    for rank, spans in enumerate(timeline.spans):
        for start, end, step in spans:
            width = (end - start) / len(step)
            for index, action in enumerate(step):  # DualPipeV's overlapped pair side by side
                left = start + index * width
                axes.barh(
                    rank,
                    width,
                    left=left,
                    color=_KIND_COLOURS.get(action.kind, "grey"),
                    edgecolor="white",
                    height=0.8,
                )
                label = f"{action.microbatch}" + (f"\ns{action.stage}" if several else "")
                axes.text(left + width / 2, rank, label, ha="center", va="center", fontsize=6, color="white")
    axes.set_yticks(range(pp), [f"rank {r}" for r in range(pp)], fontsize=8)
    axes.set_ylim(pp - 0.5, -0.5)
    axes.set_xlim(0, timeline.makespan)
    axes.set_xlabel("time (forward of one micro-batch on one stage = 1)")
    seen = {action.kind for spans in timeline.spans for _, _, step in spans for action in step}
    kinds = sorted(seen, key="FBIW".index)
    names = {"F": "forward", "B": "backward", "I": "backward (inputs)", "W": "backward (weights)"}
    from matplotlib.patches import Patch

    handles = [Patch(color=_KIND_COLOURS[k], label=names[k]) for k in kinds if k in _KIND_COLOURS]
    axes.legend(handles=handles, fontsize=7, loc="upper right", ncols=len(handles))
    per = "stage" if timeline.stages_per_rank == 1 else "stages"
    axes.set_title(
        f"{timeline.schedule}: {pp} ranks, {timeline.microbatches} micro-batches, "
        f"{timeline.stages_per_rank} {per} per rank\nbubble {timeline.bubble:.1%} of the ranks' time",
        fontsize=10,
    )


def draw_schedule_figure(timeline: Any, path: Any = None) -> Figure:
    """A figure with `draw_schedule` of ``timeline``; written to ``path`` if given.

    Examples:
        >>> from functional_shard.planning.pipeline.schedules import simulate
        >>> len(draw_schedule_figure(simulate("zbv", 2, 4, 2)).axes)
        1
    """
    figure = new_figure(max(8.0, min(20.0, timeline.makespan / 3)), 0.6 * timeline.pp + 1.6)
    draw_schedule(figure.subplots(), timeline)
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure
