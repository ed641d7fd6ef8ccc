"""Real parameters and buffers for a module built on the meta device, each rank only its shards."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from functional_shard.core.errors import ShardingError
from functional_shard.planning.plan.plan import Plan

from .applied import applied_with
from .buffers import (
    Initialiser,
    buffer_problems,
    class_name,
    hf_models,
    initialisers,
    meta_buffers,
    restore_buffers,
    sets,
)
from .data_parallel import reduce_whole_grads
from .pipeline import PassThrough
from .tensor_parallel import packed_window, place_grads_as_params


def materialize(
    plan: Plan,
    module: nn.Module,
    device: str | torch.device = "cpu",
    *,
    seed: int | None = None,
    init: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Give a module built on the meta device real parameters and buffers, shard by shard, after `apply`.

    Each rank allocates only its local shards: each module's initialiser (``init``, else the
    Hugging Face model's ``_init_weights``, else ``reset_parameters``) runs in module order on
    full-size temporaries, and this rank's slice is copied in. So for a seed the result is the
    same under every plan, and equals initialising the whole model in one process. Meta buffers
    get the values construction gives them (`restore_buffers`); real buffers keep theirs, and so do
    parameters that are all real already (loaded or trained): then only meta buffers are filled.

    Args:
        plan: the plan `apply` ran.
        module: the parallelized module, its parameters on the meta device (or all real).
        device: where the shards and buffers live.
        seed: ``torch.manual_seed`` before the parameters are drawn, if given.
        init: called on each module with parameters (in module order) instead of its own initialiser.

    Raises:
        ShardingError: the module was not applied with this plan; or, before anything changes,
            parameters or meta buffers that nothing initialises, or real parameters beside meta ones.

    Examples:
        >>> # with torch.device("meta"): model = transformers.LlamaForCausalLM(config)
        >>> # fs.apply(plan, model); fs.materialize(plan, model, seed=0)
    """
    from torch.distributed.tensor import DTensor

    applied = applied_with(plan, module, "fs.materialize")
    plan = applied.local_plan  # under pp: this rank's stages only
    if _parameters_real(module):  # loaded or trained already: only meta buffers get values
        return _fill_meta_buffers(module, device, init)
    chosen, problems = _initialisers_by_path(module, init)
    config = applied.plan.config
    problems += [
        f"{path}: its experts are split on the meta device (fs.ep or tensor parallel inside them), which "
        "materialize cannot fill; load them with fs.checkpoint.load_hf, or build the model on a real device"
        for path in dict.fromkeys((*config.tensor_parallel_experts, *config.expert_modules))
        if any(p.is_meta for p in module.get_submodule(path).parameters(recurse=False))
    ]
    buffers = meta_buffers(module)
    problems += buffer_problems(module, buffers, init=init)
    if problems:
        raise ShardingError(
            "fs.materialize cannot give every parameter and buffer a value; nothing changed:\n"
            + "\n".join(f"* {problem}" for problem in problems)
        )
    allocate(module, device)
    # before the seed: random numbers an initialiser may draw here leave the parameters' as they are
    restore_buffers(module, buffers, device, init=init)
    if seed is not None:
        torch.manual_seed(seed)
    rank = dist.get_rank()
    owner_of = {name: canonical for canonical, names in plan.aliases.items() for name in names}
    with torch.no_grad():
        for path, sub in module.named_modules():
            replaced = getattr(sub, "replaced", None) if isinstance(sub, PassThrough) else None
            if replaced is not None:  # another stage's: draw its random numbers, keep nothing
                _draw_as(replaced, path, device, chosen)
                continue
            if path not in chosen:  # no parameters of its own
                continue
            real = dict(sub._parameters)
            for name, full_value in _whole_values(sub, chosen[path], device).items():
                qualified = f"{path}.{name}" if path else name
                if owner_of.get(qualified, qualified) != qualified:
                    continue  # a tied alias: its owner's values win, as in construction
                target = real[name]
                if target is None:  # a parameter slot set to None: nothing to fill
                    continue
                local = target.to_local() if isinstance(target, DTensor) else target
                shape, offset = plan.local_shape_and_offset(qualified, rank)
                packed = getattr(sub, "_fs_packed", None)
                if isinstance(target, DTensor) and packed and name == "weight":
                    value = packed_window(full_value, target, *packed)
                    local.narrow(0, 0, value.shape[0]).copy_(value)
                elif isinstance(target, DTensor):
                    window = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
                    local.copy_(full_value[window])
                else:  # replicated (DDP, or a parameter no layer splits)
                    local.copy_(full_value)
    place_grads_as_params(plan, module)
    reduce_whole_grads(plan, module, applied.device_mesh)
    return module


