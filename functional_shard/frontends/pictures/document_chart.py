"""Packed documents under context parallel in a picture: which cp rank holds which documents' tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from functional_shard.core.sequence import document_ranges, document_work

from .canvas import matplotlib_module, new_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["draw_document_cut"]


def draw_document_cut(lengths: Sequence[int], cp: int) -> Figure:
    """A packed row of documents of ``lengths`` tokens cut over ``cp`` ranks, by tokens and by work.

    Above, the row twice, each token coloured by the rank that holds it: cut into ``cp`` equal
    runs of tokens, and cut by attention work as `functional_shard.core.sequence.document_ranges`
    cuts it (what `fs.forward_backward` does under cp); the documents' boundaries drawn in black.
    Below, each rank's attention work (`document_work`) under either cut.

    Raises:
        ShardingError: ``cp`` does not divide the row's length, or a length is not a positive int.

    Examples:
        >>> figure = draw_document_cut([40, 4, 4, 8], cp=2)
        >>> [axes.get_title().split(":")[0] for axes in figure.axes]
        ['a packed row of 4 documents over cp=2', 'attention work of each rank']
    """
    seq = sum(lengths)
    by_work = document_ranges(lengths, cp)
    share = seq // cp
    by_tokens = tuple(((rank * share, (rank + 1) * share),) for rank in range(cp))
    figure = new_figure(9, 4.4)
    row_axes, work_axes = figure.subplots(2, 1, height_ratios=(1.3, 1))
    cuts = (("by tokens", by_tokens), ("by attention work", by_work))
    for height, (_, held) in enumerate(reversed(cuts)):
        _draw_row(row_axes, height, held, lengths)
    row_axes.set_yticks(range(len(cuts)), [name for name, _ in reversed(cuts)])
    row_axes.set_xlim(0, seq)
    row_axes.set_xlabel("token of the row")
    row_axes.set_title(
        f"a packed row of {len(lengths)} documents over cp={cp}: each token coloured by its rank",
        fontsize=10,
    )
    _draw_work(work_axes, cuts, lengths)
    return figure


def _draw_row(
    axes: Axes, height: int, held: Sequence[Sequence[tuple[int, int]]], lengths: Sequence[int]
) -> None:
    colors = matplotlib_module().colormaps["tab10"]
    for rank, ranges in enumerate(held):
        for start, stop in ranges:
            axes.barh(height, stop - start, left=start, height=0.6, color=colors(rank % 10))
    boundary = 0
    for length in lengths[:-1]:
        boundary += length
        axes.plot([boundary, boundary], [height - 0.3, height + 0.3], color="black", linewidth=1)


def _draw_work(
    axes: Axes, cuts: Sequence[tuple[str, Sequence[Sequence[tuple[int, int]]]]], lengths: Sequence[int]
) -> None:
    colors = matplotlib_module().colormaps["tab10"]
    cp = len(cuts[0][1])
    width = 0.8 / len(cuts)
    for index, (name, held) in enumerate(cuts):
        work = [document_work(lengths, ranges) for ranges in held]
        spread = max(work) / max(1, min(work))
        for rank, pairs in enumerate(work):
            axes.bar(
                rank + (index - (len(cuts) - 1) / 2) * width,
                pairs,
                width=width,
                color=colors(rank % 10),
                alpha=0.45 if index == 0 else 1.0,
                edgecolor="black",
                label=f"{name}: busiest / idlest {spread:.2f}" if rank == 0 else None,
            )
    axes.set_xticks(range(cp), [f"cp rank {rank}" for rank in range(cp)])
    axes.set_ylabel("query-key pairs")
    axes.set_title("attention work of each rank: faint by tokens, solid by attention work", fontsize=10)
    axes.legend(fontsize=8)
