"""Where each rank's shard sits: local shapes, offsets, and shard/unshard on a virtual mesh.

The arithmetic is torch's: a dim split ``k`` ways gets chunks of ``ceil(n / k)``, the trailing ranks
smaller or empty, several axes splitting in turn, major to minor. An empty shard's offset is the dim's
size; off a staged spec's stage a rank's local shape is all zeros.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
from einops import rearrange

from .errors import MeshError, ShardingError, SpecError
from .mesh import Mesh, as_mesh, checked_coords
from .spec import P
from .validate import instance_of

__all__ = [
    "chunk",
    "flattened_local_shape_and_offset",
    "local_numel",
    "local_shape",
    "local_shape_and_offset",
    "shard_tensor",
    "unshard_tensor",
]


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """Offset and length of chunk ``index`` of ``size`` split ``parts`` ways (torch.chunk).

    Examples:
        >>> [chunk(10, 8, i)[1] for i in range(8)]
        [2, 2, 2, 2, 2, 0, 0, 0]
    """
    step = -(-size // parts)
    offset = min(index * step, size)
    return offset, max(0, min(step, size - offset))


def _coords(mesh: Mesh, rank: int | Mapping[str, int]) -> Mapping[str, int]:
    return mesh.coords(rank) if isinstance(rank, int) else rank


def _checked_coords(mesh: Mesh, rank: int | Mapping[str, int]) -> Mapping[str, int]:
    """``rank``'s coordinates, or an error naming what is off (a wrong answer is worse)."""
    if isinstance(rank, int) and not isinstance(rank, bool):
        return mesh.coords(rank)
    if not isinstance(rank, Mapping):
        raise MeshError(
            f"rank={rank!r}: a rank (an int in 0..{mesh.size - 1}) or coordinates by axis, "
            f"e.g. {mesh.coords(0)}, on {mesh!r}"
        )
    return checked_coords(mesh, rank, "rank")


def _check_spec(spec: P) -> None:
    if not isinstance(spec, P):
        entries = ", ".join(map(repr, spec)) if isinstance(spec, tuple | list) else repr(spec)
        raise SpecError(
            f"spec={spec!r}: expected a PartitionSpec, got {type(spec).__name__}; write fs.P({entries})"
        )


