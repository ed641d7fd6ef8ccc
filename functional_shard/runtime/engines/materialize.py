"""Real parameters and buffers for a module built on the meta device, each rank only its shards."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import device as checked_device
from functional_shard.core.validate import entry_point, refuse, torch_seed
from functional_shard.planning.plan.plan import Plan

from .applied import applied_with
from .buffers import (
    Initialiser,
    buffer_problems,
    class_name,
    hf_initialiser,
    hf_models,
    initialisers,
    join_path,
    meta_buffers,
    restore_buffers,
    said,
    sets,
)
from .data_parallel import host_params, reduce_whole_grads
from .pipeline import PassThrough
from .tensor_parallel import packed_window, place_grads_as_params


@entry_point
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
    same under every plan, and equals initialising the whole model in one process. A Hugging
    Face model's ``_init_weights`` runs children first, as transformers' ``initialize_weights``,
    and on a parent that sets a child's parameter too (GPT-2's residual projections). Meta buffers
    get the values construction gives them (`restore_buffers`); real buffers keep theirs, and so do
    parameters that are all real already (loaded or trained): then only meta buffers are filled.

    Args:
        plan: the plan `apply` ran.
        module: the parallelized module, its parameters on the meta device (or all real).
        device: where the shards and buffers live; under CPU offload the parameters' shards are
            made in host memory, as FSDP2 needs, and the buffers here.
        seed: ``torch.manual_seed`` before the parameters are drawn, if given.
        init: called on each module with parameters (in module order) instead of its own initialiser.

    Raises:
        ShardingError: ``device`` is not a device this machine has, ``seed`` not a torch seed,
            ``init`` not a function (or raising on a module), or the module was not applied with
            this plan; or, before anything changes, parameters or meta buffers that nothing
            initialises, or real parameters beside meta ones.

    Examples:
        >>> # with torch.device("meta"): model = transformers.LlamaForCausalLM(config)
        >>> # fs.apply(plan, model); fs.materialize(plan, model, seed=0)
    """
    from torch.distributed.tensor import DTensor

    # "meta" would leave every tensor without values, silently
    device = checked_device(
        device, "device", meaning='where the shards are made: "cpu", "cuda:1" or a torch.device'
    )
    if seed is not None:  # checked here: torch.manual_seed runs after the model has changed
        torch_seed(seed, "seed", meaning="or None to draw from torch's state as it is")
    if init is not None and not callable(init):  # else each module's own initialiser stood in, unsaid
        refuse(
            "init", type(init).__name__, "a function", meaning="it sets a module's own parameters in place"
        )
    applied = applied_with(plan, module, "fs.materialize")
    plan = applied.local_plan  # under pp: this rank's stages only
    if _parameters_real(module):  # loaded or trained already: only meta buffers get values
        return _fill_meta_buffers(module, device, init)
    with _other_stages_in_place(module):
        steps, last_writer, problems = _steps(module, init)
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
    allocate(module, device, host_params(plan))
    # before the seed: random numbers an initialiser may draw here leave the parameters' as they are
    restore_buffers(module, buffers, device, init=init)
    if seed is not None:
        torch.manual_seed(seed)
    rank = dist.get_rank()
    owner_of = {name: canonical for canonical, names in plan.aliases.items() for name in names}
    # values a later step (an ancestor's initialiser) sets again, kept whole until it has
    pending: dict[str, torch.Tensor] = {}
    with torch.no_grad(), _other_stages_in_place(module) as elsewhere:
        for step in steps:
            so_far = {below: pending.pop(join_path(step.path, below)) for below in step.below}
            for relative, full_value in _drawn_values(step, device, so_far, init).items():
                qualified = join_path(step.path, relative)
                if last_writer.get(qualified, step.path) != step.path:
                    pending[qualified] = full_value
                    continue
                if any(qualified.startswith(f"{other}.") for other in elsewhere):
                    continue  # another stage's: its random numbers drawn, its values dropped
                if owner_of.get(qualified, qualified) != qualified:
                    continue  # a tied alias: its owner's values win, as in construction
                owner_path, _, name = qualified.rpartition(".")
                sub = module.get_submodule(owner_path)
                target = sub._parameters[name]
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


