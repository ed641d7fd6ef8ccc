"""`shard()`: model + mesh + policy → `Plan`. Pure and deterministic; touches no data."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from functional_shard.core.errors import PlanError, PolicyError, bullets
from functional_shard.core.mesh import Mesh
from functional_shard.core.spec import Owned, P, ParamSharding, spec_problems
from functional_shard.core.tree import ModelTree, TensorSpec, matches, owner_paths, read_model

from .hf import expert_top_k
from .plan import Plan, PlanConfig
from .policy import Custom, DataParallel, Layer, ParamProblemError, Policy, Selector, as_policy, resolve_rules
from .rules import layout_of
from .stages import boundary_features, split_stages, stage_finder, stage_rank

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["shard"]


def _merge_spec(a: P, b: P, model: tuple[tuple[str, ...], ...], ndim: int) -> P:
    dims = []
    for d, (mine, theirs) in enumerate(zip(a.dim_axes(ndim), b.dim_axes(ndim), strict=True)):
        axes = list(dict.fromkeys(mine + theirs))
        # compute splits are major; splits that exist only at rest nest inside them
        dims.append(tuple(x for x in model[d] if x in axes) + tuple(x for x in axes if x not in model[d]))
    return P(*dims)


def _merge(a: ParamSharding, b: ParamSharding, ndim: int, names: tuple[str, str]) -> ParamSharding:
    merged = _merge_cached(a, b, ndim)
    if isinstance(merged, str):
        raise ParamProblemError(merged.format(*names))
    return merged


@functools.lru_cache(maxsize=4096)
def _merge_cached(a: ParamSharding, b: ParamSharding, ndim: int) -> ParamSharding | str:
    """The merge, or a message with {0} and {1} for the two layers' names (cached: blocks repeat)."""
    model = []
    for d, (mine, theirs) in enumerate(zip(a.compute.dim_axes(ndim), b.compute.dim_axes(ndim), strict=True)):
        if mine and theirs and mine != theirs:
            return (
                f"{{0}} and {{1}} both split dim {d} for compute ({mine} vs {theirs}); let one rule claim it"
            )
        model.append(mine or theirs)
    model_axes = tuple(model)
    if isinstance(a.optim, Owned) or isinstance(b.optim, Owned):
        owned, other = (a.optim, b.optim) if isinstance(a.optim, Owned) else (b.optim, a.optim)
        if isinstance(other, Owned) or not other.is_replicated:
            return (
                "{0} and {1}: ZeRO-1 keeps optimizer state whole per rank and "
                "cannot also split it; use fsdp() (ZeRO-3) or zero(2) with tensor parallel"
            )
        optim: P | Owned = owned
    else:
        optim = _merge_spec(a.optim, b.optim, model_axes, ndim)
    return ParamSharding(
        _merge_spec(a.storage, b.storage, model_axes, ndim),
        P(*model_axes),
        _merge_spec(a.grad, b.grad, model_axes, ndim),
        optim,
    )


def _answer_problems(answer: ParamSharding, shape: tuple[int, ...], mesh: Mesh) -> list[str]:
    # checked before merging: merging aligns specs to the tensor's rank and would hide
    # an extra entry or an axis named twice in one dim
    return [
        f"{field} {problem}"
        for field, spec in answer.specs().items()
        if isinstance(spec, P)
        for problem in spec_problems(spec, shape, mesh)
    ]


def _place(
    layers: tuple[Layer, ...], names: tuple[str, ...], tree: ModelTree, tensor: TensorSpec, mesh: Mesh
) -> ParamSharding:
    result, owner = None, "default"
    ndim = tensor.ndim
    for layer in layers:
        # each name is seen as its own module owns it (a tied lm_head is a Linear)
        given = [(n, a) for n in names if (a := layer(n, tree.spec_as(n, names[0]), mesh)) is not None]
        if not given:
            continue
        for _, answer in given:
            if found := _answer_problems(answer, tensor.shape, mesh):
                raise ParamProblemError(f"{layer.name} gives " + "; ".join(found))
        if len(given) > 1 and len({answer.normalized(ndim) for _, answer in given}) > 1:
            detail = "; ".join(f"{name} gets {answer}" for name, answer in given)
            raise ParamProblemError(f"tied names disagree under {layer.name}: {detail}. Give them one rule")
        answer = given[0][1]
        result = (
            answer.normalized(ndim) if result is None else _merge(result, answer, ndim, (owner, layer.name))
        )
        owner = layer.name
    return result if result is not None else ParamSharding.replicated().normalized(ndim)


