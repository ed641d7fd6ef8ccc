"""Reading a checkpoint into a module: all of it, or nothing.

Every check runs before anything is written (`integrity`): the files are whole,
hold no code (`safety`), and fit the module and its optimizers. A sharded
folder is read into copies of this rank's states, which replace the module's and the
optimizers' only once everything arrived. Should torch still fail while setting them, the
optimizers get their own state back and the error says what happened.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from functional_shard.core.errors import ShardingError

from .integrity import (
    DAMAGED_FIX,
    FIT_FIX,
    MANIFEST,
    MARK,
    META,
    Described,
    agreed,
    described,
    every_rank_keys,
    fit_problems,
    index_tensors,
    is_ours,
    manifest_problems,
    raise_problems,
    seal_problems,
)
from .safety import SafeLoadPlanner, SafeReader, load_file
from .state import (
    made_state,
    model_state,
    refuse_packed,
    saved_only,
    set_model_state,
    set_optimizer_state,
    zero1_template,
)

__all__ = [
    "META",
    "STATE_KEYS",
    "checked_file",
    "checked_folder",
    "kind_problems",
    "optimizers_by_key",
    "read",
    "refusals_raised",
]

STATE_KEYS = ("model", "state_dict")  # a module's state: save's, and Lightning's (Trainer, Fabric)
Target = tuple[str, nn.Module]  # the module's key in the checkpoint, and the module
Optimizers = dict[str, torch.optim.Optimizer]  # by key in the checkpoint
Check = Callable[[dict[str, Any]], list[str]] | None  # the meta's problems, before anything is set


def optimizers_by_key(saved: dict[str, Any]) -> dict[str, Any]:
    """A Trainer's file keeps its optimizers in Lightning's list; a folder, by key."""
    for index, optimizer in enumerate(saved.pop("optimizer_states", [])):
        saved[f"optimizer_{index}"] = optimizer
    return saved


def read(
    path: str | os.PathLike[str],
    module: tuple[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    *,
    strict: bool = True,
    trust: bool = False,
    check: Callable[[dict[str, Any]], list[str]] | None = None,
) -> dict[str, Any]:
    """Load what `write` made (a folder or a file), whatever plan saved it; or change nothing.

    ``module`` is its key and the module; ``optimizers`` go by key. A file's optimizer list
    (Lightning's ``optimizer_states``) is read as ``optimizer_0``, ``optimizer_1``, ...
    Nothing in the checkpoint runs as code unless ``trust``. ``check`` sees the meta saved
    beside once it is read, and its problems refuse the load before anything is set.

    Returns:
        The ``meta`` saved beside (for a file: everything but the states loaded).

    Raises:
        ShardingError: no checkpoint at ``path``; one that is damaged, holds code, or does
            not fit the module (the first few keys named). The module and the optimizers
            are then as they were.

    Examples:
        >>> # meta = read("ckpt", ("model", model), {"optimizer": optimizer})
    """
    path = Path(path)
    if not path.exists():
        raise ShardingError(f"no checkpoint at {path}")
    if path.is_dir():
        refuse_packed(module[1], f"reading the sharded checkpoint {path}")
        return _read_sharded(path, module, optimizers, strict=strict, trust=trust, check=check)
    return _read_full(path, module, optimizers, strict=strict, trust=trust, check=check)


def _first_refusal(problems: list[str]) -> None:
    # whole sentences (a refusal, an unreadable file): every rank raises the first
    if problems:
        raise ShardingError(problems[0])


def _whole_or_refused(read_it: Any) -> tuple[Any, list[str]]:
    try:
        return read_it(), []
    except ShardingError as error:
        return None, [str(error)]


def _read_full(
    path: Path, module: Target, optimizers: Optimizers, *, strict: bool, trust: bool, check: Check
) -> dict[str, Any]:
    # every rank reads the file and keeps its own shards (a full copy per rank while
    # loading: the price of the one-file format)
    key, target = module
    saved = optimizers_by_key(checked_file(path, trust=trust))
    refused = kind_problems(path, saved, (key,))
    _first_refusal(agreed(refused or (check(saved) if check else [])))
    problems = _fits(target, saved, key, optimizers, strict=strict)
    raise_problems(agreed(problems), f"the checkpoint at {path} does not fit this module", FIT_FIX)
    loaded = {name: (optimizer, saved.pop(name)) for name, optimizer in optimizers.items() if name in saved}
    before = {name: _snapshot(optimizer) for name, (optimizer, _) in loaded.items()}
    if strict:
        kept = {name: _state_fields(state) for name, (_, state) in loaded.items()}
        _refuse_other_kinds(path, target, {name: o for name, (o, _) in loaded.items()}, kept, before)
    _set_all(path, target, saved.pop(key), loaded, full=True, strict=strict, before=before)
    return saved


def kind_problems(path: Path, saved: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """Why what was read from ``path`` is no checkpoint of a module: it holds none of ``keys``.

    Examples:
        >>> kind_problems(Path("ckpt"), {"model": {}}, STATE_KEYS)
        []
        >>> print(kind_problems(Path("x.pt"), {"a": 1}, ("model",))[0])
        the checkpoint at x.pt holds no 'model' state (its keys: ['a']): it is not a checkpoint of this kind
    """
    if any(key in saved for key in keys):
        return []
    named = " or ".join(repr(key) for key in keys)
    return [
        f"the checkpoint at {path} holds no {named} state (its keys: {sorted(map(str, saved))[:5]}): "
        "it is not a checkpoint of this kind"
    ]


def checked_file(path: Path, *, trust: bool, alone: bool = False) -> dict[str, Any]:
    """A full file's contents, once its bytes match its seal and the safe loader rebuilt them."""
    _first_refusal(agreed(_foreign_file_problems(path), alone=alone))
    raise_problems(
        agreed(seal_problems(path), alone=alone), f"the checkpoint at {path} is damaged", DAMAGED_FIX
    )
    saved, problems = _whole_or_refused(lambda: load_file(path, trust=trust))
    if not problems and not isinstance(saved, dict):
        problems = [f"the checkpoint at {path} holds a {type(saved).__name__}, not a dict of states"]
    _first_refusal(agreed(problems, alone=alone))
    return saved


def _foreign_file_problems(path: Path) -> list[str]:
    # a file torch.save never wrote (no zip archive, no seal) is no damaged checkpoint
    if is_ours(path):
        return []
    with open(path, "rb") as stream:
        if stream.read(4) == _ZIP_START:
            return []
    return [
        f"{_NOT_ONE.format(path=path)}: it is a file, but not one torch.save wrote (a zip archive). {_PASS}"
    ]


_ZIP_START = b"PK\x03\x04"
_NOT_ONE = "there is no checkpoint at {path}"
_PASS = "Pass the folder or the file fs.checkpoint.save wrote"


def _fits(
    target: nn.Module,
    saved: dict[str, Any],
    key: str,
    optimizers: dict[str, torch.optim.Optimizer],
    *,
    strict: bool,
) -> list[str]:
    # what of the saved states does not fit the module and its optimizers (a collective:
    # a pipeline rank's module holds its stages only, so keys count if any rank wants them)
    expected = described(model_state(target))
    wanted = every_rank_keys(expected)
    problems = [
        f"{key}.{problem}" for problem in _fit(saved.get(key, {}), expected, wanted=wanted, strict=strict)
    ]
    for name, optimizer in optimizers.items():
        if name in saved:
            problems += _optimizer_fit(saved[name], optimizer, expected, wanted=wanted, prefix=f"{name}.")
        elif strict:  # as a folder's missing keys are: a file's missing optimizer is no silent skip
            problems.append(f"{name}: missing, the checkpoint was saved without it (load without it)")
    return problems


def _fit(saved: Any, expected: dict[str, Described], *, wanted: set[str], strict: bool) -> list[str]:
    if not isinstance(saved, dict):
        return [f"(the module's state): a {type(saved).__name__}, not a dict"]
    shapes = described(saved)
    problems = fit_problems(shapes, expected, wanted=wanted, strict=strict)
    return problems + [f"{key}: not a tensor" for key in saved if key in expected and key not in shapes]


def _optimizer_fit(
    saved: Any,
    optimizer: torch.optim.Optimizer,
    parameters: dict[str, Described],
    *,
    wanted: set[str],
    prefix: str,
) -> list[str]:
    if not (isinstance(saved, dict) and isinstance(saved.get("state", {}), dict)):
        return [f"{prefix.rstrip('.')}: not an optimizer's state"]
    groups = saved.get("param_groups", [])
    problems = []
    if groups and len(groups) != len(optimizer.param_groups):
        problems.append(
            f"{prefix.rstrip('.')}: {len(groups)} parameter groups in the checkpoint, "
            f"{len(optimizer.param_groups)} in the optimizer"
        )
    for name, values in saved.get("state", {}).items():
        if name not in wanted:
            problems.append(f"{prefix}state.{name}: in the checkpoint, not a parameter of the module")
            continue
        if name not in parameters:
            continue  # another pipeline stage's: that rank compares it
        shape = parameters[name][0]
        for field, value in values.items() if isinstance(values, dict) else []:
            # a moment has its parameter's shape; a factored state (fewer dims) is not compared
            if torch.is_tensor(value) and value.dim() == len(shape) and tuple(value.shape) != shape:
                problems.append(
                    f"{prefix}state.{name}.{field}: shape {list(value.shape)} in the checkpoint, "
                    f"{list(shape)} for the parameter"
                )
    return problems


def _state_fields(state: Any) -> set[str]:
    """What an optimizer's state keeps for each parameter (AdamW: exp_avg, exp_avg_sq, step).

    Examples:
        >>> sorted(_state_fields({"state": {"w": {"step": 1, "exp_avg": 0}, "b": {"step": 1}}}))
        ['exp_avg', 'step']
    """
    per_parameter = state.get("state", {}) if isinstance(state, dict) else {}
    return {field for values in per_parameter.values() if isinstance(values, dict) for field in values}


def _index_state_fields(index: Any, optimizers: Optimizers) -> dict[str, set[str]]:
    # a folder's index names every value "optimizer.state.<parameter path>.<field>"
    fields: dict[str, set[str]] = {name: set() for name in optimizers}
    for key in index.state_dict_metadata:
        top, _, rest = key.partition(".")
        if top in fields and rest.startswith("state."):
            fields[top].add(rest.rpartition(".")[2])
    return fields


def _refuse_other_kinds(
    path: Path, target: nn.Module, optimizers: Optimizers, saved: dict[str, set[str]], before: dict[str, Any]
) -> None:
    # an optimizer of another kind (AdamW's checkpoint, an SGD) keeps other fields per parameter,
    # which torch would meet as a missing key; each is compared with its state made to load into
    problems = []
    for name, optimizer in optimizers.items():
        # a ZeRO-1 optimizer's template is read from the checkpoint itself; a checkpoint of an
        # optimizer that kept nothing yet (never stepped, or stateless) loads into any kind
        if isinstance(optimizer, ZeroRedundancyOptimizer) or not saved[name]:
            continue
        kept = _state_fields(made_state(target, optimizer))
        if kept != saved[name]:
            missing = sorted(kept - saved[name])
            problems.append(
                f"{name}: the checkpoint's optimizer keeps {', '.join(sorted(saved[name]))} for each "
                f"parameter, this {type(optimizer).__name__} keeps {', '.join(sorted(kept)) or 'nothing'}"
                + (f" (missing from the checkpoint: {', '.join(missing)})" if missing else "")
            )
    problems = agreed(problems)
    if problems:
        for name, optimizer in optimizers.items():
            _restore(optimizer, before[name])
    raise_problems(
        problems,
        f"the checkpoint at {path} was saved by another kind of optimizer (or other options)",
        "Load it with an optimizer built as the one that saved it (its class and options), or load "
        "the module alone (no optimizer) and start the optimizer afresh",
    )


def _snapshot(optimizer: torch.optim.Optimizer) -> Any:
    # torch's own state_dict holds references, not copies: loading replaces the tensors
    # it refers to, so they stay as they were. A ZeRO-1 optimizer's own is this rank's.
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        return optimizer.optim.state_dict(), hyper
    return optimizer.state_dict()


def _restore(optimizer: torch.optim.Optimizer, before: Any) -> None:
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        local, hyper = before
        optimizer.optim.load_state_dict(local)
        for group, values in zip(optimizer.param_groups, hyper, strict=True):
            group.update(values)
    else:
        optimizer.load_state_dict(before)


def _set_all(
    path: Path,
    target: nn.Module,
    model: dict[str, Any],
    optimizers: dict[str, tuple[torch.optim.Optimizer, Any]],
    *,
    full: bool,
    strict: bool,
    before: dict[str, Any],
) -> None:
    # the optimizers first: torch's optimizers take their own state back (``before``) if
    # the module then fails; the module, checked already, is set last
    try:
        for optimizer, state in optimizers.values():
            set_optimizer_state(target, optimizer, state, full=full)
        set_model_state(target, model, full=full, strict=strict)
    except (RuntimeError, ValueError, KeyError, TypeError, AssertionError) as error:
        for name, (optimizer, _) in optimizers.items():
            _restore(optimizer, before[name])
        raise ShardingError(
            f"torch could not load the checkpoint at {path} into this module ({type(error).__name__}: "
            f"{str(error).strip()[:300]}); the optimizers were given their state back. {FIT_FIX}"
        ) from error


def _read_sharded(
    path: Path, module: Target, optimizers: Optimizers, *, strict: bool, trust: bool, check: Check
) -> dict[str, Any]:
    key, target = module
    meta = checked_folder(path, trust=trust)
    _first_refusal(agreed(check(meta) if check else []))
    index, problems = _whole_or_refused(lambda: SafeReader(path, trust=trust).read_metadata())
    _first_refusal(agreed(problems))
    stored = _stored(index)
    problems = _fits(target, stored, key, optimizers, strict=strict)
    raise_problems(agreed(problems), f"the checkpoint at {path} does not fit this module", FIT_FIX)
    # building an optimizer's state initializes a fresh one: it is given back on failure
    before = {name: _snapshot(optimizer) for name, optimizer in optimizers.items()}
    if strict:
        _refuse_other_kinds(path, target, optimizers, _index_state_fields(index, optimizers), before)
    try:
        states, own_params = _copies(target, optimizers, key, index)
        _load_into(path, states, strict=strict, trust=trust)
    except ShardingError:
        for name, optimizer in optimizers.items():
            _restore(optimizer, before[name])
        raise
    for name, params in own_params.items():
        # DCP keeps one rank's copy of a non-tensor value such as the param groups; under
        # a pipeline plan each rank's optimizer holds other parameters (its stages'), so
        # each group keeps this rank's parameter names and takes the saved hyperparameters
        groups = states[name].get("param_groups", [])
        if len(groups) == len(params):
            for group, own in zip(groups, params, strict=True):
                group["params"] = own
    loaded = {name: (optimizer, states[name]) for name, optimizer in optimizers.items()}
    _set_all(path, target, states.pop(key), loaded, full=False, strict=strict, before=before)
    return meta


def _stored(index: Any) -> dict[str, Any]:
    # the index's tensors as meta tensors, nested as the states were ("model.w" -> ["model"]["w"];
    # "optimizer.state.w.exp_avg" -> ["optimizer"]["state"]["w"]["exp_avg"])
    nested: dict[str, Any] = {}
    groups: dict[str, set[str]] = {}
    for name in index.state_dict_metadata:
        top, _, rest = name.partition(".")
        if rest.startswith("param_groups."):
            groups.setdefault(top, set()).add(rest.split(".")[1])
    for name, (shape, dtype) in index_tensors(index).items():
        top, _, rest = name.partition(".")
        value = torch.empty(shape, dtype=dtype, device="meta")
        if rest.startswith("state."):
            parameter, _, field = rest[len("state.") :].rpartition(".")
            nested.setdefault(top, {}).setdefault("state", {}).setdefault(parameter, {})[field] = value
        else:
            nested.setdefault(top, {})[rest] = value
    for top, seen in groups.items():
        nested.setdefault(top, {})["param_groups"] = [{} for _ in seen]
    return nested


def _copies(
    target: nn.Module, optimizers: dict[str, torch.optim.Optimizer], key: str, index: Any
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    # copies of this rank's states to load into: the module's own tensors stay as they are
    # until everything arrived; keys the checkpoint lacks (strict=False) keep their values
    def copy(value: Any) -> Any:
        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    def copies(state: Any) -> Any:
        return optree.tree_map(copy, state, none_is_leaf=True)

    states: dict[str, Any] = {key: copies(model_state(target))}
    own_params = {}
    for name, optimizer in optimizers.items():
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            states[name] = zero1_template(target, optimizer, name, index)
        else:
            states[name] = saved_only(copies(made_state(target, optimizer)), name, index, key)
            own_params[name] = [group["params"] for group in states[name].get("param_groups", [])]
    return states, own_params


def _load_into(path: Path, states: dict[str, Any], *, strict: bool, trust: bool) -> None:
    with refusals_raised(path):
        dcp.load(
            states,
            storage_reader=SafeReader(path, trust=trust),
            planner=SafeLoadPlanner(where=path, trust=trust, allow_partial_load=not strict),
        )


@contextlib.contextmanager
def refusals_raised(path: Path) -> Iterator[None]:
    """Torch's distributed checkpoint wraps each rank's failure: ours come out as they were."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as error:  # a BaseException: it wraps each rank's failure
        failures = getattr(error, "failures", {})
        cause = next(iter(failures.values()))[0] if failures else error
        if isinstance(cause, ShardingError):
            raise ShardingError(str(cause)) from error
        raise ShardingError(
            f"the checkpoint at {path} does not fit this module: {cause}. {FIT_FIX}"
        ) from error


def checked_folder(path: Path, *, trust: bool, alone: bool = False) -> dict[str, Any]:
    """A folder's ``meta.pt``, once every file matches the manifest (each rank a share).

    ``meta.pt`` says whether a manifest was written: a folder from before digests has none.
    """
    damaged = f"the checkpoint at {path} is damaged"
    has_manifest = (path / MANIFEST).exists()
    if not has_manifest and not (path / META).exists() and not (path / ".metadata").exists():
        # none of a checkpoint's files: the user's folder, not a damaged checkpoint
        shown = ", ".join(sorted(entry.name for entry in path.iterdir())[:5]) or "nothing"
        _first_refusal(
            agreed(
                [
                    f"{_NOT_ONE.format(path=path)}: the folder holds none of {META}, {MANIFEST} or .metadata "
                    f"(it holds {shown}). {_PASS}"
                ],
                alone=alone,
            )
        )
    problems = manifest_problems(path, alone=alone) if has_manifest else []
    if not (path / META).exists() and not has_manifest:
        problems.append(f"{META} (what was saved beside the tensors): missing")
    raise_problems(agreed(problems, alone=alone), damaged, DAMAGED_FIX)
    meta, problems = _whole_or_refused(lambda: load_file(path / META, trust=trust))
    if not problems and not isinstance(meta, dict):
        problems = [f"{damaged}: {META} holds a {type(meta).__name__}, not a dict. {DAMAGED_FIX}"]
    _first_refusal(agreed(problems, alone=alone))
    unlisted = meta.pop(MARK, None) is not None and not has_manifest
    raise_problems(
        [f"{MANIFEST} (the digests of its files): missing"] if unlisted else [], damaged, DAMAGED_FIX
    )
    return meta
