"""Buffers of a module built on the meta device, given the values its construction computes.

A buffer built on meta (a rotary ``inv_freq``, position ids, a norm's running statistics)
holds no value, and ``to_empty`` leaves uninitialised memory there: training runs, silently
wrong. Each such buffer is recomputed by its module's own initialiser: the caller's ``init``,
the ``_init_weights`` of the Hugging Face model around it, or its ``reset_parameters``. A dry
run on meta stand-ins (an in-place write bumps the version counter, on meta too) finds which
sets which, so a buffer nothing recomputes is refused before any change.

The initialiser, not a second construction on the CPU: constructing needs the constructor's
arguments and the class ``fs.apply`` swapped, and runs its side effects; transformers'
``from_pretrained`` restores non-persistent buffers through ``_init_weights`` in the same way.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from functional_shard.core.errors import ShardingError

__all__ = [
    "Initialiser",
    "buffer_problems",
    "class_name",
    "hf_initialiser",
    "hf_models",
    "initialisers",
    "join_path",
    "meta_buffers",
    "restore_buffers",
    "said",
    "sets",
]

Initialiser = Callable[[nn.Module], None]
"""Sets a module's own parameters (and maybe buffers) in place, as ``reset_parameters`` does."""


def meta_buffers(module: nn.Module) -> tuple[str, ...]:
    """Paths of the buffers of ``module`` still on the meta device (call it before ``to_empty``).

    Args:
        module: the module, built (in part) on the meta device.

    Returns:
        Every path of a meta buffer, in module order; a shared buffer once per path (``to_empty`` splits it).

    Examples:
        >>> with torch.device("meta"):
        ...     norm = nn.BatchNorm1d(4)
        >>> meta_buffers(nn.Sequential(norm))
        ('0.running_mean', '0.running_var', '0.num_batches_tracked')
    """
    return tuple(path for path, buffer in module.named_buffers(remove_duplicate=False) if buffer.is_meta)


def buffer_problems(module: nn.Module, paths: Iterable[str], *, init: Initialiser | None = None) -> list[str]:
    """The buffers among ``paths`` that `restore_buffers` cannot compute; changes nothing.

    Args:
        module: the module holding the buffers (before or after ``to_empty``).
        paths: buffer paths, as `meta_buffers` gives them.
        init: an initialiser tried first on each buffer's module (``fs.materialize``'s ``init``).

    Returns:
        One line per buffer that cannot be restored, naming its path, why, and the fix.

    Examples:
        >>> class Rotary(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.register_buffer("freqs", torch.arange(4.0), persistent=False)
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(Rotary(), nn.BatchNorm1d(4))
        >>> [line.split(":")[0] for line in buffer_problems(model, meta_buffers(model))]
        ['0.freqs']
    """
    return _recipes(module, paths, init)[1]


def restore_buffers(
    module: nn.Module, paths: Iterable[str], device: str | torch.device, *, init: Initialiser | None = None
) -> None:
    """Give each buffer in ``paths`` the value the module's construction gives it, on ``device``.

    Each initialiser runs with its module's parameters replaced by meta stand-ins (nothing
    written, no random numbers drawn) and its other buffers by copies (their values kept).

    Args:
        module: the module, after ``to_empty`` (or with real buffers elsewhere).
        paths: buffer paths, as `meta_buffers` gave them before ``to_empty``.
        device: where the buffers live.
        init: an initialiser tried first on each buffer's module.

    Raises:
        ShardingError: a buffer nothing recomputes (`buffer_problems` names them without changing anything).

    Examples:
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(nn.BatchNorm1d(2))
        >>> paths = meta_buffers(model)
        >>> _ = model.to_empty(device="cpu")
        >>> restore_buffers(model, paths, "cpu")
        >>> model[0].running_var
        tensor([1., 1.])
    """
    steps, problems = _recipes(module, paths, init)
    if problems:
        raise ShardingError(
            "cannot give these buffers their values:\n" + "\n".join(f"* {p}" for p in problems)
        )
    for owner_path, (owner, runs) in steps.items():
        for run, names in runs:
            _run_for(run, owner, owner_path, names, device)


