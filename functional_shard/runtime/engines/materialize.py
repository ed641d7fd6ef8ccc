"""Real parameters for a module built on the meta device, each rank only its shards."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from functional_shard.core.errors import ShardingError
from functional_shard.planning.plan import Plan

from .applied import applied_with, retie
from .data_parallel import reduce_whole_grads
from .pipeline import PassThrough
from .tensor_parallel import packed_window, place_grads_as_params


def materialize(
    plan: Plan,
    module: nn.Module,
    device: str | torch.device = "cpu",
    *,
    seed: int | None = None,
    init: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Give a module built on the meta device real parameters, shard by shard, after `apply`.

    Each rank allocates only its local shards. They are initialised by replaying each
    module's own ``reset_parameters`` (or ``init``) in module order on full-size
    temporaries, one module at a time, and copying in this rank's slice (the plan's
    offsets). So the result equals initialising the whole model in one process with the
    same seed and then sharding it — tied modules consume their random numbers as they do
    in construction, and only the owner's values are kept.

    Args:
        plan: the plan `apply` ran.
        module: the parallelized module, its parameters on the meta device.
        device: where the shards live.
        seed: ``torch.manual_seed`` first, if given.
        init: called on each module (children first in module order) instead of
            ``reset_parameters``.

    Raises:
        ShardingError: the module was not applied with this plan, or a module with
            parameters has no ``reset_parameters`` and no ``init`` was given.

    Examples:
        >>> # with torch.device("meta"): model = Llama(config)
        >>> # fs.apply(plan, model); fs.materialize(plan, model, seed=0)
    """
    from torch.distributed.tensor import DTensor

    applied = applied_with(plan, module, "fs.materialize")
    plan = applied.local_plan  # under pp: this rank's stages only
    missing = [
        path or "<root>"
        for path, sub in module.named_modules()
        if init is None
        and any(True for _ in sub.parameters(recurse=False))
        and not hasattr(sub, "reset_parameters")
    ]
    if missing:
        raise ShardingError(
            f"cannot initialise {missing}: they hold parameters but have no reset_parameters; pass init=..."
        )
    module.to_empty(device=device)
    retie(plan, module)  # to_empty makes new Parameter objects for plain tensors
    if seed is not None:
        torch.manual_seed(seed)
    rank = dist.get_rank()
    owner_of = {name: canonical for canonical, names in plan.aliases.items() for name in names}
    with torch.no_grad():
        for path, sub in module.named_modules():
            replaced = getattr(sub, "replaced", None) if isinstance(sub, PassThrough) else None
            if replaced is not None:  # another stage's: draw its random numbers, keep nothing
                _draw_as(replaced, device, init)
                continue
            direct = dict(sub.named_parameters(recurse=False))
            if not direct:
                continue
            real = dict(sub._parameters)
            for name, param in direct.items():
                shape = param.shape  # a DTensor's shape is the global shape
                sub._parameters[name] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=device))
            try:
                (init or type(sub).reset_parameters)(sub)
                initialised = {name: sub._parameters[name] for name in direct}
            finally:
                sub._parameters.update(real)
            for name, full_value in initialised.items():
                qualified = f"{path}.{name}" if path else name
                if owner_of.get(qualified, qualified) != qualified:
                    continue  # a tied alias: its owner's values win, as in construction
                target = real[name]
                if target is None:  # a parameter slot set to None: nothing to fill
                    continue
                local = target.to_local() if isinstance(target, DTensor) else target
                shape, offset = plan.local_shape_and_offset(qualified, rank)
                packed = getattr(sub, "_fs_packed", None)
                if isinstance(target, DTensor) and packed and name == "weight":
                    value = packed_window(full_value, target, *packed)
                    local.narrow(0, 0, value.shape[0]).copy_(value)
                elif isinstance(target, DTensor):
                    window = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
                    local.copy_(full_value[window])
                else:  # replicated (DDP, or a parameter no layer splits)
                    local.copy_(full_value)
    place_grads_as_params(plan, module)
    reduce_whole_grads(plan, module, applied.device_mesh)
    return module


def _draw_as(
    replaced: nn.Module, device: str | torch.device, init: Callable[[nn.Module], None] | None
) -> None:
    # as the loop above, on temporaries only: the random numbers drawn, the values dropped
    for sub in replaced.modules():
        direct = dict(sub.named_parameters(recurse=False))
        if not direct:
            continue
        if init is None and not hasattr(sub, "reset_parameters"):
            raise ShardingError(
                f"cannot initialise {type(sub).__name__} (another pipeline stage's): it holds parameters "
                "but has no reset_parameters; pass init=..."
            )
        real = dict(sub._parameters)
        for name, param in direct.items():
            sub._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device))
        try:
            (init or type(sub).reset_parameters)(sub)  # type: ignore[attr-defined]
        finally:
            sub._parameters.update(real)
