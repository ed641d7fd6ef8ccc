"""Run a plan with torch's own engines.

``apply`` parallelizes a module in place: tensor parallel through ``parallelize_module``, then
data parallel through FSDP2 (``fully_shard``) or DDP (composable ``replicate``); under a
pipeline plan, per stage of this rank, each wrapped in torch's ``PipelineStage``. Nothing here
re-implements a collective, and every check runs before any parameter is touched. The engines
live in `functional_shard.runtime.engines`, one module each; this module orchestrates them and
re-exports their public functions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from functional_shard.core.errors import MeshError, ShardingError
from functional_shard.core.mesh import Mesh
from functional_shard.planning.plan.plan import Plan

# build_device_mesh lives below mesh.py (Mesh.device_mesh uses it); re-exported here
from .device_mesh import build_device_mesh
from .engines.activation_checkpointing import apply_checkpointing
from .engines.applied import APPLIED, Applied, check_plan_and_module, retie
from .engines.checks import check_runnable, engine_problems
from .engines.context.hf import use_hf_attention
from .engines.context.parallel import context_chunks, sequence_context
from .engines.context.ring import check_ring_device
from .engines.data_parallel import apply_data_parallel, reduce_whole_grads
from .engines.evaluation import forward_loss, forward_only
from .engines.experts import apply_expert_parallel
from .engines.materialize import materialize
from .engines.optimizer import check_optimizer, clip_grad_norm_, grad_scaler, optimizer
from .engines.pipeline import apply_pipeline
from .engines.step import forward_backward
from .engines.tensor_parallel import apply_tensor_parallel, refuse_uneven_sequences

__all__ = [
    "apply",
    "build_device_mesh",
    "check_optimizer",
    "check_runnable",
    "clip_grad_norm_",
    "context_chunks",
    "engine_problems",
    "forward_backward",
    "forward_loss",
    "forward_only",
    "grad_scaler",
    "materialize",
    "optimizer",
    "sequence_context",
]


def apply(
    plan: Plan, module: nn.Module, device_mesh: DeviceMesh | None = None, *, root: str = ""
) -> nn.Module:
    """Parallelize ``module`` in place as ``plan`` says, with torch's engines.

    Call it on every rank, after ``torch.distributed`` is initialised and before the
    optimizer is built (use `optimizer`). Under a pipeline plan this rank keeps only its
    stages (the others' modules become pass-throughs, paths unchanged); train it with
    `forward_backward` and evaluate it with `forward_loss` or `forward_only` (calling it
    directly is refused: it would run this rank's stages alone).

    Args:
        plan: the plan, made for this module.
        module: the module, with the same parameters on every rank (same seed).
        device_mesh: the mesh to run on; by default built from ``plan.mesh`` on the module's device type.
        root: the submodule whose ``forward`` runs the model (a LightningModule's ``model``), holding every
            parameter.

    Returns:
        ``module`` itself, parallelized.

    Raises:
        MeshError: no process group, a world size / device mesh that differs from the plan's, or a
            ``device_mesh`` that is no DeviceMesh.
        PlanError: what the engines cannot run, one bullet per parameter, before anything changes.
        ShardingError: ``root`` under a pipeline plan; later, from the forward under sequence
            parallel, a sequence length not a multiple of the tensor-parallel size.

    Examples:
        >>> # on each of 4 ranks:
        >>> # plan = fs.shard(model, fs.Mesh(dp=4), fs.fsdp())
        >>> # fs.apply(plan, model)
        >>> # opt = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-3)
    """
    check_plan_and_module(plan, module, "fs.apply")
    if not dist.is_initialized():
        raise MeshError("fs.apply needs torch.distributed: call dist.init_process_group(...) first")
    if plan.mesh.size != dist.get_world_size():
        raise MeshError(
            f"the plan's {plan.mesh!r} has {plan.mesh.size} devices but the world size is "
            f"{dist.get_world_size()}; plan for this world (an axis of size -1 takes the rest)"
        )
    if device_mesh is None:
        device = next(module.parameters(), torch.empty(0)).device.type
        device_mesh = build_device_mesh(plan.mesh, "cpu" if device == "meta" else device)
    elif not isinstance(device_mesh, DeviceMesh):
        raise MeshError(
            f"apply(device_mesh={type(device_mesh).__name__}): a torch DeviceMesh, or None to build one "
            "from plan.mesh on the module's device"
        )
    elif Mesh.from_device_mesh(device_mesh) != plan.mesh:
        raise MeshError(
            f"the device mesh is {Mesh.from_device_mesh(device_mesh)!r} but the plan is for {plan.mesh!r}"
        )
    if module in APPLIED:
        raise ShardingError("this module is already parallelized; apply a plan to a fresh module")
    if wrapped := _parallelized_by_torch(module):
        raise ShardingError(
            f"this module is already parallelized by torch: {wrapped}; apply a plan to the plain module, "
            "before any of torch's wrappers"
        )
    try:
        module.get_submodule(root)
    except AttributeError:
        raise ShardingError(f"apply(root={root!r}): the module has no such submodule") from None
    outside = [p for p in plan.params if root and not p.startswith(root + ".")]
    if outside:
        raise ShardingError(
            f"apply(root={root!r}): parameters {outside[:3]} lie outside the root, where no engine would "
            "gather or reduce them; move them under it or choose an enclosing root"
        )
    if plan.config.pipeline is not None and root:
        raise ShardingError(
            f"apply(root={root!r}) under a pipeline plan: a stage runs the module's own forward, so "
            "pipeline the model itself (plan and apply it, not the module holding it)"
        )
    check_runnable(plan, module)
    if (context := plan.config.context) is not None:
        check_ring_device(context.engine, device_mesh.device_type, context.axis)
        use_hf_attention(module.get_submodule(root))  # a Hugging Face model's attention: the engine's
    if plan.config.pipeline is not None:
        stage_plan = apply_pipeline(plan, module, device_mesh)
        APPLIED[module] = Applied(plan, device_mesh, stage_plan)
        return module
    apply_tensor_parallel(plan, module, device_mesh)
    apply_expert_parallel(plan, module, device_mesh)
    retie(plan, module)
    apply_checkpointing(plan, module)
    apply_data_parallel(plan, module, device_mesh, root)
    reduce_whole_grads(plan, module, device_mesh)
    refuse_uneven_sequences(plan, module.get_submodule(root))
    APPLIED[module] = Applied(plan, device_mesh)
    return module


def _parallelized_by_torch(module: nn.Module) -> str | None:
    """How torch's own engines parallelized ``module`` already, in words; None if they did not."""
    # torch's engines refuse to wrap twice with a raw AssertionError, or wrap a DDP-held module
    # whose reducer keeps the parameters sharding replaces
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    for path, sub in module.named_modules():
        where = repr(path) if path else "the module itself"
        if isinstance(sub, DistributedDataParallel):
            return f"{where} is a DistributedDataParallel (plan and apply its .module)"
        if isinstance(sub, FSDPModule | FullyShardedDataParallel):
            return f"fully_shard (or FSDP) ran on {where}"
    for path, param in module.named_parameters():
        if isinstance(param, DTensor):
            return f"its parameter {path!r} is a DTensor (parallelize_module or distribute_tensor ran)"
    return None
