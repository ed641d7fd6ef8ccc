"""The `Plan` made of placed shardings; under a pipeline each tensor goes to its stage's pp rank."""

from __future__ import annotations

from functional_shard.core.errors import PolicyError
from functional_shard.core.mesh import Mesh
from functional_shard.core.spec import ParamSharding
from functional_shard.core.tree import ModelTree

from .pipeline.stages import stage_finder, tied_across_stages_fix
from .plan.config import PlanConfig
from .plan.plan import Plan

__all__ = ["assemble"]


def _staged(
    tree: ModelTree, mesh: Mesh, groups: tuple[dict[str, ParamSharding], ...], config: PlanConfig
) -> None:
    """Place every tensor of a pipelined plan on the pp rank of its stage, in ``groups``.

    A buffer in no stage stays on every rank; shared shardings stay shared (the cost model counts on it).

    Raises:
        PolicyError: a tied parameter whose names fall in different stages.
    """
    pipeline = config.pipeline
    if pipeline is None:
        return
    stage_of = stage_finder(pipeline.stages)
    copies: dict[tuple[int, int], ParamSharding] = {}
    problems = []
    for placed in groups:
        for path, sharding in placed.items():
            names = tree.aliases.get(path, (path,))
            stages = {name: stage_of(name) for name in names}
            if len(set(stages.values())) > 1:
                where = ", ".join(f"{name} in stage {stage}" for name, stage in stages.items())
                fix = tied_across_stages_fix(stages.values(), len(pipeline.stages))
                problems.append(
                    f"{where} are one tied parameter; the pipeline engine does not reduce a tied "
                    f"gradient between stages. Fix: {fix}"
                )
                continue
            stage = stages[path]
            if stage is None:
                continue
            rank = pipeline.coordinate_of(stage, mesh)
            copy = copies.get((id(sharding), rank))
            if copy is None:
                copy = copies[id(sharding), rank] = sharding.staged((pipeline.axis, rank))
            placed[path] = copy
    if problems:
        raise PolicyError("pipeline():\n" + "\n".join(f"* {p}" for p in problems))


def assemble(
    tree: ModelTree,
    mesh: Mesh,
    params: dict[str, ParamSharding],
    buffers: dict[str, ParamSharding],
    config: PlanConfig,
) -> Plan:
    """The plan of ``tree``'s placed ``params`` and ``buffers`` (each in the tree's order).

    Both dicts become the plan's own (staged in place under a pipeline).

    Raises:
        PolicyError: a tied parameter whose names fall in different pipeline stages.

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> tree, fsdp = read_model(nn.Linear(4, 2, bias=False)), fs.ParamSharding.uniform(fs.P("dp"))
        >>> assemble(tree, fs.Mesh(dp=2), {"weight": fsdp}, {}, fs.PlanConfig()).params["weight"].storage
        P('dp')
    """
    _staged(tree, mesh, (params, buffers), config)
    return Plan(
        params=params,
        buffers=buffers,
        mesh=mesh,
        tensors={**tree.params, **tree.buffers},
        aliases=dict(tree.aliases),
        config=config,
    )
