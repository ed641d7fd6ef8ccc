"""Which tokens of a sequence each context-parallel rank holds. Pure arithmetic.

With load balancing (the default) the sequence is cut into ``2·cp`` chunks and rank ``i`` holds chunks
``i`` and ``2·cp − 1 − i``: a cheap early chunk and a dear late one, so causal attention work is
even. Without it, ``cp`` chunks, rank ``i`` holding chunk ``i``.

Packed documents (`functional_shard.core.packing`) attend only inside each document, so the
work of a token is its position in its document, not in the row: `document_ranges` cuts a packed
row by that work instead (`document_work`).

Examples:
    >>> sequence_chunks(4, load_balance=True)
    ((0, 7), (1, 6), (2, 5), (3, 4))
    >>> token_ranges(16, 2, 1, load_balance=True)
    ((4, 8), (8, 12))
    >>> document_ranges((12, 2, 2), 2)  # a long document cut in four, the short ones dealt whole
    (((0, 3), (9, 14)), ((3, 9), (14, 16)))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .errors import ShardingError
from .validate import positive_int, refuse

__all__ = [
    "CONTEXT_ENGINES",
    "ENGINE_LABELS",
    "causal_imbalance",
    "causal_work",
    "check_sequence_length",
    "check_step_tokens",
    "document_imbalance",
    "document_ranges",
    "document_work",
    "held_positions",
    "segment_lengths",
    "check_split_share",
    "engine_that_runs",
    "chunk_count",
    "sequence_chunks",
    "token_positions",
    "token_ranges",
]

CONTEXT_ENGINES = ("auto", "ring", "all_gather")
"""How attention sees the whole sequence under cp: ``ring`` (torch's, CUDA only), ``all_gather``
(ours, any backend), or ``auto``: the ring on CUDA, else the all-gather."""

ENGINE_LABELS = {
    "auto": "torch's ring attention on CUDA, the all-gather engine elsewhere",
    "ring": "torch's ring attention",
    "all_gather": "the all-gather engine",
}
"""How explanations name each of `CONTEXT_ENGINES` (a plan's, and an estimate's counted one)."""


def engine_that_runs(engine: str, *, cuda: bool) -> str:
    """The cp engine that runs for a plan's ``engine``: ``"auto"`` is the ring on CUDA.

    Examples:
        >>> engine_that_runs("auto", cuda=True), engine_that_runs("auto", cuda=False)
        ('ring', 'all_gather')
        >>> engine_that_runs("ring", cuda=False)
        'ring'
    """
    if engine != "auto":
        return engine
    return "ring" if cuda else "all_gather"


def chunk_count(cp: int, *, load_balance: bool) -> int:
    """How many equal chunks a sequence is cut into: ``2·cp`` balanced, ``cp`` otherwise.

    Examples:
        >>> chunk_count(4, load_balance=True), chunk_count(4, load_balance=False)
        (8, 4)
    """
    return 2 * cp if load_balance and cp > 1 else cp


def sequence_chunks(cp: int, *, load_balance: bool) -> tuple[tuple[int, ...], ...]:
    """The chunk indices each cp rank holds, in the order it holds them.

    Examples:
        >>> sequence_chunks(2, load_balance=True), sequence_chunks(2, load_balance=False)
        (((0, 3), (1, 2)), ((0,), (1,)))
    """
    if not load_balance or cp == 1:
        return tuple((rank,) for rank in range(cp))
    return tuple((rank, 2 * cp - 1 - rank) for rank in range(cp))


def check_sequence_length(
    seq: int, cp: int, *, load_balance: bool, what: str = "sequence length", name: str = "seq"
) -> None:
    """Refuse a length the chunks do not divide, naming the nearest lengths that would work.

    ``what`` is the length in words, ``name`` the argument that gave it.

    Raises:
        ShardingError: ``seq`` is not a positive multiple of `chunk_count`.

    Examples:
        >>> check_sequence_length(4096, 4, load_balance=True)  # fine: 8 chunks of 512
        >>> check_sequence_length(100, 4, load_balance=True)
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: seq=100: cp=4 with load balancing cuts each sequence into 8 equal ...
        use 96 or 104 tokens (pad the sequences), or cp(load_balance=False) (4 chunks)
        >>> check_sequence_length(-2, 2, load_balance=False, name="seq_len")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: seq_len=-2: a positive int (a count of tokens)
    """
    # the nearest lengths below would be nonsense for these
    positive_int(seq, name, meaning="a count of tokens")
    chunks = chunk_count(cp, load_balance=load_balance)
    if seq > 0 and seq % chunks == 0:
        return
    below, above = seq - seq % chunks, seq - seq % chunks + chunks
    nearest = f"{below} or {above}" if below > 0 else f"{above}"
    balance = "with load balancing" if load_balance and cp > 1 else "without load balancing"
    other = (
        f", or cp(load_balance=False) ({cp} chunks)"
        if load_balance and cp > 1 and seq > 0 and seq % cp == 0
        else ""
    )
    refuse(
        name,
        str(seq),
        f"cp={cp} {balance} cuts each sequence into {chunks} equal chunks, and {chunks} does not divide "
        f"the {what} {seq}; use {nearest} tokens (pad the sequences){other}",
    )


MOST_STEP_TOKENS = 2**32
"""The most tokens a step may hold (batch × seq): far beyond any run, and short of the sizes
whose tensors torch can no longer count (a typo's ``seq=10**23``)."""


def check_step_tokens(batch: object, seq: object) -> None:
    """Refuse a ``batch`` or ``seq`` that is no positive int, or a step of more than 2**32 tokens.

    Examples:
        >>> check_step_tokens(8, 4096)
        >>> check_step_tokens(2**20, 2**20)
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: seq=1048576, batch=1048576: at most 4,294,967,296 (2**32) tokens ...
    """
    if positive_int(batch, "batch") * positive_int(seq, "seq") > MOST_STEP_TOKENS:
        what = f"at most {MOST_STEP_TOKENS:,} (2**32) tokens a step (batch × seq), far beyond any run"
        refuse("seq", f"{seq}, batch={batch}", what, meaning="a typo? count the tokens again")


def check_split_share(
    seq: int, cp: int, tp: int, *, load_balance: bool, axis: str, who: str | None = None
) -> None:
    """Refuse a length whose share on each cp rank sequence parallel over ``tp`` ranks cannot split.

    ``seq``: the whole length, which the cp chunks divide (`check_sequence_length`). ``who`` names the
    caller in front; without it the argument ``seq`` is refused, which the public function the user
    called names (`functional_shard.core.validate.entry_point`).

    Raises:
        ShardingError: ``tp`` does not divide ``seq / cp``.

    Examples:
        >>> check_split_share(8, 2, 2, load_balance=False, axis="tp", who="step")  # 4 a rank, 2 a tp rank
        >>> check_split_share(6, 2, 2, load_balance=False, axis="tp", who="step")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: step: the 6-token sequence leaves ...
        use a sequence length that is a multiple of 4 (4 or 8: cp=2 ranks x tp=2), or drop sequence_parallel
        >>> check_split_share(6, 2, 2, load_balance=False, axis="tp")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: seq=6: the 6-token sequence leaves ...
    """
    share = seq // cp
    if share % tp == 0:
        return
    multiple = math.lcm(chunk_count(cp, load_balance=load_balance), cp * tp)
    below = seq - seq % multiple
    nearest = f"{below} or {below + multiple}" if below > 0 else f"{multiple}"
    chunks = (
        f", cut into {chunk_count(cp, load_balance=load_balance)} chunks" if load_balance and cp > 1 else ""
    )
    problem = (
        f"the {seq}-token sequence leaves {share} tokens on each of the cp={cp} ranks, which "
        f"sequence parallel over {axis!r} splits evenly over its {tp} ranks, and {tp} does not divide "
        f"{share}; use a sequence length that is a multiple of {multiple} ({nearest}: cp={cp} ranks x "
        f"tp={tp}{chunks}), or drop sequence_parallel"
    )
    if who is None:
        refuse("seq", str(seq), problem)
    raise ShardingError(f"{who}: {problem}")


def token_ranges(seq: int, cp: int, rank: int, *, load_balance: bool) -> tuple[tuple[int, int], ...]:
    """The [start, stop) token ranges cp rank ``rank`` holds of a ``seq``-token sequence.

    Raises:
        ShardingError: ``seq`` is not divisible into the chunks (`check_sequence_length`).

    Examples:
        >>> token_ranges(8, 2, 0, load_balance=True), token_ranges(8, 2, 0, load_balance=False)
        (((0, 2), (6, 8)), ((0, 4),))
    """
    check_sequence_length(seq, cp, load_balance=load_balance)
    size = seq // chunk_count(cp, load_balance=load_balance)
    return tuple(
        (chunk * size, (chunk + 1) * size) for chunk in sequence_chunks(cp, load_balance=load_balance)[rank]
    )


def token_positions(seq: int, cp: int, rank: int, *, load_balance: bool) -> tuple[int, ...]:
    """The global positions of the tokens cp rank ``rank`` holds, in the order it holds them.

    Examples:
        >>> token_positions(8, 2, 1, load_balance=True)
        (2, 3, 4, 5)
    """
    return tuple(
        p
        for start, stop in token_ranges(seq, cp, rank, load_balance=load_balance)
        for p in range(start, stop)
    )


def causal_work(seq: int, cp: int, rank: int, *, load_balance: bool) -> int:
    """Query-key pairs cp rank ``rank`` scores under a causal mask: ``p + 1`` for its query at ``p``.

    What a kernel that skips masked blocks does on that rank.

    Examples:
        >>> [causal_work(8, 2, rank, load_balance=False) for rank in range(2)]
        [10, 26]
        >>> [causal_work(8, 2, rank, load_balance=True) for rank in range(2)]
        [18, 18]
    """
    # the sum of p + 1 over [start, stop) is the difference of two triangular numbers
    return sum(
        (stop * (stop + 1) - start * (start + 1)) // 2
        for start, stop in token_ranges(seq, cp, rank, load_balance=load_balance)
    )


def causal_imbalance(seq: int, cp: int, *, load_balance: bool) -> float:
    """The busiest cp rank's causal attention work over the ranks' mean: 1.0 when balanced.

    Unbalanced, the last rank scores almost ``(2·cp − 1) / cp`` times the mean.

    Examples:
        >>> causal_imbalance(1024, 4, load_balance=True)
        1.0
        >>> round(causal_imbalance(1024, 4, load_balance=False), 3)
        1.749
    """
    work = [causal_work(seq, cp, rank, load_balance=load_balance) for rank in range(cp)]
    return max(work) * cp / sum(work)


# ---- packed documents: the cut by attention work ------------------------------------------

CUT_SHARE = 32
"""A document whose causal work exceeds ``1/CUT_SHARE`` of a rank's share is cut over every rank;
smaller ones are dealt whole, so no rank ends more than about that fraction above the mean."""


def segment_lengths(offsets: Sequence[int], seq_len: int) -> tuple[int, ...]:
    """A packed row's segments: its documents (``offsets``, as ``cu_seqlens``), then its padding if any.

    The padding attends causally to itself (`functional_shard.core.packing.pack` gives it an id), so
    it is one segment more.

    Examples:
        >>> segment_lengths((0, 3, 5), 8), segment_lengths((0, 4, 8), 8)
        ((3, 2, 3), (4, 4))
    """
    ends = [*offsets[1:], *([seq_len] if offsets[-1] < seq_len else [])]
    return tuple(stop - start for start, stop in zip((0, *ends[:-1]), ends, strict=True))


def _triangle(n: int) -> int:
    return n * (n + 1) // 2


def document_work(lengths: Sequence[int], ranges: Sequence[tuple[int, int]]) -> int:
    """Query-key pairs the row's tokens in ``ranges`` score, attending causally inside their documents.

    A token ``p`` tokens into its document sees ``p + 1`` keys: what a kernel that skips masked
    blocks does. ``lengths``: the row's segments (`segment_lengths`), end to end.

    Examples:
        >>> document_work((4, 4), [(0, 8)])  # two documents of 4: 10 pairs each
        20
        >>> document_work((4, 4), [(2, 6)])  # 3 + 4 of the first, 1 + 2 of the second
        10
    """
    work, start = 0, 0
    for length in lengths:
        for low, high in ranges:
            first, last = max(low, start), min(high, start + length)
            if first < last:
                work += _triangle(last - start) - _triangle(first - start)
        start += length
    return work


def document_ranges(lengths: Sequence[int], cp: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each cp rank's ``[start, stop)`` token ranges of a packed row, balanced by attention work.

    Every rank holds ``seq / cp`` tokens (the all-gather engine's collectives take equal shares),
    and about the same `document_work`:

    1. A document whose work exceeds ``1/CUT_SHARE`` of a rank's share (the row's work over ``cp``)
       is cut like a causal sequence (`sequence_chunks`): ``2·cp`` equal chunks, rank ``r`` holding
       chunks ``r`` and ``2·cp − 1 − r``, whose work adds up the same on every rank. The first
       ``length % 2·cp`` tokens, the chunks' remainder, join the short documents token by token,
       as does a whole document shorter than ``2·cp`` tokens (in a row of few tokens a rank).
    2. The short documents (and those remainders) are dealt whole, dearest first, each to the
       least loaded rank with room for it (longest processing time first, which ends at most one
       piece's work above the mean). When no rank has room, the least loaded rank with any room
       takes as many of its first tokens as fit, and the rest is dealt again.

    Cutting the row by tokens instead puts the end of a long document, its dearest tokens, on one
    or two ranks: a rank holding the end of one long document does far more than one holding twenty
    short ones. ``lengths``: the row's segments (`segment_lengths`), padding included.

    Raises:
        ShardingError: ``cp`` does not divide the row's length, or a length is not a positive int.

    Examples:
        >>> document_ranges((2, 2, 2, 2), 2)  # rank 0 holds the first and third documents
        (((0, 2), (4, 6)), ((2, 4), (6, 8)))
        >>> [document_work((12, 2, 2), held) for held in document_ranges((12, 2, 2), 2)]
        [42, 42]
    """
    positive_int(cp, "cp", meaning="the context-parallel degree")
    for length in lengths:
        positive_int(length, "a document length", meaning="tokens in one document of the row")
    seq = sum(lengths)
    check_sequence_length(seq, cp, load_balance=False, what="packed row's length")
    share = max(1, sum(_triangle(length) for length in lengths) // cp)
    held: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
    loads = [0] * cp
    # a piece to deal: (its document's first token, its first token, its stop)
    pieces: list[tuple[int, int, int]] = []
    start = 0
    for length in lengths:
        if cp > 1 and length < 2 * cp and _triangle(length) * CUT_SHARE > share:
            pieces += [(start, token, token + 1) for token in range(start, start + length)]
        elif cp > 1 and _triangle(length) * CUT_SHARE > share:
            head = length % (2 * cp)
            pieces += [(start, token, token + 1) for token in range(start, start + head)]
            size = (length - head) // (2 * cp)
            for rank, chunks in enumerate(sequence_chunks(cp, load_balance=True)):
                for chunk in chunks:
                    low = head + chunk * size
                    held[rank].append((start + low, start + low + size))
                    loads[rank] += _triangle(low + size) - _triangle(low)
        else:
            pieces.append((start, start, start + length))
        start += length
    _deal(pieces, held, loads, seq // cp)
    return tuple(_merged(ranges) for ranges in held)


def _deal(
    pieces: list[tuple[int, int, int]], held: list[list[tuple[int, int]]], loads: list[int], tokens: int
) -> None:
    """Deal ``pieces`` onto ``held`` (with work ``loads``), dearest first, filling each rank to ``tokens``."""

    def work(piece: tuple[int, int, int]) -> int:
        document, first, stop = piece
        return _triangle(stop - document) - _triangle(first - document)

    rooms = [tokens - sum(stop - start for start, stop in ranges) for ranges in held]
    waiting = sorted(pieces, key=lambda piece: (-work(piece), piece[1]))
    while waiting:
        piece = waiting.pop(0)
        document, first, stop = piece
        fits = [rank for rank in range(len(held)) if rooms[rank] >= stop - first]
        if fits:
            rank = min(fits, key=lambda r: (loads[r], r))
            taken = stop
        else:
            rank = min((r for r in range(len(held)) if rooms[r]), key=lambda r: (loads[r], r))
            taken = first + rooms[rank]
            rest = (document, taken, stop)
            waiting.append(rest)
            waiting.sort(key=lambda piece: (-work(piece), piece[1]))
        held[rank].append((first, taken))
        loads[rank] += work((document, first, taken))
        rooms[rank] -= taken - first


def _merged(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return tuple(merged)


def held_positions(ranges: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The tokens ``ranges`` hold, in order (`document_ranges`' or `token_ranges`' of one rank).

    Examples:
        >>> held_positions(((0, 2), (6, 8)))
        (0, 1, 6, 7)
    """
    return tuple(p for start, stop in ranges for p in range(start, stop))


def document_imbalance(lengths: Sequence[int], cp: int) -> float:
    """The busiest cp rank's `document_work` over the ranks' mean under `document_ranges`: 1.0 balanced.

    Examples:
        >>> document_imbalance((12, 2, 2), 2)
        1.0
    """
    work = [document_work(lengths, held) for held in document_ranges(lengths, cp)]
    return max(work) * cp / sum(work)
