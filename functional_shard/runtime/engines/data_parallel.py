"""Data parallel: FSDP2 (``fully_shard``: ZeRO-2/3, FSDP, HSDP) or DDP (composable ``replicate``).

ZeRO-1 is DDP here; its ``ZeroRedundancyOptimizer`` comes from `optimizer`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from functional_shard.core.tree import dtype_from_name
from functional_shard.planning.plan.plan import Plan

from .applied import axes_mesh
from .experts import expert_data_axes, shard_experts
from .gradients import hook_accumulated_grad

FSDP2_KINDS = ("zero2", "zero3", "fsdp", "hsdp")


def apply_data_parallel(plan: Plan, module: nn.Module, device_mesh: DeviceMesh, root: str) -> None:
    """Run the plan's data parallel on ``module``: FSDP2 units bottom-up then ``root``, or DDP."""
    config, fsdp = plan.config, plan.config.fsdp
    if fsdp is None:
        return
    kind = fsdp.kind
    if kind in ("ddp", "zero1"):
        from torch.distributed._composable import replicate

        group = axes_mesh(device_mesh, config.data_axes).get_group()
        replicate(module.get_submodule(root), process_group=group)
        return
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if fsdp.replicate_axes:  # HSDP: a 2D (replicate, shard) mesh
        fsdp_mesh = device_mesh[(*fsdp.replicate_axes, *fsdp.shard_axes)]
    else:
        fsdp_mesh = axes_mesh(device_mesh, fsdp.shard_axes)
    options: dict[str, Any] = {
        "mesh": fsdp_mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=dtype_from_name(config.param_dtype) if config.param_dtype else None,
            reduce_dtype=dtype_from_name(config.reduce_dtype) if config.reduce_dtype else None,
        ),
        # pinned host memory speeds copies to an accelerator and needs one to exist
        "offload_policy": (
            CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
            if config.offload_params
            else OffloadPolicy()
        ),
    }
    # FSDP2 refuses 0-d parameters ("fully_shard doesn't support scalar parameters"); the
    # plan keeps them whole, so FSDP2 leaves them alone and reduce_whole_grads reduces them
    whole = {module.get_parameter(path) for path in whole_params(plan)}
    if whole:
        options["ignored_params"] = whole
    # expert-parallel experts first (their own mesh), or left to their own gradient hook
    whole |= shard_experts(plan, module, device_mesh, options)
    if whole:
        options["ignored_params"] = whole
    # bottom-up, as fully_shard requires: a unit takes the parameters no inner unit took; a
    # group of modules is one unit (fully_shard of their list), as deep as its shallowest
    units = [(unit,) for unit in fsdp.units if unit] + list(fsdp.unit_groups)
    for members in sorted(units, key=lambda paths: -min(path.count(".") for path in paths)):
        chosen = [module.get_submodule(path) for path in members]
        fully_shard(
            chosen[0] if len(chosen) == 1 else chosen,
            reshard_after_forward=fsdp.reshard_after_forward,
            **options,
        )
    # the root: left to FSDP2's default it stays gathered from forward to backward (an
    # explicit True would make it reshard); ZeRO-2 says False everywhere
    fully_shard(
        module.get_submodule(root),
        reshard_after_forward=None if fsdp.reshard_after_forward else False,
        **options,
    )


def whole_params(plan: Plan) -> list[str]:
    """0-d parameters of an FSDP2 plan: kept whole on every rank, outside FSDP2."""
    if plan.config.data_parallel not in FSDP2_KINDS:
        return []
    return [path for path in plan.params if plan.tensors[path].ndim == 0]


def host_params(plan: Plan, prefix: str = "") -> frozenset[str]:
    """The parameters FSDP2's CPU offload holds, whose shards must be made in host memory.

    FSDP2 refuses offloaded shards anywhere else at the first forward. The parameters it leaves
    alone (0-d ones, experts on an expert axis alone) run where the compute runs, as buffers do.
    ``prefix`` names the submodule the plan was made for, in the module the paths are taken in.

    Examples:
        >>> import functional_shard as fs
        >>> plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp() + fs.offload())
        >>> sorted(host_params(plan))
        ['bias', 'weight']
    """
    config = plan.config
    if not config.offload_params or config.data_parallel not in FSDP2_KINDS:
        return frozenset()
    left_alone = set(whole_params(plan))
    if config.experts is not None and config.experts.axis is not None and not expert_data_axes(plan):
        experts = tuple(f"{path}." for path in config.experts.modules)
        left_alone |= {path for path in plan.params if path.startswith(experts)}
    return frozenset(prefix + path for path in plan.params if path not in left_alone)


_AVERAGED: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()  # whole parameters given a hook


def reduce_whole_grads(plan: Plan, module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Average over the data-parallel ranks the gradients of the parameters FSDP2 leaves whole."""
    # A parameter FSDP2 ignores gets no gradient reduction from it: average its gradient
    # over the data-parallel ranks here, once it is accumulated, as DDP would. Meta
    # parameters get their hook in materialize (to_empty replaces them).
    paths = whole_params(plan)
    if not paths:
        return
    config = plan.config
    group = axes_mesh(device_mesh, config.data_axes).get_group()
    size = plan.mesh.axes_size(config.data_axes)
    reduce_dtype = dtype_from_name(config.reduce_dtype) if config.reduce_dtype else None

    def average(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        buffer = grad if reduce_dtype is None or grad.dtype == reduce_dtype else grad.to(reduce_dtype)
        dist.all_reduce(buffer, group=group)
        buffer.div_(size)
        if buffer is not grad:
            grad.copy_(buffer)

    for path in paths:
        param = module.get_parameter(path)
        # materialize keeps a real parameter object (to_empty swaps only meta ones): one hook
        if not param.is_meta and param not in _AVERAGED:
            hook_accumulated_grad(param, average)
            _AVERAGED.add(param)
