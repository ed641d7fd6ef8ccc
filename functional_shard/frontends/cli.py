"""``functional-shard``: plan a model from the shell, compare plans, run the demo, convert checkpoints.

Examples:
    functional-shard plan --model llama-70b --mesh dp=16,tp=8 --policy "fsdp(dp) + tp(llama, tp) + bf16"
    functional-shard plan --model path/to/config.json --mesh dp=8 --policy "zero(2, dp)" --json plan.json
    functional-shard plan --model llama-70b --auto --devices 64 --budget 80GiB --seq 8192
    functional-shard diff a.json b.json
    functional-shard demo --mesh dp=2,tp=2 --policy "fsdp(dp) + tp(llama, tp)"
    functional-shard checkpoint convert ckpt/ ckpt.pt

Every mistake in the input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import pathlib
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from functional_shard.core.errors import ShardingError, one_line
from functional_shard.core.units import format_bytes as _bytes

if TYPE_CHECKING:
    from torch import nn

    from functional_shard.core.mesh import Mesh
    from functional_shard.costing.cost import Cost
    from functional_shard.planning.plan import Change, Plan

__all__ = ["load_model", "main", "parse_mesh"]

_DEFAULT_POLICY = "fsdp(dp) + tp(auto, tp) + bf16"


class _InputError(ShardingError):
    """A bad command-line value: printed as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (and exit code 2) like every other input error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _summary(error: ShardingError) -> str:
    """One line for any error: a plan's bullets become the first problem and how many more.

    Problems often repeat per tensor (an axis missing from the mesh shows on every tensor it
    would split), so the first one names the fix; the count says whether others remain.
    """
    header, *rest = str(error).splitlines() or [""]
    problems = [line[2:] for line in rest if line.startswith("* ")]
    fixes = [line for line in rest if line.strip() and not line.startswith("* ")]
    if not problems:
        return one_line(error, limit=1000)
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return " ".join([f"{header} {problems[0]}{more}.", *fixes])


# ---- inputs ------------------------------------------------------------------------------
def parse_mesh(text: str) -> Mesh:
    """``dp=8,tp=4`` -> ``Mesh(dp=8, tp=4)``.

    Raises:
        ShardingError: not ``axis=size`` pairs, or a mesh `Mesh` refuses.

    Examples:
        >>> from functional_shard.frontends.cli import parse_mesh
        >>> parse_mesh("dp=8,tp=4")
        Mesh(dp=8, tp=4)
    """
    from functional_shard.core.mesh import Mesh

    pairs = [item.strip().partition("=") for item in text.split(",")]
    if not text.strip() or any(
        not name or not sep or not re.fullmatch(r"-?\d+", size) for name, sep, size in pairs
    ):
        raise _InputError(f"--mesh {text!r}: write axis=size pairs joined by commas, e.g. dp=8,tp=4")
    try:
        return Mesh({name.strip(): int(size) for name, _, size in pairs})
    except ShardingError as error:
        raise _InputError(f"--mesh {text!r}: {one_line(error, 300)}") from None


def _zoo_names() -> list[str]:
    from .zoo import CONFIGS

    return sorted(CONFIGS)


