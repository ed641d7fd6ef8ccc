"""What a load checks before it writes anything: the files are whole and the tensors fit.

Every check runs first and every rank hears every rank's verdict, so either all ranks load
or none changes anything. A folder keeps the sha256 digests of its files in ``manifest.json``
(``meta.pt`` says so, under `MARK`); a full file carries its digest as its zip comment, which
torch.load skips; a checkpoint without digests loads unchecked.

Saves write aside (`aside`), rename once complete (`put_in_place`), and replace only an earlier
checkpoint (`refuse_occupied`): whatever else is at the path is the user's.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import uuid
from collections.abc import Container, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from functional_shard.core.errors import ShardingError

__all__ = [
    "FORMAT",
    "MANIFEST",
    "MARK",
    "META",
    "Described",
    "agreed",
    "aside",
    "blocked_problems",
    "every_rank",
    "DAMAGED_FIX",
    "FIT_FIX",
    "distributed",
    "fit_problems",
    "index_tensors",
    "is_ours",
    "key_differences",
    "manifest_problems",
    "meta_problems",
    "META_FIX",
    "need_process_group",
    "occupied_problems",
    "put_in_place",
    "raise_problems",
    "refuse_occupied",
    "seal",
    "seal_problems",
    "write_manifest",
]

FORMAT = 2
MANIFEST = "manifest.json"
META = "meta.pt"  # a folder's values saved beside the tensors (``extra``, Lightning's loops)
MARK = "functional_shard"  # meta.pt's {"format": ...}: a folder that has a manifest
DAMAGED_FIX = "Load an intact copy, or save again"
FIT_FIX = (
    "Load it under a module of the same parameter paths, shapes and dtypes (and an optimizer of the "
    "kind that saved it), or with strict=False to skip keys that are missing or extra"
)
_SEAL = b"functional_shard-sha256:"
_END_OF_ZIP = b"PK\x05\x06"  # the signature of a zip archive's last record
_SHOWN = 5  # offending keys an error names before "and N more"

Described = tuple[tuple[int, ...], torch.dtype]


def distributed(alone: bool = False) -> bool:
    """Whether a process group runs; ``alone``: this process works by itself even so.

    An offline conversion is such a process.
    """
    return not alone and dist.is_available() and dist.is_initialized()


def every_rank(value: Any, *, alone: bool = False) -> list[Any]:
    """Every rank's ``value``, on every rank, by rank (just this one's without a process group)."""
    if not distributed(alone):
        return [value]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def agreed(problems: list[str], *, alone: bool = False) -> list[str]:
    """Every rank's problems, on every rank (in rank order, each once)."""
    return list(dict.fromkeys(problem for part in every_rank(problems, alone=alone) for problem in part))


def aside(path: Path, *, alone: bool = False) -> Path:
    """A temporary name beside ``path`` to write into: the same on every rank (rank 0 picks)."""
    names: list[str | None] = [f"{path.name}.tmp-{uuid.uuid4().hex[:8]}"]
    if distributed(alone):
        if dist.get_rank() != 0:
            names = [None]
        dist.broadcast_object_list(names, src=0)
    return path.with_name(str(names[0]))


def need_process_group(what: str) -> None:
    """Refuse ``what`` without a process group: its ranks write and agree over one."""
    if not distributed():
        raise ShardingError(
            f"{what} needs torch.distributed: call dist.init_process_group(...) first "
            "(one process alone: a gloo group of world size 1)"
        )


def put_in_place(temporary: Path, path: Path) -> None:
    """Rename what was written aside to ``path``, once it is complete (one process calls it).

    What is at ``path`` goes: the caller checked it may (`refuse_occupied`).
    """
    # the old one is moved away only now: until here a crash leaves it whole
    old = path.with_name(path.name + ".old")
    if path.exists() or path.is_symlink():
        problem = _foreign(old)
        if problem:  # the callers' checks refused it already; the last guard of the user's files
            raise ShardingError(f"{problem}; it was left as it is: move it away and save again")
        _remove(old)  # a crash's leftover after its own rename: ``path`` is the whole one
        os.replace(path, old)
        os.replace(temporary, path)
        _remove(old)
    else:
        os.replace(temporary, path)


