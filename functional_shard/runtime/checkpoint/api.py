"""Checkpoints that move between plans: sharded (a folder, one file per rank) or full (one file).

Sharded checkpoints use torch's distributed checkpoint, which reshards on load, so a
checkpoint saved under one plan loads under any other. Every save writes aside, seals what it
wrote with sha256 digests and renames, so a crash leaves the previous checkpoint whole. Every
load reads data, never code, and checks everything before it writes anything. Optimizer state
is keyed by parameter path under every plan.

`save` / `load` / `convert` are the user's functions; `model_state`, `optimizer_state`,
`set_model_state`, `set_optimizer_state`, `write` and `read` are their pieces, for framework
adapters that assemble their own checkpoints. `export_hf`, `convert_to_hf` and `load_hf` write
and read Hugging Face folders (`hf`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import entry_point, instance_of, refuse
from functional_shard.core.validate import path as check_path
from functional_shard.runtime.engines.optimizer import stale_parameters

from .async_save import PendingSave, finish_folder, save_in_background, wait_for_previous
from .hf.export import HfConversion, convert_to_hf, export_hf
from .hf.load import load_hf
from .hf.names import Piece, torchtitan_llama, zoo_llama
from .integrity import (
    FORMAT,
    MANIFEST,
    MARK,
    META,
    META_FIX,
    agreed,
    aside,
    is_ours,
    manifest_problems,
    meta_problems,
    need_process_group,
    put_in_place,
    raise_problems,
    refuse_occupied,
    seal,
    seal_problems,
    write_manifest,
)
from .read import (
    STATE_KEYS,
    checked_file,
    checked_folder,
    kind_problems,
    optimizers_by_key,
    read,
    refusals_raised,
)
from .safety import SafeReader, empty_state_planner, plain_problems
from .state import model_state, optimizer_state, refuse_packed, set_model_state, set_optimizer_state

__all__ = [
    "HfConversion",
    "PendingSave",
    "Piece",
    "convert",
    "convert_to_hf",
    "export_hf",
    "latest",
    "load",
    "load_hf",
    "model_state",
    "optimizer_state",
    "read",
    "save",
    "set_model_state",
    "set_optimizer_state",
    "torchtitan_llama",
    "write",
    "zoo_llama",
]


def write(path: str | os.PathLike[str], state: dict[str, Any], *, full: bool, meta: dict[str, Any]) -> Path:
    """Write states from `model_state` / `optimizer_state` on every rank, aside then renamed.

    Sharded: a distributed-checkpoint folder, ``meta`` in ``meta.pt`` and the digests in
    ``manifest.json``. Full: one sealed file of ``{**state, **meta}``, written by rank 0.

    Raises:
        ShardingError: no process group; or something other than an earlier checkpoint
            (or an empty folder) at ``path``, which stays as it was.
    """
    path = Path(path)
    need_process_group("fs.checkpoint.write")
    refuse_occupied(path, "fs.checkpoint.write")
    return _write(path, state, full=full, meta=meta)


def _write(path: Path, state: dict[str, Any], *, full: bool, meta: dict[str, Any]) -> Path:
    temporary = aside(path)
    failed: list[str] = []
    if full:
        if dist.get_rank() == 0:
            try:
                _save_sealed({**state, **meta}, temporary)
            except (OSError, RuntimeError) as error:  # torch.save's own, for a file it cannot open
                failed = [_cause(error)]
        failed = agreed(failed)  # every rank hears rank 0's verdict (the barrier before the rename)
    else:
        try:
            dcp.save(state, checkpoint_id=temporary)
        except CheckpointException as error:  # each rank's failure, on every rank alike; a rank's
            raise _unwritable("fs.checkpoint.save", path, _cause(error)) from error  # death is not one
        return finish_folder(temporary, path, meta)
    if failed:
        raise _unwritable("fs.checkpoint.save", path, failed[0])
    if dist.get_rank() == 0:
        put_in_place(temporary, path)
    dist.barrier()
    return path


def _cause(error: BaseException) -> str:
    # torch's distributed checkpoint wraps each rank's error (a BaseException): the first one's
    failures = error.failures if isinstance(error, CheckpointException) else {}
    cause = next(iter(failures.values()))[0] if failures else error
    return f"{type(cause).__name__}: {str(cause).strip()[:200]}"


def _unwritable(what: str, path: Path, cause: str) -> ShardingError:
    return ShardingError(
        f"{what} could not write {path} ({cause}); what was there is untouched. "
        "Save to a path this process may write, on a disk with room for it"
    )


def _save_sealed(content: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)  # as a folder's save makes its folders
    torch.save(content, path)
    seal(path)


# the typing overloads restate save's signature (they cannot share it): the return type
# follows ``asynchronous``, a path or a PendingSave
@overload
def save(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    full: bool = False,
    extra: dict[str, Any] | None = None,
    asynchronous: Literal[False] = False,
    data: Any = None,
) -> Path: ...


@overload
def save(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    full: bool = False,
    extra: dict[str, Any] | None = None,
    asynchronous: Literal[True],
    data: Any = None,
) -> PendingSave: ...


@entry_point
def save(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    full: bool = False,
    extra: dict[str, Any] | None = None,
    asynchronous: bool = False,
    data: Any = None,
) -> Path | PendingSave:
    """Save a parallelized module (and optimizer) on every rank, atomically.

    A save first waits for the module's previous asynchronous save, if one is unfinished.

    Args:
        path: a folder (sharded) or a file (``full=True``): new, empty, or an earlier checkpoint it replaces.
        module: the module `apply` parallelized.
        optimizer: its optimizer (any plan's, ZeRO-1's included), if its state should be saved too.
        full: one file with full tensors, written by rank 0, instead of one file per rank.
        extra: small plain values to keep beside (tensors, None, numbers, strings, bytes, containers of them).
        asynchronous: write this rank's shards in the background while training goes on; sharded only.
        data: a `ResumableLoader` or `ResumableSampler`, whose data order ``load(..., data=)`` puts back.

    Returns:
        The path written; with ``asynchronous``, a `PendingSave` whose ``wait()`` (every rank) finishes it.

    Raises:
        ShardingError: no process group; ``extra`` holds what a safe load could not rebuild;
            ``asynchronous`` with ``full``; tensors still on the meta device (not materialized);
            or something other than an earlier checkpoint at ``path``, which stays as it was.

    Examples:
        >>> # fs.checkpoint.save("ckpt", model, optimizer); fs.checkpoint.load("ckpt", model, optimizer)
        >>> # pending = fs.checkpoint.save("ckpt", model, optimizer, asynchronous=True); pending.wait()
        >>> # fs.checkpoint.save("ckpt", model, optimizer, data=loader)   # a fs.ResumableSampler's loader
    """
    _check_module(module, optimizer)
    for name, flag in (("full", full), ("asynchronous", asynchronous)):
        instance_of(flag, bool, name)  # a str such as "no" is truthy
    if extra is not None:
        instance_of(extra, dict, "extra", meaning="plain values by name, as {'step': 10}")
    extra = _with_data_order(extra, data)
    # every rank hears every rank's verdict: a rank refusing alone would leave the others in
    # the save's collectives
    problems = agreed(plain_problems(extra or {}, "extra"))
    if problems:
        raise ShardingError(
            f"fs.checkpoint.save: {problems[0]}{f' (and {len(problems) - 1} more)' if problems[1:] else ''}: "
            "a checkpoint keeps tensors and plain values (None, bools, numbers, strings, bytes, and lists, "
            "tuples and dicts of them), so that it loads without running code. Keep a plain form "
            "instead (an object's state_dict(), its fields as a dict)"
        )
    if asynchronous and full:
        raise ShardingError(
            "fs.checkpoint.save(full=True, asynchronous=True): an asynchronous save writes shards (torch's "
            "async_save); save a folder asynchronously and convert it to one file offline "
            "(fs.checkpoint.convert), or save the file synchronously"
        )
    need_process_group("fs.checkpoint.save")  # after the checks of the arguments alone
    raise_problems(agreed(meta_problems(module)), "fs.checkpoint.save wrote nothing", META_FIX)
    if not full:
        refuse_packed(module, "fs.checkpoint.save(full=False)")
    wait_for_previous(module)
    path = check_path(path, "path")
    refuse_occupied(path, "fs.checkpoint.save")
    state: dict[str, Any] = {"model": model_state(module, full=full)}
    if optimizer is not None:
        state["optimizer"] = optimizer_state(module, optimizer, full=full)
    meta = {"extra": extra or {}}
    if asynchronous:
        return save_in_background(path, aside(path), module, state, meta)
    return _write(path, state, full=full, meta=meta)


@entry_point
def load(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    trust: bool = False,
    data: Any = None,
) -> dict[str, Any]:
    """Load a checkpoint into a parallelized module (and optimizer), whatever plan saved it.

    All or nothing: digests, tensors and the data order are checked before anything is
    written, so a failed load changes nothing. Nothing in the checkpoint runs as code unless
    ``trust=True``.

    Args:
        path: a folder (sharded) or a file (full), of `save` under any plan.
        module: the module `apply` parallelized.
        optimizer: its optimizer, to load its state too.
        strict: ``False`` skips keys either side lacks instead of refusing them (shapes must still match).
        trust: rebuild any object the file names, running its code (only for files you trust).
        data: a `ResumableLoader` or `ResumableSampler` to continue the data order saved with ``save(data=)``.

    Returns:
        The ``extra`` values saved beside.

    Raises:
        ShardingError: no checkpoint at ``path``; one that is damaged, holds code, or does not fit
            the module; one whose optimizer state another kind of optimizer saved (other keys per
            parameter); ``data`` given and no data order saved, or one it cannot continue; ``trust``
            not a bool.

    Examples:
        >>> # extra = fs.checkpoint.load("ckpt", model, optimizer); step = extra["step"]
        >>> # fs.checkpoint.load("ckpt", model, optimizer, data=loader)   # the data order goes on
    """
    path = check_path(path, "path")
    _check_module(module, optimizer)
    _check_trust(trust)
    instance_of(strict, bool, "strict")
    if data is not None and not callable(getattr(data, "load_state_dict", None)):
        refuse("data", type(data).__name__, "a ResumableLoader or ResumableSampler", meaning=_DATA_MEANING)
    optimizers = {"optimizer": optimizer} if optimizer is not None else {}
    # read sees the saved meta before it sets anything, and every rank hears every verdict
    check = None if data is None else functools.partial(_data_order_problems, path, data)
    extra = dict(
        read(path, ("model", module), optimizers, strict=strict, trust=trust, check=check).get("extra", {})
    )
    if data is not None:
        data.load_state_dict(extra[DATA_ORDER])
    return extra


DATA_ORDER = "data_order"
_DATA_MEANING = "the run's fs.ResumableSampler or the loader it made"


def _check_trust(trust: Any) -> None:
    # a str ("no", "false" from a config file) is truthy: it would rebuild the objects a file names
    instance_of(
        trust, bool, "trust", meaning="True rebuilds any object the checkpoint names, running its code"
    )


def _check_module(module: Any, optimizer: Any) -> None:
    # before torch reads them: a wrong object fails deep inside torch, an optimizer of other
    # parameters (built before fs.apply replaced them) with a bare KeyError
    instance_of(module, nn.Module, "module", meaning="the module fs.apply parallelized")
    if optimizer is None:
        return
    instance_of(
        optimizer, torch.optim.Optimizer, "optimizer", meaning="a torch optimizer of the module, or None"
    )
    if foreign := stale_parameters(optimizer, module):
        refuse(
            "optimizer",
            type(optimizer).__name__,
            f"an optimizer of the module's parameters ({foreign} of its parameters are not the module's)",
            meaning="build it from module.parameters() after fs.apply, which replaces them",
        )


def _data_order_problems(path: str | os.PathLike[str], data: Any, meta: Any) -> list[str]:
    """Why the data order saved in ``meta`` cannot go on in ``data`` (nothing: it can)."""
    extra = meta.get("extra") if isinstance(meta, dict) else None
    if not isinstance(extra, dict) or DATA_ORDER not in extra:
        held = sorted(extra) if isinstance(extra, dict) else []
        return [
            f"fs.checkpoint.load(data=...): the checkpoint at {path} holds no data order (its extra has "
            f"{held}); it was saved without save(..., data=loader). Nothing was loaded; load without "
            "data= and start the data order anew, or resume from a checkpoint saved with data="
        ]
    if callable(getattr(data, "check_state_dict", None)):
        try:
            data.check_state_dict(extra[DATA_ORDER])
        except ShardingError as error:
            return [str(error)]
    return []


def _with_data_order(extra: dict[str, Any] | None, data: Any) -> dict[str, Any] | None:
    if data is None:
        return extra
    if DATA_ORDER in (extra or {}):
        raise ShardingError(
            f"fs.checkpoint.save: extra[{DATA_ORDER!r}] and data= both say where the data order stands; "
            f"rename the extra key or drop data="
        )
    if not callable(getattr(data, "state_dict", None)):
        raise ShardingError(
            f"fs.checkpoint.save(data=...): {type(data).__name__} has no state_dict(); pass the run's "
            "fs.ResumableSampler or the loader it made"
        )
    return {**(extra or {}), DATA_ORDER: data.state_dict()}


@entry_point
def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest whole checkpoint in ``directory`` (a folder or a file of `save`), or None.

    Crashed saves (``NAME.tmp-…``) and files a save never sealed are passed over; a folder is
    whole when every file its manifest lists is there at its written size, a file when its
    bytes match its seal; a ``NAME.old`` left between two renames counts. Newest means last
    modified. No process group is needed.

    Raises:
        ShardingError: ``directory`` is not a folder.

    Examples:
        >>> # found = fs.checkpoint.latest("checkpoints"); extra = fs.checkpoint.load(found, model, optimizer)
    """
    directory = check_path(directory, "directory")
    if not directory.is_dir():
        raise ShardingError(f"fs.checkpoint.latest: {directory} is not a folder of checkpoints")
    # another process may remove a checkpoint while this looks (Lightning's ModelCheckpoint with
    # save_top_k): one gone is passed over
    listed = (e for e in directory.iterdir() if ".tmp-" not in e.name)
    modified = {e: t for e in listed if (t := _modified_if_ours(e)) is not None}  # 0 is a time
    for candidate in sorted(modified, key=modified.__getitem__, reverse=True):
        if _whole(candidate):
            return candidate
    return None


