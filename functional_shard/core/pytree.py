"""The one place that talks to optree, so every call passes our namespace."""

from __future__ import annotations

from typing import Any, TypeVar

import optree
from typing_extensions import dataclass_transform

NAMESPACE = "functional_shard"


def flatten_with_path(tree: Any) -> tuple[list[tuple[Any, ...]], list[Any]]:
    """Paths (tuples of keys) and leaves of ``tree``, in optree's traversal order."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return paths, leaves


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is metadata, not a pytree child."""
    # mypy reads optree.dataclasses as the stdlib module it re-exports (no pytree_node)
    return optree.dataclasses.field(pytree_node=False, **kwargs)  # type: ignore[call-overload]


_T = TypeVar("_T")


@dataclass_transform(frozen_default=True, field_specifiers=(static_field,))
def dataclass(cls: type[_T]) -> type[_T]:
    """A frozen optree dataclass registered in our namespace (so it is a node, not a leaf)."""
    return optree.dataclasses.dataclass(cls, namespace=NAMESPACE, frozen=True)  # type: ignore[call-overload]
