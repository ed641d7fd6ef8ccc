"""Weights packing several pieces (q, k and v; gate and up), split over tensor-parallel ranks piece by piece.

Pure. A rank holds its share of every piece, laid end to end (`rank_share`). Equal pieces are
placed ``_StridedShard`` by torch; unequal ones (grouped-query attention's q, k and v) have no
torch placement and are placed ``Shard`` on the ranks' shares, so full checkpoints reorder
them: `piece_major` (gathered value to pieces' order) and `rank_major` (the reverse).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["piece_major", "rank_major", "rank_share", "unequal_packed"]


def _sizes(length: int, pieces: int | tuple[int, ...]) -> list[int]:
    return [length // pieces] * pieces if isinstance(pieces, int) else list(pieces)


def rank_share(
    full: torch.Tensor, dim: int, pieces: int | tuple[int, ...], size: int, rank: int
) -> torch.Tensor:
    """This rank's part of ``full`` split over ``size`` ranks on ``dim``, each packed piece on its own.

    ``pieces`` is a count of equal pieces, or each piece's size.

    Examples:
        >>> rank_share(torch.arange(6), 0, (4, 2), 2, 1).tolist()
        [2, 3, 5]
    """
    parts = full.split(_sizes(full.size(dim), pieces), dim)
    return torch.cat([piece.chunk(size, dim)[rank] for piece in parts], dim).contiguous()


def rank_major(full: torch.Tensor, dim: int, pieces: int | tuple[int, ...], size: int) -> torch.Tensor:
    """``full`` reordered so that cutting ``dim`` into ``size`` equal blocks gives each rank its share.

    Examples:
        >>> rank_major(torch.arange(6), 0, (4, 2), 2).tolist()
        [0, 1, 4, 2, 3, 5]
    """
    return torch.cat([rank_share(full, dim, pieces, size, rank) for rank in range(size)], dim)


def piece_major(gathered: torch.Tensor, dim: int, pieces: int | tuple[int, ...], size: int) -> torch.Tensor:
    """The inverse of `rank_major`: the ranks' shares laid end to end, put back piece by piece.

    Examples:
        >>> piece_major(torch.tensor([0, 1, 4, 2, 3, 5]), 0, (4, 2), 2).tolist()
        [0, 1, 2, 3, 4, 5]
    """
    shares = [part // size for part in _sizes(gathered.size(dim), pieces)]
    parts = [block.split(shares, dim) for block in gathered.chunk(size, dim)]
    return torch.cat([part[piece] for piece in range(len(shares)) for part in parts], dim)


def unequal_packed(module: nn.Module) -> dict[str, tuple[int, tuple[int, ...], int]]:
    """Parameter path -> (dim, piece sizes, tensor-parallel size) of each weight packing unequal pieces.

    Examples:
        >>> unequal_packed(nn.Linear(2, 2))
        {}
    """
    out = {}
    for path, sub in module.named_modules():
        packed: Any = getattr(sub, "_fs_packed", None)
        weight = getattr(sub, "weight", None)
        mesh = getattr(weight, "device_mesh", None)
        if isinstance(packed, tuple) and isinstance(packed[1], tuple) and len(set(packed[1])) > 1 and mesh:
            # the tensor-parallel split is the weight's last mesh dim (FSDP2's, if any, before it)
            out[f"{path}.weight" if path else "weight"] = (packed[0], packed[1], mesh.size(mesh.ndim - 1))
    return out