def _remove(path: Path) -> None:
    # a link goes, not what it points to (Lightning's ``last`` may be one)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def is_ours(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint a save wrote, which a save may replace.

    A folder with ``meta.pt`` or ``manifest.json`` beside its shards (damaged or not), or a
    file sealed with its digest (`seal`); an unsealed ``torch.save`` file is not one.

    Examples:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> is_ours(folder), (folder / MANIFEST).write_text("{}") > 0, is_ours(folder)
        (False, True, True)
    """
    if path.is_dir():
        return (path / META).is_file() or (path / MANIFEST).is_file()
    if not path.is_file():
        return False
    sealed = len(_SEAL) + 64
    size = path.stat().st_size
    with open(path, "rb") as stream:
        stream.seek(max(0, size - sealed))
        return size >= sealed and stream.read(len(_SEAL)) == _SEAL


def occupied_problems(path: Path) -> list[str]:
    """What of the user's a save to ``path`` would replace (nothing: it may write there).

    A save replaces an earlier checkpoint (`is_ours`) or an empty folder; beside one, a
    crash's ``NAME.old`` goes too, so it must be one as well.

    Examples:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> occupied_problems(folder)
        []
        >>> (folder / "notes.txt").write_text("mine")
        4
        >>> occupied_problems(folder)[0].endswith("is a folder that is not a checkpoint (it holds notes.txt)")
        True
    """
    if not (path.exists() or path.is_symlink()):
        return []
    return [problem for where in (path, path.with_name(path.name + ".old")) if (problem := _foreign(where))]


def _foreign(path: Path) -> str | None:
    if not path.exists() or is_ours(path):
        return None
    if not path.is_dir():
        return f"{path} is a file that is not a checkpoint (a save seals its file with a sha256 digest)"
    # a few entries say what it is; a huge folder is not listed whole
    with os.scandir(path) as listing:
        entries = sorted(itertools.islice(listing, _SHOWN + 1), key=lambda entry: entry.name)
    if not entries:
        return None
    shown = ", ".join(entry.name + ("/" if entry.is_dir() else "") for entry in entries[:_SHOWN])
    more = ", ..." if entries[_SHOWN:] else ""
    return f"{path} is a folder that is not a checkpoint (it holds {shown}{more})"


def blocked_problems(path: Path) -> list[str]:
    """Why nothing may be written at ``path``: a file or a checkpoint around it.

    Torch would fail deep inside its writer under a file; the next save to a checkpoint's own
    path would delete whatever was written inside it.
    """
    parents = [parent for parent in path.absolute().parents if parent.exists()]
    if parents and not parents[0].is_dir():
        return [f"{parents[0]} is a file, not a folder, so nothing can be written inside it"]
    inside = next((parent for parent in parents if is_ours(parent)), None)
    if inside is not None:
        return [f"{inside} is a checkpoint, which a save to its path replaces whole, with what is inside it"]
    return []


def refuse_occupied(path: Path, what: str, *, alone: bool = False) -> None:
    """Refuse ``what``'s save to ``path``, on every rank, if the user's things are there.

    Refused before anything is written (`occupied_problems` says why): only an earlier
    checkpoint, or an empty folder, is replaced. A path under a file or inside a checkpoint is
    refused too.
    """
    blocked = agreed(blocked_problems(path), alone=alone)
    if blocked:
        raise ShardingError(
            f"{what} wrote nothing to {path}: {blocked[0]}. Save to another path (missing folders are made)"
        )
    problems = agreed(occupied_problems(path), alone=alone)
    if problems:
        raise ShardingError(
            f"{what} wrote nothing to {path}: {'; '.join(problems)}. A save replaces only an earlier "
            f"checkpoint (a folder with {META} or {MANIFEST}, or a sealed file) or an empty folder: "
            f"save to a new path, or delete {path} yourself if nothing in it is needed"
        )


def every_rank_keys(keys: Iterable[str]) -> set[str]:
    """The union of every rank's keys (a pipeline rank holds its own stages' only)."""
    return {key for part in every_rank(sorted(keys)) for key in part}


META_FIX = (
    "Give them values first: fs.materialize(plan, module), or fs.checkpoint.load / fs.checkpoint.load_hf"
)


def meta_problems(module: torch.nn.Module) -> list[str]:
    """``module``'s tensors still on the meta device, said once (none: every tensor holds values).

    Torch's writers fail on them deep inside ("Cannot copy out of meta tensor").

    Examples:
        >>> meta_problems(torch.nn.Linear(2, 2, device="meta"))
        ['weight, bias are on the meta device (built there and never filled, they hold no values)']
    """
    tensors = itertools.chain(module.named_parameters(), module.named_buffers())
    empty = [path for path, tensor in tensors if tensor.is_meta]
    if not empty:
        return []
    more = f" and {len(empty) - 3} more" if empty[3:] else ""
    where = "on the meta device (built there and never filled, they hold no values)"
    return [f"{', '.join(empty[:3])}{more} are {where}"]


def raise_problems(problems: list[str], header: str, fix: str) -> None:
    """One `ShardingError` naming the first few problems after ``header``; none: nothing."""
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise ShardingError(f"{header}: {'; '.join(problems[:_SHOWN])}{more}. {fix}")


def fit_problems(
    saved: Mapping[str, Described], expected: Mapping[str, Described], *, wanted: set[str], strict: bool
) -> list[str]:
    """Keys missing (``strict``), unexpected (wanted by no rank) or of another shape or dtype.

    Examples:
        >>> module = {"w": ((3, 2), torch.float32)}
        >>> fit_problems({"w": ((2, 3), torch.float32)}, module, wanted={"w"}, strict=True)
        ['w: shape [2, 3] float32 in the checkpoint, [3, 2] float32 in the module']
    """
    missing, unexpected, differing = key_differences(saved, expected, known=wanted)
    problems = []
    if strict:
        problems += [f"{key}: missing from the checkpoint" for key in missing]
        problems += [f"{key}: in the checkpoint, not in the module" for key in unexpected]
    problems += [
        f"{key}: shape {_show(saved[key])} in the checkpoint, {_show(expected[key])} in the module"
        for key in differing
    ]
    return problems


def key_differences(
    held: Mapping[str, Any], expected: Mapping[str, Any], *, known: Container[str]
) -> tuple[list[str], list[str], list[str]]:
    """What two states differ in, key by key: missing, unexpected and differing keys.

    The keys of ``expected`` that ``held`` lacks, the keys of ``held`` not ``known``, and
    the keys of both whose values differ, each list in its mapping's order.

    Examples:
        >>> key_differences({"a": 1, "b": 2, "x": 0}, {"a": 1, "b": 3, "c": 4}, known={"a", "b", "c"})
        (['c'], ['x'], ['b'])
    """
    missing = [key for key in expected if key not in held]
    unexpected = [key for key in held if key not in known]
    differing = [key for key, value in expected.items() if key in held and held[key] != value]
    return missing, unexpected, differing


def index_tensors(index: Any) -> dict[str, Described]:
    """The tensors a distributed checkpoint's index lists: whole shape and dtype, by flat key.

    Flat keys as torch's distributed checkpoint writes them: ``model.w``,
    ``optimizer.state.w.exp_avg``.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        name: (tuple(item.size), item.properties.dtype)
        for name, item in index.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def _show(described: Described) -> str:
    shape, dtype = described
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"


