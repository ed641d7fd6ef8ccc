"""The ``functional-shard`` program: its argument parser, and ``main``, which runs one command.

Every mistake in the input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from functional_shard.core.errors import ShardingError, one_line

from . import checkpoint, demo, diff, plan
from .output import Out
from .plan import DEFAULT_POLICY

__all__ = ["main", "parser"]


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


# the library's arguments `plan` passes its flags to: a refusal of one names the flag the user typed
_FLAGS = {
    "batch": "--batch",
    "seq": "--seq",
    "devices": "--devices",
    "memory_budget": "--budget",
    "hardware": "--hardware",
    "kernels": "--kernels",
    "documents": "--documents",
    "steps": "--steps",
}


def _as_flag(error: ShardingError) -> ShardingError:
    """``error`` with ``estimate(seq=6): ...`` said as ``--seq 6: ...`` where a flag gave the value."""
    if error.named is None:
        return error
    who, argument = error.named
    name, _, value = argument.partition("=")
    if name not in _FLAGS:
        return error
    return type(error)(f"{_FLAGS[name]} {value}{str(error)[len(f'{who}({argument})') :]}")


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``functional-shard``: its commands and their flags.

    Examples:
        >>> parser().parse_args(["plan", "--mesh", "dp=8"]).mesh
        'dp=8'
    """
    program = _Parser(
        prog="functional-shard",
        description="Plan a model from the shell, compare plans, run the demo, convert checkpoints.",
    )
    commands = program.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_plan(commands)
    _add_diff(commands)
    _add_demo(commands)
    _add_checkpoint(commands)
    return program


def _add_plan(commands: argparse._SubParsersAction[_Parser]) -> None:
    plan_flags = commands.add_parser(
        "plan",
        help="plan a model (on the meta device) and show every tensor's placement and the cost",
        description="Plan a model on the meta device: every tensor's four specs, memory per device, "
        "bytes sent per step; with --batch/--seq also activations, peak memory and tokens/s.",
    )
    plan_flags.add_argument(
        "--model",
        default="llama-7b",
        help="a zoo name (tiny, llama-1b, llama-7b, llama-70b, ...), a Hugging Face config.json or a "
        "folder holding one, or package.module:factory (default: llama-7b)",
    )
    plan_flags.add_argument("--mesh", help="axis=size pairs, major to minor (default: dp=8,tp=4)")
    plan_flags.add_argument("--policy", help=f'a policy expression (default: "{DEFAULT_POLICY}")')
    plan_flags.add_argument(
        "--optimizer", default="adamw", choices=["adamw", "adam", "sgd"], help="(default: adamw)"
    )
    plan_flags.add_argument(
        "--batch",
        type=int,
        help="sequences per data-parallel rank (default with --seq: 1); with --auto the global batch "
        "(default: one sequence per device)",
    )
    plan_flags.add_argument("--seq", type=int, help="tokens per sequence")
    plan_flags.add_argument("--hardware", help="h100, h200, a100, b200 or local (default with --seq: h100)")
    plan_flags.add_argument(
        "--kernels",
        help="with --seq: count compile, float8, async_tp, float8_all_gather and/or compiled_loss, "
        "comma-separated (e.g. compile,float8,async_tp,float8_all_gather as torchtitan runs; default: "
        "eager); with --auto, in every candidate that has what each needs",
    )
    plan_flags.add_argument(
        "--documents",
        help="with --seq: the lengths of the documents packed in each row, comma-separated (e.g. "
        "2048,2048,4096); attention is counted per document",
    )
    plan_flags.add_argument(
        "--auto", action="store_true", help="search meshes and policies for the fastest plan that fits"
    )
    plan_flags.add_argument("--devices", type=int, help="with --auto: how many devices")
    plan_flags.add_argument("--budget", help="with --auto: memory per device, e.g. 80GiB")
    plan_flags.add_argument("--top", type=int, help="with --auto: candidates to list (default: 10)")
    plan_flags.add_argument(
        "--json", metavar="FILE", help="write the plan as JSON (- prints it instead of the tables)"
    )
    plan_flags.add_argument("--png", metavar="FILE", help="draw memory per device and one parameter's blocks")
    plan_flags.add_argument("--param", help="with --png: the parameter to draw (default: the largest)")
    plan_flags.add_argument(
        "--full", action="store_true", help="one row per tensor (do not fold repeated layers)"
    )