def _drawn_values(
    step: _Step, device: str | torch.device, so_far: dict[str, torch.Tensor], init: Initialiser | None
) -> dict[str, torch.Tensor]:
    """`_whole_values` of ``step``; the user's ``init`` raising on real tensors refused by module path."""
    try:
        return _whole_values(step, device, so_far)
    except Exception as error:
        if step.run is not init:
            raise
        # the parameters hold memory now, so a second materialize would take them for loaded
        raise _init_raised(
            error,
            step.path,
            step.module,
            "on real tensors, after passing on meta tensors; the parameters have memory but not "
            "all their values. Fix init, then build the model on meta and apply the plan again",
        ) from error


@dataclass(frozen=True)
class _Step:
    """One initialiser's call in materialize's order, and which parameters take its values."""

    path: str
    module: nn.Module
    run: Initialiser
    own: bool  # the module's own parameters (else they stand by on meta)
    below: tuple[str, ...] = ()  # descendants' parameters it sets too, by path under the module


def _steps(module: nn.Module, init: Initialiser | None) -> tuple[list[_Step], dict[str, str], list[str]]:
    """The initialisers' calls in order, who sets each parameter an ancestor sets last, and the refusals.

    Each module with parameters runs its initialiser (``init``, else the Hugging Face model's
    ``_init_weights``, else ``reset_parameters``). Under a Hugging Face model without ``init``,
    ``_init_weights`` runs as transformers' ``initialize_weights`` does, children first, and on a
    parent too where a dry run on meta stand-ins sees it set a descendant's parameter (GPT-2's
    residual projections): a parameter takes its own module's values, then each such ancestor's.
    Call it with the other stages' modules in place (`_other_stages_in_place`): every rank draws theirs.
    """
    hf = hf_models(module)
    modules = dict(module.named_modules())
    hf_runs = {path: found for path in modules if init is None and (found := hf_initialiser(hf[path]))}
    hf_sets: dict[str, tuple[frozenset[str], Exception | None]] = {}
    below: dict[str, tuple[str, ...]] = {}
    last_writer: dict[str, str] = {}
    for path, (_, run) in hf_runs.items():  # module order: an ancestor before its descendants
        sub = modules[path]
        if not any(True for child in sub.children() for _ in child.parameters()):
            continue
        hf_sets[path] = written, error = sets(run, sub, below=True)
        # a dry run that raised: the real call would raise too, after the model has changed
        below[path] = () if error else tuple(sorted(w for w in written if "." in w))
        for relative in below[path]:
            last_writer.setdefault(join_path(path, relative), path)  # the outermost writes last
    chosen: dict[str, Initialiser] = {}
    problems: list[str] = []
    for path, sub in modules.items():
        direct = {name for name, param in sub._parameters.items() if param is not None}
        if not direct:
            continue
        from_above = {name for name in direct if join_path(path, name) in last_writer}
        unset = []
        for label, run in initialisers(sub, hf[path], init):
            if label == "reset_parameters":  # torch's contract: it sets every parameter of its own
                written, error = frozenset(direct), None
            elif path in hf_sets and label == hf_runs[path][0]:
                written, error = hf_sets[path]
            else:  # a Hugging Face _init_weights passes over modules it does not know
                written, error = sets(run, sub)
            if label == "init" and error is not None:  # the user's bug, not a module init passes over
                raise _init_raised(
                    error,
                    path,
                    sub,
                    "on meta tensors (a dry run that finds what it sets); nothing changed. Fix init, or let "
                    "it return without setting a module it does not handle (its own initialiser then runs)",
                ) from error
            if direct <= written | from_above:
                chosen[path] = run
                break
            missing = ", ".join(sorted(direct - written - from_above))
            unset.append(f"{label} raised {said(error)}" if error else f"{label} leaves {missing} unset")
        else:
            if direct <= from_above:  # its ancestors set them all: nothing to draw before them
                chosen[path] = _sets_nothing
                continue
            also = "".join(f", and {u}" for u in unset)
            problems.append(
                f"{path or '<root>'} ({class_name(sub)}): cannot initialise its parameters "
                f"({', '.join(sorted(direct))}): it has no reset_parameters{also}. "
                "Pass init=... (a function that sets a module's own parameters in place)"
            )
    steps: list[_Step] = []
    visited: set[int] = set()

    def visit(path: str, sub: nn.Module) -> None:
        visited.add(id(sub))
        children_first = path in hf_runs  # as transformers' initialize_weights (nn.Module.apply)
        if not children_first:
            steps.extend(_steps_of(path, sub, chosen.get(path), hf_runs.get(path), below.get(path, ())))
        for name, child in sub._modules.items():
            if child is not None and id(child) not in visited:  # as named_modules: a shared module once
                visit(join_path(path, name), child)
        if children_first:
            steps.extend(_steps_of(path, sub, chosen.get(path), hf_runs.get(path), below.get(path, ())))

    visit("", module)
    return steps, last_writer, problems


