"""``functional-shard plan``: a model planned on the meta device, every tensor's placement and the cost.

With ``--batch``/``--seq`` the step is estimated too (`functional_shard.costing.estimate.estimate`);
with ``--auto`` the plan is searched for (`functional_shard.frontends.cli.plan_auto`).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from typing import TYPE_CHECKING

from functional_shard.core.errors import ShardingError, one_line
from functional_shard.core.units import format_bytes as _bytes

from . import plan_auto
from .inputs import (
    InputError,
    load_model,
    parse_mesh,
    read_budget,
    read_documents,
    read_hardware,
    read_kernels,
    read_policy,
)
from .output import Out, cost_rows, write_file

if TYPE_CHECKING:
    from torch import nn

    from functional_shard.costing.cost.cost_model import Cost
    from functional_shard.costing.estimate.estimate import Estimate
    from functional_shard.costing.time.hardware import Hardware
    from functional_shard.planning.plan.plan import Plan

__all__ = ["DEFAULT_POLICY", "run"]

DEFAULT_POLICY = "fsdp(dp) + tp(auto, tp) + bf16"


def _check(args: argparse.Namespace) -> None:
    """The flags that go together, before anything is read or built."""
    for flag in ("model", "hardware", "kernels", "documents", "json", "png", "param"):
        value = getattr(args, flag)
        if value is not None and not value.strip():  # a mistake, not a request for the default
            raise InputError(f"--{flag} {value!r}: empty; give a value, or leave the flag out")
    if args.auto and (args.mesh is not None or args.policy is not None):
        raise InputError("--auto searches meshes and policies itself: leave out --mesh and --policy")
    if not args.auto and (args.devices is not None or args.budget is not None):
        raise InputError("--devices and --budget go with --auto")
    if not args.auto and args.top is not None:
        raise InputError("--top goes with --auto (the candidates of the search to list)")
    if args.param and not args.png:
        raise InputError("--param goes with --png (the parameter to draw)")
    if args.batch is not None and args.seq is None:
        raise InputError("--batch needs --seq (sequences per data-parallel rank, tokens each)")
    if args.hardware and args.seq is None:
        raise InputError("--hardware needs --seq (a step's time depends on its tokens)")
    if args.kernels and args.seq is None:
        raise InputError("--kernels needs --seq (they change a step's time)")
    if args.documents and args.seq is None:
        raise InputError("--documents needs --seq (the tokens of a row the documents fill)")
    if args.documents and args.auto:
        raise InputError("--documents goes without --auto: the search counts whole sequences")
    for flag in ("batch", "seq", "devices", "top"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise InputError(f"--{flag} {value}: a positive number")
    if args.auto and (args.devices is None or args.budget is None or args.seq is None):
        raise InputError(
            "--auto needs --devices, --budget and --seq (and --batch, or one sequence per device)"
        )
    for flag, path in (("--json", args.json), ("--png", args.png)):
        if path is not None and path != "-":
            _check_file_to_write(path, flag)
    if args.png:
        _check_picture_suffix(args.png)


def _check_file_to_write(path: str, flag: str) -> None:
    """A file the command will write, refused before the plan is made (a search may take minutes)."""
    target = pathlib.Path(path)
    if target.is_dir():
        raise InputError(f"{flag} {path!r}: a folder; name a file to write")
    if not target.parent.is_dir():
        raise InputError(f"{flag} {path!r}: there is no folder {str(target.parent)!r} to write it in")


def _check_picture_suffix(path: str) -> None:
    """A file name matplotlib can write, refused before the plan is drawn (or even made)."""
    from functional_shard.frontends.pictures.canvas import matplotlib_module

    try:
        matplotlib_module()
    except ShardingError as error:  # not after a search that may take minutes
        raise InputError(f"--png {path!r}: {one_line(error, 300)}") from None
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = pathlib.PurePath(path).suffix[1:].lower()
    if suffix not in formats:
        # no suffix: matplotlib would append .png, writing a file other than the one named
        found = f"the extension .{suffix} is not a picture format" if suffix else "the name has no extension"
        raise InputError(f"--png {path!r}: {found}; end it with one of {', '.join('.' + f for f in formats)}")


def run(args: argparse.Namespace, out: Out) -> int:
    """Plan (or, with ``--auto``, search) as ``args`` ask; print the plan, its cost and estimate.

    Args:
        args: the parsed command line of ``functional-shard plan``.
        out: where the tables go (stderr takes them when ``--json -`` prints the plan).

    Returns:
        0.

    Raises:
        ShardingError: a bad input, a plan that does not fit the model, or a file not written.

    Examples:
        >>> from functional_shard.frontends.cli import main
        >>> argv = ["--model", "tiny", "--mesh", "dp=2", "--policy", "zero(2, dp)"]
        >>> main(["plan", *argv])  # doctest: +ELLIPSIS
        Plan on Mesh(dp=2): data parallel zero2 over ('dp',); tensor parallel over ()
        ...
        0
    """
    from functional_shard.planning.planner import shard

    _check(args)
    batch_given = args.batch is not None
    if args.seq is not None and args.batch is None:
        # one sequence per data-parallel rank: with --auto, a global batch of one per device
        args.batch = args.devices if args.auto else 1
    to_stdout = args.json == "-"
    say = Out(sys.stderr) if to_stdout else out  # keep stdout pure JSON
    # the cheap inputs first: a typo is reported before a big model is built
    hardware: Hardware | None
    estimate: Estimate | None = None
    if args.auto:
        budget = read_budget(args.budget)
        hardware = read_hardware(args.hardware or "h100")
        model = load_model(args.model)
        plan, estimate = plan_auto.search(model, args, budget=budget, hardware=hardware, say=say)
    else:
        # only a flag left out takes the default: an empty value is refused, not replaced
        mesh = parse_mesh("dp=8,tp=4" if args.mesh is None else args.mesh)
        if not mesh.is_resolved:
            raise InputError(
                f"--mesh {args.mesh!r}: size -1 takes the devices left over, but a plan has no device "
                "count to take them from; give every axis its size"
            )
        hardware = read_hardware(args.hardware or "h100") if args.batch is not None else None
        model = load_model(args.model)
        policy = read_policy(DEFAULT_POLICY if args.policy is None else args.policy, model)
        plan = shard(model, mesh, policy)
    if args.param is not None:  # before the tables: the picture is drawn last
        try:
            plan.canonical(args.param)
        except ShardingError as error:
            raise InputError(f"--param {args.param!r}: {one_line(error, 300)}") from None
    if args.batch is not None and estimate is None:
        estimate = _estimate(model, plan, args, batch_given=batch_given, hardware=hardware)
    if to_stdout:
        print(plan.to_json(indent=1))
    else:
        _plan_tables(say, plan, args.full)
        say.text()
        # tokens of one micro-batch on one data-parallel rank, as the estimate counted them
        tokens = estimate.batch * estimate.seq if estimate is not None else None
        _cost_tables(say, plan.cost(args.optimizer, tokens=tokens))
        if estimate is not None:
            say.text()
            say.text(str(estimate))
    if args.json and not to_stdout:
        write_file(args.json, lambda p: p.write_text(plan.to_json(indent=1) + "\n"), "--json")
        say.text(f"\nwrote the plan to {args.json}")
    if args.png:
        budget_line = hardware.memory_bytes if estimate is not None and hardware is not None else None
        _draw(say, plan, args, estimate=estimate, budget_line=budget_line)
    return 0


def _estimate(
    model: nn.Module,
    plan: Plan,
    args: argparse.Namespace,
    *,
    batch_given: bool,
    hardware: Hardware | None,
) -> Estimate:
    from functional_shard.costing.estimate.estimate import estimate

    # with --auto, --batch is the global batch; fs.estimate takes one data-parallel rank's
    per_rank = args.batch // plan.data_parallel_rank(0)[1] if args.auto else args.batch
    if plan.config.pipeline is not None and not batch_given:
        per_rank = plan.config.pipeline.microbatches  # a pipeline's default: one sequence per micro-batch
    kernels = read_kernels(args.kernels) if args.kernels else None
    documents = read_documents(args.documents) if args.documents else None
    if documents is not None:
        from functional_shard.costing.time.documents import row_documents

        # checked apart, so that --documents is named for its own faults and no others of the plan's
        try:
            row_documents(documents, args.seq, cp=plan.config.cp_size(plan.mesh), who="estimate")
        except ShardingError as error:
            raise InputError(f"--documents {args.documents!r}: {one_line(error, 300)}") from None
    return estimate(
        model,
        plan,
        batch=max(per_rank, 1),
        seq=args.seq,
        optimizer=args.optimizer,
        hardware=hardware,
        kernels=kernels,
        documents=documents,
    )


def _draw(
    say: Out, plan: Plan, args: argparse.Namespace, *, estimate: Estimate | None, budget_line: int | None
) -> None:
    try:
        figure = plan.visualize(args.param, estimate=estimate, optimizer=args.optimizer, budget=budget_line)
    except ShardingError as error:
        raise InputError(f"--png: {one_line(error, 300)}") from None
    write_file(args.png, lambda p: figure.savefig(p, dpi=110), "--png")
    say.text(f"wrote the pictures to {args.png}")


def _plan_tables(out: Out, plan: Plan, full: bool) -> None:
    text = plan.explain(collapse=not full)
    if out.console is None:
        out.text(text)
        return
    # rich draws the table of plan.explain(): summary lines, a blank line, the columns
    # (left-aligned at the header's positions), a blank line, the total
    lines = text.splitlines()
    try:
        blank = lines.index("")
        header = lines[blank + 1]
        columns = re.split(r"\s{2,}", header.strip())
        starts = [header.index(column) for column in columns]
        rows = [
            [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
            for line in lines[blank + 2 : -2]
        ]
    except (ValueError, IndexError):  # a layout this reader does not know: print it as it is
        out.text(text)
        return
    for line in lines[: blank + 1]:
        out.text(line)
    out.table("", columns, rows, right=1)
    out.text()
    out.text(lines[-1])


def _cost_tables(out: Out, cost: Cost) -> None:
    out.table(
        f"memory on rank {cost.rank}",
        ("part", "bytes"),
        [(k, _bytes(v)) for k, v in cost_rows(cost)],
        right=1,
    )
    if cost.stage_bytes:
        out.text()
        out.table(
            "pipeline stages (each on its first rank)",
            ("stage", "params", "grads", "optimizer", "gathered"),
            [
                (
                    str(stage),
                    *(_bytes(by_kind[k]) for k in ("params", "grads", "optimizer", "gathered")),
                )
                for stage, by_kind in cost.stage_bytes.items()
            ],
            right=1,
        )
    if cost.boundary_bytes:
        out.text()
        out.table(
            "pipeline boundaries (activations forward, as many gradient bytes back)",
            ("boundary", "bytes each way"),
            [(f"{s} -> {s + 1}", _bytes(b)) for s, b in cost.boundary_bytes.items()],
            right=1,
        )
    rows = [
        (kind, axis, _bytes(b)) for kind, by_axis in cost.comm_bytes.items() for axis, b in by_axis.items()
    ]
    rows.append(("total", "", _bytes(cost.comm_total_bytes)))
    out.text()
    out.table("sent per step", ("collective", "over", "bytes"), rows, right=1)
    if not cost.activation_comm_included:
        out.text("(parameters and gradients; give --seq, and --batch, for activations)")
