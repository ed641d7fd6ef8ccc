"""`ShardStrategy`: a plan (or a policy) run by ``lightning.Trainer``; the registered ``fs_*`` names."""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

import functional_shard as fs

from ._common import _agree_on_overflow, _RunsAPlan

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ShardStrategy"]


class ShardStrategy(_RunsAPlan, ParallelStrategy):
    """A Lightning strategy that runs a functional_shard plan (or a policy, planned at setup).

    No ``configure_model`` override is needed: when the LightningModule has one, it runs
    first (so models can be built on the meta device), then the plan is applied and the
    module materialized shard by shard. The distributed sampler splits the data over the
    plan's data-parallel axes; tensor-parallel ranks read the same batches.

    Pipeline plans (``fs.pipeline("pp", microbatches=4) + fs.fsdp("dp")``): the schedule runs
    each step's forward and backward over its micro-batches, so ``training_step`` returns
    `training_loss` ``(self, inputs, targets)`` and the LightningModule names its loss as a
    ``loss_fn(outputs, targets)`` method (a mean over the batch); Lightning's automatic
    optimization then steps, clips and logs as usual, and its backward is skipped (the
    schedule ran it). The plan is made for the one child module that holds the parameters
    (``fs.shard(module.model, ...)``; a policy is planned on it). What cannot work under a
    schedule is refused by name before fit starts: ``accumulate_grad_batches > 1`` (raise the
    micro-batches instead), manual optimization, validation, test and predict loops, and
    precision plugins other than ``"32-true"`` / ``"*-mixed"``.

    Expert-parallel plans (``fs.fsdp("dp") + fs.ep("dp")``, alone or under a pipeline) need
    nothing more: the sampler splits batches over the ep axis too, and each forward
    dispatches its tokens to the ranks holding their experts; accumulation, clipping,
    validation and ``"*-mixed"`` precision run as with any other plan.

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
        timeout: how long a collective waits for a hung or dead peer; past it the run ends
            with a `functional_shard.CollectiveTimeoutError` naming the collective and the
            ranks (joining the process group still waits for slow starts).

    Raises:
        functional_shard.MeshError: the plan's mesh does not match the number of devices.
        functional_shard.PlanError: the plan does not fit the module, or torch cannot run it.
        functional_shard.ShardingError: an optimizer built on parameters sharding replaced.

    Examples:
        >>> # trainer = L.Trainer(strategy=ShardStrategy(fs.fsdp()), accelerator="cpu", devices=4)
    """

    def _start_state(self) -> None:
        self.num_nodes = 1
        self._pipeline_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._schedule_grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

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
        root = _forward_root(module)
        if self._context_or_loss_parallel() and not self._pipelined():
            _refuse_under_context_parallel(trainer, module)
        if self._pipelined():
            _refuse_under_pipeline(trainer, module, self._pipeline_axis())
            if self._plan is not None and any(path.startswith(f"{root}.") for path in self._plan.params):
                raise fs.ShardingError(
                    f"ShardStrategy(plan) with a pipeline plan made for the LightningModule (paths like "
                    f"{next(iter(self._plan.params))!r}): a stage runs the model's own forward, so plan "
                    f"the model inside it, fs.shard(module.{root}, mesh, policy), or pass the policy"
                )
            self._run_plan(module.get_submodule(root), self.device_mesh, self.root_device)
        else:
            self._run_plan(module, self.device_mesh, self.root_device, root=root)
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

    def _pipeline_axis(self) -> str | None:
        if self._plan is not None:
            return self._plan.config.pipeline_axis
        layer = self._policy.pipeline if self._policy is not None else None
        return layer.axis if layer is not None else None

    def _pipelined(self) -> bool:
        return self._pipeline_axis() is not None

    def _context_or_loss_parallel(self) -> bool:
        # cp cuts sequences and attends over them; loss parallel runs forward and backward
        # under torch's loss_parallel(): either way fs.forward_backward runs the step
        if self._plan is not None:
            config = self._plan.config
            return config.context_parallel_axis is not None or config.loss_parallel
        if self._policy is None:
            return False
        return self._policy.context_parallel is not None or any(
            layer.loss_parallel for layer in self._policy.tensor_parallel
        )

    def _runs_its_own_backward(self) -> bool:
        # a pipeline's schedule, or fs.forward_backward's step under cp or loss parallel
        return self._pipelined() or self._context_or_loss_parallel()

    def pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run the plan's schedule (or cp's step) on the module's ``loss_fn``: the batch's mean loss.

        Under context parallel the step cuts this rank's chunks of the whole sequences and
        returns the mean over every token of its cp group (`fs.forward_backward`).

        The step function (and torch's schedule with it) is built once, with the precision
        plugin's loss scaler if any. Lightning zeroes gradients *between* ``training_step``
        and ``backward``, after the schedule has run the backward here: the schedule's
        gradients are set aside and handed back in `backward`.
        """
        module = self.lightning_module
        if module is None:
            raise fs.ShardingError("ShardStrategy.pipeline_step runs during fit, after setup")
        if self._pipeline_step is None:
            root = _forward_root(module)
            scaler = getattr(self.precision_plugin, "scaler", None)
            if self._pipelined():
                self._pipeline_step = fs.forward_backward(
                    self.plan, module.get_submodule(root), module.loss_fn, scaler=scaler
                )
            else:  # cp: the plan was applied to the LightningModule, its forward is root's
                self._pipeline_step = fs.forward_backward(
                    self.plan, module, module.loss_fn, scaler=scaler, root=root
                )
        params = list(module.parameters())
        for param in params:  # the last step's gradients: accumulation is refused under pp
            param.grad = None
        loss = self._pipeline_step(inputs, targets)
        self._schedule_grads = [(param, param.grad) for param in params]
        for param in params:
            param.grad = None
        return loss

    def backward(
        self, closure_loss: torch.Tensor, optimizer: torch.optim.Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Lightning's backward, or under a pipeline or cp plan its hooks only (the step ran the backward)."""
        if self._plan is None or not self._runs_its_own_backward():
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        if closure_loss.requires_grad:
            raise fs.ShardingError(
                "under a pipeline plan training_step must return training_loss(self, inputs, targets) "
                "(functional_shard.adapters.lightning), whose schedule runs the backward; it returned a "
                "loss with a graph, which would leave the stages without gradients"
            )
        if self._schedule_grads is None:
            raise fs.ShardingError(
                "under a pipeline plan training_step must return training_loss(self, inputs, targets) "
                "(functional_shard.adapters.lightning), which runs the schedule; no schedule ran this step"
            )
        for param, grad in self._schedule_grads:
            param.grad = grad
        self._schedule_grads = None
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

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

        Nothing in the file runs as code unless ``weights_only=False`` (Lightning's ``None``
        is torch's safe default), and a checkpoint that is damaged or does not fit is refused
        before anything changes.

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
            # Lightning's None is torch's safe default; only an explicit False trusts the file
            trust=weights_only is False,
        )


def training_loss(module: pl.LightningModule, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of a training step under any strategy; return it from ``training_step``.

    Under a `ShardStrategy` with a pipeline plan, the plan's schedule runs the forward and
    the backward of every micro-batch and this returns their mean loss (detached, the same
    on every rank of the pipeline); Lightning's backward is then skipped. Under a
    context-parallel plan the step cuts this rank's chunks of the whole sequences, runs the
    forward and backward over them and returns the mean loss over every token of its cp
    group (detached); Lightning's backward is skipped too. Otherwise it is
    ``module.loss_fn(child(inputs), targets)``, with ``child`` the module holding the
    parameters, for Lightning to backward as usual. So one ``training_step`` runs any plan.

    Args:
        module: the LightningModule, with a ``loss_fn(outputs, targets)`` method.
        inputs: this rank's batch of inputs (its data-parallel slice, as the sampler gives).
        targets: the matching targets.

    Returns:
        The mean loss of the batch.

    Examples:
        >>> # def training_step(self, batch, index):
        >>> #     return training_loss(self, batch[:, :-1], batch[:, 1:])
    """
    if not callable(getattr(module, "loss_fn", None)):
        raise fs.ShardingError(
            f"training_loss: {type(module).__name__} needs a loss_fn(outputs, targets) method, a mean "
            "over the batch (under a pipeline plan the last stage calls it on each micro-batch)"
        )
    strategy = module.trainer.strategy if module._trainer is not None else None
    if isinstance(strategy, ShardStrategy) and strategy._runs_its_own_backward():
        return strategy.pipeline_step(inputs, targets)
    return module.loss_fn(module.get_submodule(_forward_root(module))(inputs), targets)


def _refuse_under_pipeline(trainer: pl.Trainer, module: pl.LightningModule, axis: str | None) -> None:
    # each is a way the Trainer would run the stages outside the schedule, or scale the
    # schedule's gradients wrongly; refused by name before the plan is applied
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.utilities.model_helpers import is_overridden

    problems = []
    if trainer.state.fn != TrainerFn.FITTING:
        problems.append(
            f"trainer.{trainer.state.fn.value}(): a pipeline's stages run only inside the training "
            "schedule; evaluate under a plan without pp (the checkpoint loads under any plan)"
        )
    if trainer.accumulate_grad_batches > 1:
        problems.append(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}: the schedule already "
            "accumulates over its micro-batches; plan pipeline(microbatches=...) larger and feed "
            "bigger batches instead"
        )
    if not module.automatic_optimization:
        problems.append(
            "manual optimization (automatic_optimization = False): the schedule runs the backward, "
            "so manual_backward has nothing to do; keep automatic optimization"
        )
    validates = trainer.state.fn == TrainerFn.FITTING and trainer.limit_val_batches != 0
    if validates and is_overridden("validation_step", module):
        problems.append(
            "validation (validation_step with limit_val_batches != 0): a stage's forward alone is "
            "not the model's; pass limit_val_batches=0 and validate under a plan without pp"
        )
    precision = trainer.precision_plugin
    if type(precision) not in (Precision, MixedPrecision):
        problems.append(
            f"the precision plugin {type(precision).__name__}: under a schedule only '32-true' and the "
            "'*-mixed' autocast plugins run (the schedule runs the backward, not the plugin)"
        )
    if not callable(getattr(module, "loss_fn", None)):
        problems.append(
            f"no loss named: {type(module).__name__} needs a loss_fn(outputs, targets) method (a mean "
            "over the batch) for the schedule to call on the last stage"
        )
    _refuse(f"a pipeline plan (axis {axis!r})", problems)


def _refuse_under_context_parallel(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    # cp's step runs the backward inside training_loss (it must attend over the whole
    # sequence in the backward too, and loss parallel's backward must run under
    # loss_parallel()) and hands the gradients to Lightning's backward
    problems = []
    if trainer.accumulate_grad_batches > 1:
        problems.append(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}: each step's gradients are handed "
            "over whole; feed bigger batches instead"
        )
    if not module.automatic_optimization:
        problems.append("manual optimization (automatic_optimization = False): the step runs the backward")
    if not callable(getattr(module, "loss_fn", None)):
        problems.append(
            f"no loss named: {type(module).__name__} needs a loss_fn(outputs, targets) method (a mean over "
            "its tokens), which the step calls on this rank's chunks of the sequences"
        )
    _refuse("a context-parallel or loss-parallel plan", problems)


def _refuse(plan: str, problems: list[str]) -> None:
    if problems:
        raise fs.ShardingError(
            f"ShardStrategy with {plan} cannot run this fit:\n" + "\n".join(f"* {p}" for p in problems)
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