def hf_models(module: nn.Module, outer: nn.Module | None = None) -> dict[str, nn.Module | None]:
    """For each submodule path, the Hugging Face model nearest around it (itself included), or None.

    The nearest, as transformers' ``initialize_weights`` dispatches; by ``isinstance``, since
    ``fs.apply`` swaps classes. ``outer``: the model around ``module``.
    """
    # transformers is optional and heavy to import: a model of its classes has imported it
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    found: dict[str, nn.Module | None] = {}
    for path, sub in module.named_modules():
        if pretrained is not None and isinstance(sub, pretrained):
            found[path] = sub
        else:  # module order visits a parent before its children
            found[path] = found.get(path.rpartition(".")[0], outer) if path else outer
    return found


def initialisers(
    sub: nn.Module, hf_model: nn.Module | None, init: Initialiser | None
) -> list[tuple[str, Initialiser]]:
    """The initialisers of ``sub`` present, named, in the order tried.

    ``init``, ``hf_model._init_weights``, ``sub.reset_parameters``, then ``sub._init_self_buffers``
    (where torchtitan's modules recompute their buffers).
    """
    found: list[tuple[str, Initialiser]] = []
    if init is not None:
        found.append(("init", init))
    if (hf_init := hf_initialiser(hf_model)) is not None:
        found.append(hf_init)
    reset: Initialiser | None = getattr(type(sub), "reset_parameters", None)
    if reset is not None:
        found.append(("reset_parameters", reset))
    own_buffers: Initialiser | None = getattr(type(sub), "_init_self_buffers", None)
    if own_buffers is not None:
        found.append(("_init_self_buffers", own_buffers))
    return found


def hf_initialiser(hf_model: nn.Module | None) -> tuple[str, Initialiser] | None:
    """``hf_model._init_weights``, named by its qualified name, or None."""
    run: Initialiser | None = getattr(hf_model, "_init_weights", None)
    return None if run is None else (getattr(run, "__qualname__", "_init_weights"), run)


def sets(run: Initialiser, sub: nn.Module, *, below: bool = False) -> tuple[frozenset[str], Exception | None]:
    """What ``run(sub)`` sets on meta stand-ins, by path under ``sub``, and what it raised (or None).

    ``sub``'s own parameters and buffers; with ``below``, its descendants' parameters too (their
    buffers stand by on meta, unreported): a Hugging Face ``_init_weights`` may set a child's
    parameter from its parent, as GPT-2's scales its residual projections.
    """
    owners = dict(sub.named_modules()) if below else {"": sub}
    saved = {path: (dict(owner._parameters), dict(owner._buffers)) for path, owner in owners.items()}
    # path under sub -> (its table, its name there, the stand-in), for each tensor reported
    stand_ins: dict[str, tuple[Mapping[str, torch.Tensor | None], str, torch.Tensor]] = {}
    for path, owner in owners.items():
        for name, param in saved[path][0].items():
            if param is not None:
                stand_in = nn.Parameter(_on_meta(param), requires_grad=param.requires_grad)
                owner._parameters[name] = stand_in
                stand_ins[join_path(path, name)] = (owner._parameters, name, stand_in)
        for name, buffer in saved[path][1].items():
            if buffer is not None:
                owner._buffers[name] = buffer_stand_in = _on_meta(buffer)
                if not path:
                    stand_ins[name] = (owner._buffers, name, buffer_stand_in)
    versions = {label: tensor._version for label, (_, _, tensor) in stand_ins.items()}
    error: Exception | None = None
    try:
        # a dry run: whatever an initialiser raises on meta tensors (an .item(), say), it sets
        # nothing we can see; the error goes into the refusal if nothing else sets the tensor
        try:
            with torch.no_grad():
                run(sub)
        except Exception as raised:
            error = raised
        after = {label: table.get(name) for label, (table, name, _) in stand_ins.items()}
    finally:
        for path, owner in owners.items():
            owner._parameters.update(saved[path][0])
            owner._buffers.update(saved[path][1])
    written = set()
    for label, (_, _, tensor) in stand_ins.items():
        replaced = after[label]
        if tensor._version != versions[label] or (replaced is not None and replaced is not tensor):
            written.add(label)
    return frozenset(written), error


def said(error: BaseException) -> str:
    """An error as a refusal quotes it: its class and message."""
    return f"{type(error).__name__}: {error}"


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    # a DTensor's shape is the global shape: initialisers see whole tensors
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


_Steps = dict[str, tuple[nn.Module, list[tuple[Initialiser, tuple[str, ...]]]]]


