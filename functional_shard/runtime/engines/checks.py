"""What torch's engines cannot run, found before anything runs (pure: no process group)."""

from __future__ import annotations

from torch import nn

from functional_shard.core.errors import PlanError, bullets
from functional_shard.core.tree import read_model
from functional_shard.planning.context_checks import context_parallel_problems
from functional_shard.planning.engine_limits import engine_config_problems
from functional_shard.planning.pipeline.stages import stage_finder, tied_across_stages_fix
from functional_shard.planning.plan.json_format import config_value_problems
from functional_shard.planning.plan.plan import Plan
from functional_shard.planning.tp.module_splits import is_conv1d_module, is_projection, split_problems
from functional_shard.planning.tp.rules import sequence_parallel_problems

from .applied import check_plan_and_module
from .data_parallel import FSDP2_KINDS, whole_params
from .experts import expert_data_axes, expert_hidden, expert_module_problems

_SUPPORTED_STYLE_MODULES = (nn.Linear, nn.Embedding)

_SUPPORTED_STYLE_MODULES = (nn.Linear, nn.Embedding)


def engine_problems(plan: Plan, module: nn.Module) -> list[str]:
    """Everything about ``plan`` that torch's engines cannot run on ``module``, one line each."""
    config = plan.config
    # a plan of another module: nothing else about it means anything
    if found := _module_mismatches(plan, module):
        return found
    if config.pipeline is not None:
        found.extend(pipeline_problems(plan))
    if config.context is not None:
        found.extend(context_parallel_problems(plan, module))
    found.extend(_mesh_order_problems(plan))
    found.extend(_config_problems(plan, module))
    found.extend(_dtype_problems(plan))
    modules = dict(module.named_modules())
    found.extend(_unfed_splits(config.tp_styles, modules))
    found.extend(expert_problems(plan, modules))
    found.extend(split_problems(plan, module))
    found.extend(_style_problems(plan, modules))
    found.extend(_placement_problems(plan, modules))
    return found


def _module_mismatches(plan: Plan, module: nn.Module) -> list[str]:
    """The parameters the plan and ``module`` do not share, or share at other shapes."""
    found: list[str] = []
    tree = read_model(module)
    for path in plan.params.keys() - tree.params.keys():
        found.append(f"{path}: in the plan but not a parameter of the module")
    for path in tree.params.keys() - plan.params.keys():
        found.append(f"{path}: a parameter of the module but not in the plan; plan this module")
    for path in plan.params.keys() & tree.params.keys():
        if tree.params[path].shape != plan.tensors[path].shape:
            found.append(
                f"{path}: shape {tree.params[path].shape} in the module, "
                f"{plan.tensors[path].shape} in the plan"
            )
    return found


def _dtype_problems(plan: Plan) -> list[str]:
    """Parameters of several dtypes where torch's engine steps or gathers one dtype.

    ZeroRedundancyOptimizer takes one dtype over all parameters (integer and frozen ones too);
    FSDP2 one over each unit's trained parameters (its 0-d ones, kept whole, are not its own).
    """
    config = plan.config
    if config.data_parallel == "zero1":
        groups: dict[tuple[int, str], list[str]] = {(0, ""): list(plan.params)}
        fix = "use fs.zero(2), whose FSDP2 units take one dtype each, or give every parameter one dtype"
    elif config.data_parallel in FSDP2_KINDS:
        whole = set(whole_params(plan))
        experts = tuple(f"{path}." for path in config.experts.modules) if config.experts else ()
        groups = {}
        for path in plan.params:  # (a pipeline stage's root is a unit of its own)
            if plan.tensors[path].differentiable and path not in whole and not path.startswith(experts):
                groups.setdefault((plan.stage_of(path), plan.unit_of(path)), []).append(path)
        fix = (
            "give them one dtype (fs.mixed_precision casts them for compute), or put the others in "
            "units of their own with fs.fsdp(units=[...])"
        )
    else:
        return []
    found = []
    for (_, unit), paths in groups.items():
        first_of: dict[str, str] = {}
        for path in paths:
            first_of.setdefault(str(plan.tensors[path].dtype).removeprefix("torch."), path)
        if len(first_of) > 1:
            seen = ", ".join(f"{dtype}: {path!r}" for dtype, path in first_of.items())
            where = (
                "zero1 steps" if config.data_parallel == "zero1" else f"FSDP unit {unit or '(root)'!r} trains"
            )
            found.append(
                f"{where} parameters of several dtypes ({seen}), and torch's "
                f"{'ZeroRedundancyOptimizer' if config.data_parallel == 'zero1' else 'FSDP2'} "
                f"takes one; {fix}"
            )
    return found


