"""Pictures of a plan, from shapes alone: memory per device, and who holds which block.

`visualize` draws with matplotlib (the optional ``plot`` extra), one module per panel:

* **memory per device** (`memory`): `Plan.cost`'s parts stacked per rank, with an
  `fs.estimate`'s activations on top;
* **one parameter's blocks** (`blocks`): its shape as a grid, each block labelled with the
  ranks that hold it, as JAX's ``visualize_sharding`` but from `local_shape_and_offset`;
* **pipeline stages** (`pipeline_chart`) and **the sequence** (`sequence_chart`), for plans
  with a pipeline or context parallel.

The figure is built on matplotlib's Agg canvas (no display needed) and never touches
``pyplot``'s global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .blocks import blocks, draw_blocks
from .canvas import new_figure
from .memory import draw_memory
from .pipeline_chart import draw_schedule, draw_schedule_figure, draw_stages
from .sequence_chart import draw_sequence

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from functional_shard.costing.cost.cost_model import OptimizerKind
    from functional_shard.planning.plan.plan import Plan

__all__ = [
    "blocks",
    "draw_blocks",
    "draw_memory",
    "draw_schedule",
    "draw_schedule_figure",
    "draw_sequence",
    "draw_stages",
    "visualize",
]


def _largest(plan: Plan) -> str:
    return max(plan.params, key=lambda path: (plan.tensors[path].numel, path))


def visualize(
    plan: Plan,
    param: str | None = None,
    *,
    estimate: Any = None,
    optimizer: OptimizerKind = "adamw",
    spec: str = "storage",
    ranks: Sequence[int] | None = None,
    budget: int | None = None,
    path: Any = None,
) -> Figure:
    """Draw a plan: memory per device beside one parameter's blocks over the ranks.

    A plan with a pipeline also gets its stages per pp rank (`draw_stages`) and its schedule
    (`draw_schedule`).

    Args:
        plan: the plan.
        param: the parameter (or buffer) whose blocks to draw; by default the largest.
        estimate: an `fs.estimate` result, to draw each memory bar at its peak, activations included.
        optimizer: as for `Plan.cost`.
        spec: which of the parameter's four specs to draw (default: at rest).
        ranks: the ranks to give bars; by default all (32 spread evenly over a big mesh).
        budget: device memory in bytes, drawn as a line over the bars.
        path: if given, the figure is also written there (PNG, SVG, PDF: by the suffix).

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ShardingError: matplotlib is missing (the ``plot`` extra), an unknown parameter or spec,
            or a rank outside the mesh.

    Examples:
        >>> plan = fs.shard(nn.Linear(8, 6), fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp([("*", "colwise")]))
        >>> figure = plan.visualize("weight")
        >>> [axes.get_title().splitlines()[0] for axes in figure.axes]
        ['memory per device (predicted)', 'weight  6×8']
    """
    pipeline = plan.config.pipeline
    piped = pipeline is not None
    cut = plan.config.context is not None
    if not piped:
        figure = new_figure(19 if cut else 13, 5)
        panels = list(figure.subplots(1, 3 if cut else 2, width_ratios=[1, 1.15, 1.15][: 3 if cut else 2]))
    else:
        # the schedule gets a row of its own, as wide as the three panels above it (and the
        # sequence one below it under cp)
        figure = new_figure(19, 11.5 if cut else 8.5)
        rows, heights = (3, [5, 3.5, 3]) if cut else (2, [5, 3.5])
        grid = figure.add_gridspec(rows, 3, width_ratios=[1, 1.15, 1.15], height_ratios=heights)
        panels = [figure.add_subplot(grid[0, column]) for column in range(3)]
        panels.append(figure.add_subplot(grid[1, :]))
        if cut:
            panels.append(figure.add_subplot(grid[2, :]))
    draw_memory(panels[0], plan, estimate=estimate, optimizer=optimizer, ranks=ranks, budget=budget)
    draw_blocks(panels[1], plan, param if param is not None else _largest(plan), spec)
    if pipeline is not None:
        from functional_shard.planning.pipeline.schedules import simulate

        draw_stages(panels[2], plan, optimizer)
        draw_schedule(
            panels[3],
            simulate(
                pipeline.schedule,
                pipeline.size(plan.mesh),
                pipeline.microbatches,
                pipeline.stages_per_rank,
            ),
        )
    if cut:
        draw_sequence(panels[-1], plan)
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure
