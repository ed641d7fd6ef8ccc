"""Work that a lower layer's data offers and a higher layer does, wired by the package façade.

A module imports only from its own layer and the layers below it (docs/architecture.md), yet
a few methods of the vocabulary promise work that lives above: `Mesh.device_mesh` needs the
runtime's process groups, `Plan.cost` the cost model, `Plan.visualize` the pictures. Such a
method asks this module for the function by a name; the package façade
(``functional_shard/__init__.py``), the one module that sees every layer, says once at
import which module and attribute do that work. The module loads on the first call, so
naming it costs nothing at import.

Examples:
    >>> provider("plan.cost").__name__
    'cost'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["provide", "provider"]

# name -> (module, attribute); written once, by the façade, before any method can ask
_where: Mapping[str, tuple[str, str]] = MappingProxyType({})


def provide(where: Mapping[str, tuple[str, str]]) -> None:
    """Say which module and attribute do each named piece of work (the façade calls this once).

    Args:
        where: name -> (absolute module name, attribute).
    """
    global _where
    _where = MappingProxyType({**_where, **where})


def provider(name: str) -> Callable[..., Any]:
    """The function that does the work called ``name``, its module loaded now if not before.

    Raises:
        LookupError: nothing provides ``name`` (a façade that forgot it: a bug, not input).
    """
    try:
        module, attribute = _where[name]
    except KeyError:
        raise LookupError(f"no layer provides {name!r}; the façade names: {sorted(_where)}") from None
    function: Callable[..., Any] = getattr(importlib.import_module(module), attribute)
    return function