def _config_problems(plan: Plan, module: nn.Module) -> list[str]:
    """Settings apply() does not run, or runs through FSDP2 alone.

    `engine_config_problems`' (the plan's settings alone), a config built by hand with values no
    policy makes, and DDP or ZeRO-1 on a meta-device module.
    """
    config = plan.config
    kind = config.data_parallel
    found = engine_config_problems(config)
    found += [f"plan.{problem}" for problem in config_value_problems(config)]  # a config built by hand
    if kind in ("ddp", "zero1") and any(p.is_meta for p in module.parameters()):
        found.append(
            f"{kind} on a meta-device module: DDP keeps every parameter on every rank (meta init saves "
            "nothing) and holds on to the parameter objects that materializing replaces; build the "
            "model on a real device"
        )
    return found


def _style_problems(plan: Plan, modules: dict[str, nn.Module]) -> list[str]:
    """Tensor-parallel styles torch's engines cannot run on the layers they name."""
    tp, fsdp = plan.config.tp, plan.config.fsdp
    if tp is None:
        return []
    shard_axes = fsdp.shard_axes if fsdp else ()
    found: list[str] = []
    for path, style, _ in tp.styles:
        target = modules.get(path)
        if style == "packed_colwise" and isinstance(target, nn.Linear) and shard_axes:
            found.append(
                f"{path}: 'packed_colwise' on an nn.Linear splits its weight's dim 0, which FSDP2 shards "
                f"again over {shard_axes}; FSDP2 cannot describe a strided split inside a strided "
                "split. Use plain tensor parallel for this layer, or replicate it"
            )
    if tp.sequence_parallel and tp.axes:
        found.extend(sequence_parallel_problems(tp.styles, modules))
    return found


def _placement_problems(plan: Plan, modules: dict[str, nn.Module]) -> list[str]:
    """Parameters placed otherwise than torch's styles compute them and FSDP2 stores them."""
    config = plan.config
    found: list[str] = []
    styled = {path: style for path, style, _ in config.tp_styles}
    dispatched = config.expert_modules
    experts = set(config.tensor_parallel_experts) | set(dispatched)
    shard_axes = config.shard_axes
    for path, sharding in plan.params.items():
        # a tied tensor is split by the style of any module holding it (BERT's head bias is held
        # by the prediction head and its decoder, which alone is styled)
        holders = [name.rpartition(".")[0] for name in plan.aliases.get(path, (path,))]
        owner_path = next((holder for holder in holders if holder in styled), path.rpartition(".")[0])
        owner = modules.get(owner_path)
        if not sharding.compute.is_replicated and owner_path not in experts:
            if owner_path not in styled:
                found.append(
                    f"{path}: compute {sharding.compute!r} comes from no tensor-parallel style; apply() "
                    "splits computation only through torch's styles (colwise/rowwise rules)"
                )
            elif not isinstance(owner, _SUPPORTED_STYLE_MODULES) and not is_conv1d_module(owner):
                found.append(
                    f"{path}: style {styled[owner_path]!r} on a {type(owner).__name__}; torch's parallel "
                    "styles support nn.Linear and nn.Embedding"
                )
        at_rest = sharding.at_rest_axes
        expected = set(expert_data_axes(plan)) if owner_path in dispatched else set(shard_axes)
        if at_rest and set(at_rest) != expected:
            found.append(f"{path}: split at rest over {sorted(at_rest)}, but FSDP2 shards over {shard_axes}")
        ndim = plan.tensors[path].ndim
        for d, axes in enumerate(sharding.storage.dim_axes(ndim)):
            if d and any(a in at_rest for a in axes):
                found.append(f"{path}: split at rest on dim {d}; apply() lets FSDP2 shard dim 0 only")
        names = plan.aliases.get(path, (path,))
        units = {plan.unit_of(name) for name in names}
        if len(units) > 1:
            found.append(f"{path}: tied names {names} fall in different FSDP units {sorted(units)}")
    return found


