"""``python -m functional_shard ...``: the same as the ``functional-shard`` command."""

from .frontends.cli import main

raise SystemExit(main())
