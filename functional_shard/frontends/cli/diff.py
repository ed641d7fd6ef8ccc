"""``functional-shard diff``: what changes between two plans written by ``plan --json``.

Per tensor, its specs before and after (repeated layers folded); per device, memory and
bytes sent per step, before, after and the change.
"""

from __future__ import annotations

import argparse
import pathlib
import re
from typing import TYPE_CHECKING

from functional_shard.core.errors import one_line
from functional_shard.core.units import format_bytes as _bytes

from .inputs import InputError
from .output import Out, cost_rows

if TYPE_CHECKING:
    from functional_shard.costing.cost.cost_model import Cost
    from functional_shard.planning.plan.plan import Change, Plan

__all__ = ["run"]


def _read_plan(path: str) -> Plan:
    from functional_shard.planning.plan.plan import Plan

    if not path.strip():  # pathlib reads '' as '.', the folder here
        raise InputError(f"{path!r}: an empty file name; give the file plan --json wrote")
    try:
        text = pathlib.Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:  # a picture or a checkpoint is not text
        raise InputError(f"{path!r}: cannot read ({one_line(error, 300)})") from None
    try:
        return Plan.from_json(text)
    except (ValueError, KeyError, TypeError) as error:
        raise InputError(f"{path!r}: not a plan written by --json ({one_line(error, 300)})") from None


def _check_same_model(before: Plan, after: Plan, names: tuple[str, str]) -> None:
    """Refuse plans of two models: their tensors differ in paths or shapes.

    Placements of different tensors are not changes of one model's plan; the list of them
    would read as one, so the first few tensors that differ are named instead.
    """

    def shape(plan: Plan, path: str) -> str:
        tensor = plan.tensors.get(path)
        return "absent" if tensor is None else "×".join(map(str, tensor.shape)) or "()"

    differing = [
        f"{path} ({shape(before, path)} -> {shape(after, path)})"
        for path in dict.fromkeys([*before.tensors, *after.tensors])
        if shape(before, path) != shape(after, path)
    ]
    if differing:
        more = f" and {len(differing) - 3} more" if len(differing) > 3 else ""
        raise InputError(
            f"{names[0]!r} and {names[1]!r} plan different models: their tensors differ, "
            f"{', '.join(differing[:3])}{more}; diff compares two plans of the same model"
        )


def _shown(value: object) -> str:
    if isinstance(value, tuple) and len(value) > 4:
        return f"({len(value)} entries)"
    return str(value)


def _collapse(changes: list[Change]) -> list[tuple[str, str, str, str]]:
    """Rows of (tensor, what, before, after), repeated layers folded, alike changes joined.

    ``layers.0`` and ``layers.1`` become ``layers.* ×2`` where they change alike: a row counts the
    tensors whose change it is. The specs of a tensor that change the same way share a row
    (``storage, grad, optim``).
    """
    whats: dict[tuple[str, str, str], list[str]] = {}  # a tensor's changes alike, joined
    for change in changes:
        before, after = change.before, change.after
        if change.what == "bytes/device":
            before, after = _bytes(before), _bytes(after)
        joined = whats.setdefault((change.path, _shown(before), _shown(after)), [])
        if change.what not in joined:
            joined.append(change.what)
    tensors: dict[tuple[str, str, str, str], int] = {}  # the tensors whose row it is, layers folded
    for (path, before, after), joined in whats.items():
        key = (re.sub(r"(?<=\.)\d+(?=\.)", "*", path), ", ".join(joined), before, after)
        tensors[key] = tensors.get(key, 0) + 1
    rows = []
    for (path, what, before, after), count in tensors.items():
        rows.append((path + (f" ×{count}" if count > 1 else ""), what, before, after))
    return rows


def run(args: argparse.Namespace, out: Out) -> int:
    """Print what changes from the plan in ``args.before`` to the one in ``args.after``.

    Args:
        args: the parsed command line of ``functional-shard diff``.
        out: where the tables go.

    Returns:
        0.

    Raises:
        ShardingError: a file that cannot be read or holds no plan, or plans of two
            models (tensors with other paths or shapes).

    Examples:
        >>> import pathlib, tempfile
        >>> import functional_shard as fs
        >>> from functional_shard.frontends.cli import main
        >>> from functional_shard.zoo import llama
        >>> scratch = tempfile.TemporaryDirectory()
        >>> a, b = (pathlib.Path(scratch.name, name) for name in ("a.json", "b.json"))
        >>> _ = a.write_text(fs.shard(llama("tiny"), fs.Mesh(dp=2), fs.zero(2, "dp")).to_json())
        >>> _ = b.write_text(fs.shard(llama("tiny"), fs.Mesh(dp=2), fs.fsdp("dp")).to_json())
        >>> main(["diff", str(a), str(b)])  # doctest: +ELLIPSIS
        2 changes from .../a.json to .../b.json
        tensor  what                   before  after
        <plan>  data_parallel          zero2   fsdp
        ...
        0
        >>> scratch.cleanup()
    """
    before, after = _read_plan(args.before), _read_plan(args.after)
    _check_same_model(before, after, (args.before, args.after))
    changes = before.diff(after)
    rows = _collapse(changes)
    if rows:
        out.table(
            f"{len(changes)} changes from {args.before} to {args.after}",
            ("tensor", "what", "before", "after"),
            rows,
        )
    else:
        out.text(f"the plans in {args.before} and {args.after} place every tensor alike")
    out.text()
    costs = [plan.cost(args.optimizer) for plan in (before, after)]
    memory = [
        (name, _bytes(a), _bytes(b), _bytes(b - a))
        for (name, a), (_, b) in zip(*(cost_rows(c) for c in costs), strict=True)
    ]
    sent = [
        (f"sent: {kind} over {axis}", _bytes(a), _bytes(b), _bytes(b - a))
        for kind, axis, a, b in _comm_pairs(*costs)
    ]
    sent.append(
        (
            "sent per step",
            _bytes(costs[0].comm_total_bytes),
            _bytes(costs[1].comm_total_bytes),
            _bytes(costs[1].comm_total_bytes - costs[0].comm_total_bytes),
        )
    )
    out.table(
        f"per device (worst rank; {args.optimizer})",
        ("", "before", "after", "change"),
        memory + sent,
        right=3,
    )
    return 0


def _comm_pairs(a: Cost, b: Cost) -> list[tuple[str, str, float, float]]:
    keys = dict.fromkeys(
        (kind, axis) for cost in (a, b) for kind, by_axis in cost.comm_bytes.items() for axis in by_axis
    )
    return [
        (kind, axis, a.comm_bytes.get(kind, {}).get(axis, 0.0), b.comm_bytes.get(kind, {}).get(axis, 0.0))
        for kind, axis in keys
    ]
