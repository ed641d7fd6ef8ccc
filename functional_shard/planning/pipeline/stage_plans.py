"""What the ranks running some pipeline stages hold of a plan. Pure.

The pipeline engine runs it and the cost model counts it: one function, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from functional_shard.planning.plan.plan import Plan

from .stages import stage_finder

__all__ = ["stage_plan", "without_pipeline"]


def stage_plan(plan: Plan, stages: Iterable[int]) -> Plan:
    """``plan`` cut down to what the ranks running ``stages`` hold.

    A tensor no stage lists is every stage's. FSDP units stay gathered from forward to backward, as
    torchtitan runs them under a pipeline (else every micro-batch's backward would gather them again).

    Examples:
        >>> import functional_shard as fs
        >>> from functional_shard import zoo
        >>> plan = fs.shard(zoo.llama("tiny"), fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2))
        >>> last = stage_plan(plan, [1])
        >>> "lm_head.weight" in last.params, "embed_tokens.weight" in last.params
        (True, False)
    """
    chosen = frozenset(stages)
    config = plan.config
    stage_of = stage_finder(config.pipeline.stages if config.pipeline else ())

    def held(path: str) -> bool:
        stage = stage_of(path)
        return stage is None or stage in chosen

    def runs(module: str) -> bool:
        return stage_of(module, module=True) in chosen

    params = {path: spec for path, spec in plan.params.items() if held(path)}
    fsdp, tp, experts = config.fsdp, config.tp, config.experts
    local_config = dataclasses.replace(
        config,
        fsdp=fsdp
        and dataclasses.replace(
            fsdp,
            units=tuple(unit for unit in fsdp.units if unit == "" or runs(unit)),
            # a group's modules run on one stage (the planner refuses others)
            unit_groups=tuple(group for group in fsdp.unit_groups if runs(group[0])),
            reshard_after_forward=False,
        ),
        tp=tp
        and dataclasses.replace(
            tp,
            styles=tuple(entry for entry in tp.styles if runs(entry[0])),
            pieces=tuple(entry for entry in tp.pieces if runs(entry[0])),
        ),
        experts=experts
        and dataclasses.replace(experts, modules=tuple(module for module in experts.modules if runs(module))),
        checkpointed=tuple(module for module in config.checkpointed if runs(module)),
    )
    return dataclasses.replace(
        plan,
        params=params,
        buffers={path: spec for path, spec in plan.buffers.items() if held(path)},
        tensors={path: t for path, t in plan.tensors.items() if path in params or held(path)},
        aliases={path: names for path, names in plan.aliases.items() if path in params},
        config=local_config,
    )


def without_pipeline(plan: Plan) -> Plan:
    """``plan`` with no pipeline axis and no stages: what the engines run for one stage.

    Examples:
        >>> import functional_shard as fs
        >>> from functional_shard import zoo
        >>> plan = fs.shard(zoo.llama("tiny"), fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2))
        >>> without_pipeline(stage_plan(plan, [0])).config.pipeline is None
        True
    """
    config = dataclasses.replace(plan.config, pipeline=None)
    return dataclasses.replace(plan, config=config)
