"""One tensor's blocks over the ranks: which ranks hold which block, drawn as a grid."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from functional_shard.core.errors import ShardingError
from functional_shard.core.spec import Owned, P

from .canvas import matplotlib_module

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from functional_shard.planning.plan.plan import Plan

__all__ = ["Block", "blocks", "draw_blocks"]

_MAX_LABELLED_BLOCKS = 32


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
        >>> from functional_shard.frontends.pictures.visualize import blocks
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
        from functional_shard.costing.cost.census import zero1_owners

        owner = zero1_owners(plan)[canonical]
    elif not isinstance(chosen, P):  # pragma: no cover - specs are P or Owned
        raise ShardingError(f"{path}: unknown spec {chosen!r}")
    for rank in range(plan.mesh.size):
        if isinstance(chosen, Owned):
            coords = plan.mesh.coords(rank)
            held = coords[chosen.axis] == owner and chosen.holds(coords)
            shape, offset = (tensor.shape, (0,) * tensor.ndim) if held else ((0,) * tensor.ndim, tensor.shape)
        else:
            shape, offset = plan.local_shape_and_offset(canonical, rank, spec)
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
    colours = matplotlib_module().colormaps["tab10" if len(found) <= 10 else "tab20"].colors
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
            "the slice at index 0 of "
            + ("dim 2" if tensor.ndim == 3 else f"dims 2-{tensor.ndim - 1}")
            + (f"; ranks {_compress(elsewhere)} hold other slices" if elsewhere else "")
        )
    if empty:
        lines.append(f"ranks {_compress(empty)} hold none of it")
    axes.set_title("\n".join(lines), fontsize=10)