def _modified_if_ours(entry: Path) -> int | None:
    # a save renames only what it sealed: an unsealed file is no save's (a crash's leftover,
    # another tool's torch.save), and was never whole as a checkpoint
    try:
        return entry.stat().st_mtime_ns if is_ours(entry) else None
    except FileNotFoundError:
        return None


def _whole(candidate: Path) -> bool:
    try:
        if candidate.is_dir():  # a folder without a manifest has nothing to compare
            manifest = candidate / MANIFEST
            return not manifest.exists() or not manifest_problems(candidate, alone=True, digests=False)
        return not seal_problems(candidate)
    except FileNotFoundError:
        return False


@entry_point
def convert(source: str | os.PathLike[str], target: str | os.PathLike[str], *, trust: bool = False) -> Path:
    """Convert offline between a sharded folder and a full file (direction from ``source``).

    No process group is needed. The source is checked as `load` checks it; the result is
    written aside, sealed and renamed. Works for `save`'s checkpoints and the Trainer's
    (``ShardStrategy``).

    Raises:
        ShardingError: ``source`` does not exist, is damaged, is no checkpoint of a module, or
            holds code (without ``trust``); ``target`` holds something other than an earlier checkpoint;
            ``trust`` not a bool.

    Examples:
        >>> # fs.checkpoint.convert("ckpt", "ckpt.pt")   # sharded -> full
    """
    # torch's own loop of dcp_to_torch_save, with the safe reader and planner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    source, target = check_path(source, "source"), check_path(target, "target")
    _check_trust(trust)
    if not source.exists():
        raise ShardingError(f"no checkpoint at {source}")
    if target.resolve() == source.resolve():
        raise ShardingError(
            f"fs.checkpoint.convert wrote nothing: the target {target} is the source; convert to another "
            "path (the source is a sharded folder, the result a file, or the other way round)"
        )
    refuse_occupied(target, "fs.checkpoint.convert", alone=True)
    temporary = aside(target, alone=True)
    if source.is_dir():
        meta = checked_folder(source, trust=trust, alone=True)
        reader = SafeReader(source, trust=trust)
        reader.read_metadata()  # refused here, before torch falls back to other files
        state: dict[str, Any] = {}
        with refusals_raised(source):
            _load_state_dict(
                state,
                storage_reader=reader,
                planner=empty_state_planner(where=source, trust=trust),
                no_dist=True,
            )
        _refuse_kind(source, state)
        optimizers = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k[10:]))
        if optimizers:
            state["optimizer_states"] = [state.pop(k) for k in optimizers]
        with _writing("fs.checkpoint.convert", target):
            _save_sealed({**state, **meta}, temporary)
    else:
        saved = optimizers_by_key(checked_file(source, trust=trust, alone=True))
        _refuse_kind(source, saved)
        states = [k for k in saved if k in ("model", "optimizer", "state_dict") or k.startswith("optimizer_")]
        tensors = {k: saved.pop(k) for k in states}
        with _writing("fs.checkpoint.convert", target):
            dcp.save(tensors, checkpoint_id=temporary, no_dist=True)
            torch.save({**saved, MARK: {"format": FORMAT}}, temporary / META)
            write_manifest(temporary, alone=True)
    put_in_place(temporary, target)
    return target


@contextlib.contextmanager
def _writing(what: str, path: Path) -> Iterator[None]:
    # an offline write's refusal (a read-only or full disk) as ours: torch.save raises a
    # RuntimeError, torch's distributed checkpoint a CheckpointException; no peer can die here
    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as error:
        raise _unwritable(what, path, _cause(error)) from error


def _refuse_kind(source: Path, saved: dict[str, Any]) -> None:
    # as load refuses it: a file or folder holding no module's state is no checkpoint
    problems = kind_problems(source, saved, STATE_KEYS)
    if problems:
        raise ShardingError(
            f"{problems[0]}; fs.checkpoint.convert wrote nothing (it converts the checkpoints of "
            "fs.checkpoint.save and of Lightning's Trainer and Fabric under functional_shard)"
        )