def _steps_of(
    path: str,
    sub: nn.Module,
    own: Initialiser | None,
    hf_run: tuple[str, Initialiser] | None,
    below: tuple[str, ...],
) -> list[_Step]:
    """A module's calls: its own initialiser, then ``_init_weights`` for its descendants' parameters.

    One call where the two are the same initialiser.
    """
    steps = [] if own is None else [_Step(path, sub, own, own=True)]
    if below and hf_run is not None:
        if steps and own == hf_run[1]:  # equal bound methods: the one call sets both
            steps[0] = _Step(path, sub, own, own=True, below=below)
        else:
            steps.append(_Step(path, sub, hf_run[1], own=False, below=below))
    return steps


def _init_raised(error: Exception, path: str, sub: nn.Module, when_and_fix: str) -> ShardingError:
    """The refusal of an ``init=`` that raised ``error`` on the module at ``path``."""
    return ShardingError(
        f"fs.materialize(init=...) raised {said(error)} on {path or '<root>'} ({class_name(sub)}), "
        + when_and_fix
    )


def _sets_nothing(module: nn.Module) -> None:
    """The own initialiser of a module whose parameters its ancestors' initialisers set."""


@contextmanager
def _other_stages_in_place(module: nn.Module) -> Iterator[tuple[str, ...]]:
    """The modules other pipeline stages run (on meta), back where their `PassThrough` stands; their paths.

    So every rank runs the same initialisers in the same order, and a parent's initialiser
    that reaches into a child of another stage finds it.
    """
    swapped: list[tuple[str, nn.Module, nn.Module]] = []
    for path, sub in list(module.named_modules()):
        replaced = getattr(sub, "replaced", None) if isinstance(sub, PassThrough) else None
        if replaced is not None and path:
            swapped.append((path, module.get_submodule(path.rpartition(".")[0]), sub))
            swapped[-1][1]._modules[path.rpartition(".")[2]] = replaced
    try:
        yield tuple(path for path, _, _ in swapped)
    finally:
        for path, parent, stand_in in reversed(swapped):
            parent._modules[path.rpartition(".")[2]] = stand_in


