"""``functional-shard checkpoint convert``: a sharded checkpoint folder to one full file, or back."""

from __future__ import annotations

import argparse

from .output import Out

__all__ = ["run"]


def run(args: argparse.Namespace, out: Out) -> int:
    """Convert ``args.source`` into ``args.target`` (`functional_shard.runtime.checkpoint.convert`).

    Returns:
        0.

    Raises:
        ShardingError: no checkpoint at the source, one that is damaged, or one that holds
            objects only code could rebuild (without ``--trust``).

    Examples:
        >>> from functional_shard.frontends.cli import main
        >>> main(["checkpoint", "convert", "/no/such/ckpt", "ckpt.pt"])  # one line on stderr
        2
    """
    from functional_shard.runtime.checkpoint import convert

    out.text(f"wrote {convert(args.source, args.target, trust=args.trust)}")
    return 0