def _check(
    path: str, tensor: TensorSpec, sharding: ParamSharding, mesh: Mesh, data_axes: frozenset[str]
) -> list[str]:
    return [
        f"{path}, shape {tensor.shape}: {problem}"
        for problem in _sharding_problems(tensor.shape, sharding, mesh, data_axes)
    ]


@functools.lru_cache(maxsize=4096)
def _sharding_problems(
    shape: tuple[int, ...], sharding: ParamSharding, mesh: Mesh, data_axes: frozenset[str]
) -> tuple[str, ...]:
    """What is wrong with ``sharding`` for any tensor of ``shape`` (cached: blocks repeat)."""
    found = []
    for name, spec in sharding.specs().items():
        if isinstance(spec, Owned):
            if spec.axis not in mesh:
                found.append(f"optim {spec!r} names axis {spec.axis!r}, which is not in {mesh!r}")
            continue
        found.extend(f"{name} {problem}" for problem in spec.problems(shape, mesh))
    if found:
        return tuple(found)
    ndim = len(shape)
    compute = sharding.compute.dim_axes(ndim)
    for name in ("storage", "grad", "optim"):
        spec = sharding.specs()[name]
        if not isinstance(spec, P):
            continue
        for d, axes in enumerate(spec.dim_axes(ndim)):
            if axes[: len(compute[d])] != compute[d]:
                found.append(
                    f"{name} {spec!r} does not contain compute {sharding.compute!r} on dim {d}; "
                    "state at rest must be split at least as the computation sees it"
                )
    for axis in sharding.compute.axes:
        if axis in data_axes:
            found.append(
                f"compute {sharding.compute!r} splits over {axis!r}, a data-parallel axis "
                "(the batch is split over it); use a separate mesh axis for tensor parallel"
            )
    at_rest_only = [
        (d, axes[len(compute[d]) :])
        for d, axes in enumerate(sharding.storage.dim_axes(ndim))
        if axes[len(compute[d]) :]
    ]
    if len(at_rest_only) > 1:
        found.append(
            f"storage {sharding.storage!r} splits {len(at_rest_only)} dims at rest; FSDP2 shards one"
        )
    for d, axes in at_rest_only:
        if d == 0:
            continue
        size = shape[d]
        for axis in compute[d]:
            size = -(-size // mesh[axis])
        if size % mesh.axes_size(axes):
            found.append(
                f"storage {sharding.storage!r} shards dim {d} (size {size}) at rest over "
                f"{axes} (size {mesh.axes_size(axes)}); FSDP2 shards a dim other than 0 only when it "
                "divides evenly. Shard dim 0, or pad the parameter"
            )
    return tuple(found)


def _select(selectors: Iterable[Selector], tree: ModelTree, what: str) -> list[str]:
    chosen = []
    for path, cls in tree.modules.items():
        for selector in selectors:
            if isinstance(selector, type):
                if cls is None:
                    raise PolicyError(
                        f"{what} selects modules of class {selector.__name__}, but the model was "
                        "given as a pytree with no module classes; select by path pattern, or pass "
                        "the nn.Module"
                    )
                hit = issubclass(cls, selector)
            else:
                hit = bool(path) and matches(selector, path)
            if hit:
                chosen.append(path)
                break
    return chosen


# size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES and .FORCE_LEAF_MODULES of
# torch/distributed/fsdp/wrap.py, restated: reading them would import FSDP (~0.8 s, half of
# `import torch`) into pure planning; tests/test_boundaries.py checks they still equal torch's
_EXCLUDE_WRAP_MODULES: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict)
_FORCE_LEAF_MODULES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _size_based_units(tree: ModelTree, min_params: int) -> list[str]:
    # torch's size_based_auto_wrap_policy, post-order: a module becomes a unit when the
    # parameters its subtree holds outside units already made reach min_params. Like
    # torch, never a ModuleList/ModuleDict, and nothing inside a forced leaf (attention).
    excluded, leaves = _EXCLUDE_WRAP_MODULES, _FORCE_LEAF_MODULES
    counts = dict.fromkeys(tree.modules, 0)
    for path, tensor in tree.params.items():
        counts[path.rpartition(".")[0]] += tensor.numel

    def inside_leaf(path: str) -> bool:
        parents = list(owner_paths(path))[1:-1]  # enclosing modules, the root excluded
        return any((cls := tree.modules[p]) is not None and issubclass(cls, leaves) for p in parents)

    wrapped: list[str] = []
    for path in sorted(tree.modules, key=lambda p: -len(p.split("."))):
        if not path:
            continue
        cls = tree.modules[path]
        wrappable = not (cls is not None and issubclass(cls, excluded)) and not inside_leaf(path)
        if wrappable and counts[path] >= min_params:
            wrapped.append(path)
        else:
            counts[path.rpartition(".")[0]] += counts[path]
    order = {path: index for index, path in enumerate(tree.modules)}
    return sorted(wrapped, key=order.__getitem__)


