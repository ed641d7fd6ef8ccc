"""Settings of a plan that `fs.apply` does not run, whatever the model. Pure: it reads the config only.

The runtime's `check_runnable` refuses them before anything runs, and `fs.auto` keeps them out of
what it may choose, so the search never returns a plan that `fs.apply` then refuses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan.config import PlanConfig

__all__ = ["engine_config_problems"]


def engine_config_problems(config: PlanConfig) -> list[str]:
    """Settings apply() does not run, or runs through FSDP2 alone, one line each.

    Several tensor-parallel axes and DDP beside tensor parallel; mixed precision, CPU offload
    and HSDP, which only FSDP2 runs.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(dp=2), fs.replicate("dp") + fs.mixed_precision())
        >>> engine_config_problems(plan.config)
        ['mixed precision with ddp: apply() casts through FSDP2; use fs.fsdp(...)']
    """
    found: list[str] = []
    kind = config.data_parallel
    tp_axes = config.tensor_parallel_axes
    if len(tp_axes) > 1:
        found.append(f"tensor parallel over {tp_axes}: apply() runs one tensor-parallel axis")
    if tp_axes and kind in ("ddp", "zero1"):
        found.append(
            f"{kind} with tensor parallel: torch's DDP does not run over DTensor shards; "
            "use fs.fsdp(...) (or fs.zero(2)) for the data-parallel axis"
        )
    if kind in ("ddp", "zero1", "none"):
        with_kind = "without a data-parallel layer" if kind == "none" else f"with {kind}"
        if config.param_dtype or config.reduce_dtype:
            found.append(f"mixed precision {with_kind}: apply() casts through FSDP2; use fs.fsdp(...)")
        if config.offload_params or config.offload_grads or config.offload_optimizer:
            found.append(f"CPU offload {with_kind}: apply() offloads through FSDP2; use fs.fsdp(...)")
    offloads = {config.offload_params, config.offload_grads, config.offload_optimizer}
    if len(offloads) > 1:
        found.append(
            "offload of only some of params/grads/optimizer: FSDP2 offloads all three together "
            "(the optimizer steps on the CPU); use fs.offload() or to_lightning() for DeepSpeed"
        )
    fsdp = config.fsdp
    if fsdp and (len(fsdp.replicate_axes) > 1 or (fsdp.replicate_axes and len(fsdp.shard_axes) > 1)):
        found.append(
            f"replicate axes {fsdp.replicate_axes} with shard axes {fsdp.shard_axes}: apply() runs "
            "HSDP on one replicate and one shard axis"
        )
    return found
