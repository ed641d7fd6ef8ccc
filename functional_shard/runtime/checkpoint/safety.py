"""Reading checkpoints as data, never as code.

Pickle rebuilds objects by calling whatever the file names, so a checkpoint from elsewhere
could run anything while it loads. Every read here goes through an allowlist: torch's
``weights_only`` loader for ``torch.save`` files, and for the distributed checkpoint's
``.metadata`` index an unpickler that rebuilds only that index's classes. Anything else is
refused with a `ShardingError` naming the type; ``trust=True`` lifts the allowlist. On the
write side, `plain_problems` names the values a safe reader could not rebuild.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from functional_shard.core.errors import ShardingError

__all__ = [
    "SafeLoadPlanner",
    "SafeReader",
    "TRUST_FIX",
    "empty_state_planner",
    "load_file",
    "plain_problems",
    "refusal",
]

TRUST_FIX = (
    "If you trust the file (you or your own job wrote it), load it with trust=True "
    "(Lightning: weights_only=False); that runs the code the file names"
)

# what a value kept beside the tensors may be built of: what torch's weights_only loader
# rebuilds without running code
# (exact types: a subclass such as an IntEnum or an AttributeDict is code to the loader)
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

# the classes of torch's distributed-checkpoint index (.metadata), by module and name
_INDEX_MODULE = "torch.distributed.checkpoint.metadata"
_INDEX_EXTRA = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def refusal(where: str | os.PathLike[str], met: str) -> ShardingError:
    """The error for a checkpoint that only code could rebuild: the type met, and the way out."""
    return ShardingError(
        f"the checkpoint at {where} holds a {met}, which only running code can rebuild: a file "
        f"from elsewhere could run anything while it loads, so it was not loaded. {TRUST_FIX}"
    )


def _met(error: BaseException) -> str:
    # torch's weights_only loader names the global it refused ("GLOBAL io.open"), or the
    # pickle operation it met
    text = str(error)
    found = re.search(r"GLOBAL (\S+)", text)
    if found:
        return found.group(1)
    detail = text.rsplit("WeightsUnpickler error:", 1)[-1].strip().splitlines()
    return f"value the safe loader refused ({detail[0] if detail else type(error).__name__})"


def load_file(path: str | os.PathLike[str] | io.BytesIO, *, trust: bool, where: Any = None) -> Any:
    """A ``torch.save`` file's contents on the CPU, rebuilt by torch's safe loader unless ``trust``.

    Raises:
        ShardingError: the file holds a type only code could rebuild (named), or it is cut
            short or corrupted.

    Examples:
        >>> # load_file("ckpt.pt", trust=False)["model"]
    """
    where = where if where is not None else path
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error):
            raise refusal(where, _met(error)) from None
        raise _unreadable(where, error) from None
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, AttributeError, TypeError) as error:
        raise _unreadable(where, error) from None


def _unreadable(where: Any, error: BaseException) -> ShardingError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ShardingError(
        f"the checkpoint file {where} cannot be read ({type(error).__name__}: {first[:200]}): it was "
        "cut short or corrupted after it was written. Load an intact copy, or save again"
    )


class _IndexUnpickler(pickle.Unpickler):
    # the standard way to restrict what a pickle may name (the pickle module's docs,
    # "Restricting Globals"): the index's dataclasses, torch's dtypes, sizes and layouts
    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        return found

    @staticmethod
    def _allowed(module: str, name: str) -> bool:
        if (module, name) in _INDEX_EXTRA:
            return True
        if module == "torch":
            return isinstance(getattr(torch, name, None), torch.dtype)
        if module == _INDEX_MODULE:
            import torch.distributed.checkpoint.metadata as index

            return isinstance(getattr(index, name, None), type)
        return False


def read_index(path: Path, *, trust: bool) -> Metadata:
    """The distributed checkpoint's index (``.metadata``), read through the allowlist."""
    try:
        with open(path, "rb") as stream:
            found = pickle.load(stream) if trust else _IndexUnpickler(stream).load()
    except pickle.UnpicklingError as error:
        if str(error).startswith("GLOBAL "):
            raise refusal(path, str(error)[len("GLOBAL ") :]) from None
        raise _unreadable(path, error) from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as error:
        raise _unreadable(path, error) from None
    if not isinstance(found, Metadata):
        raise _unreadable(path, TypeError(f"its index is a {type(found).__name__}, not torch's Metadata"))
    return found


