"""Plans as Lightning strategies: ``Trainer(strategy=ShardStrategy(plan_or_policy))``.

Thin by design: the plan is made by `functional_shard.shard`, run by `functional_shard.apply`
and `functional_shard.materialize`; this module only tells Lightning when to call them.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.strategies.model_parallel import _ParallelBackwardSyncControl
from lightning.fabric.strategies.parallel import ParallelStrategy as FabricParallelStrategy
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.optim import ZeroRedundancyOptimizer

import functional_shard as fs
from functional_shard.apply import build_device_mesh
from functional_shard.policy import as_policy

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FabricShardStrategy", "ShardStrategy", "deepspeed_config", "to_lightning"]


class _RunsAPlan:
    """What the Trainer and the Fabric strategies share.

    The plan (or policy) and its mesh, the process-group settings and joining the group,
    planning and applying, each rank's data slice.
    """

    _plan: fs.Plan | None
    _policy: fs.Policy | None
    _mesh: fs.Mesh
    _seed: int | None

    def _hold(
        self,
        plan: Any,
        mesh: fs.Mesh | None,
        seed: int | None,
        save_distributed_checkpoint: bool,
        process_group_backend: str | None,
        timeout: timedelta | None,
    ) -> None:
        if isinstance(plan, fs.Plan):
            self._plan, self._policy, self._mesh = plan, None, plan.mesh
        else:
            self._plan, self._policy = None, as_policy(plan)
            self._mesh = mesh or fs.Mesh(dp=-1)
        self._seed = seed
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._device_mesh: Any = None

    # joining the process group as Lightning's Fabric does it: plain functions of the rank
    # attributes both kinds of strategy have, used as they are (by reference)
    _setup_distributed = FabricModelParallelStrategy._setup_distributed
    _get_process_group_backend = FabricModelParallelStrategy._get_process_group_backend
    _set_world_ranks = FabricModelParallelStrategy._set_world_ranks

    def setup_environment(self) -> None:
        """Join the process group and build the DeviceMesh of the plan's mesh."""
        super().setup_environment()  # type: ignore[misc]  # the Lightning strategy's
        self._setup_distributed()
        self._device_mesh = self._device_mesh_for(self.world_size, self.root_device.type)  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Split batches over the data-parallel axes only."""
        rank, replicas = self.plan.data_parallel_rank(self.global_rank)  # type: ignore[attr-defined]
        return {"num_replicas": replicas, "rank": rank}

    @property
    def plan(self) -> fs.Plan:
        """The plan this strategy runs (for a policy: available after setup)."""
        if self._plan is None:
            raise fs.ShardingError("the policy is planned in setup(), once the module and world are known")
        return self._plan

    def _device_mesh_for(self, world_size: int, device_type: str) -> Any:
        self._mesh = self._mesh.resolve(world_size)
        return build_device_mesh(self._mesh, device_type)

    def _run_plan(
        self, module: torch.nn.Module, device_mesh: Any, device: torch.device, root: str = ""
    ) -> None:
        if self._plan is None:
            self._plan = fs.shard(module, self._mesh, self._policy)
        fs.apply(self._plan, module, device_mesh, root=root)
        if any(p.is_meta for p in module.parameters()):
            fs.materialize(self._plan, module, device, seed=self._seed)

    def _zero1(
        self, optimizer: torch.optim.Optimizer, module: torch.nn.Module, schedulers: bool = False
    ) -> torch.optim.Optimizer:
        # the plan keeps optimizer state whole on owner ranks; the user built a plain
        # optimizer, so it is rebound to torch's ZeroRedundancyOptimizer, or refused
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        if schedulers or len(optimizer.param_groups) != 1:
            raise fs.ShardingError(
                "a ZeRO-1 plan rebinds the optimizer to ZeroRedundancyOptimizer, which this adapter does "
                "only for one parameter group and no LR scheduler; use fs.zero(2) or fs.fsdp() instead"
            )
        # defaults may hold keys the constructor does not take (AdamW's decoupled_weight_decay)
        accepted = inspect.signature(type(optimizer).__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return fs.optimizer(self.plan, module, type(optimizer), **kwargs)


class ShardStrategy(_RunsAPlan, ParallelStrategy):
    """A Lightning strategy that runs a functional_shard plan (or a policy, planned at setup).

    No ``configure_model`` override is needed: when the LightningModule has one, it runs
    first (so models can be built on the meta device), then the plan is applied and the
    module materialized shard by shard. The distributed sampler splits the data over the
    plan's data-parallel axes; tensor-parallel ranks read the same batches.

    Precision: ``"32-true"``, ``"bf16-mixed"``, and ``"16-mixed"`` with a loss scaler that
    agrees over every rank (`functional_shard.grad_scaler`). Checkpoints (``trainer.save_checkpoint``,
    ``ModelCheckpoint``, ``fit(ckpt_path=...)``) are written aside then renamed, sharded or
    full, for every plan (ZeRO-1's included), and load under any other plan.

    Args:
        plan: a `functional_shard.Plan` for the LightningModule, or a policy
            (``fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")``) planned once the world is known.
        mesh: the mesh for a policy; an axis of size -1 takes what the devices leave.
            Default ``Mesh(dp=-1)``. Ignored for a plan (it carries its mesh).
        seed: seed for materializing a meta-device model (default: Lightning's seed state).
        save_distributed_checkpoint: a folder with one file per rank (default), or one full
            file written by rank 0.
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
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__()
        self.num_nodes = 1
        self._hold(plan, mesh, seed, save_distributed_checkpoint, process_group_backend, timeout)

    @property
    def device_mesh(self) -> Any:
        """The torch DeviceMesh of the plan's mesh (after the processes joined)."""
        if self._device_mesh is None:
            raise fs.ShardingError("the DeviceMesh exists once the processes have joined (setup_environment)")
        return self._device_mesh

    # Lightning's own plumbing of a ParallelStrategy on a DeviceMesh, used as it is (by
    # reference): ShardStrategy cannot subclass ModelParallelStrategy, because Lightning
    # refuses precision="16-mixed" to any instance of it
    root_device = ModelParallelStrategy.root_device
    num_processes = ModelParallelStrategy.num_processes
    process_group_backend = ModelParallelStrategy.process_group_backend
    restore_checkpoint_after_setup = ModelParallelStrategy.restore_checkpoint_after_setup
    lightning_restore_optimizer = ModelParallelStrategy.lightning_restore_optimizer
    _configure_launcher = ModelParallelStrategy._configure_launcher
    set_world_ranks = ModelParallelStrategy.set_world_ranks
    model_to_device = ModelParallelStrategy.model_to_device
    tensor_init_context = ModelParallelStrategy.tensor_init_context
    barrier = ModelParallelStrategy.barrier
    broadcast = ModelParallelStrategy.broadcast
    reduce = ModelParallelStrategy.reduce
    _determine_device_ids = ModelParallelStrategy._determine_device_ids
    teardown = ModelParallelStrategy.teardown

    @property
    def is_distributed(self) -> bool:
        """Yes: Lightning then adds the distributed sampler and syncs logged values."""
        return True

    def setup_environment(self) -> None:
        """Join the process group, build the DeviceMesh, and show it to the LightningModule."""
        super().setup_environment()
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self._device_mesh

    def setup(self, trainer: pl.Trainer) -> None:
        """Plan (if a policy was given), apply, materialize, then set up the optimizers."""
        if self.model is None or self.accelerator is None:
            raise fs.ShardingError(
                "ShardStrategy.setup runs after Lightning connects a model and accelerator"
            )
        self.accelerator.setup(trainer)
        module = self.model
        self._run_plan(module, self.device_mesh, self.root_device, root=_forward_root(module))
        # Lightning clips with torch's clip_grad_norm_, which cannot mix meshes
        self.precision_plugin.clip_grad_by_norm = _clip_by_norm  # type: ignore[method-assign]
        _agree_on_overflow(self.precision_plugin)
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                fs.check_optimizer(optimizer, module)
            if self.plan.config.data_parallel == "zero1":
                schedulers = bool(self.lr_scheduler_configs)
                self.optimizers = [
                    self._zero1(optimizer, module, schedulers) for optimizer in self.optimizers
                ]
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The LightningModule's optimizers, built anew on the parallelized parameters."""
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient reduction on micro-batches that do not end an accumulation.

        Lightning's Trainer path for ModelParallelStrategy reduces on every micro-batch;
        FSDP2 and composable DDP both stop when told, and reduce the sum once.
        """
        assert self.model is not None  # Lightning calls this during fit only
        engines = [m for m in self.model.modules() if hasattr(type(m), "set_requires_gradient_sync")]
        for engine in engines:
            engine.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for engine in engines:
                engine.set_requires_gradient_sync(True)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards, or (``save_distributed_checkpoint=False``) all, on rank 0."""
        assert self.model is not None
        return fs.checkpoint.model_state(self.model, full=not self._save_distributed_checkpoint)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter path, sharded or (on rank 0) full."""
        assert self.model is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        return fs.checkpoint.optimizer_state(
            self.model, optimizer, full=not self._save_distributed_checkpoint
        )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: `load_checkpoint` loaded the module already."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: `load_checkpoint` loaded the optimizers already."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write aside, then rename: a folder with one file per rank, or one full file.

        The folder holds ``state_dict`` and ``optimizer_0``, ``optimizer_1``, ... with the
        rest of Lightning's checkpoint in ``meta.pt``; the file is Lightning's usual one.
        """
        if storage_options is not None:
            raise fs.ShardingError(
                "ShardStrategy.save_checkpoint takes no storage_options: it writes through torch's "
                "distributed checkpoint, not a CheckpointIO plugin"
            )
        path = Path(self.broadcast(filepath))
        optimizers = checkpoint.pop("optimizer_states", [])
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        if self._save_distributed_checkpoint:
            state.update({f"optimizer_{i}": optimizer for i, optimizer in enumerate(optimizers)})
        else:
            state["optimizer_states"] = optimizers
        fs.checkpoint.write(path, state, full=not self._save_distributed_checkpoint, meta=checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of any plan (folder or file) into the module and optimizers.

        Returns:
            The rest of Lightning's checkpoint (loops, callbacks, epoch).
        """
        assert self.model is not None
        assert self.lightning_module is not None
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        return fs.checkpoint.read(
            self.broadcast(checkpoint_path),
            ("state_dict", self.model),
            {f"optimizer_{i}": optimizer for i, optimizer in enumerate(optimizers)},
            strict=self.lightning_module.strict_loading,
            weights_only=bool(weights_only),
        )


def _agree_on_overflow(precision: Any) -> None:
    # float16 loss scaling must skip a step on every rank or on none; Lightning's and
    # Fabric's MixedPrecision plugins both hold a torch GradScaler and its device
    scaler = getattr(precision, "scaler", None)
    if scaler is not None and not isinstance(scaler, ShardedGradScaler):
        precision.scaler = fs.grad_scaler(
            precision.device,
            init_scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
            enabled=scaler.is_enabled(),
        )


def _clip_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
    fs.clip_grad_norm_((p for group in optimizer.param_groups for p in group["params"]), clip_val)


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


def deepspeed_config(plan: fs.Plan) -> dict[str, Any]:
    """The DeepSpeed config a ZeRO plan means (pure; Lightning's DeepSpeed defaults kept).

    Raises:
        functional_shard.ShardingError: the plan is not a ZeRO / FSDP plan DeepSpeed can run
            (tensor parallel, HSDP, DDP).

    Examples:
        >>> plan = fs.shard(torch.nn.Linear(4, 4), fs.Mesh(dp=2), fs.zero(2))
        >>> deepspeed_config(plan)["zero_optimization"]["stage"]
        2
    """
    config = plan.config
    stages = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
    if config.tensor_parallel_axes or config.data_parallel not in stages or config.replicate_axes:
        raise fs.ShardingError(
            f"DeepSpeed runs ZeRO over one data-parallel axis; this plan is {config.data_parallel!r}"
            + (
                f" with tensor parallel over {config.tensor_parallel_axes}"
                if config.tensor_parallel_axes
                else ""
            )
            + ". Use ShardStrategy(plan), or to_lightning(plan, target='model_parallel')"
        )
    stage = stages[config.data_parallel]
    zero: dict[str, Any] = {
        "stage": stage,
        # Lightning's DeepSpeedStrategy defaults, not DeepSpeed's (2e8 elements, overlap on)
        "allgather_bucket_size": 200_000_000,
        "reduce_bucket_size": 200_000_000,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "allgather_partitions": True,
        "reduce_scatter": True,
    }
    if config.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if config.offload_params:
        if stage != 3:
            raise fs.ShardingError(
                "DeepSpeed offloads parameters only at ZeRO stage 3; use fs.zero(3) or fs.fsdp()"
            )
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    result: dict[str, Any] = {"zero_optimization": zero, "zero_allow_untested_optimizer": True}
    if config.param_dtype in ("bfloat16", "float16"):
        result["bf16" if config.param_dtype == "bfloat16" else "fp16"] = {"enabled": True}
    if config.checkpointed:
        result["activation_checkpointing"] = {"partition_activations": False}
    return result


def to_lightning(plan: fs.Plan, module: torch.nn.Module | None = None, *, target: str | None = None) -> Any:
    """Lightning's own strategy for a plan, where one expresses it exactly.

    ``ddp`` plans give ``DDPStrategy``; ZeRO-2/3, FSDP and HSDP give ``FSDPStrategy``
    (FSDP1: SHARD_GRAD_OP / FULL_SHARD / HYBRID_SHARD, the plan's units as its wrap policy,
    its checkpointed modules, CPU offload, mixed precision); ZeRO-1, or ``target="deepspeed"``,
    gives ``DeepSpeedStrategy(config=deepspeed_config(plan))``. 2D plans (FSDP over one axis,
    tensor parallel over the next) give ``ModelParallelStrategy`` with the plan's sizes;
    Lightning's strategy leaves parallelizing to the LightningModule, so its
    ``configure_model`` calls ``fs.apply(plan, self, root="model")``.

    Args:
        plan: the plan.
        module: the module the plan was made for; needed when the plan names FSDP units or
            checkpointed modules (FSDP1 selects modules by object, not by path).
        target: ``"ddp"``, ``"fsdp"``, ``"deepspeed"`` or ``"model_parallel"``; by default
            the exact match.

    Raises:
        functional_shard.ShardingError: the target cannot express the plan (the message names
            the feature), or DeepSpeed is not installed.

    Examples:
        >>> plan = fs.shard(torch.nn.Linear(4, 4), fs.Mesh(dp=2), fs.zero(2))
        >>> to_lightning(plan).sharding_strategy.name
        'SHARD_GRAD_OP'
    """
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    config = plan.config
    kind = config.data_parallel
    default = "model_parallel" if config.tensor_parallel_axes else "fsdp"
    target = target or {"ddp": "ddp", "zero1": "deepspeed"}.get(kind, default)
    if target == "model_parallel":
        return _model_parallel(plan)
    if config.tensor_parallel_axes:
        raise fs.ShardingError(
            f"tensor parallel over {config.tensor_parallel_axes}: Lightning's {target} strategy "
            "cannot run it; use ShardStrategy(plan), or to_lightning(plan, target='model_parallel')"
        )
    if target == "deepspeed":
        cfg = deepspeed_config(plan)
        try:
            return DeepSpeedStrategy(config=cfg)
        except Exception as error:  # Lightning's MisconfigurationException when it is absent
            raise fs.ShardingError(
                f"DeepSpeedStrategy could not be built ({error}); the config it would get is "
                "deepspeed_config(plan)"
            ) from None
    if target == "ddp":
        if kind != "ddp" or config.param_dtype or config.offload_params:
            raise fs.ShardingError(
                f"DDPStrategy runs replicated plans without options; this plan is {kind!r}"
            )
        return DDPStrategy()
    if target != "fsdp" or kind not in ("zero2", "zero3", "fsdp", "hsdp"):
        raise fs.ShardingError(f"no Lightning strategy {target!r} for a {kind!r} plan")
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import CustomPolicy

    def by_path(paths: tuple[str, ...], what: str) -> Any:
        if not paths:
            return None
        if module is None:
            raise fs.ShardingError(
                f"the plan names {what} by module path; pass the module: to_lightning(plan, module)"
            )
        chosen = {id(module.get_submodule(path)) for path in paths}
        return CustomPolicy(lambda m: id(m) in chosen)

    strategy = {"zero2": "SHARD_GRAD_OP", "hsdp": "HYBRID_SHARD"}.get(kind, "FULL_SHARD")
    precision = None
    if config.param_dtype or config.reduce_dtype:
        precision = MixedPrecision(
            param_dtype=getattr(torch, config.param_dtype) if config.param_dtype else None,
            reduce_dtype=getattr(torch, config.reduce_dtype) if config.reduce_dtype else None,
        )
    return FSDPStrategy(
        sharding_strategy=strategy,
        auto_wrap_policy=by_path(tuple(u for u in config.units if u), "FSDP units"),
        activation_checkpointing_policy=by_path(config.checkpointed, "checkpointed modules"),
        cpu_offload=config.offload_params,
        mixed_precision=precision,
    )


def _model_parallel(plan: fs.Plan) -> Any:
    # Lightning's ModelParallelStrategy builds a (data_parallel, tensor_parallel) mesh,
    # data-parallel major; the plan must have that shape and FSDP2 over the first axis
    config, mesh = plan.config, plan.mesh
    axes = mesh.axis_names
    shaped = (
        len(axes) == 2
        and config.shard_axes == axes[:1]
        and config.tensor_parallel_axes == axes[1:]
        and not config.replicate_axes
        and config.data_parallel in ("fsdp", "zero3", "zero2")
    )
    if not shaped:
        raise fs.ShardingError(
            f"Lightning's ModelParallelStrategy runs FSDP over one axis and tensor parallel over the "
            f"next (Mesh(dp=..., tp=...)); this plan is {config.data_parallel!r} over "
            f"{config.data_axes} and tensor parallel over {config.tensor_parallel_axes} on {mesh!r}. "
            "Use ShardStrategy(plan)"
        )
    return ModelParallelStrategy(data_parallel_size=mesh.sizes[0], tensor_parallel_size=mesh.sizes[1])


class FabricShardStrategy(_RunsAPlan, FabricParallelStrategy):
    """The same plans through Fabric: ``L.Fabric(strategy=FabricShardStrategy(plan_or_policy))``.

    ``fabric.setup_module(model)`` plans (for a policy), applies and materializes; build the
    optimizer after it (an optimizer on the replaced parameters is refused by
    ``fabric.setup_optimizers``; under a ZeRO-1 plan a plain one is rebound to
    ``ZeroRedundancyOptimizer``). ``fabric.backward`` and ``fabric.no_backward_sync`` work
    as with Lightning's ModelParallelStrategy; ``precision="16-mixed"`` too (which that one
    refuses), its loss scaler agreeing over ranks (`functional_shard.grad_scaler`).
    ``fabric.save`` / ``fabric.load`` write and read `functional_shard.checkpoint`'s format
    (aside, then renamed; any plan's, ZeRO-1's included), so a checkpoint moves between
    plans, Fabric and the Trainer.

    Examples:
        >>> # fabric = L.Fabric(strategy=FabricShardStrategy(fs.fsdp()), accelerator="cpu", devices=4)
    """

    def __init__(
        self,
        plan: fs.Plan | fs.Policy | Any,
        *,
        mesh: fs.Mesh | None = None,
        seed: int | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__()
        self._num_nodes = 1
        self._backward_sync_control = _ParallelBackwardSyncControl()
        self._parallelize_fn = self._parallelize
        self._hold(plan, mesh, seed, save_distributed_checkpoint, process_group_backend, timeout)
        self._module: torch.nn.Module | None = None

    # Lightning's own plumbing, used as it is (by reference): a subclass of Fabric's
    # ModelParallelStrategy would be refused precision="16-mixed"
    device_mesh = FabricModelParallelStrategy.device_mesh
    checkpoint_io = FabricModelParallelStrategy.checkpoint_io
    root_device = FabricModelParallelStrategy.root_device
    num_nodes = FabricModelParallelStrategy.num_nodes
    num_processes = FabricModelParallelStrategy.num_processes
    process_group_backend = FabricModelParallelStrategy.process_group_backend
    _configure_launcher = FabricModelParallelStrategy._configure_launcher
    setup_module = FabricModelParallelStrategy.setup_module
    module_to_device = FabricModelParallelStrategy.module_to_device
    module_init_context = FabricModelParallelStrategy.module_init_context
    all_reduce = FabricModelParallelStrategy.all_reduce
    barrier = FabricModelParallelStrategy.barrier
    broadcast = FabricModelParallelStrategy.broadcast

    def _parallelize(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        self._run_plan(module, device_mesh, self.root_device)
        _agree_on_overflow(self.precision)
        self._module = module
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Refuse an optimizer built on parameters that sharding replaced.

        Fabric's own strategy would step them and train nothing.
        """
        if self._module is not None:
            fs.check_optimizer(optimizer, self._module)
            if self.plan.config.data_parallel == "zero1":
                optimizer = self._zero1(optimizer, self._module)
        return super().setup_optimizer(optimizer)

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Save the module, its optimizers and other values (aside, then renamed).

        A folder with one file per rank, or (``save_distributed_checkpoint=False``) one file.
        """
        if storage_options is not None or filter is not None:
            raise fs.ShardingError("FabricShardStrategy.save_checkpoint takes no storage_options or filter")
        module_key, module = _the_module(state)
        full = not self._save_distributed_checkpoint
        tensors: dict[str, Any] = {module_key: fs.checkpoint.model_state(module, full=full)}
        rest: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, torch.optim.Optimizer):
                tensors[key] = fs.checkpoint.optimizer_state(module, value, full=full)
            elif key != module_key:
                rest[key] = value.state_dict() if hasattr(value, "state_dict") else value
        fs.checkpoint.write(self.broadcast(path), tensors, full=full, meta=rest)

    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load into the module and optimizers of ``state``, whatever plan saved the checkpoint.

        Other values of ``state`` are replaced (or, with ``load_state_dict``, loaded) in place;
        returns what the checkpoint holds beyond ``state``.
        """
        if not isinstance(state, dict):
            raise fs.ShardingError(
                "fabric.load(path, state) with this strategy needs state as a dict: "
                "{'model': model, 'optimizer': optimizer, ...}"
            )
        module_key, module = _the_module(state)
        optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        rest = fs.checkpoint.read(
            self.broadcast(path),
            (module_key, module),
            optimizers,
            strict=strict,
            weights_only=bool(weights_only),
        )
        for key in [k for k in rest if k in state]:
            value = rest.pop(key)
            if hasattr(state[key], "load_state_dict"):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return rest


def _the_module(state: dict[str, Any]) -> tuple[str, torch.nn.Module]:
    modules = [(key, value) for key, value in state.items() if isinstance(value, torch.nn.Module)]
    if len(modules) != 1:
        raise fs.ShardingError(
            f"a checkpoint of a plan holds one module, found {len(modules)} in the state "
            f"({[key for key, _ in modules]}); save each plan's module on its own"
        )
    return modules[0]
