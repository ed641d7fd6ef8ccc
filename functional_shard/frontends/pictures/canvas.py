"""The pictures' canvas: matplotlib loaded on demand, headless figures, byte units for axes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from functional_shard.core.errors import ShardingError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["byte_unit", "matplotlib_module", "new_figure"]

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("bytes", 1))


def matplotlib_module() -> Any:
    """The ``matplotlib`` module.

    Raises:
        ShardingError: matplotlib is not installed (the message says how to install it).

    Examples:
        >>> matplotlib_module().__name__
        'matplotlib'
    """
    try:
        import matplotlib
    except ImportError:
        raise ShardingError(
            "plan.visualize() draws with matplotlib, which is not installed: "
            "pip install 'functional-shard[plot]'"
        ) from None
    return matplotlib


def new_figure(width: float, height: float) -> Figure:
    """A figure of ``width`` × ``height`` inches on matplotlib's Agg canvas (no display, no pyplot).

    Examples:
        >>> new_figure(4, 3).get_size_inches().tolist()
        [4.0, 3.0]
    """
    matplotlib_module()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)  # headless: the Agg canvas renders PNGs without a display
    return figure


def byte_unit(largest: float) -> tuple[str, int]:
    """The unit (name, bytes) to draw sizes up to ``largest`` bytes in.

    Examples:
        >>> byte_unit(3 * 2**30), byte_unit(100)
        (('GiB', 1073741824), ('bytes', 1))
    """
    return next((unit, scale) for unit, scale in _UNITS if largest >= scale or scale == 1)
