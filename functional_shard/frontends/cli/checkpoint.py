"""``functional-shard checkpoint convert``: a sharded folder to one full file or back, or to Hugging Face."""

from __future__ import annotations

import argparse

from functional_shard.core.errors import ShardingError

from .output import Out

__all__ = ["run"]


def run(args: argparse.Namespace, out: Out) -> int:
    """Convert ``args.source`` into ``args.target``, the other form or (``--to hf``) a Hugging Face folder.

    `functional_shard.runtime.checkpoint.api.convert` and `convert_to_hf` do the work.

    Returns:
        0.

    Raises:
        ShardingError: no checkpoint at the source, one that is damaged, or one that holds
            objects only code could rebuild (without ``--trust``); ``--config`` or
            ``--prefix`` without ``--to hf``; with it, no config, or one that does not match.

    Examples:
        >>> from functional_shard.frontends.cli import main
        >>> main(["checkpoint", "convert", "/no/such/ckpt", "ckpt.pt"])  # one line on stderr
        2
    """
    from functional_shard.runtime.checkpoint.api import convert, convert_to_hf

    if args.to != "hf":
        flags = [
            flag
            for flag, value in (("--config", args.config), ("--prefix", args.prefix))
            if value is not None
        ]
        if flags:
            raise ShardingError(f"{' and '.join(flags)}: only with --to hf (a Hugging Face folder)")
        out.text(f"wrote {convert(args.source, args.target, trust=args.trust)}")
        return 0
    done = convert_to_hf(args.source, args.target, args.config, prefix=args.prefix, trust=args.trust)
    if done.prefix:
        how = (
            "as --prefix said"
            if args.prefix is not None
            else "every tensor of the config's model lies under it"
        )
        out.text(f"stripped the prefix {done.prefix!r} from the checkpoint's keys ({how})")
    if done.left_out:
        shown = ", ".join(done.left_out[:5]) + (", ..." if len(done.left_out) > 5 else "")
        keys = "key" if len(done.left_out) == 1 else "keys"
        out.text(f"left out {len(done.left_out)} {keys} outside it ({shown})")
    out.text(f"wrote {done.path}")
    return 0
