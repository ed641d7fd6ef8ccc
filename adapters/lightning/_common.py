"""What the Trainer and the Fabric strategies share: the plan, the process group, the apply."""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

import functional_shard as fs
from functional_shard.core.errors import counted
from functional_shard.core.validate import instance_of, refuse
from functional_shard.core.validate import path as check_path
from functional_shard.planning.policy.types import as_policy
from functional_shard.runtime.engines.applied import APPLIED
from functional_shard.runtime.timeouts import set_timeout

# the strategy methods Lightning calls that run collectives: a step (forward, backward, the
# optimizer step and its closure), the strategy's own collectives, checkpoints
_COLLECTIVE_METHODS = (
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    "backward",
    "optimizer_step",
    "pipeline_step",
    "clip_gradients_norm",
    "clip_gradients_value",
    "barrier",
    "broadcast",
    "reduce",
    "all_reduce",
    "all_gather",
    "save_checkpoint",
    "load_checkpoint",
)


def _watched(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def watched(*args: Any, **kwargs: Any) -> Any:
        with fs.watch_collectives():
            return method(*args, **kwargs)

    watched.__fs_watched__ = True  # type: ignore[attr-defined]
    return watched


def _watched_steps(method: Callable[..., Any]) -> Callable[..., Any]:
    # Fabric's forward_backward returns the step the loop calls: that is what to watch
    @functools.wraps(method)
    def watched(*args: Any, **kwargs: Any) -> Any:
        return _watched(method(*args, **kwargs))

    watched.__fs_watched__ = True  # type: ignore[attr-defined]
    return watched


# on a module a strategy planned: the policy and mesh it planned from, so that another strategy
# of the same policy (a second Trainer's fit or test of the fitted module) runs the plan it has
_PLANNED_FROM = "_functional_shard_planned_from"


class _RunsAPlan:
    """What the Trainer and the Fabric strategies share.

    The plan (or policy) and its mesh, the process-group settings and joining the group,
    planning and applying, each rank's data slice.
    """

    _plan: fs.Plan | None
    _policy: fs.Policy | None
    _mesh: fs.Mesh
    _seed: int | None
    _weights: Path | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Watch the collectives of each strategy's steps, collectives and checkpoints.

        A peer that hangs or died past ``timeout`` ends the run with a
        `functional_shard.CollectiveTimeoutError` naming the collective and the ranks, not
        with torch's words (``Timed out waiting 3000ms for recv``).
        """
        super().__init_subclass__(**kwargs)
        for name in _COLLECTIVE_METHODS:
            method = getattr(cls, name, None)
            if callable(method) and not getattr(method, "__fs_watched__", False):
                setattr(cls, name, _watched(method))
        steps = getattr(cls, "forward_backward", None)
        if callable(steps) and not getattr(steps, "__fs_watched__", False):
            setattr(cls, "forward_backward", _watched_steps(steps))  # noqa: B010 (a method, set on the class)

    def __init__(
        self,
        plan: fs.Plan | fs.Policy | Any,
        *,
        mesh: fs.Mesh | None = None,
        seed: int | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        weights: str | os.PathLike[str] | None = None,
        weights_mapping: Mapping[str, Any] | Callable[[str], Any] | None = None,
        trust_weights: bool = False,
    ) -> None:
        super().__init__()  # the Lightning strategy this class is mixed into
        self._hold(plan, mesh, seed, save_distributed_checkpoint, process_group_backend, timeout)
        self._weights = _weights_folder(type(self).__name__, weights, weights_mapping, trust_weights)
        self._weights_mapping = weights_mapping
        self._trust_weights = trust_weights
        self._start_state()

    def _start_state(self) -> None:
        """Each strategy's own fields, set after Lightning's and the plan's."""

    def _hold(
        self,
        plan: Any,
        mesh: fs.Mesh | None,
        seed: int | None,
        save_distributed_checkpoint: bool,
        process_group_backend: str | None,
        timeout: timedelta | None,
    ) -> None:
        if mesh is not None:
            instance_of(mesh, fs.Mesh, "mesh", meaning="as fs.Mesh(dp=-1)")
        if timeout is not None:
            seconds = repr(timeout) if type(timeout) in (int, float) else "..."
            instance_of(
                timeout,
                timedelta,
                "timeout",
                meaning=f"as Lightning's strategies take it: timeout=timedelta(seconds={seconds})",
            )
        if isinstance(plan, fs.Plan):
            if mesh is not None and mesh != plan.mesh:
                # the plan is laid out on its own mesh: another one would be silently ignored
                refuse(
                    "mesh",
                    repr(mesh),
                    f"not the plan's own mesh, {plan.mesh!r}",
                    meaning="drop mesh= (a plan carries its mesh), or plan for this mesh, or pass the "
                    "policy with mesh=",
                )
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

    def _set_world_ranks(self) -> None:
        """Fabric's, after refusing a world the mesh does not fit (Fabric calls it when it is made)."""
        self._refuse_another_world()
        FabricModelParallelStrategy._set_world_ranks(self)  # type: ignore[arg-type]

    def _refuse_another_world(self) -> None:
        """Refuse devices x num_nodes that the mesh cannot fill, as soon as Lightning says them.

        Lightning says them when the Trainer or Fabric is made, before it starts or joins any
        process, and says the same on every rank: so every rank refuses alike, where joining a
        world of the wrong size would wait for ranks that never come (num_nodes on one machine).
        """
        devices, nodes = self.num_processes, self.num_nodes  # type: ignore[attr-defined]
        if not devices:  # Lightning has not said its devices yet
            return
        world, mesh = devices * nodes, self._mesh
        fixed = math.prod(size for size in mesh.sizes if size != -1)
        if (fixed == world) if mesh.is_resolved else (world % fixed == 0):
            return
        told = f"devices={devices}" + (f" x num_nodes={nodes}" if nodes != 1 else "")
        if not mesh.is_resolved:
            held = f"{mesh!r}'s fixed axes hold {counted(fixed, 'device')}"
            problem = f"{held}, which does not divide the world size {world}"
            fix = f"set {'devices x num_nodes' if nodes != 1 else 'devices'} to a multiple of {fixed}"
        else:
            planned = self._plan is not None
            held = f"{'the plan' if planned else 'mesh='} {mesh!r} has {counted(fixed, 'device')}"
            problem = f"{held} but the world size is {world}"
            remake = "make the plan" if planned else "give mesh= (or size -1 on one axis)"
            per_node = f"devices={fixed // nodes}" if fixed % nodes == 0 else f"devices x num_nodes = {fixed}"
            fix = f"{remake} for {counted(world, 'rank')}, or set {per_node}"
        raise fs.MeshError(f"{type(self).__name__}: {problem} ({told}); {fix}")

    def setup_environment(self) -> None:
        """Join the process group and build the DeviceMesh of the plan's mesh."""
        super().setup_environment()  # type: ignore[misc]  # the Lightning strategy's
        joins = not torch.distributed.is_initialized()
        collectives = self._timeout
        if joins and collectives is not None:
            # joining waits for every process to start (Lightning's default, 30 minutes):
            # a peer still importing is not hung; ``timeout`` is for the collectives after
            self._timeout = max(collectives, default_pg_timeout or collectives)
        try:
            self._setup_distributed()
        finally:
            self._timeout = collectives
        if joins and collectives is not None:
            set_timeout(collectives.total_seconds())
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
        return self._mesh.device_mesh(device_type)

    def _run_plan(
        self, module: torch.nn.Module, device_mesh: Any, device: torch.device, root: str = ""
    ) -> None:
        if self._runs_it_already(module):
            return
        if self._plan is None:
            self._plan = fs.shard(module, self._mesh, self._policy)
            setattr(module, _PLANNED_FROM, (self._policy, self._mesh))
        fs.apply(self._plan, module, device_mesh, root=root)
        if self._weights is not None:
            # meta or materialized, each rank's shards are filled from the folder: no random init
            fs.checkpoint.load_hf(
                self._weights,
                module,
                mapping=self._weights_mapping,
                trust=self._trust_weights,
                device=device,
                root=root,
            )
        elif any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            fs.materialize(self._plan, module, device, seed=self._seed)

    def _runs_it_already(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` runs this strategy's plan already (an earlier fit or setup applied it)."""
        applied = APPLIED.get(module)
        if applied is None:
            return False
        if self._plan is None:
            # planned from this policy and mesh by an earlier strategy: its plan; otherwise (an
            # earlier strategy ran a plan, or fs.apply did) the policy planned for the module,
            # which reads the classes its code wrote, as it did before the module was parallelized
            recorded = getattr(module, _PLANNED_FROM, None) == (self._policy, self._mesh)
            self._plan = applied.plan if recorded else fs.shard(module, self._mesh, self._policy)
        if applied.plan == self._plan:
            return True
        who = type(self).__name__
        raise fs.ShardingError(
            f"{who}: the module runs another plan already (an earlier strategy applied it) and a module is "
            f"parallelized once; pass the plan it runs, {who}(earlier_strategy.plan), or the same policy "
            "and mesh, or build a fresh module"
        )

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


def refuse_a_dtensor(tensor: object, collective: str) -> None:
    """Refuse a DTensor to a collective over the ranks' own tensors (all_gather, all_reduce).

    A DTensor is one tensor over every rank already; gloo and NCCL have no rule for it
    (torch raises "c10d.allgather_.default does not have a sharding strategy registered").
    """
    if isinstance(tensor, DTensor):
        raise fs.ShardingError(
            f"{collective} of a DTensor (shape {tuple(tensor.shape)}, {tensor.placements} on the mesh): it "
            "is one tensor over the ranks already, and the collective takes each rank's own; pass "
            "tensor.full_tensor() for the whole tensor, or tensor.to_local() for this rank's shard"
        )


def clip_grad_value(parameters: Iterable[torch.Tensor], clip_val: float) -> None:
    """Clamp every gradient into ``[-clip_val, clip_val]``, one kind of tensor at a time.

    torch's ``clip_grad_value_`` clamps them all in one foreach call, which refuses plain
    tensors beside DTensors (a tensor-parallel plan's replicated norms beside its sharded
    projections) and DTensors of several meshes; DTensor's own clamp keeps a partial sum whole.
    """
    kinds: dict[object, list[torch.Tensor]] = {}
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None:
            kind = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            kinds.setdefault(kind, []).append(parameter)
    for same_kind in kinds.values():
        torch.nn.utils.clip_grad_value_(same_kind, clip_value=clip_val)


@contextmanager
def gradient_sync_blocked(module: torch.nn.Module, enabled: bool = True) -> Generator[None, None, None]:
    """Within: backward accumulates gradients without reducing them (FSDP2's and replicate's engines).

    Lightning's own switch finds FSDP2 modules only; a replicated plan's module (DDP, ZeRO-1)
    would reduce on every micro-batch, unsaid.
    """
    switches = [
        getattr(m, "set_requires_gradient_sync")  # noqa: B009 (FSDP2's and replicate's, found by name)
        for m in module.modules()
        if enabled and hasattr(type(m), "set_requires_gradient_sync")
    ]
    for switch in switches:
        switch(False)
    try:
        yield
    finally:
        for switch in switches:
            switch(True)


def _weights_folder(
    who: str, weights: str | os.PathLike[str] | None, mapping: object, trust: bool
) -> Path | None:
    """The folder ``weights=`` names, checked to be one (its files are read at setup, on every rank)."""
    if weights is None:
        if mapping is not None or trust:
            raise fs.ShardingError(
                f"{who}: weights_mapping= and trust_weights= say how to read weights=, which is not "
                "given; pass weights=FOLDER too, or drop them"
            )
        return None
    folder = check_path(weights, "weights")
    if folder.is_dir():
        return folder
    if folder.exists():
        problem, fix = (
            "a file, not a folder",
            f"pass the folder that holds it, weights={str(folder.parent)!r}",
        )
    else:
        problem = "no such folder"
        fix = (
            "pass a Hugging Face model's folder (config.json and model.safetensors, as save_pretrained "
            "writes them) at a path every node sees"
        )
    raise fs.ShardingError(
        f"{who}(weights={str(weights)!r}): {problem}; {fix}, or weights=None to initialise the model as usual"
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


# the dtype each Lightning precision flag computes in; "32-true" and "64-true" compute in
# the parameters' own dtype
_PRECISION_DTYPES = {
    "16-mixed": "float16",
    "16-true": "float16",
    "bf16-mixed": "bfloat16",
    "bf16-true": "bfloat16",
}


def _refuse_two_precisions(plan: fs.Plan, precision: Any, who: str) -> None:
    """Refuse a plan that computes in one low precision under a Lightning flag for another."""
    flag = getattr(precision, "precision", None)
    flagged = _PRECISION_DTYPES.get(flag) if isinstance(flag, str) else None
    planned = plan.config.param_dtype
    if planned is not None and flagged is not None and planned != flagged:
        # the mixed flag of the plan's dtype, where Lightning has one (none for float32)
        flags = [f for f, d in _PRECISION_DTYPES.items() if d == planned and f.endswith("-mixed")]
        raise fs.ShardingError(
            f"{who}: the plan computes in {planned} (mixed_precision in its policy) and precision="
            f"{flag!r} in {flagged}: autocast would recast the plan's {planned} copies, and some ops "
            f"refuse the mix. Keep one: drop mixed_precision from the policy, or use precision="
            + " or ".join(repr(f) for f in [*flags, "32-true"])
        )