def _units(tree: ModelTree, layer: DataParallel | None) -> tuple[str, ...]:
    if layer is None or not layer.shards or layer.kind == "zero1":
        return ()
    if layer.min_params is not None:
        units = _size_based_units(tree, layer.min_params)
    elif layer.units is not None:
        units = _select(layer.units, tree, "fsdp(units=...)")
    else:
        units = [
            path
            for path, cls in tree.modules.items()
            if path and cls is not None and tree.modules.get(path.rpartition(".")[0]) is nn.ModuleList
        ]
    return ("", *units)


def _styles_of(
    policy: Policy, tree: ModelTree, paths: Iterable[str], styles: dict[str, tuple[str, str, str]]
) -> None:
    for path in paths:
        for name in tree.aliases.get(path, (path,)):
            for layer in policy.tensor_parallel:
                rule = layer.rules.match(name)
                module_path = name.rpartition(".")[0]
                if rule is not None and isinstance(rule.target, str) and rule.target != "replicate":
                    kind = layout_of(tree.spec_as(name, path))
                    styles.setdefault(module_path, (module_path, rule.target, kind))


def _tp_styles(
    policy: Policy,
    tree: ModelTree,
    shared: Mapping[str, tuple[str, list[tuple[str, str, str]]]] | None = None,
) -> tuple[tuple[str, str, str], ...]:
    """(module path, style, layout) of each module a tensor-parallel rule gave a style.

    apply needs the style, not only the specs (an output gathered for the loss, sequence
    parallel norms), and the cost model the layout ("linear", "embedding"). ``shared``
    maps a block's path to (its representative's path, the representative's styles).
    """
    styles: dict[str, tuple[str, str, str]] = {}
    if not policy.tensor_parallel:
        return ()
    if shared is None:
        _styles_of(policy, tree, tree.params, styles)
    else:
        in_blocks = {path for block in tree.blocks if block.path in shared for path in block.params}
        _styles_of(policy, tree, (p for p in tree.params if p not in in_blocks), styles)
        for block in tree.blocks:
            if block.path not in shared:
                continue
            source, entries = shared[block.path]
            cut = len(source)
            for module_path, style, kind in entries:
                mine = block.path + module_path[cut:]
                styles.setdefault(mine, (mine, style, kind))
    order = {path: index for index, path in enumerate(tree.modules)}
    return tuple(sorted(styles.values(), key=lambda item: order.get(item[0], len(order))))


