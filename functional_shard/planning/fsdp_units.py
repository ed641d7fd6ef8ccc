"""Which modules a plan selects: its FSDP units, and the modules it checkpoints."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from functional_shard.core.errors import PolicyError
from functional_shard.core.tree import ModelTree, matches, owner_paths

from .policy import DataParallel, Selector

__all__ = ["fsdp_units", "select_modules"]


def select_modules(selectors: Iterable[Selector], tree: ModelTree, what: str) -> list[str]:
    """The module paths any of ``selectors`` (classes, or path patterns) selects, in model order.

    Raises:
        PolicyError: a class selector on a pytree, which has no module classes.

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> tree = read_model(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
        >>> select_modules([nn.Linear], tree, "checkpointing()"), select_modules(["1"], tree, "units")
        (['0', '2'], ['1'])
    """
    selectors = tuple(selectors)
    if not selectors:
        return []
    chosen = []
    for path, cls in tree.modules.items():
        for selector in selectors:
            if isinstance(selector, type):
                if cls is None:
                    raise PolicyError(
                        f"{what} selects modules of class {selector.__name__}, but the model was "
                        "given as a pytree with no module classes; select by path pattern, or pass "
                        "the nn.Module"
                    )
                hit = issubclass(cls, selector)
            else:
                hit = bool(path) and matches(selector, path)
            if hit:
                chosen.append(path)
                break
    return chosen


# size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES and .FORCE_LEAF_MODULES of
# torch/distributed/fsdp/wrap.py, restated: reading them would import FSDP (~0.8 s, half of
# `import torch`) into pure planning; tests/test_boundaries.py checks they still equal torch's
_EXCLUDE_WRAP_MODULES: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict)
_FORCE_LEAF_MODULES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _size_based_units(tree: ModelTree, min_params: int) -> list[str]:
    # torch's size_based_auto_wrap_policy, post-order: a module becomes a unit when the
    # parameters its subtree holds outside units already made reach min_params. Like
    # torch, never a ModuleList/ModuleDict, and nothing inside a forced leaf (attention).
    excluded, leaves = _EXCLUDE_WRAP_MODULES, _FORCE_LEAF_MODULES
    counts = dict.fromkeys(tree.modules, 0)
    for path, tensor in tree.params.items():
        counts[path.rpartition(".")[0]] += tensor.numel

    def inside_leaf(path: str) -> bool:
        parents = list(owner_paths(path))[1:-1]  # enclosing modules, the root excluded
        return any((cls := tree.modules[p]) is not None and issubclass(cls, leaves) for p in parents)

    wrapped: list[str] = []
    for path in sorted(tree.modules, key=lambda p: -len(p.split("."))):
        if not path:
            continue
        cls = tree.modules[path]
        wrappable = not (cls is not None and issubclass(cls, excluded)) and not inside_leaf(path)
        if wrappable and counts[path] >= min_params:
            wrapped.append(path)
        else:
            counts[path.rpartition(".")[0]] += counts[path]
    order = {path: index for index, path in enumerate(tree.modules)}
    return sorted(wrapped, key=order.__getitem__)


def fsdp_units(tree: ModelTree, layer: DataParallel | None) -> tuple[str, ...]:
    """The FSDP units (module paths, the root ``""`` first) of the sharding layer ``layer``.

    By the layer's ``min_params`` (torch's size-based policy), its ``units`` selectors, or
    by default every element of an ``nn.ModuleList`` (the transformer blocks).

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> tree = read_model(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> fsdp_units(tree, fs.fsdp("dp").layers[0])
        ('', '0', '1')
    """
    if layer is None or not layer.shards or layer.kind == "zero1":
        return ()
    if layer.min_params is not None:
        units = _size_based_units(tree, layer.min_params)
    elif layer.units is not None:
        units = select_modules(layer.units, tree, "fsdp(units=...)")
    else:
        modules = tree.modules
        lists = {path for path, cls in modules.items() if cls is nn.ModuleList}
        # a unit is a module whose parent is a ModuleList (none: no walk over the paths)
        units = (
            [
                path
                for path, cls in modules.items()
                if path and cls is not None and path.rpartition(".")[0] in lists
            ]
            if lists
            else []
        )
    return ("", *units)
