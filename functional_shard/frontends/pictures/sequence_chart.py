"""Context parallel in a picture: which cp rank holds which chunks of a sequence."""

from __future__ import annotations

from typing import TYPE_CHECKING

from functional_shard.core.errors import ShardingError
from functional_shard.core.sequence import chunk_count, sequence_chunks

from .canvas import matplotlib_module

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from functional_shard.planning.plan.plan import Plan

__all__ = ["draw_sequence"]


def draw_sequence(axes: Axes, plan: Plan) -> None:
    """Draw the sequence cut into chunks over the cp axis, into matplotlib ``axes``.

    The top row is one sequence, its chunks coloured by the cp rank that holds them; below,
    each rank's chunks and its share of the causal attention work.

    Raises:
        ShardingError: the plan has no cp axis.

    Examples:
        >>> from functional_shard.frontends.pictures.canvas import new_figure
        >>> axes = new_figure(4, 2).subplots()
        >>> draw_sequence(axes, fs.shard(nn.Linear(8, 8), fs.Mesh(cp=2), fs.replicate() + fs.cp("cp")))
        >>> axes.get_title().splitlines()[0]
        "sequence over 'cp': 4 chunks, load-balanced"
    """
    context = plan.config.context
    if context is None:
        raise ShardingError("draw_sequence: the plan has no cp axis; add fs.cp(...)")
    axis, balance, cp = context.axis, context.load_balance, context.size(plan.mesh)
    chunks = chunk_count(cp, load_balance=balance)
    held = sequence_chunks(cp, load_balance=balance)
    colors = matplotlib_module().colormaps["tab10"]
    owner = {chunk: rank for rank, mine in enumerate(held) for chunk in mine}
    # a query in chunk c attends to the keys of chunks 0..c: c + 1/2 chunks of work, in chunks²
    work = [sum(chunk + 0.5 for chunk in mine) for mine in held]
    total = sum(work)
    for chunk in range(chunks):
        rank = owner[chunk]
        axes.barh(cp, 1, left=chunk, color=colors(rank % 10), edgecolor="white")
        axes.text(chunk + 0.5, cp, str(chunk), ha="center", va="center", fontsize=8)
    for rank, mine in enumerate(held):
        row = cp - 1 - rank
        for chunk in mine:
            axes.barh(row, 1, left=chunk, color=colors(rank % 10), edgecolor="white")
        axes.text(chunks + 0.2, row, f"{work[rank] / total:.0%} of attention", va="center", fontsize=8)
    axes.set_yticks([cp, *range(cp)], ["sequence", *(f"{axis} {rank}" for rank in reversed(range(cp)))])
    axes.set_xlim(0, chunks * 1.45)
    axes.set_xticks([0, chunks], ["token 0", "last"])
    balanced = balance and cp > 1
    title = f"sequence over {axis!r}: {chunks} chunks, {'load-balanced' if balanced else 'in order'}"
    rule = "rank i holds chunks i and 2·cp−1−i" if balanced else "rank i holds chunk i"
    axes.set_title(f"{title}\n{rule}", fontsize=10)