def _config(
    policy: Policy,
    mesh: Mesh,
    tree: ModelTree,
    layers: tuple[Layer, ...],
    compute_axes: set[str],
    tp_styles: tuple[tuple[str, str, str], ...],
) -> PlanConfig:
    data = policy.data_parallel
    # "the rest" excludes axes that a policy function splits for compute: it claims none
    # up front, but its tensor-parallel axis is no data axis
    claimed = {axis for layer in layers for axis in layer.claimed_axes} | compute_axes
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
    pipe = policy.pipeline
    pipe_config: dict[str, Any] = {}
    if pipe is not None and pipe.axis in mesh:  # a missing axis is reported with the others
        from .schedules import check_pipeline  # torch's schedule refuses counts it cannot run

        stages = split_stages(tree, mesh[pipe.axis] * pipe.stages_per_rank, pipe.split, pipe.pieces)
        check_pipeline(pipe.schedule, mesh[pipe.axis], pipe.stages_per_rank, pipe.microbatches)
        pipe_config = {
            "pipeline_axis": pipe.axis,
            "pipeline_stages": stages,
            "pipeline_schedule": pipe.schedule,
            "microbatches": pipe.microbatches,
            "stages_per_rank": pipe.stages_per_rank,
            "boundary_features": boundary_features(tree, stages, pipe.hidden_size),
        }
    experts = policy.expert_parallel
    if experts is not None:
        owners = {path.rpartition(".")[0] for path in tree.params if experts.selects(path)}
        pipe_config["expert_axis"] = experts.axis
        pipe_config["expert_modules"] = tuple(path for path in tree.modules if path in owners)
    return PlanConfig(
        data_parallel=kind,
        replicate_axes=tuple(replicate),
        shard_axes=sharding_layer.shard_axes if sharding_layer else (),
        tensor_parallel_axes=tuple(layer.axis for layer in policy.tensor_parallel),
        tp_styles=tp_styles,
        sequence_parallel=any(layer.sequence_parallel for layer in policy.tensor_parallel),
        # under a pipeline FSDP keeps each stage gathered across its micro-batches, as
        # torchtitan runs it (reshard_after_forward = not pp_enabled): one all-gather a step
        reshard_after_forward=(sharding_layer.reshard_after_forward if sharding_layer else True)
        and "pipeline_axis" not in pipe_config,  # (pipe_config also carries the expert axis)
        units=_units(tree, sharding_layer),
        checkpointed=tuple(_select(options.checkpoint or (), tree, "checkpointing()")),
        checkpoint_policy=options.checkpoint_policy or "full",
        param_dtype=options.param_dtype,
        reduce_dtype=options.reduce_dtype,
        offload_params=bool(options.offload_params),
        offload_grads=bool(options.offload_grads),
        offload_optimizer=bool(options.offload_optimizer),
        **pipe_config,
    )


def shard(model: Any, mesh: Mesh | DeviceMesh, policy: Policy | Any) -> Plan:
    """Plan how ``model`` is laid out on ``mesh`` under ``policy``. Pure and deterministic.

    Args:
        model: an ``nn.Module`` (meta device included), a state dict, or any optree
            pytree of tensors; only shapes, dtypes, names and owners are read.
        mesh: an `fs.Mesh` (every axis resolved) or a torch ``DeviceMesh``.
        policy: layers combined with ``+`` (`fsdp`, `tp`, ...), or a function
            ``(path, tensor_spec, mesh) -> ParamSharding | None``.

    Returns:
        A `Plan` with one `ParamSharding` per parameter (tied parameters once) and per
        buffer (replicated unless a rule says otherwise).

    Raises:
        MeshError: the mesh has an axis of size -1.
        PolicyError: the policy's layers conflict, or select modules the model lacks.
        PlanError: the plan does not fit the model; one bullet per parameter path.

    Examples:
        >>> import torch.nn as nn, functional_shard as fs
        >>> model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        >>> policy = fs.fsdp("dp") + fs.tp([("0", "colwise"), ("2", "rowwise")], "tp")
        >>> plan = fs.shard(model, fs.Mesh(dp=2, tp=2), policy)
        >>> plan.params["0.weight"].storage, plan.params["2.weight"].storage
        (P(('tp', 'dp'), None), P('dp', 'tp'))
    """
    return _shard(model, mesh, policy, reuse_blocks=True)