def described(tensors: Mapping[str, Any]) -> dict[str, Described]:
    """Each tensor's global shape and dtype (a DTensor's whole shape), by key."""
    return {k: (tuple(v.shape), v.dtype) for k, v in tensors.items() if isinstance(v, torch.Tensor)}


def _hash(path: Path, end: int) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as stream:
        left = end
        while left > 0 and (block := stream.read(min(left, 1 << 20))):
            hasher.update(block)
            left -= len(block)
    return hasher.hexdigest()


def seal(path: Path) -> None:
    """Append a full file's digest to it, as its zip archive's comment (torch.load skips it).

    The digest covers every byte before the comment's length field, so any byte changed,
    cut or lost after `seal` is found by `seal_problems`.
    """
    size = path.stat().st_size
    comment = _SEAL + _hash(path, size - 2).encode()
    with open(path, "r+b") as stream:
        stream.seek(size - 2)
        stream.write(len(comment).to_bytes(2, "little") + comment)


def seal_problems(path: Path) -> list[str]:
    """What is wrong with a full file's bytes: nothing, or how it differs from when sealed.

    An unsealed file (no comment) passes.
    """
    size = path.stat().st_size
    sealed = len(_SEAL) + 64
    with open(path, "rb") as stream:
        stream.seek(max(0, size - sealed - 22))
        tail = stream.read()
    if tail.endswith(b"\0\0") and tail[-22:-18] == _END_OF_ZIP:
        return []  # unsealed: nothing to compare
    trailer = tail[-sealed:]
    if (
        tail[:4] != _END_OF_ZIP
        or tail[20:22] != sealed.to_bytes(2, "little")
        or not trailer.startswith(_SEAL)
    ):
        return [f"{path.name}: its end is cut short or changed"]
    if _hash(path, size - sealed - 2) != trailer[len(_SEAL) :].decode("ascii", "replace"):
        return [f"{path.name}: its contents changed since it was written (corrupted)"]
    return []