def _initialisers_by_path(
    module: nn.Module, init: Initialiser | None
) -> tuple[dict[str, Initialiser], list[str]]:
    """The initialiser of each module with parameters, by path, and the modules that have none.

    Another pipeline stage's modules too: materialize draws their random numbers.
    """
    hf = hf_models(module)
    found: list[tuple[str, nn.Module, nn.Module | None]] = []
    for path, sub in module.named_modules():
        replaced = getattr(sub, "replaced", None) if isinstance(sub, PassThrough) else None
        if replaced is None:
            found.append((path, sub, hf[path]))
            continue
        inner = hf_models(replaced, outer=hf[path])
        found.extend((f"{path}.{p}" if p else path, s, inner[p]) for p, s in replaced.named_modules())
    chosen: dict[str, Initialiser] = {}
    problems: list[str] = []
    for path, sub, hf_model in found:
        direct = {name for name, param in sub._parameters.items() if param is not None}
        if not direct:
            continue
        if init is not None:
            chosen[path] = init
            continue
        unset = []
        for label, run in initialisers(sub, hf_model, None):
            # reset_parameters is torch's contract; a Hugging Face _init_weights passes over
            # modules it does not know, so it must be seen to set every parameter
            written, error = (direct, "") if label == "reset_parameters" else sets(run, sub)
            if direct <= written:
                chosen[path] = run
                break
            missing = ", ".join(sorted(direct - written))
            unset.append(f"{label} raised {error}" if error else f"{label} leaves {missing} unset")
        else:
            also = "".join(f", and {u}" for u in unset)
            problems.append(
                f"{path or '<root>'} ({class_name(sub)}): cannot initialise its parameters "
                f"({', '.join(sorted(direct))}): it has no reset_parameters{also}. "
                "Pass init=... (a function that sets a module's own parameters in place)"
            )
    return chosen, problems


def _draw_as(
    replaced: nn.Module, path: str, device: str | torch.device, chosen: dict[str, Initialiser]
) -> None:
    # as the loop above, on temporaries only: the random numbers drawn, the values dropped
    for sub_path, sub in replaced.named_modules():
        qualified = f"{path}.{sub_path}" if sub_path else path
        if qualified in chosen:
            _whole_values(sub, chosen[qualified], device)


def _whole_values(sub: nn.Module, run: Initialiser, device: str | torch.device) -> dict[str, torch.Tensor]:
    """``run(sub)`` on full-size temporaries of its own parameters: their values."""
    params, buffers = dict(sub._parameters), dict(sub._buffers)
    direct = dict(sub.named_parameters(recurse=False))
    for name, param in direct.items():
        shape = param.shape  # a DTensor's shape is the global shape
        sub._parameters[name] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=device))
    for name, buffer in buffers.items():
        if buffer is not None:  # an initialiser may reset buffers too: theirs are set already
            sub._buffers[name] = buffer.clone()
    try:
        run(sub)
        return {name: sub.get_parameter(name) for name in direct}
    finally:
        sub._parameters.update(params)
        sub._buffers.update(buffers)


def _parameters_real(module: nn.Module) -> bool:
    """Whether every parameter holds values already (none on meta); a mix is refused."""
    real = [path for path, param in module.named_parameters() if not param.is_meta]
    if real and len(real) < len(list(module.parameters())):
        named = f"{', '.join(real[:3])}{' ...' if len(real) > 3 else ''}"
        raise ShardingError(
            f"fs.materialize: {named} already hold values beside parameters on the meta device; drawing "
            "the others would overwrite them or draw in another order than the whole model built in one "
            "process. Build every parameter on the meta device, or load every one "
            "(fs.checkpoint.load_hf, fs.checkpoint.load)"
        )
    return bool(real)


def _fill_meta_buffers(module: nn.Module, device: str | torch.device, init: Initialiser | None) -> nn.Module:
    """Give ``module``'s meta buffers their values, its parameters untouched; refused before any change."""
    buffers = meta_buffers(module)
    problems = buffer_problems(module, buffers, init=init)
    if problems:
        raise ShardingError(
            "fs.materialize cannot give every buffer a value; nothing changed:\n"
            + "\n".join(f"* {problem}" for problem in problems)
        )
    _allocate_buffers(module, buffers, device)
    restore_buffers(module, buffers, device, init=init)
    return module


def _allocate_buffers(module: nn.Module, paths: tuple[str, ...], device: str | torch.device) -> None:
    """Give the meta buffers at ``paths`` memory on ``device``, leaving parameters as they are."""
    for path in paths:
        owner_path, _, name = path.rpartition(".")
        owner = module.get_submodule(owner_path)
        owner._buffers[name] = torch.empty_like(owner.get_buffer(name), device=device)


def allocate(module: nn.Module, device: str | torch.device) -> None:
    """Give a meta module's tensors memory on ``device`` (``to_empty``), keeping what is already real.

    ``to_empty`` replaces every tensor: buffers already on a real device get their values back,
    and parameters that go by several names (tied) are tied again, since it makes a new
    ``Parameter`` for each name. The values of the rest are uninitialised.

    Examples:
        >>> lin = nn.Linear(2, 2, device="meta")
        >>> allocate(lin, "cpu"); lin.weight.device.type
        'cpu'
    """
    kept = {path: b for path, b in module.named_buffers(remove_duplicate=False) if not b.is_meta}
    ties = [group for group in parameter_names(module).values() if len(group) > 1]
    module.to_empty(device=device)
    for first, *others in ties:
        shared = module.get_parameter(first)
        for other in others:
            owner_path, _, attr = other.rpartition(".")
            setattr(module.get_submodule(owner_path), attr, shared)
    with torch.no_grad():
        for path, value in kept.items():
            module.get_buffer(path).copy_(value)


def parameter_names(module: nn.Module) -> dict[str, list[str]]:
    """Each parameter once, under its first name, with every name it goes by (tied weights).

    Examples:
        >>> parameter_names(nn.Linear(2, 2))
        {'weight': ['weight'], 'bias': ['bias']}
    """
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {group[0]: group for group in names.values()}
