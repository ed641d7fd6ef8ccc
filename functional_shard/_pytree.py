"""The one place that talks to optree, so every call passes our namespace."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

NAMESPACE = "functional_shard"


def flatten_with_path(tree: Any) -> tuple[list[tuple[Any, ...]], list[Any]]:
    """Paths (tuples of keys) and leaves of ``tree``, in optree's traversal order."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return paths, leaves


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``optree.tree_map`` in our namespace (so Plan is a node, not a leaf)."""
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def dataclass(**kwargs: Any) -> Callable[[type], type]:
    """A frozen optree dataclass registered in our namespace."""
    return optree.dataclasses.dataclass(namespace=NAMESPACE, frozen=True, **kwargs)


field = optree.dataclasses.field