def file_digest(path: Path) -> dict[str, Any]:
    """A file's size and sha256."""
    hasher = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            hasher.update(block)
    return {"bytes": path.stat().st_size, "sha256": hasher.hexdigest()}


def _mine(names: list[str], alone: bool) -> list[str]:
    # each rank digests a share of the files: the work spreads as the writing did
    if not distributed(alone):
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def write_manifest(folder: Path, *, alone: bool = False) -> None:
    """Digest every file of a written folder (each rank a share) into its ``manifest.json``."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
    digests = {name: file_digest(folder / name) for name in _mine(names, alone)}
    if distributed(alone):
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, digests)
        digests = {name: d for part in every for name, d in part.items()}
        if dist.get_rank() != 0:
            return
    files = {name: digests[name] for name in names}
    # compact: every byte of it means something, so a changed byte cannot pass unseen
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": files}, separators=(",", ":")))


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a key repeats in {keys}")
    return dict(pairs)


def manifest_problems(folder: Path, *, alone: bool = False, digests: bool = True) -> list[str]:
    """This rank's share of the folder's files that are missing, cut short or changed.

    Changed since `write_manifest`, that is; `agreed` gathers every rank's share. Without
    ``digests`` only presence and sizes are compared (no file is read).
    """
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return [f"{MANIFEST}: missing"]
    try:
        written = json.loads(manifest.read_text(), object_pairs_hook=_no_repeats)
        if written["format"] != FORMAT:
            return [f"{MANIFEST}: format {written['format']!r}, this version reads {FORMAT}"]
        listed = {str(name): (int(d["bytes"]), str(d["sha256"])) for name, d in written["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
        return [f"{MANIFEST}: unreadable ({type(error).__name__}: {error})"]
    problems = []
    for name in _mine(sorted(listed), alone):
        size, digest = listed[name]
        where = folder / name
        if not where.is_file():
            problems.append(f"{name}: missing")
        elif where.stat().st_size != size:
            problems.append(f"{name}: {where.stat().st_size} bytes, {size} when written (cut short or grown)")
        elif digests and file_digest(where)["sha256"] != digest:
            problems.append(f"{name}: its contents changed since it was written (corrupted)")
    return problems
