"""Pictures of a plan, from shapes alone: memory per device, and who holds which block.

`visualize` draws two panels with matplotlib (the optional ``plot`` extra):

* **memory per device** — stacked bars of parameters, gradients, optimizer state,
  buffers and gathered FSDP units for each rank, as `Plan.cost` predicts them; with an
  `fs.estimate` result, its activation and workspace parts are stacked on top;
* **one parameter's blocks** — its global shape as a grid, each block labelled with the
  ranks that hold it (replicas share a block), in the spirit of JAX's
  ``visualize_sharding``, but computed from `local_shape_and_offset`: no processes, no
  tensors;
* **pipeline stages** (a plan with a pipeline) — for each pp rank, its stages in the
  order it holds them, each as wide as its parameters, labelled with its modules.

The figure is built on matplotlib's Agg canvas (no display needed) and never touches
``pyplot``'s global state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from functional_shard.core.errors import ShardingError
from functional_shard.core.layout import local_shape_and_offset
from functional_shard.core.spec import Owned, P

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from functional_shard.costing.cost import OptimizerKind
    from functional_shard.planning.plan import Plan

__all__ = [
    "blocks",
    "draw_blocks",
    "draw_memory",
    "draw_schedule",
    "draw_schedule_figure",
    "draw_stages",
    "visualize",
]

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
_MAX_LABELLED_BLOCKS = 32
_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("bytes", 1))


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ShardingError(
            "plan.visualize() draws with matplotlib, which is not installed: "
            "pip install 'functional-shard[plot]'"
        ) from None
    return matplotlib


def _new_figure(width: float, height: float) -> Figure:
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)  # headless: the Agg canvas renders PNGs without a display
    return figure


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


def _compress(ranks: Sequence[int], limit: int = 6) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``0-3, 8``; long lists end in ``… (n)``."""
    runs: list[tuple[int, int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    if len(parts) > limit:
        return ", ".join(parts[: limit - 1]) + f", … ({len(ranks)} ranks)"
    return ", ".join(parts)


def _estimate_parts(estimate: Any) -> dict[str, int]:
    """The estimate's memory parts that `Plan.cost` does not draw (activations, workspace)."""
    if estimate is None:
        return {}
    memory: Mapping[str, int] | None = getattr(estimate, "memory", None)
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
        estimate: an `fs.estimate` result; its parts beyond the plan's (activations,
            logits, workspace) are stacked on every bar (they are per data-parallel rank).
        optimizer: as for `Plan.cost`.
        ranks: the ranks to draw; by default all, or 32 spread evenly over a big mesh.
        budget: draw a line at this many bytes (the device's memory).

    Raises:
        ShardingError: a rank outside the mesh, or ``estimate`` is not an estimate.
    """
    shown = _ranks_shown(plan.mesh.size, ranks)
    costs = [plan.cost(optimizer, rank=rank) for rank in shown]
    extra = _estimate_parts(estimate)
    largest = max([c.total_bytes for c in costs] + [budget or 0]) + sum(extra.values())
    unit, scale = next((u, s) for u, s in _UNITS if largest >= s or s == 1)
    stacks = {label: [getattr(c, field) / scale for c in costs] for field, label in _COST_PARTS}
    stacks.update(
        {
            name.removesuffix("_bytes").replace("_", " "): [value / scale] * len(shown)
            for name, value in extra.items()
        }
    )
    positions = list(range(len(shown)))
    bottom = [0.0] * len(shown)
    colours = iter(_matplotlib().colormaps["tab10"].colors)
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
    title = "memory per device (predicted)" + (" with activations" if extra else "")
    axes.set_title(f"{title}\n{subtitle}", fontsize=10)
    axes.legend(fontsize=8, loc="upper right", ncols=2)
    axes.grid(axis="y", alpha=0.3)


Block = tuple[int, int, int, int]
"""A block in the picture: (first row, rows, first column, columns)."""


def blocks(
    plan: Plan, path: str, spec: str = "storage"
) -> tuple[dict[Block, list[int]], list[int], list[int]]:
    """Which ranks hold which block of a tensor, as `draw_blocks` draws it.

    Dim 0 gives the rows and dim 1 the columns (a 1-d tensor is one row, a 0-d one one
    cell); of a tensor with more dims, the slice at index 0 of dims 2 and up is shown.

    Args:
        plan: the plan.
        path: the parameter or buffer.
        spec: ``"storage"`` (at rest), ``"compute"``, ``"grad"`` or ``"optim"``.

    Returns:
        ``(blocks, empty, elsewhere)``: each drawn block -> the ranks holding it (replicas
        share a block); the ranks whose shard is empty; the ranks whose shard lies in
        another slice of dims 2 and up.

    Raises:
        ShardingError: no such tensor or spec.

    Examples:
        >>> from functional_shard.frontends.pictures import blocks
        >>> policy = fs.fsdp("dp") + fs.replicate("tp")
        >>> plan = fs.shard(nn.Linear(4, 3, bias=False), fs.Mesh(dp=2, tp=2), policy)
        >>> blocks(plan, "weight")
        ({(0, 2, 0, 4): [0, 1], (2, 1, 0, 4): [2, 3]}, [], [])
    """
    if spec not in ("storage", "compute", "grad", "optim"):
        raise ShardingError(f"spec={spec!r}: one of storage, compute, grad, optim")
    canonical = plan.canonical(path)
    tensor = plan.tensors[canonical]
    chosen = plan.sharding(canonical).normalized(tensor.ndim).specs()[spec]
    found: dict[Block, list[int]] = {}
    empty: list[int] = []
    elsewhere: list[int] = []
    owner = None
    if isinstance(chosen, Owned):  # ZeRO-1: the whole tensor on the owner's ranks
        from functional_shard.costing.cost import zero1_owners

        owner = zero1_owners(plan)[canonical]
    elif not isinstance(chosen, P):  # pragma: no cover - specs are P or Owned
        raise ShardingError(f"{path}: unknown spec {chosen!r}")
    for rank in range(plan.mesh.size):
        if isinstance(chosen, Owned):
            coords = plan.mesh.coords(rank)
            held = coords[chosen.axis] == owner and chosen.holds(coords)
            shape, offset = (tensor.shape, (0,) * tensor.ndim) if held else ((0,) * tensor.ndim, tensor.shape)
        else:
            shape, offset = local_shape_and_offset(tensor.shape, chosen, plan.mesh, rank)
        if tensor.ndim and not math.prod(shape):
            empty.append(rank)
        elif any(offset[d] != 0 for d in range(2, tensor.ndim)):
            elsewhere.append(rank)
        else:
            row, rows = (offset[0], shape[0]) if tensor.ndim >= 1 else (0, 1)
            col, cols = (offset[1], shape[1]) if tensor.ndim >= 2 else (0, 1)
            found.setdefault((row, rows, col, cols), []).append(rank)
    return dict(sorted(found.items())), empty, elsewhere


def draw_blocks(axes: Axes, plan: Plan, path: str, spec: str = "storage") -> None:
    """Draw which ranks hold which block of one tensor, into matplotlib ``axes``.

    Dim 0 runs down, dim 1 across; see `blocks` for tensors of other ranks.

    Args:
        axes: where to draw.
        plan: the plan.
        path: the parameter or buffer.
        spec: ``"storage"`` (at rest), ``"compute"``, ``"grad"`` or ``"optim"``.

    Raises:
        ShardingError: no such tensor or spec.
    """
    found, empty, elsewhere = blocks(plan, path, spec)
    canonical = plan.canonical(path)
    tensor = plan.tensors[canonical]
    rows = tensor.shape[0] if tensor.ndim >= 1 else 1
    cols = tensor.shape[1] if tensor.ndim >= 2 else 1
    colours = _matplotlib().colormaps["tab10" if len(found) <= 10 else "tab20"].colors
    from matplotlib.patches import Rectangle

    # past a few dozen blocks, label an evenly spaced subset and drop the borders
    many = len(found) > _MAX_LABELLED_BLOCKS
    every = math.ceil(len(found) / 16) if many else 1
    for index, ((row, height, col, width), holders) in enumerate(found.items()):
        colour = colours[index % len(colours)]
        axes.add_patch(
            Rectangle(
                (col, row), width, height, facecolor=colour, edgecolor="white", linewidth=0 if many else 1.5
            )
        )
        if index % every == 0:
            text = _compress(holders)
            if len(holders) == 1 and len(found) <= 16 and len(plan.mesh.axis_names) > 1:
                coords = plan.mesh.coords(holders[0]).items()
                text += "\n" + ", ".join(f"{axis}={i}" for axis, i in coords)
            axes.text(
                col + width / 2,
                row + height / 2,
                text if len(text) < 48 else text[:46] + "…",
                ha="center",
                va="center",
                fontsize=9 if len(found) <= 8 else 7,
            )
    axes.set_xlim(0, max(cols, 1))
    axes.set_ylim(max(rows, 1), 0)
    axes.set_xlabel(f"dim 1 ({cols})" if tensor.ndim >= 2 else "")
    axes.set_ylabel(f"dim 0 ({rows})" if tensor.ndim >= 1 else "")
    if tensor.ndim < 2:
        axes.set_xticks([])
    if tensor.ndim < 1:
        axes.set_yticks([])
    axes.tick_params(labelsize=7)
    chosen = plan.sharding(canonical).normalized(tensor.ndim).specs()[spec]
    count = f"{len(found)} block" + ("" if len(found) == 1 else "s")
    lines = [
        f"{canonical}  {'×'.join(map(str, tensor.shape)) or '()'}",
        f"{spec} {chosen!r}: {count}, labelled by the ranks holding them"
        + (f" (every {every}th)" if many else ""),
    ]
    if tensor.ndim > 2:
        lines.append(
            f"the slice at index 0 of dims 2-{tensor.ndim - 1}"
            + (f"; ranks {_compress(elsewhere)} hold other slices" if elsewhere else "")
        )
    if empty:
        lines.append(f"ranks {_compress(empty)} hold none of it")
    axes.set_title("\n".join(lines), fontsize=10)


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

    One row per pp coordinate; each of its stages is a box as wide as the stage's
    parameter bytes (on the stage's first rank), labelled with the stage index and its
    modules.

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
    from functional_shard.planning.stages import rank_stages

    config = plan.config
    axis = config.pipeline_axis
    if axis is None:
        raise ShardingError("draw_stages: the plan has no pipeline; make one with fs.pipeline(...)")
    pp = plan.mesh[axis]
    stage_bytes = plan.cost(optimizer).stage_bytes
    largest = max(
        sum(
            stage_bytes[s]["params"]
            for s in rank_stages(r, pp, config.stages_per_rank, config.pipeline_schedule)
        )
        for r in range(pp)
    )
    unit, scale = next((u, x) for u, x in _UNITS if largest >= x or x == 1)
    colours = _matplotlib().colormaps["tab10" if len(stage_bytes) <= 10 else "tab20"].colors
    for rank in range(pp):
        left = 0.0
        for stage in rank_stages(rank, pp, config.stages_per_rank, config.pipeline_schedule):
            width = stage_bytes[stage]["params"] / scale
            axes.barh(
                rank, width, left=left, color=colours[stage % len(colours)], edgecolor="white", height=0.7
            )
            label = f"stage {stage}\n{_modules_label(config.pipeline_stages[stage])}"
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
        f"pipeline stages over {axis!r} (schedule {config.pipeline_schedule}, "
        f"{config.microbatches} micro-batches)\n{len(config.pipeline_stages)} stages, "
        f"{config.stages_per_rank} per rank",
        fontsize=10,
    )
    axes.grid(axis="x", alpha=0.3)


_KIND_COLOURS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#b279a2"}


def draw_schedule(axes: Axes, timeline: Any) -> None:
    """Draw a pipeline schedule: which rank runs which micro-batch when, into ``axes``.

    One row per pp rank; each action of torch's own list for that rank is a box from its
    start to its end on the clock of `functional_shard.planning.schedules.simulate` (forwards blue,
    full backwards red, input-gradient backwards orange, weight-gradient backwards purple),
    labelled with the micro-batch, and the stage when a rank runs several. The white gaps
    are the bubble.

    Args:
        axes: where to draw.
        timeline: a `functional_shard.planning.schedules.Timeline`.

    Examples:
        >>> from functional_shard.planning.schedules import simulate
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
        >>> from functional_shard.planning.schedules import simulate
        >>> len(draw_schedule_figure(simulate("zbv", 2, 4, 2)).axes)
        1
    """
    figure = _new_figure(max(8.0, min(20.0, timeline.makespan / 3)), 0.6 * timeline.pp + 1.6)
    draw_schedule(figure.subplots(), timeline)
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure


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

    A plan with a pipeline gets a third panel, which pp rank holds which stage
    (`draw_stages`), and below them its schedule on a clock with equal stages
    (`draw_schedule`; forward 1, backward 2).

    Args:
        plan: the plan.
        param: the parameter (or buffer) whose blocks to draw; by default the largest.
        estimate: an `fs.estimate` result, to stack activations on the memory bars.
        optimizer: as for `Plan.cost`.
        spec: which of the parameter's four specs to draw (default: at rest).
        ranks: the ranks to give bars; by default all (32 spread evenly over a big mesh).
        budget: device memory in bytes, drawn as a line over the bars.
        path: if given, the figure is also written there (PNG, SVG, PDF: by the suffix).

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ShardingError: matplotlib is missing (``pip install 'functional-shard[plot]'``),
            an unknown parameter or spec, or a rank outside the mesh.

    Examples:
        >>> plan = fs.shard(nn.Linear(8, 6), fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp([("*", "colwise")]))
        >>> figure = plan.visualize("weight")
        >>> [axes.get_title().splitlines()[0] for axes in figure.axes]
        ['memory per device (predicted)', 'weight  6×8']
    """
    pipeline_axis = plan.config.pipeline_axis
    piped = pipeline_axis is not None
    if not piped:
        figure = _new_figure(13, 5)
        panels = figure.subplots(1, 2, width_ratios=[1, 1.15])
    else:
        # the schedule gets a row of its own, as wide as the three panels above it
        figure = _new_figure(19, 8.5)
        grid = figure.add_gridspec(2, 3, width_ratios=[1, 1.15, 1.15], height_ratios=[5, 3.5])
        panels = [figure.add_subplot(grid[0, column]) for column in range(3)]
        panels.append(figure.add_subplot(grid[1, :]))
    draw_memory(panels[0], plan, estimate=estimate, optimizer=optimizer, ranks=ranks, budget=budget)
    draw_blocks(panels[1], plan, param if param is not None else _largest(plan), spec)
    if pipeline_axis is not None:
        from functional_shard.planning.schedules import simulate

        config = plan.config
        draw_stages(panels[2], plan, optimizer)
        draw_schedule(
            panels[3],
            simulate(
                config.pipeline_schedule,
                plan.mesh[pipeline_axis],
                config.microbatches,
                config.stages_per_rank,
            ),
        )
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure
