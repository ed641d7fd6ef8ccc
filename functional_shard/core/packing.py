"""Packed documents: many short documents in rows of one length, each attending only to itself.

`pack` lays documents end to end into rows of ``seq_len`` tokens, next fit and in order (a row may
end with padding). Each document's tokens get their own positions and a document id, so a model can
keep attention inside each document (`functional_shard.core.document_masks`).

Examples:
    >>> batch = pack([[5, 6, 7], [8, 9], [3, 4, 2, 1]], seq_len=6)
    >>> batch.tokens.tolist()
    [[5, 6, 7, 8, 9, 0], [3, 4, 2, 1, 0, 0]]
    >>> batch.positions.tolist()
    [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    >>> batch.offsets, batch.sources
    (((0, 3, 5), (0, 4)), ((0, 1), (2,)))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from .errors import ShardingError, bullets
from .validate import entry_point, non_negative_int, one_of, positive_int, refuse

__all__ = [
    "IGNORE_INDEX",
    "DocumentTooLongError",
    "PackedBatch",
    "collate_packed",
    "counted_share",
    "pack",
    "share_weighted",
]

IGNORE_INDEX = -100
"""The label of a token that predicts nothing (a document's last token, the padding):
``torch.nn.functional.cross_entropy``'s default ``ignore_index``."""


def counted_share(part: torch.Tensor, whole: torch.Tensor, parts: int) -> float:
    """What to weight a mean loss over ``part``'s counted targets by, ``whole`` cut into ``parts`` parts.

    Packed rows count their targets unevenly (`IGNORE_INDEX` at each document's last token), so the
    mean of the parts' mean losses is not the mean over ``whole``; each part's loss weighted by its
    share of the counted targets (times ``parts``) makes it so.

    Examples:
        >>> whole = torch.tensor([[1, 2, IGNORE_INDEX, IGNORE_INDEX], [1, 2, 3, 4]])
        >>> counted_share(whole[:1], whole, 2), counted_share(whole[1:], whole, 2)
        (0.6666666666666666, 1.3333333333333333)
    """
    counted = int((whole != IGNORE_INDEX).sum())
    return parts * int((part != IGNORE_INDEX).sum()) / counted if counted else 1.0


def share_weighted(loss: torch.Tensor, part: torch.Tensor, counted: torch.Tensor, parts: int) -> torch.Tensor:
    """``loss``, a mean over ``part``'s counted targets, weighted by `counted_share`, read from no device.

    ``counted``: the whole's count of counted targets, a tensor (``(whole != IGNORE_INDEX).sum()``).
    The weight stays on the device, so a pipeline's micro-batches cost no read each: ``part`` of no
    counted target (padding alone; its mean is NaN) gives 0 and a zero gradient where the whole
    has some, and where it has none the loss is as it is (a weight of 1, as `counted_share`'s).

    Examples:
        >>> whole = torch.tensor([[1, 2, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX] * 4])
        >>> counted = (whole != IGNORE_INDEX).sum()
        >>> share_weighted(torch.tensor(0.5), whole[:1], counted, 2).item()
        1.0
        >>> share_weighted(torch.tensor(float("nan")), whole[1:], counted, 2).item()
        0.0
    """
    mine = (part != IGNORE_INDEX).sum()
    # float64, as counted_share's Python division: the same weight, rounded once to the loss's
    share = torch.where(counted > 0, parts * mine.double() / counted.double(), 1.0)
    # a Python number multiplies a half or bfloat16 tensor in float32: so does this
    compute = torch.promote_types(loss.dtype, torch.float32)
    weighted = (loss.to(compute) * share.to(compute)).to(loss.dtype)
    return torch.where((mine > 0) | (counted == 0), weighted, torch.zeros_like(weighted))


class DocumentTooLongError(ShardingError):
    """A document longer than the rows `pack` was asked to fill, with ``long="refuse"``."""


# eq=False: the fields hold tensors, whose == is elementwise; two batches compare by identity
@dataclass(frozen=True, eq=False)
class PackedBatch:
    """Documents packed into rows of one length, as `pack` returns them; a dataset of its rows.

    ``len(batch)`` is its rows and ``batch[i]`` (an int, a slice or a sequence of ints) a `PackedBatch`
    of those rows, so a DataLoader reads it row by row and `collate_packed` puts the rows back together.

    Attributes:
        tokens: ``(rows, seq_len)`` token ids; each row's documents end to end, then padding.
        positions: ``(rows, seq_len)``: 0, 1, 2, ... from each document's first token (and the padding's).
        document_ids: ``(rows, seq_len)``: 0, 1, ... by document within the row; the padding the next id.
        labels: ``(rows, seq_len)``: the next token of the same document, else `IGNORE_INDEX`.
        offsets: each row's document boundaries, as flash attention's ``cu_seqlens`` (padding after).
        sources: each row's documents as indices into `pack`'s input (a split document once per piece).
        pad_id: the token id of the padding.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    document_ids: torch.Tensor
    labels: torch.Tensor
    offsets: tuple[tuple[int, ...], ...]
    sources: tuple[tuple[int, ...], ...]
    pad_id: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __getitem__(self, index: int | slice | Sequence[int]) -> PackedBatch:
        """The rows at ``index``, every field cut alike.

        Examples:
            >>> batch = pack([[1, 2], [3, 4, 5], [6]], seq_len=3)
            >>> batch[1].tokens.tolist(), batch[[2, 0]].offsets, batch[1:].sources
            ([[3, 4, 5]], ((0, 1), (0, 2)), ((1,), (2,)))
        """
        count = len(self)
        if isinstance(index, slice):
            rows = list(range(count))[index]
        elif isinstance(index, int) and not isinstance(index, bool):
            rows = [index]
        elif isinstance(index, Sequence) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in index
        ):
            rows = list(index)
        else:
            raise ShardingError(
                f"PackedBatch[{type(index).__name__}]: index its rows by an int, a slice or a list of ints"
            )
        if bad := [i for i in rows if not -count <= i < count]:
            raise ShardingError(f"PackedBatch[{bad[0]}]: the batch has {count} rows (0 to {count - 1})")
        rows = [i % count for i in rows]
        return replace(
            self,
            tokens=self.tokens[rows],
            positions=self.positions[rows],
            document_ids=self.document_ids[rows],
            labels=self.labels[rows],
            offsets=tuple(self.offsets[i] for i in rows),
            sources=tuple(self.sources[i] for i in rows),
        )

    def to(self, device: torch.device | str, **kwargs: Any) -> PackedBatch:
        """The same rows with every tensor on ``device`` (``kwargs`` as `torch.Tensor.to` takes them).

        Lightning's Trainer and Fabric move a batch by its ``to``: a `PackedBatch` from a loader
        reaches the strategy's device whole, offsets and sources kept.

        Examples:
            >>> batch = pack([[1, 2], [3]], seq_len=3).to("cpu")
            >>> batch.tokens.device.type, batch.offsets
            ('cpu', ((0, 2, 3),))
        """
        return replace(
            self,
            tokens=self.tokens.to(device, **kwargs),
            positions=self.positions.to(device, **kwargs),
            document_ids=self.document_ids.to(device, **kwargs),
            labels=self.labels.to(device, **kwargs),
        )

    @property
    def seq_len(self) -> int:
        """Tokens in each row."""
        return int(self.tokens.shape[1])

    @property
    def padding(self) -> int:
        """Padding tokens in all the rows together (at the end of each row)."""
        return sum(self.seq_len - row[-1] for row in self.offsets)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Every segment's boundaries over the flattened rows, int32, as flash attention's varlen.

        The segments of ``tokens.view(-1)``: each row's documents, then its padding if any.

        Examples:
            >>> pack([[1, 2, 3], [4]], seq_len=3).cu_seqlens.tolist()
            [0, 3, 4, 6]
        """
        bounds = [0]
        for row, offsets in enumerate(self.offsets):
            start = row * self.seq_len
            bounds.extend(start + end for end in offsets[1:])
            if offsets[-1] < self.seq_len:
                bounds.append(start + self.seq_len)
        return torch.tensor(bounds, dtype=torch.int32)


@entry_point
def pack(
    documents: Sequence[Any],
    seq_len: int,
    *,
    long: Literal["refuse", "split"] = "refuse",
    pad_id: int = 0,
) -> PackedBatch:
    """Pack token sequences into rows of ``seq_len`` tokens, next fit and in order.

    Args:
        documents: the documents, each a sequence of token ids (a list, or a 1-D integer tensor).
        seq_len: tokens in each row.
        long: a document longer than ``seq_len``: ``"refuse"`` raises, ``"split"`` packs its pieces apart.
        pad_id: the token id that fills each row after its last document, at least 0 (its labels
            are ``IGNORE_INDEX`` whatever it is).

    Returns:
        A `PackedBatch`.

    Raises:
        DocumentTooLongError: a document is longer than ``seq_len`` and ``long="refuse"``.
        ShardingError: no documents, an empty one, not 1-D ints (or one negative or past int64), or a bad
            ``seq_len``, ``long`` or ``pad_id``.

    Examples:
        >>> pack([[1, 2, 3, 4, 5], [6]], seq_len=4, long="split").tokens.tolist()
        [[1, 2, 3, 4], [5, 6, 0, 0]]
        >>> pack([[1, 2, 3, 4, 5]], seq_len=4)
        Traceback (most recent call last):
        ...
        functional_shard.core.packing.DocumentTooLongError: pack(seq_len=4): 1 document is longer than a row:
        * document 0 has 5 tokens
        Pass long="split" to cut each into pieces of at most 4 tokens, or raise seq_len to 5.
    """
    _check_arguments(seq_len, long, pad_id)
    tensors = _documents(documents, seq_len)
    rows = _rows([len(doc) for doc in tensors], seq_len, long=long)
    tokens = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    positions = torch.zeros_like(tokens)
    document_ids = torch.zeros_like(tokens)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    offsets, sources = [], []
    for row, pieces in enumerate(rows):
        ends = [0]
        for number, (source, start, stop) in enumerate(pieces):
            at, length = ends[-1], stop - start
            tokens[row, at : at + length] = tensors[source][start:stop]
            positions[row, at : at + length] = torch.arange(length)
            document_ids[row, at : at + length] = number
            labels[row, at : at + length - 1] = tensors[source][start + 1 : stop]
            ends.append(at + length)
        # the padding: one segment more, counting its positions from 0
        positions[row, ends[-1] :] = torch.arange(seq_len - ends[-1])
        document_ids[row, ends[-1] :] = len(pieces)
        offsets.append(tuple(ends))
        sources.append(tuple(source for source, _, _ in pieces))
    return PackedBatch(tokens, positions, document_ids, labels, tuple(offsets), tuple(sources), pad_id)


@entry_point
def collate_packed(items: Sequence[Any]) -> Any:
    """A DataLoader's batch of `PackedBatch` rows as one `PackedBatch`; other items as torch collates them.

    `functional_shard.ResumableLoader` collates with it, so a `PackedBatch` is a dataset it walks as it is.

    Raises:
        ShardingError: no items; rows of different lengths or padding ids, or packed rows mixed with
            other items.

    Examples:
        >>> batch = pack([[1, 2], [3, 4, 5], [6]], seq_len=3)
        >>> together = collate_packed([batch[2], batch[0]])
        >>> together.tokens.tolist(), together.offsets, together.sources
        ([[6, 0, 0], [1, 2, 0]], ((0, 1), (0, 2)), ((2,), (0,)))
        >>> collate_packed([1, 2]).tolist()
        [1, 2]
    """
    if not isinstance(items, Sequence) or isinstance(items, str | bytes) or not items:
        shown = repr(items) if isinstance(items, Sequence) else type(items).__name__
        refuse(
            "items",
            shown,
            "a non-empty list of dataset items",
            meaning="what a DataLoader hands its collate_fn",
        )
    packed = [isinstance(item, PackedBatch) for item in items]
    if not any(packed):
        from torch.utils.data import default_collate

        return default_collate(list(items))
    if not all(packed):
        raise ShardingError(
            "collate_packed: a batch mixes PackedBatch rows with other items; read one kind of dataset"
        )
    shapes = sorted({(item.seq_len, item.pad_id) for item in items})
    if len(shapes) > 1:
        raise ShardingError(
            f"collate_packed: the rows differ in (seq_len, pad_id): {shapes}; pack every row alike"
        )
    first = items[0]
    return replace(
        first,
        tokens=torch.cat([item.tokens for item in items]),
        positions=torch.cat([item.positions for item in items]),
        document_ids=torch.cat([item.document_ids for item in items]),
        labels=torch.cat([item.labels for item in items]),
        offsets=tuple(row for item in items for row in item.offsets),
        sources=tuple(row for item in items for row in item.sources),
    )


def _check_arguments(seq_len: Any, long: Any, pad_id: Any) -> None:
    positive_int(seq_len, "seq_len", meaning="the tokens in each row")
    one_of(
        long,
        ("refuse", "split"),
        "long",
        meaning="what to do with a document longer than seq_len: raise, or cut it into seq_len pieces",
    )
    # the padding is a model input the embedding reads, not a label: -100 and the like belong
    # in labels (IGNORE_INDEX), which pack sets under the padding itself
    meaning = "the token id of the padding; token ids count from 0"
    if non_negative_int(pad_id, "pad_id", meaning=meaning) > _LARGEST_ID:
        refuse("pad_id", repr(pad_id), f"an int of at most {_LARGEST_ID}, the largest int64", meaning=meaning)


_LARGEST_ID = torch.iinfo(torch.long).max


def _documents(documents: Any, seq_len: int) -> list[torch.Tensor]:
    """Each document as a 1-D long tensor; every malformed one named in one error."""
    if isinstance(documents, str | bytes) or not isinstance(documents, Sequence | torch.Tensor):
        raise ShardingError(
            f"pack(documents={type(documents).__name__}): pass a sequence of documents, each a list "
            "or 1-D tensor of token ids"
        )
    if len(documents) == 0:
        raise ShardingError(f"pack(seq_len={seq_len}): no documents to pack; pass at least one")
    tensors, problems = [], []
    for index, document in enumerate(documents):
        tensor, problem = _document(document)
        if problem is not None:
            problems.append(f"document {index} {problem}")
        tensors.append(tensor)
    if problems:
        raise ShardingError(
            bullets(
                f"pack(seq_len={seq_len}): {len(problems)} of {len(tensors)} documents cannot be packed:",
                problems,
                "Pass each document as a non-empty list or 1-D integer tensor of token ids (0 or more).",
            )
        )
    return tensors


def _document(document: Any) -> tuple[torch.Tensor, str | None]:
    if isinstance(document, str | bytes):
        return torch.empty(0), f"is a {type(document).__name__}, not token ids"
    try:
        tensor = torch.as_tensor(document)
    except (TypeError, ValueError, RuntimeError):
        past = _past_int64(
            (position, value)
            for position, value in enumerate(document if isinstance(document, Sequence) else ())
            if isinstance(value, int) and not -_LARGEST_ID - 1 <= value <= _LARGEST_ID
        )
        return torch.empty(0), past or f"({type(document).__name__}) is not a sequence of token ids"
    if tensor.ndim != 1:
        return tensor, f"has shape {tuple(tensor.shape)}, not one dim of token ids"
    if tensor.numel() == 0:
        return tensor, "is empty"
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        return tensor, f"holds {tensor.dtype} values, not integer token ids"
    if isinstance(document, Sequence) and (
        flags := [at for at, v in enumerate(document) if isinstance(v, bool)]
    ):
        # a list mixing ints and bools becomes an int tensor: True would be read as token 1, silently
        return tensor, f"holds a bool at position {flags[0]}, not an integer token id"
    if tensor.dtype == torch.uint64:  # its ids past int64 would turn negative in a long tensor, silently
        as_long = tensor.to(torch.long)
        if past := _past_int64((int(at), int(as_long[at]) + 2**64) for at in (as_long < 0).nonzero()):
            return tensor, past
    if tensor.dtype.is_signed and bool((tensor < 0).any()):
        # an embedding reads no negative row: refused here by document, not deep inside the model
        return tensor, f"holds a negative token id ({int(tensor.min())}); token ids count from 0"
    return tensor.to(device="cpu", dtype=torch.long), None


def _past_int64(positions_and_ids: Iterable[tuple[int, int]]) -> str | None:
    """The first token id out of int64's range, by position, or None if there is none."""
    first = next(iter(positions_and_ids), None)
    if first is None:
        return None
    position, value = first
    return f"holds token id {value} at position {position}, outside int64 (token ids: 0 to {_LARGEST_ID})"


def _rows(lengths: list[int], seq_len: int, *, long: str) -> list[list[tuple[int, int, int]]]:
    """Each row's pieces ``(document, start, stop)``: next fit, in order, long ones split if asked."""
    too_long = [(index, length) for index, length in enumerate(lengths) if length > seq_len]
    if too_long and long == "refuse":
        noun = "document is" if len(too_long) == 1 else "documents are"
        raise DocumentTooLongError(
            bullets(
                f"pack(seq_len={seq_len}): {len(too_long)} {noun} longer than a row:",
                [f"document {index} has {length} tokens" for index, length in too_long],
                f'Pass long="split" to cut each into pieces of at most {seq_len} tokens, or raise '
                f"seq_len to {max(length for _, length in too_long)}.",
            )
        )
    rows: list[list[tuple[int, int, int]]] = [[]]
    used = 0
    for index, length in enumerate(lengths):
        for start in range(0, length, seq_len):
            stop = min(start + seq_len, length)
            if used + stop - start > seq_len:
                rows.append([])
                used = 0
            rows[-1].append((index, start, stop))
            used += stop - start
    return rows
