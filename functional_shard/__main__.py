"""``python -m functional_shard ...``: the same as the ``functional-shard`` command."""

from .cli import main

raise SystemExit(main())
