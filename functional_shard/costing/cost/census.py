"""A plan's parameters counted once per kind: the census both halves of the cost model read.

Big models repeat a few (shape, dtype, sharding) kinds across their blocks: memory and traffic are
summed over the kinds, each with its count. Also who owns ZeRO-1's optimizer state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

from functional_shard.core.spec import Owned, ParamSharding
from functional_shard.core.tree import TensorSpec, dtype_from_name

if TYPE_CHECKING:
    from functional_shard.planning.plan.plan import Plan

__all__ = ["Census", "census_of", "grouped", "itemsize_of", "param_units", "zero1_owners"]


def zero1_owners(plan: Plan) -> dict[str, int]:
    """The rank index (along the ZeRO-1 axis) that owns each parameter's optimizer state.

    As ZeroRedundancyOptimizer does: largest first (ties in model order), each to the rank with the
    fewest elements so far; under a pipeline, per pp rank over its own stages' parameters.
    """
    owned = [(path, s.optim) for path, s in plan.params.items() if isinstance(s.optim, Owned)]
    if not owned:
        return {}
    n = plan.mesh[owned[0][1].axis]
    loads: dict[Any, list[int]] = {}
    owners = {}
    for path, optim in sorted(owned, key=lambda item: plan.tensors[item[0]].numel, reverse=True):
        stage_loads = loads.setdefault(optim.on, [0] * n)
        rank = stage_loads.index(min(stage_loads))
        owners[path] = rank
        stage_loads[rank] += plan.tensors[path].numel
    return owners


def itemsize_of(name: str | None, tensor: TensorSpec) -> int:
    """Bytes per element: of the dtype ``name`` (mixed precision's) if given, else the tensor's own."""
    return dtype_from_name(name).itemsize if name else tensor.itemsize


Census: TypeAlias = list[tuple[TensorSpec, ParamSharding, tuple[str, ...], int, int]]
"""(tensor, sharding, units, ZeRO-1 owner or -1, count in each unit) for each kind of parameter."""


def _module_units(plan: Plan) -> tuple[set[str], dict[str, str], Callable[[str], str]]:
    """The plan's units, the modules whose unit is known, and a finder of a module's innermost unit.

    The finder answers "" for a module in no unit, and keeps each answer in the known modules.
    """
    units = set(plan.config.fsdp.units if plan.config.fsdp else ())
    # a module of a group of modules is its group's unit; seeded here, found like a unit
    unit_by_module: dict[str, str] = {"": "", **plan.config.group_of()}

    def unit_of_module(module_path: str) -> str:
        unit = unit_by_module.get(module_path)
        if unit is None:
            unit = unit_by_module[module_path] = (
                module_path if module_path in units else unit_of_module(module_path.rpartition(".")[0])
            )
        return unit

    return units, unit_by_module, unit_of_module


def param_units(plan: Plan) -> dict[str, str]:
    """Every parameter's `Plan.unit_of`, by path, from one walk up the module tree.

    Examples:
        >>> from functional_shard.zoo import Block, llama
        >>> units = param_units(fs.shard(llama("tiny"), fs.Mesh(dp=2), fs.fsdp("dp", units=Block)))
        >>> units["layers.1.mlp.up_proj.weight"], units["norm.weight"]
        ('layers.1', '')
    """
    unit_of_module = _module_units(plan)[2]
    # a tied parameter's unit holds all its names: unit_of's own walk
    return {
        path: plan.unit_of(path) if path in plan.aliases else unit_of_module(path.rpartition(".")[0])
        for path in plan.params
    }


def census_of(plan: Plan, owners: Mapping[str, int]) -> Census:
    """(tensor, sharding, FSDP units, ZeRO-1 owner or -1, count in each unit) for the plan's parameters.

    Units holding the same kinds of parameters in the same order share one entry, so the cost model's
    time goes to distinct kinds, not blocks; kinds are told apart by the identity of the objects
    shard() shares between alike blocks.

    Examples:
        >>> plan = fs.shard(nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]), fs.Mesh(dp=2), fs.fsdp())
        >>> [(units, count) for _, _, units, _, count in census_of(plan, {})]
        [(('0', '1', '2'), 1), (('0', '1', '2'), 1)]
    """
    tensors, aliases = plan.tensors, plan.aliases
    units, unit_by_module, unit_of_module = _module_units(plan)

    # each unit's parameters as identities (tensor, sharding, owner), flat: a unit's
    # signature, equal for units alike; and its paths, read back for one unit of a kind
    signature: dict[str, list[int]] = {}
    members: dict[str, list[str]] = {}
    # a unit with no unit (nor grouped module) inside holds every path under it: the
    # parameters of a block come one after another, so most need no lookup at all
    inner = {""}
    for module in (*units, *unit_by_module):
        while module:
            module = module.rpartition(".")[0]
            inner.add(module)
    leaves = units - inner
    prefix, current = "\0", ""  # (no path starts with a NUL)
    for path, sharding in plan.params.items():
        if path.startswith(prefix) and path not in aliases:
            unit = current
        else:
            unit = plan.unit_of(path) if path in aliases else unit_of_module(path.rpartition(".")[0])
            prefix, current = (unit + ".", unit) if unit in leaves else ("\0", "")
        flat = signature.get(unit)
        if flat is None:
            flat = signature[unit] = []
            members[unit] = []
        flat += (id(tensors[path]), id(sharding), owners.get(path, -1) if owners else -1)
        members[unit].append(path)
    kinds: dict[tuple[int, ...], list[str]] = {}
    for unit, flat in signature.items():
        kinds.setdefault(tuple(flat), []).append(unit)
    census: Census = []
    for alike in kinds.values():
        counted: dict[tuple[int, int, int], list[Any]] = {}
        for path in members[alike[0]]:
            tensor, sharding = tensors[path], plan.params[path]
            owner = owners.get(path, -1) if owners else -1
            entry = counted.get((id(tensor), id(sharding), owner))
            if entry is None:
                counted[id(tensor), id(sharding), owner] = [tensor, sharding, owner, 1]
            else:
                entry[3] += 1
        names = tuple(alike)
        census += [(tensor, sharding, names, owner, n) for tensor, sharding, owner, n in counted.values()]
    return census


def grouped(
    census: Census, extra: Callable[[ParamSharding, tuple[str, ...], int], Hashable]
) -> Counter[tuple[Any, ...]]:
    """Count the census by kind: (shape, itemsize, differentiable, sharding, ``extra``) -> how many."""
    by_identity: dict[tuple[int, int, Hashable], list[Any]] = {}
    for tensor, sharding, units, owner, count in census:
        key = (id(tensor), id(sharding), extra(sharding, units, owner))
        entry = by_identity.get(key)
        if entry is None:
            by_identity[key] = [tensor, sharding, key[2], count * len(units)]
        else:
            entry[3] += count * len(units)
    grouped: Counter[tuple[Any, ...]] = Counter()
    for tensor, sharding, more, count in by_identity.values():
        grouped[(tensor.shape, tensor.itemsize, tensor.differentiable, sharding, more)] += count
    return grouped
