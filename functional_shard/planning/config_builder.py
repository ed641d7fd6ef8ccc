"""The `PlanConfig` that `shard()` writes: engines, FSDP units, tensor-parallel styles, pipeline, experts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from functional_shard.core.errors import PolicyError
from functional_shard.core.mesh import Mesh
from functional_shard.core.tree import ModelTree, within

from .fsdp.unit_finder import chosen_units, select_modules
from .pipeline.stages import boundary_features, split_stages, stage_finder
from .plan.config import ContextConfig, ExpertConfig, FsdpConfig, PipelineConfig, PlanConfig, TpConfig
from .policy.types import ExpertParallel, Policy
from .tp.styles import Packed, layout_of

__all__ = ["SharedStyles", "plan_config", "styles_of", "tp_pieces", "tp_styles"]

StyleEntry = tuple[str, str, str]
"""(module path, style, layout), as `TpConfig.styles` holds them."""


def styles_of(policy: Policy, tree: ModelTree, paths: Iterable[str], styles: dict[str, StyleEntry]) -> None:
    """Add to ``styles`` the style a tensor-parallel rule gives the module of each of ``paths``.

    Every name of a tied tensor counts; the first style given a module stays.

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> tree, styles = read_model(nn.Sequential(nn.Linear(2, 2))), {}
        >>> styles_of(fs.tp([("0", "colwise")], "tp"), tree, tree.params, styles)
        >>> styles
        {'0': ('0', 'colwise', 'linear')}
    """
    for path in paths:
        for name in tree.aliases.get(path, (path,)):
            for layer in policy.tensor_parallel:
                rule = layer.rules.match(name)
                module_path = name.rpartition(".")[0]
                style = rule.style if rule is not None else None
                if style is not None and style != "replicate":
                    kind = layout_of(tree.spec_as(name, path))
                    if style == "moe_tp_experts" and kind != "experts":
                        continue  # it splits 3-D expert weights only: elsewhere the module stays whole
                    styles.setdefault(module_path, (module_path, style, kind))


@dataclass(frozen=True, slots=True)
class SharedStyles:
    """The styles of a plan whose repeated blocks were planned once per kind.

    ``outside``: the parameters in no such block; ``blocks``: each block's path and its kind's styles.
    """

    outside: tuple[str, ...]
    blocks: tuple[tuple[str, tuple[StyleEntry, ...]], ...]


def tp_styles(policy: Policy, tree: ModelTree, shared: SharedStyles | None = None) -> tuple[StyleEntry, ...]:
    """(module path, style, layout) of each module a tensor-parallel rule gave a style, in model order.

    apply needs the style, not only the specs, and the cost model the layout ("linear", "embedding").

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> tree = read_model(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2)))
        >>> tp_styles(fs.tp([("0", "colwise"), ("2", "rowwise")], "tp"), tree)
        (('0', 'colwise', 'linear'), ('2', 'rowwise', 'linear'))
    """
    styles: dict[str, StyleEntry] = {}
    if not policy.tensor_parallel:
        return ()
    if shared is None:
        styles_of(policy, tree, tree.params, styles)
    else:
        styles_of(policy, tree, shared.outside, styles)
        add = styles.setdefault  # (hundreds of entries in a big model's blocks)
        for block_path, entries in shared.blocks:
            for relative, style, kind in entries:
                mine = block_path + relative
                add(mine, (mine, style, kind))
    return _in_module_order(styles, tree.modules)


def tp_pieces(
    policy: Policy, mesh: Mesh, tp_styles: tuple[StyleEntry, ...]
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(module path, piece sizes) of each packed projection a `Packed` rule target sized.

    Raises:
        PolicyError: a piece the tensor-parallel size does not divide (named, with the module).

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> policy = fs.tp([("0", fs.packed((4, 2, 2))), ("1", "rowwise")], "tp")
        >>> tree = read_model(nn.Sequential(nn.Linear(2, 8), nn.Linear(8, 2)))
        >>> tp_pieces(policy, fs.Mesh(tp=2), tp_styles(policy, tree))
        (('0', (4, 2, 2)),)
    """
    found = []
    for path, style, _ in tp_styles:
        if style != "packed_colwise":
            continue
        for layer in policy.tensor_parallel:
            rule = layer.rules.match(f"{path}.weight")
            if rule is None or not isinstance(rule.target, Packed):
                continue
            pieces = rule.target.pieces
            size = mesh[layer.axis] if layer.axis in mesh else 1  # noqa: SIM401 (a Mesh has no get)
            uneven = [n for n in pieces if n % size]
            if uneven:
                raise PolicyError(
                    f"{layer.name}, rule {rule.pattern!r}: {path} packs pieces {pieces}; each is split "
                    f"on its own over {layer.axis!r} (size {size}), which does not divide {uneven}. Use a "
                    f"tensor-parallel size that divides every piece, or split {path} 'replicate'"
                )
            found.append((path, pieces))
            break
    return tuple(found)