class SafeReader(FileSystemReader):
    """torch's file-system reader whose index is read through the allowlist unless ``trust``."""

    def __init__(self, path: str | os.PathLike[str], *, trust: bool = False) -> None:
        super().__init__(path)
        self.trust = trust

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The index, as torch's reader returns it, rebuilt through the allowlist."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        index = read_index(Path(self._get_metadata_path(kwargs.get("rank"))), trust=self.trust)
        storage = index.storage_meta if index.storage_meta is not None else StorageMeta()
        storage.load_id = self.load_id
        index.storage_meta = storage
        return index


class _SafeBytes:
    """Non-tensor values (an optimizer's param groups) rebuilt by torch's safe loader."""

    trust: bool = False
    where: Any = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # torch's DefaultLoadPlanner.load_bytes loads with weights_only=False; the rest as it does
        from torch.distributed.checkpoint._traverse import set_element

        loaded = load_file(value, trust=self.trust, where=f"{self.where} ({read_item.dest_index.fqn})")
        planner: Any = self
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
        else:
            planner.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """torch's load planner, with non-tensor values read through the allowlist unless ``trust``."""

    def __init__(self, *, where: Any, trust: bool = False, allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.trust, self.where = trust, where


def empty_state_planner(*, where: Any, trust: bool) -> DefaultLoadPlanner:
    """The planner that loads a whole folder into an empty dict (offline conversion), safely."""
    # torch's own planner for dcp_to_torch_save; private, so imported where it is used
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class _Planner(_SafeBytes, _EmptyStateDictLoadPlanner):
        pass

    planner = _Planner()
    planner.trust, planner.where = trust, where
    return planner


def plain_problems(value: Any, where: str, *, inside: tuple[int, ...] = ()) -> list[str]:
    """Where ``value`` holds something a safe reader could not rebuild, one line each.

    ``inside``: the ids of the containers ``value`` is in, so that one holding itself is named.

    Examples:
        >>> plain_problems({"step": 3, "seen": [1, 2]}, "extra")
        []
        >>> plain_problems({"when": object()}, "extra")
        ["extra['when'] is a builtins.object"]
        >>> looped = {"seen": []}
        >>> looped["seen"].append(looped)
        >>> plain_problems(looped, "extra")
        ["extra['seen'][0] is a dict that holds itself"]
    """
    if type(value) in _PLAIN_LEAVES or type(value) in _PLAIN_TENSORS:
        return []
    if type(value) in (dict, OrderedDict, list, tuple) and id(value) in inside:
        return [f"{where} is a {type(value).__name__} that holds itself"]
    inside = (*inside, id(value))
    if type(value) in (dict, OrderedDict):
        return [p for key, item in value.items() for p in _keyed(key, item, where, inside)]
    if type(value) in (list, tuple):
        return [
            p
            for index, item in enumerate(value)
            for p in plain_problems(item, f"{where}[{index}]", inside=inside)
        ]
    kind = type(value)
    return [f"{where} is a {kind.__module__}.{kind.__qualname__}"]


def _keyed(key: Any, item: Any, where: str, inside: tuple[int, ...]) -> list[str]:
    if type(key) not in (str, int, float, bool, type(None)):
        return [f"{where} has a key of type {type(key).__qualname__}"]
    return plain_problems(item, f"{where}[{key!r}]", inside=inside)
