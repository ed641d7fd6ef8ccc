"""Which plan each parallelized module runs, and the small helpers every engine shares."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from functional_shard.core.errors import ShardingError
from functional_shard.planning.plan.plan import Plan


@dataclass(frozen=True)
class Applied:
    """A module's plan and the device mesh `apply` ran it on."""

    plan: Plan
    device_mesh: DeviceMesh
    stage_plan: Plan | None = None
    """Under pp, the part of the plan this rank's stages hold (a plan without pp)."""

    @property
    def local_plan(self) -> Plan:
        """The plan of the parameters this rank's module holds."""
        return self.stage_plan or self.plan


# which plan each parallelized module runs, for optimizer(); weak so modules can die
APPLIED: weakref.WeakKeyDictionary[nn.Module, Applied] = weakref.WeakKeyDictionary()


def check_plan_and_module(plan: object, module: object, caller: str) -> None:
    """Refuse anything but a `Plan` then an ``nn.Module``, naming a swapped pair as such."""
    if isinstance(plan, Plan) and isinstance(module, nn.Module):
        return
    if isinstance(plan, nn.Module) and isinstance(module, Plan):
        fix = "swap them"
    elif isinstance(plan, Plan):
        fix = "pass the model the plan was made from"
    else:
        fix = "fs.shard(model, mesh, policy) makes the plan"
    raise ShardingError(
        f"{caller}(plan, module, ...) takes the Plan first, then the nn.Module; it got "
        f"{type(plan).__name__}, then {type(module).__name__}: {fix}"
    )


def applied_with(plan: Plan, module: nn.Module, caller: str) -> Applied:
    """What `apply` recorded for ``module``; refuses a module applied with another plan, or none."""
    check_plan_and_module(plan, module, caller)
    applied = APPLIED.get(module)
    if applied is None or applied.plan != plan:
        raise ShardingError(f"{caller} needs the module fs.apply(plan, module) returned, with the same plan")
    return applied


def axes_mesh(device_mesh: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh:
    """The sub-mesh over ``axes``, flattened into one dimension when there are several."""
    if len(axes) == 1:
        return device_mesh[axes[0]]
    return device_mesh[axes]._flatten("_".join(axes))


def retie(plan: Plan, module: nn.Module) -> None:
    """Point every tied name at its canonical parameter again."""
    # parallelize_module and fully_shard replace Parameter objects; tied names must
    # point at one parameter again: the split one where a style split it under another name
    # (BERT's head bias, split by its decoder's style, is held by the prediction head first)
    from torch.distributed.tensor import DTensor

    for canonical, names in plan.aliases.items():
        held = [module.get_parameter(name) for name in names]
        shared = next((p for p in held if isinstance(p, DTensor)), module.get_parameter(canonical))
        for name in names:
            owner_path, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner_path), attr, shared)
