"""``functional-shard demo``: a plan trained on local processes, beside its prediction.

The demo itself is `functional_shard.frontends.live_demo`; this module reads its flags.
"""

from __future__ import annotations

import argparse

from .inputs import parse_mesh, read_policy

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Run the demo as ``args`` ask; its report goes to stdout.

    Returns:
        0 when every prediction held and the run matched one process, else 1.

    Raises:
        ShardingError: a bad mesh, policy or step count, or (without ``--force``) more
            processes than the machine runs, before any process starts.

    Examples:
        >>> from functional_shard.frontends.cli import main
        >>> main(["demo", "--mesh", "dp=2", "--policy", "fsdp(dp)", "--steps", "2"])  # one line on stderr
        2
    """
    from functional_shard.frontends.live_demo import model_shapes
    from functional_shard.frontends.live_demo import run as run_demo

    mesh = parse_mesh(args.mesh)
    policy = read_policy(args.policy, model_shapes(args.model))  # its errors name --policy
    result = run_demo(mesh, policy, model=args.model, steps=args.steps, force=args.force, packed=args.packed)
    return 0 if result.ok else 1
