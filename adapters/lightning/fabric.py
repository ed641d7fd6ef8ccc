"""`FabricShardStrategy`: the same plans run by ``lightning.Fabric``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.strategies.parallel import ParallelStrategy as FabricParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.wrappers import _FabricModule

import functional_shard as fs
from functional_shard.runtime.engines.optimizer import stale_parameters

from ._common import (
    _agree_on_overflow,
    _refuse_two_precisions,
    _RunsAPlan,
    clip_grad_value,
    gradient_sync_blocked,
    refuse_a_dtensor,
)

__all__ = ["FabricShardStrategy"]


class FabricShardStrategy(_RunsAPlan, FabricParallelStrategy):
    """The same plans through Fabric: ``L.Fabric(strategy=FabricShardStrategy(plan_or_policy))``.

    ``fabric.setup_module(model)`` plans (for a policy), applies and materializes (or fills
    from ``weights=``); build the optimizer after it. ``fabric.backward`` and
    ``fabric.no_backward_sync`` work as usual, and ``precision="16-mixed"`` too, its loss
    scaler agreeing over ranks (`functional_shard.grad_scaler`).

    One loop for every plan: ``step = strategy.forward_backward(model, loss_fn)`` gives
    ``step(inputs, targets) -> loss`` (`functional_shard.forward_backward` under the
    precision's autocast and loss scaler); under a pipeline plan ``fabric.backward`` is
    refused, since a stage's forward alone is not the model's. ``fabric.save`` /
    ``fabric.load`` use `functional_shard.runtime.checkpoint.api`'s format, so a checkpoint
    moves between plans, Fabric and the Trainer. The arguments are `ShardStrategy`'s.

    Examples:
        >>> # fabric = L.Fabric(strategy=FabricShardStrategy(fs.fsdp()), accelerator="cpu", devices=4)
    """

    def _start_state(self) -> None:
        self._num_nodes = 1
        self._backward_sync_control = _EveryEngineSyncControl()
        self._parallelize_fn = self._parallelize
        self._module: torch.nn.Module | None = None
        # set up before any module: checked once the module is, whose parameters sharding replaces
        self._early_optimizers: list[torch.optim.Optimizer] = []

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
    barrier = FabricModelParallelStrategy.barrier
    broadcast = FabricModelParallelStrategy.broadcast

    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """``fabric.all_reduce`` of each rank's own tensor (Fabric's), a DTensor refused with the fix."""
        refuse_a_dtensor(tensor, "fabric.all_reduce")
        return FabricModelParallelStrategy.all_reduce(self, tensor, group, reduce_op)  # type: ignore[arg-type]  # Fabric's, by reference

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        """``fabric.all_gather`` of each rank's own tensor (Fabric's), a DTensor refused with the fix."""
        refuse_a_dtensor(tensor, "fabric.all_gather")
        return super().all_gather(tensor, group, sync_grads)

    def _parallelize(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        self._run_plan(module, device_mesh, self.root_device)
        _refuse_two_precisions(self.plan, self.precision, "FabricShardStrategy")
        _agree_on_overflow(self.precision)
        self._module = module
        early, self._early_optimizers = self._early_optimizers, []
        for optimizer in early:
            _refuse_stale(optimizer, module)
            if self.plan.config.data_parallel == "zero1":  # too late to rebind it
                raise fs.ShardingError(
                    "FabricShardStrategy: a ZeRO-1 plan rebinds the optimizer to ZeroRedundancyOptimizer "
                    f"when it is set up, which this one was before the module. {_OPTIMIZER_AFTER}"
                )
            fs.check_optimizer(optimizer, module)
        return module

    def forward_backward(
        self, module: torch.nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> Callable[..., torch.Tensor]:
        """``step(inputs, targets) -> loss``: one forward and backward under the plan, any plan.

        `functional_shard.forward_backward` on the module ``fabric.setup_module`` returned,
        run in the precision's autocast and scaled by its loss scaler (float16); under a
        pipeline plan the schedule runs every micro-batch. Step the optimizer after it.
        Packed rows pass their layout by keyword, ``step(batch.tokens, batch.labels,
        positions=batch.positions, document_ids=batch.document_ids)``; under cp they are
        cut by attention work.

        Raises:
            functional_shard.ShardingError: ``module`` is not the one this strategy set up.
        """
        inner = module.module if isinstance(module, _FabricModule) else module
        if self._module is None or inner is not self._module:
            raise fs.ShardingError(
                "FabricShardStrategy.forward_backward needs the module fabric.setup_module(model) returned"
            )
        scaler = getattr(self.precision, "scaler", None)
        step = fs.forward_backward(self.plan, inner, loss_fn, scaler=scaler)
        precision = self.precision

        def in_precision(
            inputs: torch.Tensor, targets: torch.Tensor, **packed: torch.Tensor | None
        ) -> torch.Tensor:
            with precision.forward_context():
                return step(inputs, targets, **packed)

        return in_precision

    def backward(
        self, tensor: torch.Tensor, module: torch.nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        """``fabric.backward``; refused under a pipeline plan, whose schedule runs the backward."""
        if self._plan is not None and self._plan.config.pipeline is not None:
            raise fs.ShardingError(
                f"fabric.backward under a pipeline plan (axis {self._plan.config.pipeline.axis!r}): the "
                "schedule runs every micro-batch's forward and backward, and a stage's output is not the "
                "model's. Use step = fabric.strategy.forward_backward(model, loss_fn); loss = step(x, y)"
            )
        super().backward(tensor, module, *args, **kwargs)

    def clip_gradients_norm(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the global norm over every shard, mesh and stage (`functional_shard.clip_grad_norm_`).

        torch's ``clip_grad_norm_`` would take each pipeline stage's norm alone.
        """
        self.precision.unscale_gradients(optimizer)
        parameters = (p for group in optimizer.param_groups for p in group["params"])
        total = fs.clip_grad_norm_(parameters, float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {float(total)}")
        return total

    def clip_gradients_value(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_val: float | int
    ) -> None:
        """Clamp each gradient into ``[-clip_val, clip_val]``, under any plan.

        torch's ``clip_grad_value_`` fails where a plan mixes DTensor and plain gradients (TP).
        """
        self.precision.unscale_gradients(optimizer)
        clip_grad_value(self.precision.main_params(optimizer), float(clip_val))

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Refuse an optimizer built on parameters that sharding replaced.

        Fabric's own strategy would step them and train nothing; ``fabric.setup(model,
        optimizer)`` hands over such an optimizer always. One set up before the module is
        checked when the module is.
        """
        if self._module is None:
            self._early_optimizers.append(optimizer)
        else:
            _refuse_stale(optimizer, self._module)
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
        if storage_options is not None:
            raise fs.ShardingError(
                "FabricShardStrategy.save_checkpoint takes no storage_options: it writes through torch's "
                "distributed checkpoint, not a CheckpointIO plugin; drop storage_options"
            )
        if filter is not None:
            raise fs.ShardingError(
                "FabricShardStrategy.save_checkpoint takes no filter: the module and its optimizers are "
                "saved whole, to load under any plan; drop filter= (fabric.load(path, state) loads what "
                "state holds and returns the rest)"
            )
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
        returns what the checkpoint holds beyond ``state``. Nothing in the file runs as code
        unless ``weights_only=False`` (Lightning's ``None`` is torch's safe default), and a
        checkpoint that is damaged or does not fit is refused before anything changes.
        """
        if not isinstance(state, dict):
            raise fs.ShardingError(
                "fabric.load(path, state) with this strategy needs state as a dict: "
                "{'model': model, 'optimizer': optimizer, ...}"
            )
        module_key, module = _the_module(state)
        optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        path = self.broadcast(path)
        values = [key for key in state if key != module_key and key not in optimizers]

        def asked_but_not_saved(saved: dict[str, Any]) -> list[str]:
            # Fabric's strict load refuses a key of the state the checkpoint lacks, where it
            # would keep the value it had, unsaid; checked before anything loads
            absent = [key for key in values if key not in saved]
            if not strict or not absent:
                return []
            return [
                f"fabric.load: the checkpoint at {path} holds no {', '.join(map(repr, absent))} of the "
                "state asked for, and nothing was loaded; drop them from the state, or pass strict=False "
                "to keep their current values"
            ]

        rest = fs.checkpoint.read(
            path,
            (module_key, module),
            optimizers,
            strict=strict,
            # Lightning's None is torch's safe default; only an explicit False trusts the file
            trust=weights_only is False,
            check=asked_but_not_saved,
        )
        for key in [k for k in rest if k in state]:
            value = rest.pop(key)
            if hasattr(state[key], "load_state_dict"):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return rest


class _EveryEngineSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync`` for every plan: FSDP2's and replicate's engines both stop reducing."""

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> AbstractContextManager[None]:
        """Within: gradients accumulate on this rank, reduced at the next backward outside."""
        return gradient_sync_blocked(module, enabled)


_OPTIMIZER_AFTER = (
    "Set the module up first, then build the optimizer over its parameters: model = fabric.setup_module("
    "model); optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), ...))"
)


def _refuse_stale(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> None:
    # fabric.setup(model, optimizer), or setup_optimizers before setup_module, hands one over
    if stale := stale_parameters(optimizer, module):
        raise fs.ShardingError(
            f"FabricShardStrategy: the optimizer holds {stale} parameters that are not the module's "
            "current ones: it was built before sharding replaced them, or set up before the module. "
            + _OPTIMIZER_AFTER
        )


def _the_module(state: dict[str, Any]) -> tuple[str, torch.nn.Module]:
    modules = [(key, value) for key, value in state.items() if isinstance(value, torch.nn.Module)]
    if len(modules) != 1:
        raise fs.ShardingError(
            f"a checkpoint of a plan holds one module, found {len(modules)} in the state "
            f"({[key for key, _ in modules]}); save each plan's module on its own"
        )
    return modules[0]
