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
from functional_shard.runtime.engines.data_parallel import host_params
from functional_shard.runtime.engines.materialize import move

from ._common import (
    _agree_on_overflow,
    _refuse_two_precisions,
    _RunsAPlan,
    clip_grad_value,
    gradient_sync_blocked,
    refuse_a_dtensor,
)
from .pipeline_loop import (
    _RunsSchedules,
    forward_root,
    refuse_under_context_parallel,
    refuse_under_pipeline,
)
from .pipeline_loop import training_loss as training_loss

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ShardStrategy"]


class ShardStrategy(_RunsAPlan, _RunsSchedules, ParallelStrategy):
    """A Lightning strategy that runs a functional_shard plan (or a policy, planned at setup).

    The LightningModule's ``configure_model`` (if any) runs first, so models can be built on the
    meta device; then the plan is applied and the module materialized shard by shard, or filled
    from ``weights=``. The sampler splits the data over the plan's data-parallel axes.

    Under a pipeline plan ``training_step`` returns `training_loss` ``(self, inputs, targets)``
    and the LightningModule defines ``loss_fn(outputs, targets)``; evaluation steps call
    `evaluation_loss` and `model_outputs`. Lightning's optimization then steps, clips,
    accumulates and logs as usual (docs/lightning.md, "Pipeline plans").

    Precision: ``"32-true"``, ``"*-true"``, ``"bf16-mixed"``, and ``"16-mixed"`` with a loss
    scaler that agrees over every rank; others are refused. Checkpoints are written aside then
    renamed, sharded or full, and load under any other plan.

    Args:
        plan: a `functional_shard.Plan` for the LightningModule, or a policy planned once the world is known.
        mesh: the mesh for a policy (default ``Mesh(dp=-1)``); for a plan, its own or None.
        seed: seed for materializing a meta-device model (default: Lightning's seed state).
        save_distributed_checkpoint: a folder with one file per rank (default), or one full file.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default by device.
        timeout: how long (a ``timedelta``) a collective waits for a hung or dead peer before a
            `CollectiveTimeoutError`.
        weights: a Hugging Face folder the model child starts from, loaded once the plan is applied.
        weights_mapping: which model tensor each folder tensor fills (``load_hf``'s ``mapping``).
        trust_weights: read pickled ``pytorch_model.bin`` files too (``load_hf``'s ``trust``).

    Raises:
        functional_shard.MeshError: the mesh does not fit ``devices`` x ``num_nodes`` (as the
            Trainer is made, before any process starts).
        functional_shard.PlanError: the plan does not fit the module, or torch cannot run it.
        functional_shard.ShardingError: an optimizer built on replaced parameters; ``weights`` is
            not a folder, or does not fit the model; ``mesh`` is no Mesh, or not a plan's own;
            ``timeout`` is no ``timedelta``.

    Examples:
        >>> # trainer = L.Trainer(strategy=ShardStrategy(fs.fsdp()), accelerator="cpu", devices=4)
        >>> # fine-tune a published model (configure_model builds it on the meta device):
        >>> # ShardStrategy(fs.fsdp("dp"), weights="Llama-3.2-1B/")
    """

    def _start_state(self) -> None:
        self.num_nodes = 1
        self._pipeline_step: Callable[..., torch.Tensor] | None = None
        self._schedule_grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self._evaluations: dict[str, Callable[..., torch.Tensor]] = {}

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
    tensor_init_context = ModelParallelStrategy.tensor_init_context
    barrier = ModelParallelStrategy.barrier
    broadcast = ModelParallelStrategy.broadcast
    reduce = ModelParallelStrategy.reduce
    _determine_device_ids = ModelParallelStrategy._determine_device_ids
    teardown = ModelParallelStrategy.teardown

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        """``self.all_gather`` of each rank's own tensor (Lightning's), a DTensor refused with the fix."""
        refuse_a_dtensor(tensor, "all_gather")
        return super().all_gather(tensor, group, sync_grads)

    def set_world_ranks(self) -> None:
        """Lightning's, after refusing a world the mesh does not fit (called as the Trainer is made)."""
        self._refuse_another_world()
        ModelParallelStrategy.set_world_ranks(self)  # type: ignore[arg-type]

    _host: frozenset[str] = frozenset()  # the parameters FSDP2's CPU offload holds (known in setup)

    def model_to_device(self) -> None:
        """Lightning's move to the root device, but the shards FSDP2 offloads stay in host memory."""
        assert self.model is not None
        move(self.model, self.root_device, self._host)

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
        root = forward_root(module)
        if self._context_or_loss_parallel() and not self._pipelined():
            refuse_under_context_parallel(trainer, module)
        if self._pipelined():
            refuse_under_pipeline(trainer, module, self._pipeline_axis())
            if self._plan is not None and any(path.startswith(f"{root}.") for path in self._plan.params):
                raise fs.ShardingError(
                    f"ShardStrategy(plan) with a pipeline plan made for the LightningModule (paths like "
                    f"{next(iter(self._plan.params))!r}): a stage runs the model's own forward, so plan "
                    f"the model inside it, fs.shard(module.{root}, mesh, policy), or pass the policy"
                )
            self._run_plan(module.get_submodule(root), self.device_mesh, self.root_device)
        else:
            self._run_plan(module, self.device_mesh, self.root_device, root=root)
        # Lightning clips with torch's clip_grad_norm_ and clip_grad_value_, which cannot mix
        # meshes, nor DTensors with plain tensors
        self.precision_plugin.clip_grad_by_norm = _clip_by_norm  # type: ignore[method-assign]
        self.precision_plugin.clip_grad_by_value = _clip_by_value  # type: ignore[method-assign]
        _refuse_two_precisions(self.plan, self.precision_plugin, "ShardStrategy")
        _refuse_weight_averaging(trainer, module, self._pipelined())
        _agree_on_overflow(self.precision_plugin)
        self.model = self.precision_plugin.convert_module(module)
        self._host = host_params(self.plan, prefix=f"{root}." if self._pipelined() else "")
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

    def backward(
        self, closure_loss: torch.Tensor, optimizer: torch.optim.Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Lightning's backward, or under a pipeline or cp plan its hooks only (the step ran the backward)."""
        if self._plan is None or not self._runs_its_own_backward():
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self._hand_back_grads(closure_loss)
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
        with gradient_sync_blocked(self.model):
            yield

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


def _refuse_weight_averaging(trainer: pl.Trainer, module: torch.nn.Module, pipelined: bool) -> None:
    """Refuse StochasticWeightAveraging where the plan shards or splits the parameters.

    The callback copies the module in its setup hook, before the plan applies: it would
    average whole tensors with DTensor shards (torch raises deep in the first update) or,
    under a pipeline, with one stage's parameters (seen: the ranks hang). Lightning refuses
    it to its own sharded strategies alike.
    """
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from torch.distributed.tensor import DTensor

    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    averaging = [type(c).__name__ for c in callbacks if isinstance(c, StochasticWeightAveraging)]
    sharded = any(isinstance(p, DTensor) for p in module.parameters())
    if averaging and (sharded or pipelined):
        held = "split into pipeline stages" if pipelined else "sharded (DTensors)"
        raise fs.ShardingError(
            f"ShardStrategy: the callback {averaging[0]} averages a copy of the whole module made before "
            f"the plan applies, and this plan's parameters are {held}; drop the callback, or run a plan "
            "that keeps every parameter whole on each rank (fs.replicate() or fs.zero(1))"
        )


def _clip_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
    fs.clip_grad_norm_((p for group in optimizer.param_groups for p in group["params"]), clip_val)


def _clip_by_value(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
    clip_grad_value((p for group in optimizer.param_groups for p in group["params"]), clip_val)


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