def _recipes(module: nn.Module, paths: Iterable[str], init: Initialiser | None) -> tuple[_Steps, list[str]]:
    """Per buffer-owning module: which initialiser sets which of its buffers; and the problems."""
    wanted: dict[str, list[str]] = {}
    problems: list[str] = []
    for path in paths:
        owner_path, _, name = path.rpartition(".")
        wanted.setdefault(owner_path, []).append(name)
    hf = hf_models(module) if wanted else {}
    steps: _Steps = {}
    for owner_path, names in wanted.items():
        owner = _submodule(module, owner_path)
        if owner is None or any(getattr(owner, "_buffers", {}).get(n) is None for n in names):
            problems.extend(
                f"{join_path(owner_path, n)}: the module holds no buffer at this path" for n in names
            )
            continue
        left, runs, tried = list(names), [], []
        for label, run in initialisers(owner, hf.get(owner_path), init):
            written, error = sets(run, owner)
            tried.append(f"{label} (raised {said(error)})" if error else label)
            if got := tuple(n for n in left if n in written):
                runs.append((run, got))
                left = [n for n in left if n not in written]
        if runs:
            steps[owner_path] = (owner, runs)
        problems.extend(_problem(join_path(owner_path, n), owner, tried) for n in left)
    return steps, problems


def _problem(path: str, owner: nn.Module, tried: list[str]) -> str:
    kind = class_name(owner)
    why = f"none of {', '.join(tried)} sets it" if tried else "it has no reset_parameters"
    return (
        f"{path}: {kind} computes this buffer when it is built, but {why}, so after the meta device "
        f"it would hold uninitialised memory. Give {kind} a reset_parameters that sets it, or build the "
        "model with its buffers on a real device (only its parameters on meta)"
    )


def _run_for(
    run: Initialiser, owner: nn.Module, owner_path: str, names: tuple[str, ...], device: str | torch.device
) -> None:
    params, buffers = dict(owner._parameters), dict(owner._buffers)
    fresh: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        if param is not None:  # no values written to the real parameters, no random numbers drawn
            owner._parameters[name] = nn.Parameter(_on_meta(param), requires_grad=param.requires_grad)
    for name, buffer in buffers.items():
        if buffer is None:
            continue
        if name in names:
            fresh[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
            owner._buffers[name] = fresh[name]
        else:  # an initialiser may reset it too: the value it holds (loaded, say) stays
            owner._buffers[name] = buffer.clone()
    versions = {name: tensor._version for name, tensor in fresh.items()}
    try:
        with torch.no_grad():
            run(owner)
        after = dict(owner._buffers)
    except Exception as error:  # it passed on meta tensors (`sets`): only real values make it raise
        raise ShardingError(
            f"{owner_path or '<root>'} ({class_name(owner)}): its initialiser raised {said(error)} on real "
            "buffers, after passing on meta tensors; the buffers have memory but not their values. Fix that "
            "initialiser (init=..., or the module's own: either may run), then build the model on meta again"
        ) from error
    finally:
        owner._parameters.update(params)
        owner._buffers.update(buffers)
    for name in names:
        value = after.get(name)
        if value is None or (value is fresh[name] and value._version == versions[name]):
            raise ShardingError(
                f"{join_path(owner_path, name)}: its initialiser set it on meta tensors but not here"
            )
        _put(owner, name, value, device)


def _put(owner: nn.Module, name: str, value: torch.Tensor, device: str | torch.device) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    current = owner._buffers[name]
    if current is None:
        return
    value = value.to(device=device if current.is_meta else current.device, dtype=current.dtype)
    if isinstance(current, DTensor):  # torch's tensor parallel replicates a styled module's buffers
        # src_data_rank=None: each rank takes its part of the value it holds, no collective
        value = distribute_tensor(value, current.device_mesh, current.placements, src_data_rank=None)
    if current.is_meta:  # not through to_empty: the value is the buffer
        owner._buffers[name] = value
    else:
        with torch.no_grad():
            current.copy_(value)  # the tensor others may hold stays the buffer


def class_name(module: nn.Module) -> str:
    """The name of the module's own class, not of one torch's engines swapped in (``FSDPNet``)."""
    own = next((c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed.")), None)
    return (own or type(module)).__name__


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def join_path(owner_path: str, name: str) -> str:
    """``name`` under the module at ``owner_path`` (``""``: the root).

    Examples:
        >>> join_path("layers.0", "weight"), join_path("", "weight")
        ('layers.0.weight', 'weight')
    """
    return f"{owner_path}.{name}" if owner_path else name