def _shard(model: Any, mesh: Mesh | DeviceMesh, policy: Policy | Any, *, reuse_blocks: bool) -> Plan:
    """`shard`; with ``reuse_blocks`` each kind of repeated block is planned once.

    Both ways give equal plans (tests hold it); the per-parameter way is the reference,
    and also writes the error message when the reusing way finds any problem.
    """
    if not isinstance(mesh, Mesh):
        mesh = Mesh.from_device_mesh(mesh)
    mesh.require_resolved("shard()")
    policy = _with_model_pieces(resolve_rules(as_policy(policy), model), model)
    tree = read_model(model)
    experts = policy.expert_parallel
    plan = None
    if (
        reuse_blocks
        and tree.blocks
        and not any(isinstance(layer, Custom) for layer in policy.layers)
        and (experts is None or experts.index_free)
    ):
        plan = _shard_reusing_blocks(tree, mesh, policy)
    if plan is None:
        plan = _shard_each(tree, mesh, policy)
    return with_expert_top_k(plan, model)


def with_expert_top_k(plan: Plan, model: Any) -> Plan:
    """``plan`` told how many experts each token visits, where it splits experts modules.

    The cost of dispatching tokens to experts depends on it, and only the model (its
    config or a router) says it: a plan made from a `ModelTree` learns it here.
    """
    config = plan.config
    if not config.expert_modules and not config.tensor_parallel_experts:
        return plan
    return dataclasses.replace(plan, config=dataclasses.replace(config, expert_top_k=expert_top_k(model)))


def _with_model_pieces(policy: Policy, model: Any) -> Policy:
    """The pipeline layer told what the model says of itself: HF pieces and hidden size."""
    from .hf import hidden_size, pp_pieces

    pipe = policy.pipeline
    if pipe is None:
        return policy
    told = dataclasses.replace(pipe, pieces=pp_pieces(model), hidden_size=hidden_size(model))
    layers = tuple(told if layer is pipe else layer for layer in policy.layers)
    return dataclasses.replace(policy, layers=layers)


def _staged(tree: ModelTree, mesh: Mesh, placed: dict[str, ParamSharding], config: PlanConfig) -> None:
    """Place every tensor of a pipelined plan on the pp rank of its stage, in ``placed``.

    A buffer in no stage (a rotary table at the root) stays on every rank; shardings that
    blocks share stay shared (one staged copy per pp rank), which the cost model counts on.

    Raises:
        PolicyError: a tied parameter whose names fall in different stages.
    """
    axis = config.pipeline_axis
    if axis is None:
        return
    stage_of = stage_finder(config.pipeline_stages)
    pp, per_rank, schedule = mesh[axis], config.stages_per_rank, config.pipeline_schedule
    copies: dict[tuple[int, int], ParamSharding] = {}
    problems = []
    for path, sharding in placed.items():
        names = tree.aliases.get(path, (path,))
        stages = {name: stage_of(name) for name in names}
        if len(set(stages.values())) > 1:
            where = ", ".join(f"{name} in stage {stage}" for name, stage in stages.items())
            problems.append(
                f"{where} are one tied parameter; the pipeline engine does not reduce a tied "
                "gradient between stages. Untie them (e.g. tie_word_embeddings=False), or put "
                "them in one stage with pipeline(split=[...])"
            )
            continue
        stage = stages[path]
        if stage is None:
            continue
        rank = stage_rank(stage, pp, per_rank, schedule)
        copy = copies.get((id(sharding), rank))
        if copy is None:
            copy = copies[id(sharding), rank] = sharding.staged((axis, rank))
        placed[path] = copy
    if problems:
        raise PolicyError("pipeline():\n" + "\n".join(f"* {p}" for p in problems))


