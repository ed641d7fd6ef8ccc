"""The elementwise passes torch's ring attention runs beyond its kernels, counted in bytes (pure).

Per attention call on cp rank ``r`` of ``n`` (torch's ``_templated_ring_attention`` and its backward,
default options), each op reading its inputs and writing its output once:

- forward: the local keys and values concatenated per step, each chunk's output cast to float32
  and merged into the running one (a ``torch.cat`` for a half chunk), the result cast back;
- backward: float32 zero gradients, the concatenations again, each chunk's gradients added into the
  float32 sums, the keys' and values' sums concatenated for each permute, the casts back.

`tests/unit/test_ring_merges.py` counts the same bytes by running torch's own functions.
"""

from __future__ import annotations

__all__ = ["ring_merge_bytes"]

_F32 = 4  # bytes an element of the ring's float32 merges and sums


def _chunks(n: int, rank: int, load_balance: bool) -> list[tuple[float, bool]]:
    """Per ring step: the chunk's share of the local query (1, 1/2, 0 where skipped) and whether it is half.

    A half chunk is torch's ``partial`` one: the second half of the query against all the keys.
    """
    steps = []
    for i in range(n):
        if i <= rank:  # its own chunk; under load balancing, the whole query against half the keys
            steps.append((1.0, False))
        elif not load_balance:
            steps.append((0.0, False))  # a later chunk than the rank's own: causal skips it
        else:
            steps.append((0.5, True))  # the second half of the query against all the keys
    return steps


def _forward(n: int, rank: int, load_balance: bool, size: int) -> tuple[float, float]:
    features: float = (n - 1) * 2 * (2 * size)  # keys and values concatenated, read and written
    rows = 0.0
    merged = False
    for share, partial in _chunks(n, rank, load_balance):
        if not share:
            continue
        features += share * (size + _F32)  # the chunk's output cast to float32
        if merged:
            # out - sigmoid(lse_b - lse) * (out - out_b): a sub, a mul and a sub of float32 outputs
            features += share * 8 * _F32
            # lse_b - lse, its sigmoid, the broadcast in the mul, lse - lse_b, logsigmoid, lse - it
            rows += share * 14 * _F32
            if partial:  # torch.cat of the untouched half and the merged one: whole, read and written
                features += 2 * _F32
                rows += 2 * _F32
        merged = True
    features += _F32 + size  # the running output cast back
    return features, rows


def _backward(n: int, rank: int, load_balance: bool, size: int) -> tuple[float, float]:
    features: float = 3 * _F32  # the float32 gradient sums of query, keys and values, zeroed
    features += (n - 1) * 2 * (2 * size)  # keys and values concatenated for the first n - 1 steps
    rows = 0.0
    add = 2 * _F32  # a float32 sum read and written
    for i, (share, partial) in enumerate(_chunks(n, rank, load_balance)):
        grad = size if share else _F32  # a skipped chunk's gradients are float32 zeros, made for it
        if not share:
            features += 3 * _F32
        if partial:
            rows += 2 * _F32 / 2  # the logsumexp's second half made contiguous (more than one head)
        if i and load_balance and not partial:
            # the keys' first half: each sum's first half += it, then torch.cat of the whole sum
            features += 2 * (0.5 * (add + grad) + 2 * _F32)
        else:
            features += 2 * (add + grad)
        features += 2 * 2 * _F32  # keys' and values' sums concatenated for the permute
        if partial:
            features += 0.5 * (add + grad) + 2 * _F32  # the query's second half, then a cat
        else:
            features += add + grad
    features += _F32 + size  # the query's gradient cast back
    features += 2 * (_F32 + size)  # the keys' and values' last sums cast back
    return features, rows


def ring_merge_bytes(
    cp: int, rank: int, *, load_balance: bool, queries: float, rows: float = 0.0, itemsize: int = 2
) -> tuple[float, float]:
    """Bytes torch's ring moves beyond its kernels in one call on cp rank ``rank``: (forward, backward).

    ``queries``: elements of the rank's local query; ``rows``: its logsumexp rows; ``itemsize``: bytes an
    element in the compute dtype. Causal attention, as torch's ring runs it.

    Examples:
        >>> ring_merge_bytes(1, 0, load_balance=True, queries=1)  # one chunk: casts, float32 sums, a copy
        (12.0, 76.0)
        >>> forward, backward = ring_merge_bytes(8, 7, load_balance=True, queries=1)
        >>> forward > ring_merge_bytes(8, 0, load_balance=True, queries=1)[0]  # more whole chunks
        True
    """
    forward = _forward(cp, rank, load_balance, itemsize)
    backward = _backward(cp, rank, load_balance, itemsize)
    return (
        forward[0] * queries + forward[1] * rows,
        backward[0] * queries + backward[1] * rows,
    )
