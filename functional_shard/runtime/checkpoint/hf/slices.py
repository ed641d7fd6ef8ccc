"""The tensors of a Hugging Face folder, read in slices: what the folder holds, and windows of it.

No process group here. `open_folder` reads the headers only (safetensors files are
memory-mapped; a slice reads its own bytes), and refuses what cannot be read safely: a
folder of pickled ``pytorch_model.bin`` files without ``trust=True`` (read then with
``weights_only``), damaged or truncated files, an index naming missing files.
`fill_local` writes one rank's window of a model tensor, composed of one or more folder
tensors (`names.Piece`), reading only the rows, columns and experts the window covers.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from functional_shard.core.errors import ShardingError

from .folder import INDEX, SINGLE
from .names import Piece, rotary_rows

__all__ = ["Folder", "Index", "Source", "composed_shape", "fill_local", "open_folder", "quantized"]

PICKLE_SINGLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"

_SAFE_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Source:
    """One tensor of the folder: its key, file, shape and dtype (None: a dtype torch lacks)."""

    key: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    stored: str
    start: int = 0
    """Where its bytes begin in a safetensors file."""


@dataclass
class Folder:
    """A Hugging Face folder's tensors (headers read), and its files opened as they are read."""

    path: Path
    sources: dict[str, Source]
    config: dict[str, Any]
    pickled: bool
    _open: dict[str, Any] = field(default_factory=dict)

    def read(self, key: str, window: Sequence[slice], into: torch.Tensor | None = None) -> torch.Tensor:
        """The ``window`` of one tensor: ``into``, filled, or a view of the mapped file (copy it out).

        A window in one stretch of a safetensors file (whole rows) is read into ``into`` with
        one read call, mapping no page. Any other window is a view of the memory-mapped file:
        only the pages the caller copies are read, each element copied once.
        """
        source = self.sources[key]
        if source.dtype is None:  # refused before any read (quantized)
            raise ShardingError(f"{key}: stored as {source.stored}, which torch cannot read")
        stretch = None if self.pickled else _stretch(source.shape, window)
        if into is not None and stretch is not None and into.is_contiguous() and into.numel() == stretch[1]:
            return self._read_stretch(source, *stretch, into=into)
        handle = self._handle(source.file)
        if self.pickled:
            return handle[key][tuple(window)]
        count = math.prod(source.shape)
        if count == 0:
            return torch.empty(source.shape, dtype=source.dtype)[tuple(window)]
        # the header was checked against the file's length when the folder was opened: a file
        # shorter now was cut (or is still being copied) since
        if source.start + count * source.dtype.itemsize > len(handle):
            raise _cut_short(source)
        whole = torch.frombuffer(handle, dtype=source.dtype, count=count, offset=source.start)
        return whole.view(source.shape)[tuple(window)]

    def _read_stretch(self, source: Source, first: int, count: int, *, into: torch.Tensor) -> torch.Tensor:
        # straight into the shard when the dtypes agree; else through one buffer of the window
        buffer = into if into.dtype == source.dtype else torch.empty(count, dtype=source.dtype)
        view = buffer.reshape(-1).view(torch.uint8).numpy().data.cast("B")
        offset = source.start + first * buffer.element_size()
        with open(self.path / source.file, "rb", buffering=0) as file:
            done = 0
            while done < len(view):  # a read returns at most about 2 GiB on Linux
                got = os.preadv(file.fileno(), [view[done:]], offset + done)
                if got <= 0:
                    raise _cut_short(source)
                done += got
        if buffer is not into:
            into.copy_(buffer.view(into.shape))
        return into

    def release(self) -> None:
        """Close the files opened so far (they open again when next read).

        Every page a window touched stays resident (RssFile) until its file is closed, so a
        rank that kept its files open would hold its shards twice.
        """
        self._open.clear()

    def _handle(self, name: str) -> Any:
        if name not in self._open:
            if self.pickled:
                self._open[name] = torch.load(
                    self.path / name, mmap=True, weights_only=True, map_location="cpu"
                )
            else:
                # copy-on-write: torch.frombuffer wants a writable buffer; nothing is written
                with open(self.path / name, "rb") as file:
                    self._open[name] = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._open[name]