def pipeline_problems(plan: Plan) -> list[str]:
    """What the pipeline engine cannot run in ``plan``, one line each (pure)."""
    config, pipeline = plan.config, plan.config.pipeline
    found: list[str] = []
    if pipeline is None or pipeline.axis not in plan.mesh:
        axis = pipeline.axis if pipeline else None
        return [f"pipeline axis {axis!r} is not an axis of {plan.mesh!r}; add it to the mesh"]
    axis, pp = pipeline.axis, pipeline.size(plan.mesh)
    expected = pp * pipeline.stages_per_rank
    if len(pipeline.stages) != expected:
        found.append(
            f"the plan lists {len(pipeline.stages)} stages, but {axis!r} (size {pp}) "
            f"× {pipeline.stages_per_rank} stages per rank makes {expected}; plan it again"
        )
    if config.data_parallel in ("ddp", "zero1"):
        found.append(
            f"{config.data_parallel} under pipeline parallel: torch's pipeline stages drive FSDP2's "
            "gradient sync across micro-batches, not composable DDP's; use fs.fsdp(...), fs.hsdp(...) "
            "or fs.zero(2)/fs.zero(3) for the data-parallel axes"
        )
    stage_of = stage_finder(pipeline.stages)
    for canonical, names in plan.aliases.items():
        where = {name: stage_of(name) for name in names}
        if len(set(where.values())) > 1:
            placed = ", ".join(
                f"{name} in {f'stage {stage}' if stage is not None else 'no stage'}"
                for name, stage in where.items()
            )
            fix = tied_across_stages_fix(where.values(), len(pipeline.stages))
            found.append(
                f"{canonical}: a tied parameter split across pipeline stages ({placed}); apply() does not "
                f"keep it in step between stages. Fix: {fix}"
            )
    return found


def _mesh_order_problems(plan: Plan) -> list[str]:
    # torch slices a DeviceMesh only in its own order of dims (a KeyError otherwise)
    config, order = plan.config, list(plan.mesh.axis_names)
    shard_axes = config.shard_axes
    groups = {"the data-parallel axes": config.data_axes, "the FSDP shard axes": shard_axes}
    return [
        f"{what} {axes} are not in the mesh's order {tuple(order)}: torch's device meshes slice axes "
        f"in their own order; list them as the mesh does ({tuple(sorted(axes, key=order.index))}), "
        "or reorder the mesh"
        for what, axes in groups.items()
        if list(axes) != sorted(axes, key=order.index)
    ][:1]


def check_runnable(plan: Plan, module: nn.Module) -> None:
    """Raise if torch's engines cannot run ``plan`` on ``module``; pure (no process group).

    `apply` runs it first; call it early (before launching processes, say) to fail sooner.

    Raises:
        PlanError: every problem `engine_problems` finds, one bullet each.

    Examples:
        >>> plan = fs.shard(nn.Linear(8, 8), fs.Mesh(dp=2), fs.fsdp())
        >>> check_runnable(plan, nn.Linear(8, 8))  # fine: returns None
    """
    check_plan_and_module(plan, module, "fs.check_runnable")
    if problems := engine_problems(plan, module):
        raise PlanError(
            bullets(
                f"torch's engines cannot run this plan on {plan.mesh!r}:",
                problems,
                "Change the policy, or plan for what apply() supports (see docs: Applying plans).",
            )
        ) from None


