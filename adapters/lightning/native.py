"""Lightning's own strategies for a plan, where one expresses it exactly (pure translation)."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

import functional_shard as fs
from functional_shard.core.errors import bullets
from functional_shard.core.validate import entry_point, instance_of, one_of, refuse
from functional_shard.planning.plan.config import PlanConfig

from ._common import _PRECISION_DTYPES

__all__ = ["deepspeed_config", "to_lightning"]

_TARGETS = ("ddp", "fsdp", "deepspeed", "model_parallel")


# DeepSpeed's names for the dtypes it trains and communicates in
# (https://www.deepspeed.ai/docs/config-json/: ``bf16``, ``fp16``, ``communication_data_type``)
_DEEPSPEED_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@entry_point
def deepspeed_config(plan: fs.Plan) -> dict[str, Any]:
    """The DeepSpeed config a ZeRO plan means (pure; Lightning's DeepSpeed defaults kept).

    Each option of the plan has its DeepSpeed key or is refused: ``param_dtype`` is ``bf16`` or
    ``fp16`` enabled (``float32`` both pinned off, so Lightning's precision cannot turn them
    on), ``reduce_dtype`` is ``communication_data_type``, offload is ``offload_optimizer`` and
    ``offload_param``. DeepSpeed's optimizer offload holds the gradient partitions on the host
    too, so offloading the optimizer state alone frees more device memory than the plan
    counts, never less; gradients alone it cannot offload. The plan's FSDP units
    have no counterpart: ZeRO-3 gathers each module's parameters as forward reaches it.

    Raises:
        functional_shard.ShardingError: ``plan`` is no plan, or not a ZeRO / FSDP plan DeepSpeed can run
            (tensor parallel, HSDP, DDP), or it holds an option DeepSpeed has no key for (each
            named: float64, gradients offloaded without the optimizer state, checkpointed modules).

    Examples:
        >>> plan = fs.shard(torch.nn.Linear(4, 4), fs.Mesh(dp=2), fs.zero(2))
        >>> deepspeed_config(plan)["zero_optimization"]["stage"]
        2
    """
    instance_of(plan, fs.Plan, "plan", meaning="fs.shard(model, mesh, policy) makes one")
    config = plan.config
    stages = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
    replicated = config.fsdp is not None and config.fsdp.replicate_axes
    if config.tp is not None or config.data_parallel not in stages or replicated:
        raise fs.ShardingError(
            f"DeepSpeed runs ZeRO over one data-parallel axis; this plan is {config.data_parallel!r}"
            + (f" with tensor parallel over {config.tp.axes}" if config.tp is not None else "")
            + ". Use ShardStrategy(plan), or to_lightning(plan, target='model_parallel')"
        )
    stage = stages[config.data_parallel]
    if problems := _deepspeed_problems(config, stage):
        raise fs.ShardingError(
            bullets(
                "deepspeed_config: DeepSpeed has no setting for these options of the plan:",
                problems,
                "Change the plan as each says, or use ShardStrategy(plan)",
            )
        )
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
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    result: dict[str, Any] = {"zero_optimization": zero, "zero_allow_untested_optimizer": True}
    if config.param_dtype is not None:
        for dtype in ("bfloat16", "float16"):
            result[_DEEPSPEED_DTYPES[dtype]] = {"enabled": config.param_dtype == dtype}
    if config.reduce_dtype is not None:
        result["communication_data_type"] = _DEEPSPEED_DTYPES[config.reduce_dtype]
    return result


# the dtype DeepSpeed's precision plugin casts the model and the inputs to, per Trainer flag
_DEEPSPEED_PRECISIONS = {**_PRECISION_DTYPES, "32-true": "float32"}


class _PlannedDeepSpeed(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy on a plan's config, which pins the dtype DeepSpeed trains in."""

    def __init__(self, config: dict[str, Any], param_dtype: str | None) -> None:
        super().__init__(config=config)
        self._param_dtype = param_dtype

    def setup_environment(self) -> None:
        """Refuse a Trainer precision other than the plan's, then Lightning's (before any process joins).

        The config pins DeepSpeed's bf16 and fp16, so Lightning's precision no longer sets
        them; its plugin still casts the inputs to the flag's dtype, and the model would
        meet inputs of another dtype deep inside DeepSpeed.
        """
        flag = self.precision_plugin.precision
        flagged = _DEEPSPEED_PRECISIONS.get(flag)
        planned = self._param_dtype
        if planned is not None and flagged is not None and planned != flagged:
            flags = [f for f, dtype in _DEEPSPEED_PRECISIONS.items() if dtype == planned]
            raise fs.ShardingError(
                f"to_lightning(target='deepspeed'): the plan trains in {planned} (mixed_precision in its "
                f"policy, pinned in the DeepSpeed config) and precision={flag!r} casts the inputs to "
                f"{flagged}; use precision=" + " or ".join(repr(f) for f in flags) + ", or drop "
                "mixed_precision from the plan (Lightning's precision then sets DeepSpeed's)"
            )
        super().setup_environment()


def _deepspeed_problems(config: PlanConfig, stage: int) -> list[str]:
    # each option of the plan DeepSpeed's config cannot say, with the change that fixes it
    problems = [
        f"{option} {dtype}: DeepSpeed trains and communicates in {', '.join(_DEEPSPEED_DTYPES)} only; "
        f"use fs.mixed_precision with one of them"
        for option, dtype in (("param_dtype", config.param_dtype), ("reduce_dtype", config.reduce_dtype))
        if dtype is not None and dtype not in _DEEPSPEED_DTYPES
    ]
    if config.offload_params and stage != 3:
        problems.append(
            "offload_params: DeepSpeed offloads parameters only at ZeRO stage 3; use fs.zero(3) or fs.fsdp()"
        )
    if config.offload_grads and not config.offload_optimizer:
        problems.append(
            "offload_grads without offload_optimizer: DeepSpeed moves gradients to the host only with "
            "the optimizer state; offload both (fs.offload(params=False)) or neither"
        )
    if config.checkpointed:
        # Lightning's DeepSpeedStrategy passes activation_checkpointing to
        # deepspeed.checkpointing.configure, which recomputes only what forward itself wraps
        problems.append(
            f"checkpointed modules {list(config.checkpointed)}: DeepSpeed recomputes only what the "
            "model's forward wraps in deepspeed.checkpointing.checkpoint; drop fs.checkpointing and wrap "
            "them there, or use to_lightning(plan, module, target='fsdp')"
        )
    return problems


@entry_point
def to_lightning(plan: fs.Plan, module: torch.nn.Module | None = None, *, target: str | None = None) -> Any:
    """Lightning's own strategy for a plan, where one expresses it exactly.

    ``ddp`` plans give ``DDPStrategy``; ZeRO-2/3, FSDP and HSDP give ``FSDPStrategy`` (FSDP1,
    with the plan's units, checkpointing, offload and precision); ZeRO-1 gives
    ``DeepSpeedStrategy(config=deepspeed_config(plan))``, which refuses at setup a Trainer
    precision whose dtype is not the plan's ``mixed_precision``. An option of the plan the strategy
    has no setting for is refused by name, never dropped. 2D plans (FSDP, then tensor
    parallel) give ``ModelParallelStrategy``, whose LightningModule's ``configure_model``
    calls ``fs.apply(plan, self, root="model")``.

    Args:
        plan: the plan.
        module: the module the plan was made for; needed for FSDP units or checkpointed modules.
        target: ``"ddp"``, ``"fsdp"``, ``"deepspeed"`` or ``"model_parallel"``; by default the exact match.

    Raises:
        functional_shard.ShardingError: ``plan`` is no plan; the target cannot express the plan (the
            feature named: pipeline, context and expert parallelism, and tensor parallel inside
            experts modules, none of them do) or one of its
            options (the option named), or DeepSpeed is not installed; at the DeepSpeed
            strategy's setup, a Trainer precision other than the plan's.

    Examples:
        >>> plan = fs.shard(torch.nn.Linear(4, 4), fs.Mesh(dp=2), fs.zero(2))
        >>> to_lightning(plan).sharding_strategy.name
        'SHARD_GRAD_OP'
    """
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    instance_of(plan, fs.Plan, "plan", meaning="fs.shard(model, mesh, policy) makes one")
    if module is not None:
        instance_of(module, torch.nn.Module, "module", meaning="the module the plan was made for")
    if target is not None:
        one_of(target, _TARGETS, "target", meaning="Lightning's strategy to build")
    config = plan.config
    # none of Lightning's own strategies runs these: the strategy built would drop them
    settings = (("pipeline parallel", config.pipeline), ("context parallel", config.context))
    unexpressed = [feature for feature, setting in settings if setting is not None]
    if config.experts is not None and config.experts.axis is not None:
        unexpressed.append(f"expert parallel over {config.experts.axis!r}")
    elif config.experts is not None:
        # no expert axis: tp splits each expert's weights, the experts config holds their top-k only
        tp_experts = config.tensor_parallel_experts or ("its experts modules",)
        more = f" and {len(tp_experts) - 1} more" if len(tp_experts) > 1 else ""
        unexpressed.append(
            f"tensor parallel inside experts modules over {config.tensor_parallel_axes} "
            f"({tp_experts[0]}{more}; no expert axis)"
        )
    if unexpressed:
        raise fs.ShardingError(
            f"to_lightning: the plan runs {unexpressed[0]}, which none of Lightning's own "
            "strategies runs; use ShardStrategy(plan)"
        )
    kind = config.data_parallel
    default = "model_parallel" if config.tp is not None else "fsdp"
    target = target or {"ddp": "ddp", "zero1": "deepspeed"}.get(kind, default)
    if target == "model_parallel":
        return _model_parallel(plan)
    if config.tp is not None:
        raise fs.ShardingError(
            f"tensor parallel over {config.tp.axes}: Lightning's {target} strategy "
            "cannot run it; use ShardStrategy(plan), or to_lightning(plan, target='model_parallel')"
        )
    if target == "deepspeed":
        cfg = deepspeed_config(plan)
        try:
            return _PlannedDeepSpeed(cfg, config.param_dtype)
        except Exception as error:  # Lightning's MisconfigurationException when it is absent
            raise fs.ShardingError(
                f"DeepSpeedStrategy could not be built ({error}); the config it would get is "
                "deepspeed_config(plan)"
            ) from None
    offloaded = [part for part in ("params", "grads", "optimizer") if getattr(config, f"offload_{part}")]
    if target == "ddp":
        if kind != "ddp":
            raise fs.ShardingError(f"DDPStrategy runs replicated plans; this plan is {kind!r}")
        options = {
            "param_dtype": config.param_dtype,
            "reduce_dtype": config.reduce_dtype,
            "offload": offloaded,
            "checkpointed": config.checkpointed,
        }
        if given := [option for option, value in options.items() if value]:
            # apply() casts and offloads through FSDP2 alone: ShardStrategy refuses those beside DDP too
            through_fsdp = [option for option in given if option != "checkpointed"]
            fix = (
                f"Drop them from the plan (Trainer(precision='bf16-mixed') casts under DDPStrategy), or "
                f"plan with fs.fsdp(...): {', '.join(through_fsdp)} run through FSDP2 only, so "
                "ShardStrategy(plan) refuses them beside DDP too"
                if through_fsdp
                else "Drop them from the plan, or use ShardStrategy(plan)"
            )
            raise fs.ShardingError(
                f"DDPStrategy runs replicated plans without options; this plan sets {', '.join(given)}. {fix}"
            )
        return DDPStrategy()
    if target != "fsdp" or kind not in ("zero2", "zero3", "fsdp", "hsdp"):
        raise fs.ShardingError(f"no Lightning strategy {target!r} for a {kind!r} plan")
    if 0 < len(offloaded) < 3:  # FSDPStrategy's one flag would drop the rest, or offload more
        raise fs.ShardingError(
            f"FSDPStrategy offloads params, grads and optimizer state together; this plan offloads "
            f"only {' and '.join(offloaded)}. Use fs.offload(), or to_lightning(plan, target='deepspeed')"
        )
    assert config.fsdp is not None  # (the kinds above are data-parallel)
    if config.fsdp.unit_groups:
        raise fs.ShardingError(
            f"FSDP units of several modules {[list(group) for group in config.fsdp.unit_groups]}: "
            "FSDPStrategy wraps one module per unit; name each module a unit of its own, or use "
            "ShardStrategy(plan)"
        )
    if config.checkpointed and config.checkpoint_policy != "full":
        raise fs.ShardingError(
            f"checkpoint_policy {config.checkpoint_policy!r}: FSDPStrategy recomputes whole modules; "
            "use fs.checkpointing(..., policy='full'), or ShardStrategy(plan)"
        )
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import CustomPolicy

    def by_path(paths: tuple[str, ...], what: str) -> Any:
        if not paths:
            return None
        if module is None:
            raise fs.ShardingError(
                f"the plan names {what} by module path; pass the module: to_lightning(plan, module)"
            )
        modules = dict(module.named_modules(remove_duplicate=False))
        if missing := [path for path in paths if path not in modules]:
            refuse(
                "module",
                type(module).__name__,
                f"the module the plan was made for (the plan's {what} name {missing[0]!r}, which it lacks)",
            )
        chosen = {id(modules[path]) for path in paths}
        return CustomPolicy(lambda m: id(m) in chosen)

    shardings = {"zero2": ShardingStrategy.SHARD_GRAD_OP, "hsdp": ShardingStrategy.HYBRID_SHARD}
    strategy = shardings.get(kind, ShardingStrategy.FULL_SHARD)
    if kind == "hsdp" and not config.fsdp.reshard_after_forward:
        # torch's name for HSDP that keeps gathered parameters from forward to backward
        strategy = ShardingStrategy._HYBRID_SHARD_ZERO2
    precision = None
    if config.param_dtype or config.reduce_dtype:
        precision = MixedPrecision(
            param_dtype=getattr(torch, config.param_dtype) if config.param_dtype else None,
            reduce_dtype=getattr(torch, config.reduce_dtype) if config.reduce_dtype else None,
        )
    return FSDPStrategy(
        sharding_strategy=strategy,
        auto_wrap_policy=by_path(
            tuple(u for u in (config.fsdp.units if config.fsdp else ()) if u), "FSDP units"
        ),
        activation_checkpointing_policy=by_path(config.checkpointed, "checkpointed modules"),
        cpu_offload=config.offload_params,
        mixed_precision=precision,
        device_mesh=_hybrid_sizes(plan) if kind == "hsdp" else None,
    )


def _hybrid_sizes(plan: fs.Plan) -> tuple[int, int]:
    # without a mesh FSDPStrategy's HYBRID_SHARD shards within each node and replicates across
    # nodes, whatever the plan's sizes (and refuses a module without units); its mesh is
    # (replicate, shard), replicate major, as the plan's must be
    assert plan.config.fsdp is not None  # (hsdp is a data-parallel kind)
    replicate, shard = plan.config.fsdp.replicate_axes, plan.config.fsdp.shard_axes
    order = [axis for axis in plan.mesh.axis_names if axis in (*replicate, *shard)]
    if order != [*replicate, *shard]:
        raise fs.ShardingError(
            f"to_lightning: FSDPStrategy lays HSDP out as (replicate, shard), replicate major, but "
            f"{plan.mesh!r} orders the replicate axes {replicate} and shard axes {shard} otherwise; "
            "list the replicate axes first in the mesh, or use ShardStrategy(plan)"
        )
    return math.prod(plan.mesh[a] for a in replicate), math.prod(plan.mesh[a] for a in shard)


def _model_parallel(plan: fs.Plan) -> Any:
    # Lightning's ModelParallelStrategy builds a (data_parallel, tensor_parallel) mesh,
    # data-parallel major; the plan must have that shape and FSDP2 over the first axis
    config, mesh = plan.config, plan.mesh
    axes = mesh.axis_names
    tp_axes = config.tensor_parallel_axes
    shaped = (
        len(axes) == 2
        and config.fsdp is not None
        and config.fsdp.shard_axes == axes[:1]
        and tp_axes == axes[1:]
        and not config.fsdp.replicate_axes
        and config.data_parallel in ("fsdp", "zero3", "zero2")
    )
    if not shaped:
        raise fs.ShardingError(
            f"Lightning's ModelParallelStrategy runs FSDP over one axis and tensor parallel over the "
            f"next (Mesh(dp=..., tp=...)); this plan is {config.data_parallel!r} over "
            f"{config.data_axes} and tensor parallel over {tp_axes} on {mesh!r}. "
            "Use ShardStrategy(plan)"
        )
    return ModelParallelStrategy(data_parallel_size=mesh.sizes[0], tensor_parallel_size=mesh.sizes[1])