def _cut_short(source: Source) -> ShardingError:
    return ShardingError(f"{source.key} ({source.file}): the file ends inside the tensor; copy it again")


def _stretch(shape: Sequence[int], window: Sequence[slice]) -> tuple[int, int] | None:
    """The first element and count of a window in one stretch of a row-major tensor, else None.

    One stretch: single positions on the outer dims, then one range, then whole dims.
    """
    first, count, stride, whole = 0, 1, 1, True
    for size, part in zip(reversed(shape), reversed(window), strict=True):
        start, stop, step = part.indices(size)
        extent = max(0, stop - start)
        if step != 1 or (not whole and extent != 1):
            return None
        first += start * stride
        whole = whole and extent == size
        count *= extent
        stride *= size
    return first, count


def _refused(path: Path, what: str) -> ShardingError:
    return ShardingError(f"fs.checkpoint.load_hf changed nothing: {path} {what}")


def open_folder(path: Path, *, trust: bool) -> Folder:
    """The folder's tensors, from their headers (no data read).

    Raises:
        ShardingError: not a folder; no weights; only pickled weights without ``trust``; an
            index or file that cannot be read (named, with the key it names).
    """
    if not path.is_dir():
        raise _refused(
            path, "is not a folder; pass the folder save_pretrained wrote (config.json and weights)"
        )
    config = _config(path)
    names = {entry.name for entry in path.iterdir()}
    if INDEX in names or SINGLE in names:
        return Folder(path, _safetensors(path, names), config, pickled=False)
    if PICKLE_INDEX in names or PICKLE_SINGLE in names:
        if not trust:
            raise _refused(
                path,
                "holds only pickled weights (pytorch_model.bin), which can run code when read. Convert it to "
                "safetensors, or pass trust=True for a folder you made yourself (read with weights_only)",
            )
        return Folder(path, _pickled(path, names), config, pickled=True)
    raise _refused(
        path,
        f"holds no weights ({SINGLE}, or {INDEX} with its files); it holds {sorted(names)[:5]}",
    )


def _config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.exists():
        return {}
    try:
        values = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise _refused(
            path, f"has a config.json that cannot be read ({error}); restore it or remove it"
        ) from None
    if not isinstance(values, dict):
        # not read as no config: the tie of the head and the head sizes come from it
        raise _refused(
            path, f"has a config.json holding a JSON {type(values).__name__}, not an object; restore it"
        )
    return values


