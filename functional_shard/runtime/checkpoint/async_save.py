"""Saves that let training go on: torch's asynchronous distributed checkpoint, finished later.

``save(..., asynchronous=True)`` copies this rank's shards to host memory, hands the writing
to a background thread and returns a `PendingSave` at once. Only `PendingSave.wait` (or the
module's next save) writes ``meta.pt`` and the manifest and renames the folder into place, so
until then the previous checkpoint stays whole.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from functional_shard.core.errors import ShardingError

from .integrity import FORMAT, MARK, META, put_in_place, refuse_occupied, write_manifest

__all__ = ["PendingSave", "finish_folder", "save_in_background", "wait_for_previous"]

# the attribute a module keeps its unfinished save (and the process group it writes with) under
_PENDING = "_fs_pending_save"
_GROUP = "_fs_checkpoint_group"


def finish_folder(temporary: Path, path: Path, meta: dict[str, Any]) -> Path:
    """Complete a folder of shards every rank wrote: ``meta.pt``, the manifest, the rename."""
    if dist.get_rank() == 0:  # beside the shards: DCP loads only the keys asked for
        torch.save({**meta, MARK: {"format": FORMAT}}, temporary / META)
    dist.barrier()
    write_manifest(temporary)
    dist.barrier()
    if dist.get_rank() == 0:
        put_in_place(temporary, path)
    dist.barrier()
    return path


@dataclass(eq=False)
class PendingSave:
    """An asynchronous save under way: `wait` finishes it (on every rank) and returns its path.

    Examples:
        >>> # pending = fs.checkpoint.save("ckpt", model, optimizer, asynchronous=True)
        >>> # ... more training steps ...
        >>> # pending.wait()
    """

    path: Path
    temporary: Path
    meta: dict[str, Any]
    _writing: Any = field(repr=False)
    _module: nn.Module | None = field(default=None, repr=False)

    def done(self) -> bool:
        """Whether the background writing has ended (`wait` still finishes the folder)."""
        return bool(self._module is None or self._writing.done())

    def wait(self) -> Path:
        """Wait for the shards, then write ``meta.pt`` and the manifest and rename into place.

        A collective: every rank calls it (the module's next save does, if nothing else).

        Raises:
            ShardingError: the background writing failed, or something other than a
                checkpoint came to the path meanwhile; what is there is untouched.
        """
        module, self._module = self._module, None
        if module is None:
            return self.path  # finished already
        if getattr(module, _PENDING, None) is self:
            delattr(module, _PENDING)
        try:
            self._writing.result()
        except Exception as error:
            self._discard()
            raise ShardingError(
                f"the asynchronous save to {self.path} failed while writing ({type(error).__name__}: "
                f"{error}); the previous checkpoint there is untouched. Save again"
            ) from error
        try:  # the path was checked when the save began; training went on since
            refuse_occupied(self.path, "fs.checkpoint.save(asynchronous=True)")
        except ShardingError:
            self._discard()
            raise
        return finish_folder(self.temporary, self.path, self.meta)

    def _discard(self) -> None:
        if dist.get_rank() == 0:
            shutil.rmtree(self.temporary, ignore_errors=True)


def wait_for_previous(module: nn.Module) -> None:
    """Finish the module's unfinished asynchronous save, if any: one save at a time."""
    pending = getattr(module, _PENDING, None)
    if pending is not None:
        pending.wait()


def _checkpoint_group(module: nn.Module) -> Any:
    # the background thread's collectives go over a group of their own (gloo), as torch
    # asks of async_save, so they never interleave with the training step's
    group = getattr(module, _GROUP, None)
    if group is None:
        group = dist.new_group(backend="gloo")
        object.__setattr__(module, _GROUP, group)
    return group


def save_in_background(
    path: Path, temporary: Path, module: nn.Module, state: dict[str, Any], meta: dict[str, Any]
) -> PendingSave:
    """Start torch's asynchronous save of ``state`` (this rank's shards) into ``temporary``."""
    writing = dcp.async_save(state, checkpoint_id=temporary, process_group=_checkpoint_group(module))
    # torch returns its response object when staging is asynchronous too; its upload is the end
    writing = getattr(writing, "upload_completion", writing)
    pending = PendingSave(path, temporary, meta, writing, module)
    object.__setattr__(module, _PENDING, pending)
    return pending