def _add_diff(commands: argparse._SubParsersAction[_Parser]) -> None:
    diff_flags = commands.add_parser(
        "diff",
        help="what changes between two plans written by --json: per tensor, memory and traffic",
    )
    diff_flags.add_argument("before", help="a plan written by plan --json")
    diff_flags.add_argument("after", help="another plan of the same model (plans of two models are refused)")
    diff_flags.add_argument(
        "--optimizer", default="adamw", choices=["adamw", "adam", "sgd"], help="(default: adamw)"
    )


def _add_demo(commands: argparse._SubParsersAction[_Parser]) -> None:
    demo_flags = commands.add_parser(
        "demo",
        help="train a plan on local processes: predicted vs measured cost, parity with one process",
    )
    demo_flags.add_argument(
        "--mesh", default="dp=2,tp=2", help="one local process per device (default: dp=2,tp=2)"
    )
    demo_flags.add_argument(
        "--policy", default="fsdp(dp) + tp(llama, tp)", help='(default: "fsdp(dp) + tp(llama, tp)")'
    )
    demo_flags.add_argument("--model", default="tiny", choices=["tiny", "tiny-tied"], help="(default: tiny)")
    demo_flags.add_argument("--steps", type=int, default=5, help="AdamW steps, 3 or more (default: 5)")
    demo_flags.add_argument(
        "--force",
        action="store_true",
        help="start the mesh's processes past this machine's limit (4 per CPU core, at least 8)",
    )
    demo_flags.add_argument(
        "--packed",
        action="store_true",
        help="train on packed rows: documents of mixed lengths, each attending only to itself",
    )


def _add_checkpoint(commands: argparse._SubParsersAction[_Parser]) -> None:
    checkpoint_flags = commands.add_parser("checkpoint", help="checkpoint tools")
    actions = checkpoint_flags.add_subparsers(dest="action", required=True, parser_class=_Parser)
    convert_flags = actions.add_parser(
        "convert",
        help="sharded folder <-> full file, or to a Hugging Face folder, offline",
        description="Convert a checkpoint of any plan offline: a sharded folder to one full file or back "
        "(--to other), or to a Hugging Face folder that from_pretrained loads (--to hf).",
    )
    convert_flags.add_argument("source", help="a checkpoint folder (sharded) or file (full)")
    convert_flags.add_argument(
        "target",
        help="--to other: a .pt file for a folder, a folder for a file; --to hf: the folder to write",
    )
    convert_flags.add_argument(
        "--to",
        choices=["other", "hf"],
        default="other",
        help="other: the other form of checkpoint; hf: config.json and safetensors (default: other)",
    )
    convert_flags.add_argument("--config", help="with --to hf: the model's config.json (or its folder)")
    convert_flags.add_argument(
        "--prefix",
        help="with --to hf: what to strip from the checkpoint's keys, such as a LightningModule's "
        "'model.' (default: found from the config's tensors)",
    )
    convert_flags.add_argument(
        "--trust",
        action="store_true",
        help="rebuild any object the checkpoint names, running its code: only for a file you trust",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for bad input, with one line on stderr).

    Examples:
        >>> from functional_shard.frontends.cli import main
        >>> main(["plan", "--model", "tiny", "--mesh", "dp=2", "--policy", "fsdp(dp)"])  # doctest: +ELLIPSIS
        Plan on Mesh(dp=2): data parallel fsdp over ('dp',); ...
        0
    """
    args = parser().parse_args(argv)
    out = Out(sys.stdout)
    try:
        if args.command == "plan":
            return plan.run(args, out)
        if args.command == "diff":
            return diff.run(args, out)
        if args.command == "demo":
            return demo.run(args)
        return checkpoint.run(args, out)
    except ShardingError as error:
        print(f"functional-shard: {_summary(_as_flag(error))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (| head): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