def _weight_map(path: Path, index: str) -> dict[str, str]:
    try:
        weight_map = json.loads((path / index).read_text())["weight_map"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError("weight_map is not names to file names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise _refused(
            path, f"has an {index} that cannot be read ({type(error).__name__}: {error})"
        ) from None
    outside = [name for name in set(weight_map.values()) if Path(name).name != name]
    if outside:
        raise _refused(path, f"has an {index} naming files outside the folder: {outside[:3]}")
    return dict(weight_map)


def _safetensors(path: Path, names: set[str]) -> dict[str, Source]:
    from safetensors import SafetensorError, safe_open

    files = sorted(set(_weight_map(path, INDEX).values())) if INDEX in names else [SINGLE]
    sources: dict[str, Source] = {}
    for name in files:
        if name not in names:
            raise _refused(path, f"lacks {name}, which {INDEX} names; copy the whole folder again")
        try:
            with safe_open(str(path / name), framework="pt") as handle:  # checks the header
                for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    sliced = handle.get_slice(key)
                    stored = sliced.get_dtype()
                    sources[key] = Source(
                        key, name, tuple(sliced.get_shape()), _SAFE_DTYPES.get(stored), stored
                    )
        except (SafetensorError, OSError) as error:
            raise _refused(path, f"has a damaged file {name} ({error}); copy it again") from None
        for key, start in _starts(path / name).items():
            sources[key] = dataclasses.replace(sources[key], start=start)
    if INDEX in names:
        weight_map = _weight_map(path, INDEX)
        absent = [
            key for key, file in weight_map.items() if sources.get(key) is None or sources[key].file != file
        ]
        if absent:
            raise _refused(
                path, f"has an index naming tensors its files lack: {absent[:5]}; copy the folder again"
            )
    return sources


def _starts(file: Path) -> dict[str, int]:
    # a safetensors file: 8 bytes of header length (little-endian), the JSON header, then the
    # data; each tensor's data_offsets count from the data's start (safe_open checked them)
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {
        key: 8 + length + entry["data_offsets"][0] for key, entry in header.items() if key != "__metadata__"
    }


def _pickled(path: Path, names: set[str]) -> dict[str, Source]:
    files = (
        sorted(set(_weight_map(path, PICKLE_INDEX).values())) if PICKLE_INDEX in names else [PICKLE_SINGLE]
    )
    sources: dict[str, Source] = {}
    for name in files:
        try:
            state = torch.load(path / name, mmap=True, weights_only=True, map_location="cpu")
        except Exception as error:
            raise _refused(
                path, f"has a file {name} that cannot be read ({type(error).__name__}); copy it again"
            ) from None
        if not isinstance(state, dict):
            raise _refused(path, f"has a file {name} holding a {type(state).__name__}, not a state dict")
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                sources[key] = Source(key, name, tuple(value.shape), value.dtype, str(value.dtype))
    return sources


def quantized(source: Source) -> bool:
    """Whether a tensor is stored quantized (8-bit or smaller integers or floats), not as plain floats."""
    return source.dtype is None or source.dtype in (
        torch.int8,
        torch.uint8,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )


def composed_shape(pieces: Sequence[tuple[Source, Piece]]) -> tuple[int, ...] | str:
    """The shape the pieces compose (in their order), or why they compose none."""
    experts = {piece.expert for _, piece in pieces}
    if None in experts and len(experts) > 1:
        return "some pieces are experts and some not"
    if None in experts:
        return _laid(pieces)
    shapes = set()
    for expert in sorted(experts, key=lambda e: e or 0):
        laid = _laid([(s, p) for s, p in pieces if p.expert == expert], expert=True)
        if isinstance(laid, str):
            return f"expert {expert}: {laid}"
        shapes.add(laid)
    if sorted(e or 0 for e in experts) != list(range(len(experts))):
        return f"experts {sorted(e or 0 for e in experts)} are not 0..{len(experts) - 1}"
    if len(shapes) != 1:
        return f"the experts' shapes differ: {sorted(shapes)}"
    return (len(experts), *shapes.pop())


def _laid(pieces: Sequence[tuple[Source, Piece]], *, expert: bool = False) -> tuple[int, ...] | str:
    indexes = [piece.index for _, piece in pieces]
    if sorted(indexes) != list(range(len(pieces))):
        return f"pieces {sorted(indexes)} are not 0..{len(pieces) - 1}"
    if len(pieces) == 1:
        return pieces[0][0].shape
    dims = {piece.dim - expert for _, piece in pieces}
    shapes = [source.shape for source, _ in sorted(pieces, key=lambda item: item[1].index)]
    dim = dims.pop() if len(dims) == 1 else -1
    if dim < 0 or any(len(s) != len(shapes[0]) or dim >= len(s) for s in shapes):
        return f"pieces of shapes {shapes} cannot be laid end to end on one dim"
    rest = {s[:dim] + s[dim + 1 :] for s in shapes}
    if len(rest) != 1:
        return f"pieces of shapes {shapes} differ off dim {dim}"
    return (*shapes[0][:dim], sum(s[dim] for s in shapes), *shapes[0][dim + 1 :])


@dataclass(frozen=True)
class _Part:
    """A stretch of one dim: local positions ``at`` and folder positions ``read``.

    ``pick``: the order to take what was read in, where the folder holds it in another order.
    """

    at: slice
    read: slice
    pick: torch.Tensor | None = None


Index = torch.Tensor | range
"""Global positions on one dim: a tensor, or a range where they run without a gap (FSDP's rows)."""


def _tensor(index: Index) -> torch.Tensor:
    return torch.arange(index.start, index.stop) if isinstance(index, range) else index


def _parts(positions: Index, values: Index) -> list[_Part]:
    """Contiguous local positions read as few stretches of the folder as their order allows."""
    if isinstance(positions, range) and isinstance(values, range):  # one stretch, nothing to search
        return (
            [_Part(slice(positions.start, positions.stop), slice(values.start, values.stop))]
            if positions
            else []
        )
    positions, values = _tensor(positions), _tensor(values)
    if positions.numel() == 0:
        return []
    count = positions.numel()
    low, high = int(values.min()), int(values.max())
    contiguous = int(positions[-1]) - int(positions[0]) + 1 == count
    if contiguous and high - low + 1 == count and not bool((values.diff() == 1).all()):
        # a permutation of one stretch (rotary rows interleaved): read it once, then reorder
        at = slice(int(positions[0]), int(positions[0]) + count)
        return [_Part(at, slice(low, high + 1), values - low)]
    breaks = ((positions.diff() != 1) | (values.diff() != 1)).nonzero().flatten() + 1
    starts, ends = [0, *breaks.tolist()], [*breaks.tolist(), count]
    return [
        _Part(
            slice(int(positions[a]), int(positions[a]) + b - a), slice(int(values[a]), int(values[a]) + b - a)
        )
        for a, b in zip(starts, ends, strict=True)
    ]


def _rows_of(index: Index, low: int, size: int, total: int, groups: int) -> tuple[Index, Index]:
    """The positions of ``index`` a piece holds, and its own rows there.

    The piece holds ``size`` of ``total`` rows from ``low`` on; laid in ``groups`` groups,
    it holds ``size / groups`` rows of each, from ``low / groups`` within it.
    """
    if isinstance(index, range) and groups <= 1:
        first = max(index.start, low)
        stop = max(first, min(index.stop, low + size))
        return range(first - index.start, stop - index.start), range(first - low, stop - low)
    index = _tensor(index)
    if groups <= 1:
        inside = torch.logical_and(index >= low, index < low + size).nonzero().flatten()
        return inside, index[inside] - low
    span, share, start = total // groups, size // groups, low // groups
    within = index % span
    inside = torch.logical_and(within >= start, within < start + share).nonzero().flatten()
    return inside, (index[inside] // span) * share + within[inside] - start


def fill_local(
    folder: Folder,
    local: torch.Tensor,
    indices: Sequence[Index],
    pieces: Sequence[tuple[Source, Piece]],
    head_dim: int | None = None,
    groups: int = 1,
) -> None:
    """Write into ``local`` the model tensor's elements at ``indices`` (one `Index` per dim).

    The model tensor is ``pieces`` laid end to end (experts stacked on dim 0). Only the
    elements the indices name are read; ``head_dim`` and ``groups`` serve `Piece.rotary`
    and `Piece.grouped`.
    """
    offsets: dict[tuple[int | None, int], int] = {}
    totals: dict[int | None, int] = {}
    for expert in sorted({p.expert for _, p in pieces}, key=lambda e: -1 if e is None else e):
        start = 0
        for source, piece in sorted(
            ((s, p) for s, p in pieces if p.expert == expert), key=lambda i: i[1].index
        ):
            offsets[(expert, piece.index)] = start
            start += source.shape[piece.dim - (expert is not None)] if source.shape else 0
        totals[expert] = start
    for source, piece in pieces:
        stacked = piece.expert is not None
        parts: list[list[_Part]] = []
        for dim, index in enumerate(indices):
            if stacked and dim == 0:
                positions = torch.eq(_tensor(index), int(piece.expert or 0)).nonzero().flatten().tolist()
                parts.append([_Part(slice(p, p + 1), slice(0, 0)) for p in positions])
                continue
            size = source.shape[dim - stacked]
            if dim == piece.dim:
                low = offsets[(piece.expert, piece.index)]
                laid = groups if piece.grouped else 1
                inside, values = _rows_of(index, low, size, totals[piece.expert], laid)
            else:
                inside, values = _rows_of(index, 0, size, size, 1)
            if piece.rotary and dim == piece.dim and head_dim:
                values = rotary_rows(_tensor(values), head_dim)
            parts.append(_parts(inside, values))
        for combination in itertools.product(*parts):
            target = local[tuple(part.at for part in combination)]
            picked = any(part.pick is not None for part in combination)
            windows = [part.read for part in combination[stacked:]]
            value = folder.read(source.key, windows, into=None if picked else target)
            if value is target:
                continue
            for dim, part in enumerate(combination[stacked:]):
                if part.pick is not None:
                    value = value.index_select(dim, part.pick)
            target.copy_(value.reshape(target.shape))
