"""Checkpoints that move between plans: sharded (a folder, one file per rank) or full (one file).

With `apply` and `launch`, the only module that talks to process groups. Sharded
checkpoints use torch's distributed checkpoint, which reshards on load, so a checkpoint
saved under one plan loads under any other (FSDP×4 → FSDP×2·TP×2 → one process). Every
save writes aside and renames: a crash in the middle leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from .errors import ShardingError

__all__ = ["convert", "load", "save"]

_EXTRA = "extra.pt"


def _refuse_zero1(optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is not None and type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        raise ShardingError(
            "checkpoints of ZeRO-1 optimizers (ZeroRedundancyOptimizer) are not supported yet: torch's "
            "distributed checkpoint cannot read its whole-tensor ownership; use fs.zero(2) or fs.fsdp()"
        )


def _shared_name(path: Path) -> Path:
    # every rank must write to the same temporary folder: rank 0 picks, all hear it
    names = [f"{path.name}.tmp-{uuid.uuid4().hex[:8]}"] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(names, src=0)
    return path.with_name(str(names[0]))


def _replace(temporary: Path, path: Path) -> None:
    # the old checkpoint is moved away only once the new one is complete
    old = path.with_name(path.name + ".old")
    if path.exists():
        os.replace(path, old)
    os.replace(temporary, path)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()


def save(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    full: bool = False,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save a parallelized module (and optimizer) on every rank, atomically.

    Args:
        path: a folder (sharded) or a file (``full=True``).
        module: the module `apply` parallelized.
        optimizer: its optimizer, if its state should be saved too.
        full: one file with full tensors, written by rank 0, instead of one file per rank.
        extra: small picklable values to keep beside (step counters, say).

    Returns:
        The path written.

    Raises:
        ShardingError: a ZeRO-1 optimizer, whose state torch cannot checkpoint this way.

    Examples:
        >>> # fs.checkpoint.save("ckpt", model, optimizer); fs.checkpoint.load("ckpt", model, optimizer)
    """
    _refuse_zero1(optimizer)
    path = Path(path)
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    model_state, optim_state = get_state_dict(module, optimizer or [], options=options)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    temporary = _shared_name(path)
    if full:
        if dist.get_rank() == 0:
            torch.save({**state, "extra": extra or {}}, temporary)
    else:
        dcp.save(state, checkpoint_id=temporary)
        if dist.get_rank() == 0:  # beside the shards: DCP loads only the keys asked for
            torch.save(extra or {}, temporary / _EXTRA)
    dist.barrier()
    if dist.get_rank() == 0:
        _replace(temporary, path)
    dist.barrier()
    return path


def load(
    path: str | os.PathLike[str], module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a checkpoint into a parallelized module (and optimizer), whatever plan saved it.

    Returns:
        The ``extra`` values saved beside.

    Raises:
        ShardingError: no checkpoint at ``path``, or a ZeRO-1 optimizer.
    """
    _refuse_zero1(optimizer)
    path = Path(path)
    if not path.exists():
        raise ShardingError(f"no checkpoint at {path}")
    if path.is_file():
        # every rank reads the file and keeps its own shards (a full copy per rank while
        # loading: the price of the one-file format)
        saved = torch.load(path, map_location="cpu", weights_only=False)
        set_state_dict(
            module,
            optimizer or [],
            model_state_dict=saved["model"],
            optim_state_dict=saved.get("optimizer", {}),
            options=StateDictOptions(full_state_dict=True),
        )
        return dict(saved.get("extra", {}))
    model_state, optim_state = get_state_dict(module, optimizer or [])
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        module, optimizer or [], model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {})
    )
    return torch.load(path / _EXTRA, weights_only=False) if (path / _EXTRA).exists() else {}


def convert(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Convert offline between a sharded folder and a full file (direction from ``source``).

    No process group is needed. The result is written aside and renamed.

    Raises:
        ShardingError: ``source`` does not exist.

    Examples:
        >>> # fs.checkpoint.convert("ckpt", "ckpt.pt")   # sharded -> full
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source, target = Path(source), Path(target)
    if not source.exists():
        raise ShardingError(f"no checkpoint at {source}")
    temporary = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    if source.is_dir():
        dcp_to_torch_save(source, temporary)
        state = torch.load(temporary, weights_only=False)
        state["extra"] = torch.load(source / _EXTRA, weights_only=False) if (source / _EXTRA).exists() else {}
        torch.save(state, temporary)
    else:
        state = torch.load(source, weights_only=False)
        extra = state.pop("extra", {})
        dcp.save(state, checkpoint_id=temporary, no_dist=True)
        torch.save(extra, temporary / _EXTRA)
    _replace(temporary, target)
    return target