def _in_module_order(styles: Mapping[str, StyleEntry], modules: Mapping[str, Any]) -> tuple[StyleEntry, ...]:
    # a stable sort by module index, modules unknown to the tree last: one walk, no sort
    ordered = [styles[path] for path in modules if path in styles]
    if len(ordered) < len(styles):
        ordered += [entry for path, entry in styles.items() if path not in modules]
    return tuple(ordered)


def plan_config(
    policy: Policy,
    mesh: Mesh,
    tree: ModelTree,
    *,
    compute_axes: set[str],
    tp_styles: tuple[StyleEntry, ...],
) -> PlanConfig:
    """The plan-level config of ``policy`` on ``mesh`` for ``tree``.

    ``compute_axes``: the axes the placed specs split for compute; ``tp_styles``: as `tp_styles` gives them.

    Raises:
        PolicyError: the pipeline cannot be cut or scheduled, or a selector selects nothing a pytree can say.

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> config = plan_config(fs.fsdp("dp"), fs.Mesh(dp=2), read_model(nn.Linear(2, 2)),
        ...     compute_axes=set(), tp_styles=())
        >>> config.data_parallel, config.fsdp.shard_axes, config.fsdp.units
        ('fsdp', ('dp',), ('',))
    """
    data = policy.data_parallel
    # "the rest" excludes axes that a policy function splits for compute: it claims none
    # up front, but its tensor-parallel axis is no data axis
    claimed = {axis for layer in policy.layers for axis in layer.claimed_axes} | compute_axes
    replicate: list[str] = []
    for layer in data:
        replicate += (
            layer.replicate_axes
            if layer.replicate_axes is not None
            else [a for a in mesh if a not in claimed]
        )
    sharding_layer = next((layer for layer in data if layer.shards), None)
    kinds: list[str] = [layer.kind for layer in data if layer.shards] or (["ddp"] if data else ["none"])
    kind = "hsdp" if kinds[0] == "fsdp" and replicate else kinds[0]
    options = policy.options
    pipeline = _pipeline_config(policy, mesh, tree)
    units = chosen_units(tree, sharding_layer)
    stages = pipeline.stages if pipeline is not None else ()
    _refuse_groups_across_stages(units.groups, stages)
    if sharding_layer is not None and sharding_layer.units is not None:  # asked for, not found by size
        _refuse_modules_across_stages(
            tuple(unit for unit in units.units if unit),  # the root: each stage's own
            stages,
            "fsdp(units=...)",
            "FSDP gathers a unit on one stage's ranks: name modules within one stage (the blocks)",
        )
    tp = _tp_config(policy, mesh, tp_styles)
    fsdp = None
    if kind != "none":
        fsdp = FsdpConfig(
            kind=kind,
            replicate_axes=tuple(replicate),
            shard_axes=sharding_layer.shard_axes if sharding_layer else (),
            # under a pipeline FSDP keeps each stage gathered across its micro-batches, as
            # torchtitan runs it (reshard_after_forward = not pp_enabled): one all-gather a step
            reshard_after_forward=(sharding_layer.reshard_after_forward if sharding_layer else True)
            and pipeline is None,
            units=units.units,
            unit_groups=units.groups,
            unit_reasons=units.reasons,
        )
    experts, context = policy.expert_parallel, policy.context_parallel
    checkpointed = tuple(select_modules(options.checkpoint or (), tree, "checkpointing()"))
    _refuse_modules_across_stages(
        checkpointed,
        stages,
        "checkpointing()",
        "checkpoint modules within one stage (the blocks: a block class, or 'layers.*')",
    )
    return PlanConfig(
        fsdp=fsdp,
        tp=tp,
        pipeline=pipeline,
        experts=_expert_config(experts, tree) if experts is not None else None,
        context=(
            ContextConfig(axis=context.axis, load_balance=context.load_balance, engine=context.engine)
            if context is not None
            else None
        ),
        checkpointed=checkpointed,
        checkpoint_policy=options.checkpoint_policy or "full",
        param_dtype=options.param_dtype,
        reduce_dtype=options.reduce_dtype,
        offload_params=bool(options.offload_params),
        offload_grads=bool(options.offload_grads),
        offload_optimizer=bool(options.offload_optimizer),
    )


