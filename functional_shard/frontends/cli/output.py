"""What the commands print and write: plain text, or rich tables on a terminal; files written."""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from functional_shard.core.errors import one_line

from .inputs import InputError

if TYPE_CHECKING:
    from functional_shard.costing.cost.cost_model import Cost

__all__ = ["Out", "cost_rows", "write_file"]


class Out:
    """Plain text, or rich tables when stdout is a terminal and rich is installed.

    Examples:
        >>> import sys
        >>> Out(sys.stdout).table("memory", ("part", "bytes"), [("params", "1.00 KiB")], right=1)
        memory
        part       bytes
        params  1.00 KiB
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.console: Any = None
        if stream.isatty() and importlib.util.find_spec("rich") is not None:
            from rich.console import Console

            self.console = Console(file=stream, highlight=False)

    def text(self, text: str = "") -> None:
        """One line (or several), wrapped as ``print`` wraps them."""
        if self.console is not None:
            self.console.print(text, markup=False, soft_wrap=True)  # wrap as print does
        else:
            print(text, file=self.stream)

    def table(
        self,
        title: str,
        header: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        right: int = 0,
        numbers: Sequence[int] = (),
    ) -> None:
        """A table; the last ``right`` columns, and the columns at ``numbers``, are aligned right."""
        aligned = {*range(len(header) - right, len(header)), *numbers}
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        # rich crops columns that do not fit; a table wider than the terminal prints as text
        if self.console is not None and sum(widths) + 2 * len(widths) <= self.console.width:
            from rich import box
            from rich.table import Table

            table = Table(
                title=title or None,
                title_justify="left",
                header_style="bold",
                box=box.SIMPLE_HEAD,
                padding=(0, 1),
                pad_edge=False,
                show_edge=False,
            )
            for i, name in enumerate(header):
                table.add_column(name, justify="right" if i in aligned else "left", no_wrap=True)
            for row in rows:
                table.add_row(*row)
            self.console.print(table)
            return

        def line(cells: Sequence[str]) -> str:
            return "  ".join(
                f"{c:>{w}}" if i in aligned else f"{c:<{w}}"
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        print("\n".join([title, line(header), *(line(r) for r in rows)]), file=self.stream)


def cost_rows(cost: Cost) -> list[tuple[str, int]]:
    """The memory rows of a plan's cost on one rank, as the plan and diff tables show them.

    Examples:
        >>> import functional_shard as fs
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(dp=2), fs.fsdp("dp"))
        >>> [part for part, _ in cost_rows(plan.cost())]  # doctest: +NORMALIZE_WHITESPACE
        ['params', 'grads', 'optimizer', 'buffers', 'gathered', 'total on device',
         'host (offloaded)']
    """
    return [
        ("params", cost.params_bytes),
        ("grads", cost.grads_bytes),
        ("optimizer", cost.optimizer_bytes),
        ("buffers", cost.buffers_bytes),
        ("gathered", cost.gathered_bytes),
        ("total on device", cost.total_bytes),
        ("host (offloaded)", cost.host_bytes),
    ]


def write_file(path: str, write: Callable[[pathlib.Path], object], what: str) -> None:
    """Run ``write`` on ``path``; a failure is one line naming the flag ``what`` and the path.

    Raises:
        ShardingError: the file cannot be written.

    Examples:
        >>> write_file("/no/such/folder/plan.json", lambda p: p.write_text("{}"), "--json")
        Traceback (most recent call last):
        ...
        functional_shard.frontends.cli.inputs.InputError: --json '/no/such/folder/plan.json': ...
    """
    try:
        write(pathlib.Path(path))
    except OSError as error:
        raise InputError(f"{what} {path!r}: cannot write ({one_line(error, 300)})") from None