def _axis_problems(policy: Policy, mesh: Mesh) -> list[str]:
    return [
        f"{layer.name} names axis {a!r}, which is not in {mesh!r}"
        for layer in policy.layers
        for a in layer.claimed_axes
        if a not in mesh
    ]


def _unused_axes(policy: Policy, mesh: Mesh, shardings: Iterable[ParamSharding]) -> list[str]:
    layers = policy.layers
    claimed = {axis for layer in layers for axis in layer.claimed_axes}
    takes_rest = any(isinstance(layer, DataParallel) and layer.replicate_axes is None for layer in layers)
    used = claimed | {a for s in shardings for spec in s.specs().values() for a in spec.axes}
    return [
        f"axis {axis!r} (size {size}) is used by no policy: add fs.replicate({axis!r}) "
        f"to split the batch over it, or fs.fsdp({axis!r}) to shard over it"
        for axis, size in mesh.axes
        if axis not in used and size > 1 and not takes_rest
    ]


def _plan(tree: ModelTree, mesh: Mesh, placed: dict[str, ParamSharding], config: PlanConfig) -> Plan:
    _staged(tree, mesh, placed, config)
    return Plan(
        params={p: placed[p] for p in tree.params},
        buffers={p: placed[p] for p in tree.buffers},
        mesh=mesh,
        tensors={**tree.params, **tree.buffers},
        aliases=dict(tree.aliases),
        config=config,
    )


def _compute_free_axes(config: PlanConfig) -> frozenset[str]:
    # data-parallel axes no computation may split; expert parallelism borrows its axis from
    # data parallelism: the expert tensors are split over it (tokens travel to them)
    return frozenset(config.data_axes) - {config.expert_axis}


def _shard_each(tree: ModelTree, mesh: Mesh, policy: Policy) -> Plan:
    """Plan every parameter on its own: the reference, and the path that reports problems."""
    layers = policy.layers
    problems = _axis_problems(policy, mesh)
    # data parallelism shards parameters and their state, never buffers
    buffer_layers = tuple(layer for layer in layers if not isinstance(layer, DataParallel))
    placed: dict[str, ParamSharding] = {}
    for group, group_layers in ((tree.params, layers), (tree.buffers, buffer_layers)):
        for path, tensor in group.items():
            try:
                placed[path] = _place(group_layers, tree.aliases.get(path, (path,)), tree, tensor, mesh)
            except ParamProblemError as problem:
                problems.append(f"{path}, shape {tensor.shape}: {problem}")
    compute_axes = {axis for sharding in placed.values() for axis in sharding.compute.axes}
    config = _config(policy, mesh, tree, layers, compute_axes, _tp_styles(policy, tree))
    if not problems:
        data_axes = _compute_free_axes(config)
        problems += _unused_axes(policy, mesh, placed.values())
        tensors = {**tree.params, **tree.buffers}
        for path, sharding in placed.items():
            problems += _check(path, tensors[path], sharding, mesh, data_axes)
    if problems:
        raise PlanError(
            bullets(
                f"plan does not fit the model on {mesh!r}:",
                problems,
                "Fix the rule, change the mesh, or pad the parameter.",
            )
        ) from None
    return _plan(tree, mesh, placed, config)


# A glob of these characters can tell one block index from another (``layers.3.*``,
# ``layers.?.*``); any other glob matches ``layers.3.x`` exactly when it matches
# ``layers.7.x``: its literals cannot match the digits, so only a ``*`` spans them.
_INDEX_SENSITIVE = frozenset("0123456789?[")


def _index_free(pattern: object) -> bool:
    return isinstance(pattern, str) and not _INDEX_SENSITIVE.intersection(pattern)


def _first_rules(
    policy: Policy,
    sensitive: tuple[tuple[int, ...], ...],
    paths: tuple[str, ...],
    free: tuple[tuple[int | None, ...], ...],
) -> tuple[tuple[int | None, ...], ...]:
    """For each tensor-parallel layer and path, the index of the first rule that matches.

    ``free`` holds the first index-free rule matching each relative path (the same in
    every block of a kind); only the index-sensitive rules before it are tried here.
    """
    result = []
    for layer, free_first, candidates in zip(policy.tensor_parallel, free, sensitive, strict=True):
        rules = layer.rules.rules
        firsts = []
        for path, bound in zip(paths, free_first, strict=True):
            limit = len(rules) if bound is None else bound
            firsts.append(next((i for i in candidates if i < limit and rules[i].matches(path)), bound))
        result.append(tuple(firsts))
    return tuple(result)