def _pipeline_config(policy: Policy, mesh: Mesh, tree: ModelTree) -> PipelineConfig | None:
    """The stages ``policy``'s pipeline cuts ``tree`` into on ``mesh``, checked runnable; None without one."""
    pipe = policy.pipeline
    if pipe is None or pipe.axis not in mesh:  # a missing axis is reported with the others
        return None
    from .pipeline.schedules import check_pipeline  # torch's schedule refuses counts it cannot run

    stages = split_stages(tree, mesh[pipe.axis] * pipe.stages_per_rank, pipe.split, pipe.pieces)
    check_pipeline(pipe.schedule, mesh[pipe.axis], pipe.stages_per_rank, pipe.microbatches)
    return PipelineConfig(
        axis=pipe.axis,
        stages=stages,
        schedule=pipe.schedule,
        microbatches=pipe.microbatches,
        stages_per_rank=pipe.stages_per_rank,
        boundary_features=boundary_features(tree, stages, pipe.hidden_size),
    )


def _expert_config(experts: ExpertParallel, tree: ModelTree) -> ExpertConfig:
    owners = {path.rpartition(".")[0] for path in tree.params if experts.selects(path)}
    if not owners:
        # ep() would then split nothing and dispatch nothing: the plan would silently be plain FSDP
        shown = ", ".join(repr(getattr(pattern, "pattern", pattern)) for pattern in experts.experts or ())
        raise PolicyError(
            f"{experts.name}: experts={shown} selects no parameter of the model; name the expert "
            "tensors' paths ('*.experts.*'), or leave experts= out for shard() to find them"
        )
    return ExpertConfig(axis=experts.axis, modules=tuple(path for path in tree.modules if path in owners))


def _tp_config(policy: Policy, mesh: Mesh, tp_styles: tuple[StyleEntry, ...]) -> TpConfig | None:
    layers = policy.tensor_parallel
    if not layers:
        return None
    parallel_loss = [layer for layer in layers if layer.loss_parallel]
    if parallel_loss and not any(style == "colwise_gather" for _, style, _ in tp_styles):
        raise PolicyError(
            f"{parallel_loss[0].name} with loss_parallel=True: no module is a tensor-parallel head (the "
            "style 'colwise_gather', which lm_head gets from the llama, gpt2 and Hugging Face rules), so "
            "no vocabulary-split logits exist for the loss; give the head that style, or drop loss_parallel"
        )
    return TpConfig(
        axes=tuple(layer.axis for layer in layers),
        styles=tp_styles,
        pieces=tp_pieces(policy, mesh, tp_styles),
        sequence_parallel=any(layer.sequence_parallel for layer in layers),
        loss_parallel=bool(parallel_loss),
    )


def _refuse_groups_across_stages(
    groups: tuple[tuple[str, ...], ...], stages: tuple[tuple[str, ...], ...]
) -> None:
    # FSDP gathers a unit on the ranks of one stage: a group whose modules run on
    # different stages has no ranks to gather it
    if not stages:
        return
    from .pipeline.stages import stage_finder

    stage_of = stage_finder(stages)
    for group in groups:
        held = {member: stage_of(member, module=True) for member in group}
        if len(set(held.values())) > 1:
            where = ", ".join(f"{member} on stage {stage}" for member, stage in held.items())
            raise PolicyError(
                f"fsdp(units=...): the group {group!r} spans pipeline stages ({where}); FSDP gathers a "
                "unit on one stage's ranks: group modules of one stage, or let each be its own unit"
            )


def _refuse_modules_across_stages(
    modules: tuple[str, ...], stages: tuple[tuple[str, ...], ...], asked: str, fix: str
) -> None:
    # a stage runs (recomputes, gathers) what it holds whole; a module that holds modules of several
    # stages runs whole on none of them, and each stage's plan would leave it out, unsaid
    if not stages:
        return
    stage_of = stage_finder(stages)
    for module in modules:
        if stage_of(module, module=True) is not None:
            continue
        held = sorted({s for s, listed in enumerate(stages) for m in listed if within(m, [module])})
        if held:
            raise PolicyError(
                f"{asked}: {repr(module) if module else 'the root module'} holds modules of pipeline "
                f"stages {', '.join(map(str, held))}, and no stage runs it whole; {fix}"
            )