def _from_hf_config(path: pathlib.Path) -> nn.Module:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise _InputError(f"--model {str(path)!r}: the folder holds no config.json")
    try:
        import torch
        import transformers
    except ImportError:
        raise _InputError(
            f"--model {str(path)!r}: reading a Hugging Face config needs transformers: "
            "pip install 'functional-shard[hf]'"
        ) from None
    try:
        values = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise _InputError(f"--model {str(file)!r}: not readable JSON ({one_line(error, 300)})") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise _InputError(f"--model {str(file)!r}: not a Hugging Face config (no 'model_type')")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # config warnings are not about the plan
    try:
        config = transformers.AutoConfig.for_model(**values)
        with torch.device("meta"):  # shapes only: no weights are read or allocated
            return transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise _InputError(
            f"--model {str(file)!r}: transformers cannot build a causal LM from it ({one_line(error, 200)})"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def _from_factory(text: str) -> nn.Module:
    import torch
    from torch import nn

    module_name, _, attribute = text.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise _InputError(
            f"--model {text!r}: cannot import {module_name!r} ({one_line(error, 300)})"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise _InputError(f"--model {text!r}: {module_name} has no function or class {attribute!r}")
    try:
        with torch.device("meta"):  # shapes only, however big the model
            model = factory()
    except Exception as error:  # the user's code: report it in one line, like any bad input
        raise _InputError(
            f"--model {text!r}: {attribute}() raised {type(error).__name__}: {one_line(error, 300)} "
            "(the factory is called with no arguments, on the meta device)"
        ) from None
    if not isinstance(model, nn.Module):
        raise _InputError(
            f"--model {text!r}: {attribute}() returned {type(model).__name__}, not an nn.Module"
        )
    return model


def load_model(text: str) -> nn.Module:
    """The model ``--model`` names, built on the meta device (shapes only, no weights).

    Args:
        text: a zoo name (``tiny``, ``llama-7b``, ...), a Hugging Face ``config.json`` or a
            folder holding one (built with transformers' ``AutoModelForCausalLM.from_config``),
            or ``package.module:factory`` (a function or class called with no arguments).

    Raises:
        ShardingError: none of these, naming what was tried.

    Examples:
        >>> from functional_shard.frontends.cli import load_model
        >>> load_model("tiny").embed_tokens.weight.device
        device(type='meta')
    """
    if text in _zoo_names():
        from .zoo import llama

        return llama(text)
    path = pathlib.Path(text)
    if path.exists():
        return _from_hf_config(path)
    if re.fullmatch(r"[\w.]+:\w+", text):
        return _from_factory(text)
    if text.endswith(".json") or "/" in text:
        raise _InputError(f"--model {text!r}: no such file or folder")
    raise _InputError(
        f"--model {text!r}: not a zoo model ({', '.join(_zoo_names())}), a config.json or a folder "
        "holding one, or package.module:factory"
    )


def _policy(text: str, model: nn.Module | None) -> Any:
    from functional_shard.planning.policy_text import parse_policy

    try:
        return parse_policy(text, model)
    except ShardingError as error:
        raise _InputError(f"--policy: {one_line(error, limit=1000)}") from None


def _needs(module: str, names: str, what: str) -> Any:
    """A module of this package that another part of the project provides, or a clear error."""
    if importlib.util.find_spec(f"functional_shard.{module}") is None:
        raise _InputError(f"{what} needs functional_shard.{module} ({names}), which this installation lacks")
    return importlib.import_module(f"functional_shard.{module}")


def _hardware(name: str) -> Any:
    module = _needs("costing.hardware", "fs.hardware", f"--hardware {name!r}")
    try:
        return module.hardware(name)
    except ShardingError as error:
        raise _InputError(f"--hardware {name!r}: {one_line(error, 300)}") from None


def _budget(text: str) -> int:
    for module_name in ("costing.estimate", "search.auto"):
        if importlib.util.find_spec(f"functional_shard.{module_name}") is not None:
            module = importlib.import_module(f"functional_shard.{module_name}")
            if hasattr(module, "parse_bytes"):
                try:
                    return int(module.parse_bytes(text))
                except ShardingError as error:
                    raise _InputError(f"--budget {text!r}: {one_line(error, 300)}") from None
    raise _InputError(f"--budget {text!r} needs fs.estimate's parse_bytes, which this installation lacks")


# ---- output ------------------------------------------------------------------------------
class _Out:
    """Plain text, or rich tables when stdout is a terminal and rich is installed."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.console: Any = None
        if stream.isatty() and importlib.util.find_spec("rich") is not None:
            from rich.console import Console

            self.console = Console(file=stream, highlight=False)

    def text(self, text: str = "") -> None:
        if self.console is not None:
            self.console.print(text, markup=False, soft_wrap=True)  # wrap as print does
        else:
            print(text, file=self.stream)

    def table(
        self,
        title: str,
        header: Sequence[str],
        rows: Sequence[Sequence[str]],
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


def _plan_tables(out: _Out, plan: Plan, full: bool) -> None:
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


def _cost_rows(cost: Cost) -> list[tuple[str, int]]:
    return [
        ("params", cost.params_bytes),
        ("grads", cost.grads_bytes),
        ("optimizer", cost.optimizer_bytes),
        ("buffers", cost.buffers_bytes),
        ("gathered", cost.gathered_bytes),
        ("total on device", cost.total_bytes),
        ("host (offloaded)", cost.host_bytes),
    ]


def _cost_tables(out: _Out, cost: Cost) -> None:
    out.table(
        f"memory on rank {cost.rank}",
        ("part", "bytes"),
        [(k, _bytes(v)) for k, v in _cost_rows(cost)],
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


def _write(path: str, write: Callable[[pathlib.Path], object], what: str) -> None:
    try:
        write(pathlib.Path(path))
    except OSError as error:
        raise _InputError(f"{what} {path!r}: cannot write ({one_line(error, 300)})") from None


# ---- commands ----------------------------------------------------------------------------
def _plan(args: argparse.Namespace, out: _Out) -> int:
    from functional_shard.planning.planner import shard

    if args.auto and (args.mesh or args.policy):
        raise _InputError("--auto searches meshes and policies itself: leave out --mesh and --policy")
    if not args.auto and (args.devices is not None or args.budget is not None):
        raise _InputError("--devices and --budget go with --auto")
    if args.param and not args.png:
        raise _InputError("--param goes with --png (the parameter to draw)")
    if args.batch is not None and args.seq is None:
        raise _InputError("--batch needs --seq (sequences per data-parallel rank, tokens each)")
    if args.hardware and args.seq is None:
        raise _InputError("--hardware needs --seq (a step's time depends on its tokens)")
    for flag in ("batch", "seq", "devices", "top"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise _InputError(f"--{flag} {value}: a positive number")
    if args.auto and (args.devices is None or args.budget is None or args.seq is None):
        raise _InputError(
            "--auto needs --devices, --budget and --seq (and --batch, or one sequence per device)"
        )
    batch_given = args.batch is not None
    if args.seq is not None and args.batch is None:
        # one sequence per data-parallel rank: with --auto, a global batch of one per device
        args.batch = args.devices if args.auto else 1
    # the cheap inputs first: a typo is reported before a big model is built
    mesh = None if args.auto else parse_mesh(args.mesh or "dp=8,tp=4")
    budget = _budget(args.budget) if args.auto else None
    hardware = _hardware(args.hardware or "h100") if args.batch is not None else None
    model = load_model(args.model)
    to_stdout = args.json == "-"
    say = _Out(sys.stderr) if to_stdout else out  # keep stdout pure JSON
    if mesh is None:
        auto = _needs("search.auto", "fs.search_plans", "--auto")
        report = auto.search_plans(
            model,
            devices=args.devices,
            memory_budget=budget,
            optimizer=args.optimizer,
            batch=args.batch,
            seq=args.seq,
            hardware=hardware,
        )
        _candidates_table(say, report, args.top)
        say.text()
        if report.best is None:
            raise _InputError(_nothing_fits(report, args.devices))
        plan = report.best
        chosen = report.best_candidate
        say.text(f"chosen: {chosen.mesh!r} {chosen.policy_text}; its plan and estimate:")
        say.text()
    else:
        plan = shard(model, mesh, _policy(args.policy or _DEFAULT_POLICY, model))
    estimate = None
    if mesh is None:
        estimate = getattr(report.best_candidate, "estimate", None)  # the search estimated it already
    if args.batch is not None and estimate is None:
        estimate_module = _needs("costing.estimate", "fs.estimate", "--batch/--seq")
        # with --auto, --batch is the global batch; fs.estimate takes one data-parallel rank's
        per_rank = args.batch // plan.data_parallel_rank(0)[1] if args.auto else args.batch
        if plan.config.pipeline_axis and not batch_given:
            per_rank = plan.config.microbatches  # a pipeline's default: one sequence per micro-batch
        estimate = estimate_module.estimate(
            model, plan, batch=max(per_rank, 1), seq=args.seq, optimizer=args.optimizer, hardware=hardware
        )
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
        _write(args.json, lambda p: p.write_text(plan.to_json(indent=1) + "\n"), "--json")
        say.text(f"\nwrote the plan to {args.json}")
    if args.png:
        budget_line = getattr(hardware, "memory_bytes", None) if estimate is not None else None
        try:
            figure = plan.visualize(
                args.param, estimate=estimate, optimizer=args.optimizer, budget=budget_line
            )
        except ShardingError as error:
            raise _InputError(f"--png: {one_line(error, 300)}") from None
        _write(args.png, lambda p: figure.savefig(p, dpi=110), "--png")
        say.text(f"wrote the pictures to {args.png}")
    return 0


def _candidates_table(out: _Out, report: Any, top: int) -> None:
    """The search's candidates, those that fit first, fastest first (as ``AutoReport.table``)."""
    from functional_shard.search.report import step_text

    def rows(candidates: Any) -> list[tuple[str, ...]]:
        return [
            (
                repr(c.mesh),
                c.policy_text,
                _bytes(c.peak_bytes) if c.peak_bytes is not None else "-",
                step_text(c.step_seconds) if c.step_seconds is not None else "-",
                "chosen" if c is report.best_candidate else (c.rejected or "fits"),
            )
            for c in candidates
        ]

    ranked = rows(sorted(report.candidates, key=lambda c: (not c.fits, c.key()))[:top])
    shown = f"the first {len(ranked)}" if len(ranked) < len(report.candidates) else "all"
    if getattr(report, "no_tensor_parallel", None):
        out.text(f"no tensor parallelism: {report.no_tensor_parallel}")
    out.table(
        f"{str(report).splitlines()[0]}; {shown}, those that fit first, fastest first:",
        ("mesh", "policy", "peak", "step", "verdict"),
        ranked,
        numbers=(2, 3),
    )
    experts = getattr(report, "expert_parallel_candidates", ())
    if experts:
        out.text()
        out.table(
            "expert parallel (experts split by index over ep), the best of each ep size:",
            ("mesh", "policy", "peak", "step", "verdict"),
            rows(experts),
            numbers=(2, 3),
        )


def _nothing_fits(report: Any, devices: int) -> str:
    estimated = [c for c in report.candidates if c.peak_bytes is not None]
    head = f"--budget: no plan fits {_bytes(report.budget_bytes)} per device on {devices} devices"
    if not estimated:
        return head + "; no candidate could be planned for this model"
    closest = min(estimated, key=lambda c: c.peak_bytes)
    return (
        f"{head}; the closest, {closest.mesh!r} {closest.policy_text}, peaks at {_bytes(closest.peak_bytes)} "
        f"({_bytes(closest.peak_bytes - report.budget_bytes)} over): use more devices, a smaller --batch or "
        "--seq, or a larger --budget"
    )


def _read_plan(path: str) -> Plan:
    from functional_shard.planning.plan import Plan

    try:
        text = pathlib.Path(path).read_text()
    except OSError as error:
        raise _InputError(f"{path!r}: cannot read ({one_line(error, 300)})") from None
    try:
        return Plan.from_json(text)
    except (ValueError, KeyError, TypeError) as error:
        raise _InputError(f"{path!r}: not a plan written by --json ({one_line(error, 300)})") from None


def _shown(value: object) -> str:
    if isinstance(value, tuple) and len(value) > 4:
        return f"({len(value)} entries)"
    return str(value)


def _collapse(changes: list[Change]) -> list[tuple[str, str, str, str]]:
    """Rows of (tensor, what, before, after), repeated layers folded, alike changes joined.

    ``layers.0`` and ``layers.1`` become ``layers.* ×2``; the specs of a tensor that change
    the same way share a row (``storage, grad, optim``).
    """
    counts: dict[str, set[str]] = {}
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for change in changes:
        path = re.sub(r"(?<=\.)\d+(?=\.)", "*", change.path)
        counts.setdefault(path, set()).add(change.path)
        before, after = change.before, change.after
        if change.what == "bytes/device":
            before, after = _bytes(before), _bytes(after)
        whats = grouped.setdefault((path, _shown(before), _shown(after)), [])
        if change.what not in whats:
            whats.append(change.what)
    rows = []
    for (path, before, after), whats in grouped.items():
        count = len(counts[path])
        rows.append((path + (f" ×{count}" if count > 1 else ""), ", ".join(whats), before, after))
    return rows


def _diff(args: argparse.Namespace, out: _Out) -> int:
    before, after = _read_plan(args.before), _read_plan(args.after)
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
        for (name, a), (_, b) in zip(*(_cost_rows(c) for c in costs), strict=True)
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


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    result = demo.run(parse_mesh(args.mesh), args.policy, model=args.model, steps=args.steps)
    return 0 if result.ok else 1


def _convert(args: argparse.Namespace, out: _Out) -> int:
    from functional_shard.runtime import checkpoint

    out.text(f"wrote {checkpoint.convert(args.source, args.target)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="functional-shard",
        description="Plan a model from the shell, compare plans, run the demo, convert checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = commands.add_parser(
        "plan",
        help="plan a model (on the meta device) and show every tensor's placement and the cost",
        description="Plan a model on the meta device: every tensor's four specs, memory per device, "
        "bytes sent per step; with --batch/--seq also activations, peak memory and tokens/s.",
    )
    plan.add_argument(
        "--model",
        default="llama-7b",
        help="a zoo name (tiny, llama-1b, llama-7b, llama-70b, ...), a Hugging Face config.json or a "
        "folder holding one, or package.module:factory (default: llama-7b)",
    )
    plan.add_argument("--mesh", help="axis=size pairs, major to minor (default: dp=8,tp=4)")
    plan.add_argument("--policy", help=f'a policy expression (default: "{_DEFAULT_POLICY}")')
    plan.add_argument(
        "--optimizer", default="adamw", choices=["adamw", "adam", "sgd"], help="(default: adamw)"
    )
    plan.add_argument(
        "--batch",
        type=int,
        help="sequences per data-parallel rank (default with --seq: 1); with --auto the global batch "
        "(default: one sequence per device)",
    )
    plan.add_argument("--seq", type=int, help="tokens per sequence")
    plan.add_argument("--hardware", help="h100, h200, a100, b200 or local (default with --seq: h100)")
    plan.add_argument(
        "--auto", action="store_true", help="search meshes and policies for the fastest plan that fits"
    )
    plan.add_argument("--devices", type=int, help="with --auto: how many devices")
    plan.add_argument("--budget", help="with --auto: memory per device, e.g. 80GiB")
    plan.add_argument("--top", type=int, default=10, help="with --auto: candidates to list (default: 10)")
    plan.add_argument(
        "--json", metavar="FILE", help="write the plan as JSON (- prints it instead of the tables)"
    )
    plan.add_argument("--png", metavar="FILE", help="draw memory per device and one parameter's blocks")
    plan.add_argument("--param", help="with --png: the parameter to draw (default: the largest)")
    plan.add_argument("--full", action="store_true", help="one row per tensor (do not fold repeated layers)")
    diff = commands.add_parser(
        "diff",
        help="what changes between two plans written by --json: per tensor, memory and traffic",
    )
    diff.add_argument("before", help="a plan written by plan --json")
    diff.add_argument("after", help="another plan of the same model")
    diff.add_argument(
        "--optimizer", default="adamw", choices=["adamw", "adam", "sgd"], help="(default: adamw)"
    )
    demo = commands.add_parser(
        "demo",
        help="train a plan on local processes: predicted vs measured cost, parity with one process",
    )
    demo.add_argument("--mesh", default="dp=2,tp=2", help="one local process per device (default: dp=2,tp=2)")
    demo.add_argument(
        "--policy", default="fsdp(dp) + tp(llama, tp)", help='(default: "fsdp(dp) + tp(llama, tp)")'
    )
    demo.add_argument("--model", default="tiny", choices=["tiny", "tiny-tied"], help="(default: tiny)")
    demo.add_argument("--steps", type=int, default=5, help="AdamW steps, 3 or more (default: 5)")
    ckpt = commands.add_parser("checkpoint", help="checkpoint tools")
    ckpt_commands = ckpt.add_subparsers(dest="action", required=True, parser_class=_Parser)
    conv = ckpt_commands.add_parser("convert", help="sharded folder <-> full file, offline")
    conv.add_argument("source", help="a checkpoint folder (sharded) or file (full)")
    conv.add_argument("target", help="the other form: a .pt file for a folder, a folder for a file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for bad input, with one line on stderr).

    Examples:
        >>> from functional_shard.frontends.cli import main
        >>> main(["plan", "--model", "tiny", "--mesh", "dp=2", "--policy", "fsdp(dp)"])  # doctest: +ELLIPSIS
        Plan on Mesh(dp=2): data parallel fsdp over ('dp',); ...
        0
    """
    args = _parser().parse_args(argv)
    out = _Out(sys.stdout)
    try:
        if args.command == "plan":
            return _plan(args, out)
        if args.command == "diff":
            return _diff(args, out)
        if args.command == "demo":
            return _demo(args)
        return _convert(args, out)
    except ShardingError as error:
        print(f"functional-shard: {_summary(error)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (| head): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