def _shard_reusing_blocks(tree: ModelTree, mesh: Mesh, policy: Policy) -> Plan | None:
    """`_shard_each`'s plan, with each kind of block planned once; None on any problem.

    Blocks share a plan when their keys are equal (same parent, relative paths, tensors,
    owners' classes and module classes) and every tensor-parallel layer picks the same
    rule for each of their tensors. Nothing else a layer sees differs between them:
    data-parallel layers read the tensor only, styles the tensor and its last name.
    """
    layers = policy.layers
    if _axis_problems(policy, mesh):
        return None
    buffer_layers = tuple(layer for layer in layers if not isinstance(layer, DataParallel))
    tp_layers = policy.tensor_parallel
    sensitive = tuple(
        tuple(i for i, rule in enumerate(layer.rules.rules) if not _index_free(rule.pattern))
        for layer in tp_layers
    )
    frees: dict[Any, tuple[tuple[int | None, ...], ...]] = {}
    kinds: dict[Any, tuple[str, tuple[ParamSharding, ...]]] = {}
    from_blocks: dict[str, ParamSharding] = {}
    shared_styles: dict[str, tuple[str, list[tuple[str, str, str]]]] = {}
    for block in tree.blocks:
        paths = block.params + block.buffers
        free = frees.get(block.key)
        if free is None:
            free = frees[block.key] = tuple(
                tuple(
                    next(
                        (
                            i
                            for i, rule in enumerate(layer.rules.rules)
                            if _index_free(rule.pattern) and rule.matches(path)
                        ),
                        None,
                    )
                    for path in paths
                )
                for layer in tp_layers
            )
        kind = (block.key, _first_rules(policy, sensitive, paths, free) if any(sensitive) else ())
        known = kinds.get(kind)
        if known is None:
            placements = []
            try:
                for path in block.params:
                    placements.append(_place(layers, (path,), tree, tree.params[path], mesh))
                for path in block.buffers:
                    placements.append(_place(buffer_layers, (path,), tree, tree.buffers[path], mesh))
            except ParamProblemError:
                return None
            styles: dict[str, tuple[str, str, str]] = {}
            _styles_of(policy, tree, block.params, styles)
            known = kinds[kind] = (block.path, tuple(placements))
            shared_styles[block.path] = (block.path, list(styles.values()))
        else:
            shared_styles[block.path] = (known[0], shared_styles[known[0]][1])
        from_blocks.update(zip(paths, known[1], strict=True))
    placed: dict[str, ParamSharding] = {}
    try:
        for group, group_layers in ((tree.params, layers), (tree.buffers, buffer_layers)):
            for path, tensor in group.items():
                sharding = from_blocks.get(path)
                if sharding is None:
                    sharding = _place(group_layers, tree.aliases.get(path, (path,)), tree, tensor, mesh)
                placed[path] = sharding
    except ParamProblemError:
        return None
    distinct = {id(s): s for s in placed.values()}.values()
    compute_axes = {axis for sharding in distinct for axis in sharding.compute.axes}
    config = _config(policy, mesh, tree, layers, compute_axes, _tp_styles(policy, tree, shared_styles))
    if _unused_axes(policy, mesh, distinct):
        return None
    data_axes = _compute_free_axes(config)
    tensors = {**tree.params, **tree.buffers}
    checked: set[tuple[int, int]] = set()
    for path, sharding in placed.items():
        tensor = tensors[path]
        key = (id(tensor), id(sharding))
        if key not in checked:
            if _sharding_problems(tensor.shape, sharding, mesh, data_axes):
                return None
            checked.add(key)
    return _plan(tree, mesh, placed, config)