def _whole_values(
    step: _Step, device: str | torch.device, so_far: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``step.run(step.module)`` on full-size temporaries: the values of the parameters it gives values to.

    Its own parameters start empty; the descendants' in ``step.below`` from ``so_far`` (their
    values until now); every other parameter under the module, and the descendants' buffers,
    stand by on meta (a draw there draws nothing). Its own buffers are copies: an initialiser may
    reset them too, and theirs are set already.
    """
    sub = step.module
    own = tuple(dict(sub.named_parameters(recurse=False))) if step.own else ()  # a tie inside it once
    owners = dict(sub.named_modules()) if step.below else {"": sub}
    saved = {path: (dict(owner._parameters), dict(owner._buffers)) for path, owner in owners.items()}
    for path, owner in owners.items():
        for name, param in saved[path][0].items():
            if param is None:
                continue
            relative = join_path(path, name)
            if relative in so_far:
                # the same object, as in transformers: its init.* pass over a tensor an earlier
                # initialiser marked _is_hf_initialized
                value = so_far[relative]
                owner._parameters[name] = value if isinstance(value, nn.Parameter) else nn.Parameter(value)
            else:  # a DTensor's shape is the global shape
                where = device if step.own and not path else "meta"
                owner._parameters[name] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=where)
                )
        for name, buffer in saved[path][1].items():
            if buffer is not None:
                owner._buffers[name] = (
                    buffer.clone()
                    if not path
                    else torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")
                )
    try:
        step.run(sub)
        return {relative: sub.get_parameter(relative) for relative in (*own, *step.below)}
    finally:
        for path, owner in owners.items():
            owner._parameters.update(saved[path][0])
            owner._buffers.update(saved[path][1])


def _parameters_real(module: nn.Module) -> bool:
    """Whether every parameter holds values already (none on meta); a mix is refused."""
    real = [path for path, param in module.named_parameters() if not param.is_meta]
    if real and len(real) < len(list(module.parameters())):
        named = f"{', '.join(real[:3])}{' ...' if len(real) > 3 else ''}"
        hold = "holds" if len(real) == 1 else "hold"
        raise ShardingError(
            f"fs.materialize: {named} already {hold} values beside parameters on the meta device; drawing "
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


def allocate(module: nn.Module, device: str | torch.device, host: Collection[str] = ()) -> None:
    """Give a meta module's tensors memory on ``device`` (``to_empty``), keeping what is already real.

    The parameters named in ``host`` get host memory instead (`host_params`: FSDP2's CPU offload
    refuses its shards anywhere else). Each tensor is replaced: buffers already on a real device
    get their values back, and parameters that go by several names (tied) are tied again, since
    it makes a new ``Parameter`` for each name. The values of the rest are uninitialised.

    Examples:
        >>> lin = nn.Linear(2, 2, device="meta")
        >>> allocate(lin, "cpu"); lin.weight.device.type
        'cpu'
    """
    kept = {path: b for path, b in module.named_buffers(remove_duplicate=False) if not b.is_meta}
    ties = [group for group in parameter_names(module).values() if len(group) > 1]
    where = _homes(module, device, host)
    module._apply(lambda t: torch.empty_like(t, device=where.get(id(t), device)))
    for first, *others in ties:
        shared = module.get_parameter(first)
        for other in others:
            owner_path, _, attr = other.rpartition(".")
            setattr(module.get_submodule(owner_path), attr, shared)
    with torch.no_grad():
        for path, value in kept.items():
            module.get_buffer(path).copy_(value)


def move(module: nn.Module, device: str | torch.device, host: Collection[str] = ()) -> None:
    """``module.to(device)``, but the parameters named in ``host`` (and their gradients) to host memory.

    Examples:
        >>> lin = nn.Linear(2, 2)
        >>> move(lin, "meta", host=["bias"]); lin.weight.device.type, lin.bias.device.type
        ('meta', 'cpu')
    """
    where = _homes(module, device, host)
    module._apply(lambda t: t.to(where.get(id(t), device)))


def _homes(module: nn.Module, device: str | torch.device, host: Collection[str]) -> dict[int, torch.device]:
    # by identity: nn.Module._apply hands over tensors, not names (a tied one under any of its names)
    cpu = torch.device("cpu")
    where = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in host:
            where[id(param)] = cpu
            if param.grad is not None:
                where[id(param.grad)] = cpu
    return where


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
