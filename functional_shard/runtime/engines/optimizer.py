"""The optimizer a plan places, and the clipping and loss scaling that agree across meshes."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import entry_point, instance_of, one_of, refuse
from functional_shard.planning.plan.plan import Plan

from .applied import applied_with, axes_mesh
from .pipeline import pipeline_group_of


def check_optimizer(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """Refuse an optimizer of stale parameters, or one that steps DTensors and tensors together.

    Sharding replaces Parameter objects: an optimizer built before would silently train nothing.
    torch's foreach and fused kernels refuse groups that mix DTensors and tensors (tensor
    parallel keeps the norms plain), so such groups with ``foreach`` unset step per tensor.

    Raises:
        ShardingError: some of the optimizer's parameters are not the module's; or a group
            that mixes DTensors and tensors asks for ``foreach=True`` or ``fused=True``.

    Examples:
        >>> # fs.check_optimizer(torch.optim.AdamW(model.parameters()), model)
    """
    from torch.distributed.tensor import DTensor

    instance_of(optimizer, torch.optim.Optimizer, "optimizer", meaning="the optimizer first, then its module")
    instance_of(module, nn.Module, "module", meaning="the module fs.apply parallelized")
    if stale := stale_parameters(optimizer, module):
        raise ShardingError(
            f"the optimizer holds {stale} parameters that are not the module's current ones: it was "
            "built before sharding replaced them. Build it after fs.apply, e.g. "
            "fs.optimizer(plan, module, torch.optim.AdamW, lr=...)"
        )
    names = {id(p): name for name, p in module.named_parameters()}
    for index, group in enumerate(optimizer.param_groups):
        kinds = {isinstance(p, DTensor) for p in group["params"]}
        if len(kinds) < 2:
            continue
        asked = [option for option in ("foreach", "fused") if group.get(option)]
        if asked:
            plain = next(names[id(p)] for p in group["params"] if not isinstance(p, DTensor))
            raise ShardingError(
                f"optimizer param group {index}: {asked[0]}=True steps DTensors and plain tensors "
                f"(e.g. {plain!r}) in one kernel, which torch refuses; leave {asked[0]} unset (those "
                "groups then step per tensor), or give the plain parameters a group of their own"
            )
        if "foreach" in group:
            group["foreach"] = False


def stale_parameters(optimizer: torch.optim.Optimizer, module: nn.Module) -> int:
    """How many of ``optimizer``'s parameters are not ``module``'s own (those sharding replaced, say).

    Examples:
        >>> layer = nn.Linear(2, 2)
        >>> stale_parameters(torch.optim.SGD(layer.parameters(), lr=0.1), nn.Linear(2, 2))
        2
    """
    current = {id(p) for p in module.parameters()}
    return sum(id(p) not in current for group in optimizer.param_groups for p in group["params"])


@entry_point
def optimizer(
    plan: Plan, module: nn.Module, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
) -> torch.optim.Optimizer:
    """An optimizer whose state sits where the plan's ``optim`` specs say.

    ZeRO-1 plans get torch's ``ZeroRedundancyOptimizer`` over the data-parallel group;
    other plans the plain optimizer over the module's (DTensor) shards.

    Raises:
        ShardingError: ``module`` was not parallelized by `apply` with this plan, or ``optimizer_class``
            is not a class of optimizers (an optimizer already built, say).

    Examples:
        >>> # opt = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-3)
    """
    applied = applied_with(plan, module, "fs.optimizer")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        refuse(
            "optimizer_class",
            type(optimizer_class).__name__
            if not isinstance(optimizer_class, type)
            else optimizer_class.__name__,
            "a torch.optim.Optimizer class",
            meaning="pass the class and its arguments, fs.optimizer(plan, module, torch.optim.AdamW, lr=...)",
        )
    params: Iterable[nn.Parameter] = module.parameters()
    if plan.config.data_parallel == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        assert plan.config.fsdp is not None  # (zero1 is a data-parallel kind)
        group = axes_mesh(applied.device_mesh, plan.config.fsdp.shard_axes).get_group()
        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=group, **kwargs)
    result = optimizer_class(params, **kwargs)
    check_optimizer(result, module)
    return result


@entry_point
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients by their global norm, across every shard of every mesh and every stage.

    Unlike torch's ``clip_grad_norm_``, it works when parameters live on different meshes
    (FSDP-only norms beside FSDP x TP projections), under CPU offload (gradients in host memory,
    reduced on the mesh's device), and combines the stages of a pipeline, so every rank clips by
    the norm of the whole model.

    Args:
        parameters: the parameters whose gradients to clip (``model.parameters()``), or one of them.
        max_norm: the largest total norm kept, at least 0 (``inf`` measures without clipping).
        norm_type: the order of the norm, above 0 (``float("inf")`` for the largest entry).

    Returns:
        The total norm before clipping.

    Raises:
        ShardingError: a module given for its parameters, a negative or NaN ``max_norm`` (it would
            flip or blank the gradients), or a ``norm_type`` that is not a number above 0 (the shards'
            norms, and the stages', combine into the total only for such orders).

    Examples:
        >>> # fs.clip_grad_norm_(model.parameters(), 1.0)
    """
    from torch.distributed.tensor import DTensor

    if isinstance(parameters, nn.Module):
        refuse(
            "parameters",
            type(parameters).__name__,
            "parameters, not a module",
            meaning="pass module.parameters()",
        )
    if not _real(max_norm) or not max_norm >= 0:
        refuse("max_norm", repr(max_norm), "a number of at least 0", meaning="the largest total norm kept")
    if not _real(norm_type) or not norm_type > 0:
        refuse(
            "norm_type",
            repr(norm_type),
            "a number above 0",
            meaning="the order of the norm: 2.0, or float('inf') for the largest entry",
        )
    # one tensor is its own parameter list, as torch takes it (iterating it would yield its rows)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else "local"
        groups.setdefault(key, []).append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        if isinstance(norm, DTensor) and norm.to_local().device.type != norm.device_mesh.device_type:
            # CPU offload keeps the gradients in host memory, where NCCL reduces nothing: the
            # shards' norms are reduced on the mesh's device (from_local moves them there)
            norm = DTensor.from_local(norm.to_local(), norm.device_mesh, norm.placements, run_check=False)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    pp_group = pipeline_group_of(params)
    if not norms and pp_group is None:
        return torch.tensor(0.0)
    device = norms[0].device if norms else torch.device("cpu")
    total = (
        torch.linalg.vector_norm(torch.stack([n.float().to(device) for n in norms]), norm_type)
        if norms
        else torch.zeros((), device=device)
    )
    if pp_group is not None:
        total = _across_stages(total, norm_type, pp_group)
    coefficient = float(max_norm) / (float(total) + 1e-6)
    if coefficient < 1.0:  # as torch: scale only when the norm is above the limit
        for grad in grads:
            grad.mul_(coefficient)
    return total


