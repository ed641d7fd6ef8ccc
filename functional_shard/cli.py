"""``functional-shard``: plan a model from the shell; convert checkpoints offline.

Examples:
    functional-shard plan --model llama-70b --mesh dp=16,tp=8 --policy fsdp:dp+tp:tp --tokens 8192
    functional-shard checkpoint convert ckpt/ ckpt.pt
    functional-shard demo --mesh dp=2,tp=2 --policy fsdp:dp+tp:tp
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from . import checkpoint, rules
from .errors import ShardingError
from .mesh import Mesh
from .planner import shard
from .policy import Policy, fsdp, hsdp, mixed_precision, replicate, tp, zero
from .zoo import CONFIGS, llama


def _mesh(text: str) -> Mesh:
    try:
        return Mesh({name: int(size) for name, _, size in (item.partition("=") for item in text.split(","))})
    except ValueError:
        raise ShardingError(f"--mesh {text!r}: write axis=size pairs, e.g. dp=8,tp=4") from None


def _policy(text: str) -> Policy:
    """``fsdp:dp+tp:tp``, ``zero2:dp``, ``hsdp:node/gpu``, ``ddp:dp``, ``bf16``."""
    makers: dict[str, Callable[[str], Policy]] = {
        "fsdp": fsdp,
        "ddp": replicate,
        "zero1": lambda a: zero(1, a),
        "zero2": lambda a: zero(2, a),
        "zero3": lambda a: zero(3, a),
        "hsdp": lambda a: hsdp(*a.split("/")),
        "tp": lambda a: tp(rules.llama, a),
        "sp": lambda a: tp(rules.llama, a, sequence_parallel=True),
    }
    policy = Policy()
    for part in text.split("+"):
        name, _, axis = part.partition(":")
        if name == "bf16":
            policy = policy + mixed_precision(torch.bfloat16)
        elif name in makers and axis:
            policy = policy + makers[name](axis)
        else:
            raise ShardingError(
                f"--policy part {part!r}: use {sorted(makers)} as name:axis, joined by +, or bf16"
            )
    return policy


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = argparse.ArgumentParser(prog="functional-shard", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plan_cmd = commands.add_parser("plan", help="plan a Llama-shaped model (meta device) and show its cost")
    plan_cmd.add_argument("--model", default="llama-7b", choices=sorted(CONFIGS))
    plan_cmd.add_argument("--mesh", default="dp=8,tp=4")
    plan_cmd.add_argument("--policy", default="fsdp:dp+tp:tp+bf16")
    plan_cmd.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch per data rank")
    plan_cmd.add_argument("--json", action="store_true", help="print the plan as JSON instead")
    demo = commands.add_parser(
        "demo",
        help="train a plan on local processes: predicted vs measured cost, parity with one process",
    )
    demo.add_argument("--mesh", default="dp=2,tp=2", help="one local process per device")
    demo.add_argument("--policy", default="fsdp:dp+tp:tp")
    demo.add_argument("--model", default="tiny", choices=["tiny", "tiny-tied"])
    demo.add_argument("--steps", type=int, default=5)
    ckpt = commands.add_parser("checkpoint", help="checkpoint tools")
    ckpt_commands = ckpt.add_subparsers(dest="action", required=True)
    conv = ckpt_commands.add_parser("convert", help="sharded folder <-> full file, offline")
    conv.add_argument("source")
    conv.add_argument("target")
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            plan = shard(llama(args.model), _mesh(args.mesh), _policy(args.policy))
            print(
                plan.to_json(indent=1)
                if args.json
                else f"{plan.explain()}\n\n{plan.cost(tokens=args.tokens)}"
            )
        elif args.command == "demo":
            from . import demo as demo_module

            result = demo_module.run(
                _mesh(args.mesh), _policy(args.policy), model=args.model, steps=args.steps
            )
            return 0 if result.ok else 1
        else:
            print(f"wrote {checkpoint.convert(args.source, args.target)}")
    except ShardingError as error:
        print(f"functional-shard: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