def _unfed_splits(tp_styles: tuple[tuple[str, str, str], ...], modules: dict[str, nn.Module]) -> list[str]:
    # A rowwise Linear takes its input split on the feature dim: some colwise Linear beside
    # it (see _neighbours) must produce that split. A colwise Linear's split output must
    # reach a rowwise Linear beside it, or the module between them sees a fraction of the
    # features it expects. Layers whose split is made whole at the edge (colwise_gather,
    # rowwise_split_input) need no partner; embeddings take and give whole activations.
    # (packed_colwise counts as colwise: its pieces stay split too.)
    style_of = {
        path: "colwise" if style == "packed_colwise" else style
        for path, style, kind in tp_styles
        if kind != "embedding"
    }
    found = []
    for path, style in style_of.items():
        if style not in ("rowwise", "colwise") or not is_projection(modules.get(path)):
            continue
        siblings = _neighbours(path, [p for p, module in modules.items() if is_projection(module)], style_of)
        partner = "colwise" if style == "rowwise" else "rowwise"
        if any(style_of.get(other) == partner for other in siblings):
            continue
        whole = [other for other in siblings if other not in style_of]
        if style == "rowwise":
            feeders = f"its feeding layer(s) {whole} stay whole" if whole else "no colwise layer beside it"
            found.append(
                f"{path}: split rowwise (it expects its input split over the tensor-parallel ranks), but "
                f"{feeders}, so no layer splits its input. Split the feeding layer colwise, or make "
                f"{path!r} 'rowwise_split_input' (it then slices a whole input)"
            )
        else:
            readers = f"{whole} beside it stay whole" if whole else "no rowwise layer is beside it"
            found.append(
                f"{path}: split colwise (its output stays split over the tensor-parallel ranks), but "
                f"{readers}, so nothing takes the split output. Split the consuming layer rowwise, or "
                f"make {path!r} 'colwise_gather'"
            )
    return found


def _neighbours(path: str, projections: list[str], style_of: dict[str, str]) -> list[str]:
    # the other projections under the nearest module enclosing ``path`` that holds one not
    # split as ``path`` is: its siblings (Hugging Face's o_proj beside q_proj), else its
    # parent's (torchtitan 0.3.0's attention.qkv_linear.wq/wk/wv or fused wqkv, read by
    # attention.wo one level up)
    parent, found = path, []
    while parent:
        parent = parent.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        found = [other for other in projections if other != path and other.startswith(prefix)]
        if any(style_of.get(other) != style_of.get(path) for other in found):
            break
    return found


# data-parallel engines expert parallelism composes with: FSDP2 on one mesh (no replicas)
_EXPERT_DATA_PARALLEL = ("fsdp", "zero2", "zero3")


def expert_problems(plan: Plan, modules: dict[str, nn.Module]) -> list[str]:
    """What the experts engine cannot run: tensor parallel inside experts, expert parallelism."""
    config = plan.config
    found: list[str] = []
    tp_experts = list(config.tensor_parallel_experts)
    tp_size = plan.mesh[config.tp.axes[0]] if config.tp and config.tp.axes else 1
    dispatched = config.expert_modules
    for path in dict.fromkeys(tp_experts + list(dispatched)):
        # torchtitan's grouped experts: tensor parallel only (expert parallelism runs HF's layout)
        titan = path in tp_experts and path not in dispatched
        problems = expert_module_problems(path, modules.get(path), titan=titan)
        found.extend(problems)
        target = modules.get(path)
        if problems or target is None:
            continue
        hidden = expert_hidden(target)
        if path in tp_experts and hidden % tp_size:
            found.append(
                f"{path}: each expert's {hidden} intermediate features (gate and up each) do not split over "
                f"{tp_size} tensor-parallel ranks; use a tensor-parallel size that divides {hidden}"
            )
    if tp_experts and config.tp and config.tp.sequence_parallel:
        found.append(
            f"{tp_experts[0]}: experts split by tensor parallel take whole activations, which sequence "
            "parallel does not hand them. Drop sequence_parallel, or leave the experts whole"
        )
    axis = config.experts.axis if config.experts else None
    if axis is None:
        return found
    if not dispatched:
        found.append(f"ep({axis!r}): no expert tensor in the plan")
    both = sorted(set(tp_experts) & set(dispatched))
    if both:
        found.append(
            f"{both[0]}: split both by expert (ep over {axis!r}) and inside each expert (tensor parallel); "
            "apply() runs one of them per experts module. Leave the experts out of the tp rules, or drop ep"
        )
    if axis not in config.data_axes:
        found.append(
            f"ep({axis!r}): {axis!r} is not a data-parallel axis, so its ranks read the same tokens and "
            "apply() has none to dispatch. Borrow a data axis: fs.fsdp(('dp', 'ep')) + fs.ep('ep'), or "
            "fs.fsdp('dp') + fs.ep('dp')"
        )
    if config.data_parallel not in _EXPERT_DATA_PARALLEL or (config.fsdp and config.fsdp.replicate_axes):
        found.append(
            f"ep({axis!r}) with {config.data_parallel} over {config.data_axes}: apply() runs expert "
            "parallelism with FSDP2 over the data axes (fs.fsdp(...)), no replicate axis"
        )
    return found
