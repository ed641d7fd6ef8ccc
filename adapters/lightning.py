"""Plans as Lightning strategies: ``Trainer(strategy=ShardStrategy(plan_or_policy))``.

Thin by design: the plan is made by `functional_shard.shard`, run by `functional_shard.apply`
and `functional_shard.materialize`; this module only tells Lightning when to call them.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

import functional_shard as fs
from functional_shard.apply import build_device_mesh
from functional_shard.policy import as_policy

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ShardStrategy"]


class ShardStrategy(ModelParallelStrategy):
    """A Lightning strategy that runs a functional_shard plan (or a policy, planned at setup).

    No ``configure_model`` override is needed: when the LightningModule has one, it runs
    first (so models can be built on the meta device), then the plan is applied and the
    module materialized shard by shard. The distributed sampler splits the data over the
    plan's data-parallel axes; tensor-parallel ranks read the same batches.

    Args:
        plan: a `functional_shard.Plan` for the LightningModule, or a policy
            (``fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")``) planned once the world is known.
        mesh: the mesh for a policy; an axis of size -1 takes what the devices leave.
            Default ``Mesh(dp=-1)``. Ignored for a plan (it carries its mesh).
        seed: seed for materializing a meta-device model (default: Lightning's seed state).
        save_distributed_checkpoint: as in Lightning's ModelParallelStrategy.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default by device.
        timeout: process group timeout.

    Raises:
        functional_shard.MeshError: the plan's mesh does not match the number of devices.
        functional_shard.PlanError: the plan does not fit the module, or torch cannot run it.
        functional_shard.ShardingError: an optimizer built on parameters sharding replaced.

    Examples:
        >>> # trainer = L.Trainer(strategy=ShardStrategy(fs.fsdp()), accelerator="cpu", devices=4)
    """

    def __init__(
        self,
        plan: fs.Plan | fs.Policy | Any,
        *,
        mesh: fs.Mesh | None = None,
        seed: int | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(seconds=1800),
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if isinstance(plan, fs.Plan):
            self._plan: fs.Plan | None = plan
            self._policy: fs.Policy | None = None
            self._mesh = plan.mesh
        else:
            self._plan, self._policy = None, as_policy(plan)
            self._mesh = mesh or fs.Mesh(dp=-1)
        self._seed = seed

    @property
    def plan(self) -> fs.Plan:
        """The plan this strategy runs (for a policy: available after setup)."""
        if self._plan is None:
            raise fs.ShardingError("the policy is planned in setup(), once the module and world are known")
        return self._plan

    def setup_environment(self) -> None:
        """Join the process group and build the DeviceMesh of the plan's mesh."""
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        self._mesh = self._mesh.resolve(self.world_size)
        self._device_mesh = build_device_mesh(self._mesh, self.root_device.type)
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Split batches over the data-parallel axes only."""
        plan = self.plan
        coords = plan.mesh.coords(self.global_rank)
        rank, replicas = 0, 1
        for axis in plan.config.data_axes:
            rank = rank * plan.mesh[axis] + coords[axis]
            replicas *= plan.mesh[axis]
        return {"num_replicas": replicas, "rank": rank}

    def setup(self, trainer: pl.Trainer) -> None:
        """Plan (if a policy was given), apply, materialize, then set up the optimizers."""
        if self.model is None or self.accelerator is None:
            raise fs.ShardingError(
                "ShardStrategy.setup runs after Lightning connects a model and accelerator"
            )
        self.accelerator.setup(trainer)
        module = self.model
        if self._plan is None:
            self._plan = fs.shard(module, self._mesh, self._policy)
        fs.apply(self._plan, module, self.device_mesh, root=_forward_root(module))
        if any(p.is_meta for p in module.parameters()):
            fs.materialize(self._plan, module, self.root_device, seed=self._seed)
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                fs.check_optimizer(optimizer, module)
            if self._plan.config.data_parallel == "zero1":
                self.optimizers = [self._zero1(optimizer, module) for optimizer in self.optimizers]
        self.setup_precision_plugin()

    def _zero1(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> torch.optim.Optimizer:
        # the plan keeps optimizer state whole on owner ranks; the LightningModule built a
        # plain optimizer, so it is rebound to torch's ZeroRedundancyOptimizer, or refused
        if self.lr_scheduler_configs or len(optimizer.param_groups) != 1:
            raise fs.ShardingError(
                "a ZeRO-1 plan rebinds the optimizer to ZeroRedundancyOptimizer, which this adapter does "
                "only for one parameter group and no LR scheduler; use fs.zero(2) or fs.fsdp() instead"
            )
        # defaults may hold keys the constructor does not take (AdamW's decoupled_weight_decay)
        accepted = inspect.signature(type(optimizer).__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return fs.optimizer(self.plan, module, type(optimizer), **kwargs)

    def model_to_device(self) -> None:
        """Move what the engines left on another device (buffers, say)."""
        assert self.model is not None
        self.model.to(self.root_device)


def _forward_root(module: torch.nn.Module) -> str:
    # training_step calls the LightningModule's children, never its own forward, so the
    # engines' root hooks go on the one child that holds the parameters
    holders = [name for name, child in module.named_children() if any(True for _ in child.parameters())]
    if len(holders) != 1 or any(True for _ in module.parameters(recurse=False)):
        raise fs.ShardingError(
            f"ShardStrategy needs the LightningModule's parameters inside one child module (e.g. "
            f"self.model), whose forward training_step calls; found them in {holders or 'the module itself'}"
        )
    return holders[0]


def _register() -> None:
    rules = fs.rules.llama
    named: dict[str, tuple[Any, fs.Mesh]] = {
        "fs_ddp": (fs.replicate(), fs.Mesh(dp=-1)),
        "fs_zero1": (fs.zero(1), fs.Mesh(dp=-1)),
        "fs_zero2": (fs.zero(2), fs.Mesh(dp=-1)),
        "fs_zero3": (fs.zero(3), fs.Mesh(dp=-1)),
        "fs_fsdp": (fs.fsdp(), fs.Mesh(dp=-1)),
        "fs_hsdp": (fs.hsdp("node", "gpu"), fs.Mesh(node=2, gpu=-1)),
        "fs_fsdp_tp": (fs.fsdp("dp") + fs.tp(rules, "tp"), fs.Mesh(dp=-1, tp=2)),
    }
    for name, (policy, mesh) in named.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(
                name,
                ShardStrategy,
                description=f"functional_shard: {name[3:]} on {mesh!r}",
                plan=policy,
                mesh=mesh,
            )


_register()
