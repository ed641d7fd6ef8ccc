"""Package discovery: setuptools finds every package; none is listed by hand.

`adapters/` stays at the repository's top level (the core never imports it) and installs as
`functional_shard.adapters`, a mapping pyproject.toml's `packages.find` cannot express.
Everything else about the project is in pyproject.toml.
"""

from setuptools import find_packages, setup

ADAPTERS = "functional_shard.adapters"

setup(
    packages=[
        *find_packages(include=["functional_shard", "functional_shard.*"]),
        ADAPTERS,
        *(f"{ADAPTERS}.{name}" for name in find_packages("adapters")),
    ],
    package_dir={ADAPTERS: "adapters"},
)
