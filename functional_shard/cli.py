"""The ``functional-shard`` command's entry point, at the path installers and users name.

The commands live in `functional_shard.frontends.cli`; this path also serves the two readers
training scripts borrow (examples/train_torchrun.py) and ``python -m functional_shard.cli``.
"""

from .frontends.cli import load_model as load_model
from .frontends.cli import main as main
from .frontends.cli import parse_mesh as parse_mesh

__all__ = ["load_model", "main", "parse_mesh"]


if __name__ == "__main__":
    raise SystemExit(main())