def local_shape_and_offset(
    shape: Sequence[int], spec: P, mesh: Mesh, rank: int | Mapping[str, int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shape and global offset of ``rank``'s shard (what DTensor reports).

    Args:
        shape: the global shape.
        spec: how it is split.
        mesh: the mesh.
        rank: a rank (row-major over the mesh axes) or its coordinates by axis.

    Raises:
        SpecError: ``spec`` is not a `P`, or does not fit ``shape`` on ``mesh``.
        MeshError: ``mesh`` is not a `Mesh`, or ``rank`` is not a place on it.

    Examples:
        >>> local_shape_and_offset((10, 4), P(("tp", "dp")), Mesh(dp=2, tp=2), 1)
        ((3, 4), (5, 0))
        >>> local_shape_and_offset((10, 4), P("dp", on=("pp", 1)), Mesh(pp=2, dp=2), 1)
        ((0, 0), (10, 4))
    """
    mesh = as_mesh(mesh, "mesh")
    _check_spec(spec)
    if found := spec.problems(shape, mesh):
        raise SpecError("; ".join(found))
    coords = _checked_coords(mesh, rank)
    if not spec.holds(coords):
        return tuple(0 for _ in shape), tuple(shape)
    sizes: list[int] = []
    offsets: list[int] = []
    for size, axes in zip(shape, spec.dim_axes(len(shape)), strict=True):
        offset = 0
        for axis in axes:
            step, size = chunk(size, mesh[axis], coords[axis])
            offset += step
        sizes.append(size)
        offsets.append(offset if size else shape[len(offsets)])
    return tuple(sizes), tuple(offsets)


def _holds_run(entry: object, group: tuple[str, ...]) -> bool:
    axes = (entry,) if isinstance(entry, str) else tuple(entry) if isinstance(entry, tuple) else ()
    return any(axes[i : i + len(group)] == group for i in range(len(axes) - len(group) + 1))


def flattened_local_shape_and_offset(
    shape: Sequence[int], spec: P, mesh: Mesh, rank: int | Mapping[str, int], group: tuple[str, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`local_shape_and_offset` where one engine splits over the axes of ``group`` as one.

    FSDP2 flattens its several shard axes into one mesh dim and cuts a dim once, ``torch.chunk``
    over their product; the spec read alone would cut over each axis in turn, which differs for
    uneven dims. A spec that splits no dim over all of ``group`` in turn is read as it is.

    Examples:
        >>> mesh = Mesh(dp=3, ep=4)
        >>> local_shape_and_offset((128,), P(("dp", "ep")), mesh, 4)
        ((11,), (43,))
        >>> flattened_local_shape_and_offset((128,), P(("dp", "ep")), mesh, 4, ("dp", "ep"))
        ((11,), (44,))
    """
    if len(group) < 2 or not any(_holds_run(entry, group) for entry in spec):
        return local_shape_and_offset(shape, spec, mesh, rank)
    mesh = as_mesh(mesh, "mesh")
    coords = _checked_coords(mesh, rank)
    flat = "_".join(group)
    while flat in mesh:
        flat += "_"
    index = 0
    for axis in group:
        index = index * mesh[axis] + coords[axis]
    axes = {name: size for name, size in mesh.axes if name not in group} | {flat: mesh.axes_size(group)}
    place = {name: at for name, at in coords.items() if name not in group} | {flat: index}

    def merged(entry: object) -> object:
        if not (isinstance(entry, tuple) and _holds_run(entry, group)):
            return entry
        start = next(i for i in range(len(entry)) if entry[i : i + len(group)] == group)
        run = (*entry[:start], flat, *entry[start + len(group) :])
        return run[0] if len(run) == 1 else run

    flat_spec = P(*(merged(entry) for entry in spec), on=spec.on)
    return local_shape_and_offset(shape, flat_spec, Mesh(axes), place)


def local_shape(shape: Sequence[int], spec: P, mesh: Mesh, rank: int | Mapping[str, int]) -> tuple[int, ...]:
    """The local shape of ``rank``'s shard.

    Raises:
        SpecError: ``spec`` is not a `P`, or does not fit ``shape`` on ``mesh``.
        MeshError: ``mesh`` is not a `Mesh`, or ``rank`` is not a place on it.

    Examples:
        >>> local_shape((100, 8), P("dp"), Mesh(dp=8), 7)
        (9, 8)
    """
    return local_shape_and_offset(shape, spec, mesh, rank)[0]


def local_numel(
    shape: Sequence[int],
    spec: P,
    mesh: Mesh,
    rank: int | Mapping[str, int],
    padded_axes: frozenset[str] = frozenset(),
) -> int:
    """Elements ``rank`` holds; splits over ``padded_axes`` count chunk 0's size on every rank.

    FSDP2 pads the sharded dim to a multiple of the shard count, so every rank allocates as much as rank 0.

    Examples:
        >>> mesh = Mesh(dp=8)
        >>> local_numel((10,), P("dp"), mesh, 7), local_numel((10,), P("dp"), mesh, 7, frozenset({"dp"}))
        (0, 2)
    """
    coords = _coords(mesh, rank)
    if not spec.holds(coords):
        return 0
    # only the coordinates on axes the spec names matter; keying the cache on them
    # makes the repeated blocks of a model one computation
    index = tuple(0 if axis in padded_axes else coords[axis] for axis in spec.axes)
    return _local_numel(tuple(shape), spec, mesh, index)


@functools.lru_cache(maxsize=16384)
def _local_numel(shape: tuple[int, ...], spec: P, mesh: Mesh, index: tuple[int, ...]) -> int:
    chunks = iter(index)
    total = 1
    for size, axes in zip(shape, spec.dim_axes(len(shape)), strict=True):
        for axis in axes:
            size = chunk(size, mesh[axis], next(chunks))[1]
        total *= size
    return total


def _split(tensor: torch.Tensor, dim: int, parts: int) -> list[torch.Tensor]:
    # pad to parts * ceil(n / parts) and fold: chunk i is torch.chunk's chunk i, then padding
    # (as FSDP2 lays shards out)
    size = tensor.shape[dim]
    step = -(-size // parts)
    moved = tensor.movedim(dim, 0)
    if step == 0:
        return [tensor.narrow(dim, 0, 0) for _ in range(parts)]
    padding = moved.new_zeros((parts * step - size, *moved.shape[1:]))
    blocks = rearrange(torch.cat([moved, padding]), "(k c) ... -> k c ...", k=parts)
    return [blocks[i, : chunk(size, parts, i)[1]].movedim(0, dim) for i in range(parts)]


def _splits(spec: P, ndim: int) -> list[tuple[int, str]]:
    return [(dim, axis) for dim, axes in enumerate(spec.dim_axes(ndim)) for axis in axes]


def shard_tensor(tensor: torch.Tensor, spec: P, mesh: Mesh) -> list[torch.Tensor]:
    """Every rank's shard of ``tensor`` under ``spec``, indexed by rank (a virtual mesh).

    Ranks off a staged spec's stage get an empty tensor (a 0-d tensor's is shaped ``(0,)``).

    Raises:
        SpecError: the spec does not fit the tensor on ``mesh``.

    Examples:
        >>> [s.tolist() for s in shard_tensor(torch.arange(5), P("dp"), Mesh(dp=2))]
        [[0, 1, 2], [3, 4]]
        >>> [s.tolist() for s in shard_tensor(torch.arange(3), P(on=("pp", 1)), Mesh(pp=2))]
        [[], [0, 1, 2]]
    """
    instance_of(tensor, torch.Tensor, "tensor", meaning="the whole tensor, which the ranks split")
    if found := spec.problems(tensor.shape, mesh):
        raise SpecError("; ".join(found))
    splits = _splits(spec, tensor.ndim)
    pieces: dict[tuple[int, ...], torch.Tensor] = {(): tensor}
    for dim, axis in splits:
        pieces = {
            (*key, index): part
            for key, piece in pieces.items()
            for index, part in enumerate(_split(piece, dim, mesh[axis]))
        }
    result = []
    absent = tensor.new_empty(tuple(0 for _ in tensor.shape) or (0,))
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        held = spec.holds(coords)
        result.append(pieces[tuple(coords[axis] for _, axis in splits)] if held else absent)
    return result


def unshard_tensor(shards: Sequence[torch.Tensor], spec: P, mesh: Mesh) -> torch.Tensor:
    """Reassemble the global tensor from every rank's shard (inverse of `shard_tensor`).

    Replicas must agree; shards of ranks off a staged spec's stage are ignored.

    Raises:
        ShardingError: wrong number of shards, or replicas that differ.

    Examples:
        >>> mesh = Mesh(dp=3)
        >>> unshard_tensor(shard_tensor(torch.arange(7), P("dp"), mesh), P("dp"), mesh).tolist()
        [0, 1, 2, 3, 4, 5, 6]
    """
    if len(shards) != mesh.size:
        raise ShardingError(f"unshard_tensor needs one shard per rank of {mesh!r}, got {len(shards)}")
    holders = [(rank, shard) for rank, shard in enumerate(shards) if spec.holds(mesh.coords(rank))]
    if not holders:
        raise ShardingError(f"no rank of {mesh!r} holds a tensor placed on {spec.on}")
    ndim = holders[0][1].ndim
    splits = _splits(spec, ndim)
    pieces: dict[tuple[int, ...], torch.Tensor] = {}
    for rank, shard in holders:
        coords = mesh.coords(rank)
        key = tuple(coords[axis] for _, axis in splits)
        if key not in pieces:
            pieces[key] = shard
        elif not torch.equal(pieces[key], shard):
            raise ShardingError(
                f"rank {rank} {coords} holds a replica that differs from the first holder of "
                f"shard {key}; replicated shards must be equal"
            )
    for level in reversed(range(len(splits))):
        dim, axis = splits[level]
        grouped: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for key in sorted(pieces):
            grouped.setdefault(key[:level], []).append(pieces[key])
        # chunks are contiguous and in order, so joining is concatenation
        pieces = {key: torch.cat(parts, dim) for key, parts in grouped.items()}
        if any(len(parts) != mesh[axis] for parts in grouped.values()):
            raise ShardingError(f"missing shards along axis {axis!r}")
    return pieces[()]
