"""Which modules a plan selects: its FSDP units, and the modules it checkpoints."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from functional_shard.core.errors import PolicyError
from functional_shard.core.tree import ModelTree, matches, owner_paths
from functional_shard.planning.plan.config import group_name
from functional_shard.planning.policy.types import DataParallel, Selector

from .repeated_blocks import repeated_blocks as _repeated_blocks

__all__ = ["ChosenUnits", "chosen_units", "fsdp_units", "select_modules"]


def select_modules(selectors: Iterable[Selector], tree: ModelTree, what: str) -> list[str]:
    """The module paths any of ``selectors`` (classes, or path patterns) selects, in model order.

    A class selects every module of that class; a path pattern the outermost modules it matches.

    Raises:
        PolicyError: a class selector on a pytree, or a selector that selects no module.

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> tree = read_model(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
        >>> select_modules([nn.Linear], tree, "checkpointing()"), select_modules(["1"], tree, "units")
        (['0', '2'], ['1'])
        >>> nested = read_model(nn.ModuleDict({"layers": nn.ModuleList([nn.Sequential(nn.Linear(2, 2))])}))
        >>> select_modules(["layers.*"], nested, "checkpointing()")
        ['layers.0']
        >>> select_modules(["Linear"], tree, "checkpointing()")
        Traceback (most recent call last):
        ...
        functional_shard.PolicyError: checkpointing(): 'Linear' selects no module of the model: ...
    """
    chosen: set[str] = set()
    for selector in selectors:
        found = _selected(selector, tree, what)
        if not found:
            raise PolicyError(f"{what}: {_nothing_selected(selector, tree)}")
        chosen.update(found)
    return [path for path in tree.modules if path in chosen]


def _selected(selector: Selector, tree: ModelTree, what: str) -> list[str]:
    """The module paths ``selector`` alone selects, in model order.

    Raises:
        PolicyError: a class selector on a pytree, which has no module classes.
    """
    if isinstance(selector, type) and any(cls is None for cls in tree.modules.values()):
        raise PolicyError(
            f"{what} selects modules of class {selector.__name__}, but the model was "
            "given as a pytree with no module classes; select by path pattern, or pass "
            "the nn.Module"
        )
    if isinstance(selector, type):
        return [path for path, cls in tree.modules.items() if cls is not None and issubclass(cls, selector)]
    found = {path for path in tree.modules if path and matches(selector, path)}
    # "*" spans dots, so a pattern meant for the blocks also matches every module inside
    # them: nested checkpoints would run an inner forward once more per level
    return [
        path
        for path in tree.modules
        if path in found and not any(p in found for p in owner_paths(path) if p != path)
    ]


def _nothing_selected(selector: Selector, tree: ModelTree) -> str:
    """Why ``selector`` selects nothing in ``tree``, and what would."""
    classes = sorted({cls.__name__ for cls in tree.modules.values() if cls is not None})
    if isinstance(selector, type):
        return (
            f"no module of the model is a {selector.__name__}; its module classes: "
            f"{', '.join(classes[:12])}. Select one of those, or a module-path pattern"
        )
    shown = repr(getattr(selector, "pattern", selector))
    if isinstance(selector, str) and selector in classes:
        return (
            f"{shown} selects no module of the model: a string is a module-path pattern, and "
            f"{selector} is a module class of the model; pass the class itself (in policy text, "
            f"the bare name {selector}, unquoted)"
        )
    return (
        f"{shown} selects no module of the model: its modules: {_some_modules(tree)}. "
        "Use a module-path pattern ('layers.*', '*' spans dots) or a module class"
    )


# size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES and .FORCE_LEAF_MODULES of
# torch/distributed/fsdp/wrap.py, restated: reading them would import FSDP (~0.8 s, half of
# `import torch`) into pure planning; tests/unit/test_boundaries.py checks they still equal torch's
_EXCLUDE_WRAP_MODULES: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict)
_FORCE_LEAF_MODULES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _size_based_units(tree: ModelTree, min_params: int) -> list[str]:
    # torch's size_based_auto_wrap_policy, post-order: a module becomes a unit when its subtree's
    # parameters outside units reach min_params; never a ModuleList/ModuleDict nor inside a forced leaf
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


@dataclass(frozen=True, slots=True)
class ChosenUnits:
    """A sharding layer's FSDP units: single modules, groups of modules, and why each."""

    units: tuple[str, ...]
    """Module paths, the root ``""`` first."""
    groups: tuple[tuple[str, ...], ...] = ()
    """Modules that make one unit together, each group in model order."""
    reasons: tuple[tuple[str, str], ...] = ()
    """(unit name, why), for every unit and group (`PlanConfig.unit_reasons`)."""


# containers whose elements are the model's blocks (torch's auto-wrap skips the containers
# themselves): every element of a ModuleList or ModuleDict, a Sequential's when they repeat
def _selected_units(tree: ModelTree, selectors: tuple[Any, ...]) -> ChosenUnits:
    picked: dict[str, str] = {}
    for selector in (selector for selector in selectors if not isinstance(selector, tuple)):
        shown = (
            selector.__name__ if isinstance(selector, type) else repr(getattr(selector, "pattern", selector))
        )
        for path in select_modules([selector], tree, "fsdp(units=...)"):
            picked.setdefault(path, f"fsdp(units=...) selects it ({shown})")
    order = {path: index for index, path in enumerate(tree.modules)}
    units = sorted(picked.items(), key=lambda item: order[item[0]])
    groups = []
    for group in (selector for selector in selectors if isinstance(selector, tuple)):
        members = []
        for member in group:
            found = _selected(member, tree, "fsdp(units=...)")
            if not found:
                raise PolicyError(
                    f"fsdp(units=...): the group {group!r} names {member!r}, which is no module of "
                    f"the model; its modules: {_some_modules(tree)}. Name modules by their path "
                    "(as named_modules() gives them) or class"
                )
            members += [path for path in found if path not in members]
        nested = [(a, b) for a in members for b in members if a != b and b.startswith(f"{a}.")]
        if nested or "" in members:
            inner, outer = nested[0][::-1] if nested else ("", "")
            raise PolicyError(
                f"fsdp(units=...): the group {group!r} holds {inner!r} inside {outer!r} (or the "
                "root): a group's modules must not nest; name the outer one alone"
            )
        groups.append(tuple(members))
    grouped = {member for members in groups for member in members}
    clashes = [path for path, _ in units if path in grouped]
    if clashes:
        raise PolicyError(
            f"fsdp(units=...): {clashes[0]!r} is both a unit of its own and in a group; name each module once"
        )
    reasons = [*units, *((group_name(g), f"fsdp(units=...) groups {', '.join(g)}") for g in groups)]
    return ChosenUnits(tuple(path for path, _ in units), tuple(groups), tuple(reasons))


def _some_modules(tree: ModelTree) -> str:
    shown = [path for path in tree.modules if path and "." not in path][:8]
    return ", ".join(shown) + (", ..." if len(tree.modules) > len(shown) + 1 else "")


def chosen_units(tree: ModelTree, layer: DataParallel | None) -> ChosenUnits:
    """The FSDP units of the sharding layer ``layer``, and why each is one.

    By the layer's ``min_params``, its ``units`` selectors (tuples: groups), or else the repeated blocks.

    Raises:
        PolicyError: a group names no module, or nests, or a module is named twice.

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> tree = read_model(nn.Sequential(nn.Linear(2, 2), nn.ModuleDict({"a": nn.Linear(2, 2)})))
        >>> for unit, why in chosen_units(tree, fs.fsdp("dp").layers[0]).reasons:
        ...     print(repr(unit), why)
        '' the root: every parameter no other unit holds
        '1.a' a repeated block: 1 × Linear in 1 (ModuleDict)
    """
    if layer is None or not layer.shards or layer.kind == "zero1":
        return ChosenUnits(())
    if layer.min_params is not None:
        reason = f"size-based: holds {layer.min_params:,} or more parameters no smaller unit holds"
        paths = tuple(_size_based_units(tree, layer.min_params))
        found = ChosenUnits(paths, (), tuple((path, reason) for path in paths))
    elif layer.units is not None:
        found = _selected_units(tree, layer.units)
    else:
        blocks = _repeated_blocks(tree)
        found = ChosenUnits(tuple(path for path, _ in blocks), (), tuple(blocks))
    root = ("", "the root: every parameter no other unit holds")
    return ChosenUnits(("", *found.units), found.groups, (root, *found.reasons))


def fsdp_units(tree: ModelTree, layer: DataParallel | None) -> tuple[str, ...]:
    """The FSDP units (module paths, the root ``""`` first) of the sharding layer ``layer``.

    Groups of modules (`chosen_units`) are not among them.

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> tree = read_model(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> fsdp_units(tree, fs.fsdp("dp").layers[0])
        ('', '0', '1')
    """
    return chosen_units(tree, layer).units