def _real(value: object) -> bool:
    # a plain or numpy number; not a bool, nor a str that torch would convert with float()
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _across_stages(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    # the stages hold disjoint parameters: p-th powers add up, an infinity norm is the max
    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.float() ** norm_type
    dist.all_reduce(powered, group=group)
    return powered ** (1.0 / norm_type)


@entry_point
def grad_scaler(device: str = "cuda", **kwargs: Any) -> torch.amp.GradScaler:
    """A loss scaler for float16 training under any plan: every rank skips the same steps.

    It unscales each rank's local shards, then agrees over every rank: torch's ``GradScaler``
    decides per rank, and its ``ShardedGradScaler`` fails on gradients of different meshes.

    Args:
        device: where the scale lives: the ranks' device (``"cuda"``, also under CPU offload, or
            ``"cpu"``); either way the overflow flags are reduced where the process group can.
        kwargs: as for ``torch.amp.GradScaler`` (``init_scale``, ``growth_interval``, ``enabled``, ...).

    Examples:
        >>> # scaler = fs.grad_scaler("cuda"); scaler.scale(loss).backward()
        >>> # scaler.step(optimizer); scaler.update()
    """
    # torch's GradScaler takes any device name, and a typo scales nothing where the gradients are
    one_of(device, ("cuda", "cpu"), "device", meaning="where the gradients live: the plan's ranks run on one")
    if not dist.is_initialized():
        raise ShardingError(
            "fs.grad_scaler agrees over the process group: initialise torch.distributed first"
        )
    return _LocalShardsGradScaler(device, **kwargs)


def _local_grads_of(optimizer: torch.optim.Optimizer) -> Any:
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor

    # the same storage as the DTensor gradients, so unscaling in place unscales them
    local = [
        SimpleNamespace(grad=p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    return SimpleNamespace(param_groups=[{"params": local}])


class _LocalShardsGradScaler(ShardedGradScaler):
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        # the base class then all-reduces found_inf over the whole world; it moves flags off the
        # host itself only for a scaler on an accelerator
        found = super()._unscale_grads_(_local_grads_of(optimizer), inv_scale, found_inf, allow_fp16)
        backends = dist.get_backend_config(self.process_group)
        return {where: flag.to(reduced_on(flag.device, backends)) for where, flag in found.items()}


def reduced_on(device: torch.device, backends: str) -> torch.device:
    """Where a process group of ``backends`` (``dist.get_backend_config``) reduces a tensor on ``device``.

    NCCL reduces no host tensors, and CPU offload keeps the gradients (and so their overflow
    flags) in host memory: those go to the group's device.

    Examples:
        >>> host = torch.device("cpu")
        >>> reduced_on(host, "cuda:nccl"), reduced_on(host, "cpu:gloo,cuda:nccl")
        (device(type='cuda'), device(type='cpu'))
    """
    kinds = [entry.partition(":")[0] for entry in backends.split(",") if ":" in entry]
    if not kinds or device.type in kinds:
        return device
    return torch.device(kinds[0])
