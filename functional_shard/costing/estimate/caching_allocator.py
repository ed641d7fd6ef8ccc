"""torch's CUDA caching allocator, simulated: what ``max_memory_reserved`` counts.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.11; the default
settings: no ``max_split_size_mb``, no ``expandable_segments``, no garbage-collection
threshold, no ``roundup_power2_divisions``):

- a request is rounded up to a multiple of 512 bytes (``kMinBlockSize``, ``round_size``);
- rounded sizes up to 1 MiB (``kSmallSize``) go to the small pool, larger ones to the large
  pool (``get_pool``);
- a free cached block serves only requests of the stream it was allocated on, and the pool
  hands out the smallest free block of that stream that is large enough, the lowest address
  among equal sizes (``BlockComparatorSize``: stream, then size, then address;
  ``get_free_block``'s ``lower_bound``);
- without such a block, a new segment is ``cudaMalloc``-ed: 2 MiB for the small pool
  (``kSmallBuffer``), 20 MiB for requests under 10 MiB (``kLargeBuffer``,
  ``kMinLargeAlloc``), else the request rounded up to 2 MiB (``kRoundLarge``,
  ``get_allocation_size``);
- the block handed out is split when the rest is worth keeping: in the small pool when
  at least 512 bytes remain, in the large pool when more than 1 MiB remains
  (``should_split``); otherwise the whole block goes to the request;
- a freed block merges with its free neighbours of the same segment (``free_block``,
  ``try_merge_blocks``) and stays cached: nothing goes back to CUDA without
  ``empty_cache`` (``release_cached_blocks``: every free, unsplit segment);
- when ``cudaMalloc`` fails, the allocator frees every free, unsplit cached segment and
  tries once more (``malloc``'s retry; ``release_available_cached_blocks`` frees nothing
  without ``max_split_size_mb``) before raising out-of-memory.

Reserved memory is the sum of the segments' sizes; ``max_memory_reserved`` its high mark.
`replay` runs a recorded allocator history (``torch.cuda.memory._record_memory_history``)
through the same rules: tests/unit/test_gpu_truth.py holds the simulator to the addresses
torch chose on an H200.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["CachingAllocator", "OutOfMemoryError", "Segment", "allocation_size", "rounded"]

MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20
MIN_OWN_SEGMENT = 10 << 20
LARGE_ROUNDING = 2 << 20


def rounded(size: int) -> int:
    """A request's block size: at least 512 bytes, a multiple of 512."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def allocation_size(block: int) -> int:
    """The segment ``cudaMalloc``-ed for a (rounded) block no cached block serves."""
    if block <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if block < MIN_OWN_SEGMENT:
        return LARGE_SEGMENT
    return -(-block // LARGE_ROUNDING) * LARGE_ROUNDING


class OutOfMemoryError(Exception):
    """A request that neither the cache nor the device, after emptying the cache, can serve."""


@dataclass
class _Block:
    address: int
    size: int
    segment: Segment
    allocated: bool = False
    requested: int = 0
    prev: _Block | None = None
    next: _Block | None = None


@dataclass(eq=False)
class Segment:
    """One ``cudaMalloc``-ed range: its stream, pool and the blocks it is cut into."""

    address: int
    size: int
    stream: int
    small: bool
    first: _Block | None = field(default=None, repr=False)

    def blocks(self) -> Iterator[tuple[int, bool]]:
        """(size, allocated) of each block, in address order."""
        block = self.first
        while block is not None:
            yield block.size, block.allocated
            block = block.next


class CachingAllocator:
    """The allocator's state: segments, blocks, and its counters.

    ``capacity`` (bytes) is what ``cudaMalloc`` may hand out in all; ``None``: unbounded.
    New segments get addresses from ``addresses`` (a driver's choice: the simulator needs
    them only to break ties between free blocks of one size); by default descending, as
    the H200's recorded segments were.

    Examples:
        >>> allocator = CachingAllocator()
        >>> first = allocator.malloc(3 << 20)  # under 10 MiB: a 20 MiB segment, split
        >>> second = allocator.malloc(5 << 20)  # from the rest of it
        >>> allocator.reserved >> 20, allocator.allocated >> 20, second - first == 3 << 20
        (20, 8, True)
        >>> allocator.free(first)
        >>> _ = allocator.malloc(3 << 20, stream=7)  # another stream's request: a segment of its own
        >>> allocator.reserved >> 20
        40
    """

    def __init__(self, capacity: int | None = None, *, top: int = 1 << 47) -> None:
        self.capacity = capacity
        self._next_address = top
        self.segments: list[Segment] = []
        self._free: dict[tuple[int, bool], list[tuple[int, int]]] = {}
        self._blocks: dict[int, _Block] = {}  # every free or allocated block, by address
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.retries = 0

    # -- the free lists: per (stream, pool), sorted by (size, address) -------------------

    def _cache(self, block: _Block) -> None:
        bisect.insort(self._free.setdefault(self._key(block.segment), []), (block.size, block.address))

    def _uncache(self, block: _Block) -> None:
        free = self._free[self._key(block.segment)]
        del free[bisect.bisect_left(free, (block.size, block.address))]

    @staticmethod
    def _key(segment: Segment) -> tuple[int, bool]:
        return segment.stream, segment.small

    # -- malloc and free ---------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes on ``stream``; the block's address."""
        block_size = rounded(size)
        small = block_size <= SMALL_REQUEST
        found = self._best_fit(block_size, stream, small)
        if found is None:
            found = self._new_segment(allocation_size(block_size), stream, small)
        self._uncache(found)
        rest = found.size - block_size
        if rest >= MIN_BLOCK if small else rest > SMALL_REQUEST:
            remainder = _Block(found.address + block_size, rest, found.segment, prev=found, next=found.next)
            if found.next is not None:
                found.next.prev = remainder
            found.next, found.size = remainder, block_size
            self._blocks[remainder.address] = remainder
            self._cache(remainder)
        found.allocated, found.requested = True, size
        self.allocated += found.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return found.address

    def free(self, address: int) -> None:
        """Free the block at ``address``: it merges with free neighbours and stays cached."""
        block = self._blocks[address]
        if not block.allocated:
            raise ValueError(f"free of a block that is not allocated: {address:#x}")
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._uncache(neighbour)
                del self._blocks[neighbour.address]
                if neighbour is block.prev:
                    block.address, block.prev = neighbour.address, neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                    else:
                        block.segment.first = block
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                block.size += neighbour.size
        self._blocks.pop(address)
        self._blocks[block.address] = block
        self._cache(block)

    def empty_cache(self) -> None:
        """Give CUDA back every segment that is one free block (``torch.cuda.empty_cache``)."""
        for segment in list(self.segments):
            first = segment.first
            if first is not None and first.next is None and not first.allocated:
                self._uncache(first)
                del self._blocks[first.address]
                self.segments.remove(segment)
                self.reserved -= segment.size

    def _best_fit(self, size: int, stream: int, small: bool) -> _Block | None:
        free = self._free.get((stream, small), [])
        at = bisect.bisect_left(free, (size, 0))
        return self._blocks[free[at][1]] if at < len(free) else None

    def _new_segment(self, size: int, stream: int, small: bool) -> _Block:
        if self.capacity is not None and self.reserved + size > self.capacity:
            self.retries += 1
            self.empty_cache()
            if self.reserved + size > self.capacity:
                raise OutOfMemoryError(
                    f"{size} bytes more on {self.reserved} reserved ({self.allocated} allocated) "
                    f"exceed {self.capacity}"
                )
        self._next_address -= size
        return self.add_segment(self._next_address, size, stream, small)

    def add_segment(self, address: int, size: int, stream: int, small: bool) -> _Block:
        """A segment at ``address``, one free block (how a replay sets up the recorded ones)."""
        segment = Segment(address, size, stream, small)
        block = _Block(address, size, segment)
        segment.first = block
        self.segments.append(segment)
        self._blocks[address] = block
        self._cache(block)
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def hold(self, address: int, size: int) -> None:
        """Mark ``size`` bytes at ``address``, inside a free block, allocated (a replay's start)."""
        containing = max((a for a in self._blocks if a <= address), default=None)
        block = self._blocks[containing] if containing is not None else None
        if block is None or block.allocated or address + size > block.address + block.size:
            raise ValueError(f"no free block holds {size} bytes at {address:#x}")
        self._uncache(block)
        pieces = [(block.address, address - block.address, False), (address, size, True)]
        pieces.append((address + size, block.address + block.size - address - size, False))
        before, after = block.prev, block.next
        del self._blocks[block.address]
        made = []
        for start, length, allocated in pieces:
            if length:
                made.append(_Block(start, length, block.segment, allocated=allocated, requested=length))
        for left, right in zip([before, *made], [*made, after], strict=True):
            if left is not None:
                left.next = right
            else:
                block.segment.first = right
            if right is not None:
                right.prev = left
        for piece in made:
            self._blocks[piece.address] = piece
            if piece.allocated:
                self.allocated += piece.size
            else:
                self._cache(piece)
        self.peak_allocated = max(self.peak_allocated, self.allocated)


def run(
    allocator: CachingAllocator, events: Iterable[tuple[str, int, int, int]]
) -> Iterator[tuple[int, int]]:
    """Feed ``events`` (action, size, key, stream) to ``allocator``; yields each alloc's (key, address).

    ``key`` names a tensor: an ``"alloc"`` gives it a block, a ``"free"`` frees that block.
    """
    where: dict[int, int] = {}
    for action, size, key, stream in events:
        if action == "alloc":
            where[key] = allocator.malloc(size, stream)
            yield key, where[key]
        else:
            allocator.free(where.pop(key))


def blocks_of(segments: Sequence[Segment]) -> list[tuple[int, int, list[tuple[int, bool]]]]:
    """(address, size, blocks) of each segment, by address: to compare with a snapshot."""
    return sorted((s.address, s.size, list(s.blocks())) for s in segments)


@dataclass(frozen=True)
class Replay:
    """A recorded step run again: where the simulator put each block, beside torch."""

    allocator: CachingAllocator
    allocations: int
    misplaced: int
    """Allocations the simulator put at another address than torch did."""


def replay(history: dict) -> Replay:
    """Run one recorded step (``bench/cuda_memory_history.py``'s JSON) through the simulator.

    The step starts from what the warm-up steps left: the recorded segments (no segment is
    made in a steady step), holding the blocks alive when the step began: those it frees
    without having allocated them, and those still held at its end that it did not allocate.
    A large-pool block keeps a free rest of at most 1 MiB after it (``should_split``), so such
    a gap belongs to the block before it. Frees count when completed (``free_completed``:
    a block used on another stream returns to the cache once that stream's work is done).
    """
    segments = sorted(history["segments"], key=lambda s: s["address"])
    starts = [s["address"] for s in segments]

    def segment_of(address: int) -> dict:
        return segments[bisect.bisect_right(starts, address) - 1]

    events = [e for e in history["events"] if e[0] in ("alloc", "free_completed")]
    streams: dict[int, int] = {}
    held: dict[int, int] = {}  # address -> size, alive when the step began
    live: set[int] = set()
    for action, size, address, stream in events:
        streams.setdefault(segment_of(address)["address"], stream)
        if action == "alloc":
            live.add(address)
        elif address in live:
            live.remove(address)
        else:
            held[address] = rounded(size)
    for segment in segments:
        address = segment["address"]
        for size, state in segment["blocks"]:
            if state.startswith("active") and address not in live:
                held[address] = size
            address += size
    allocator = CachingAllocator()
    for segment in segments:
        stream = streams.get(segment["address"], -1)  # untouched by the step: no stream serves it
        allocator.add_segment(segment["address"], segment["size"], stream, segment["pool"] == "small")
    for address in sorted(held):
        segment = segment_of(address)
        end = segment["address"] + segment["size"]
        following = min((a for a in held if address < a < end), default=end)
        size = held[address]
        if segment["pool"] != "small" and 0 < following - address - size <= SMALL_REQUEST:
            size = following - address
        allocator.hold(address, size)
    where = {address: address for address in held}
    misplaced = allocations = 0
    for action, size, address, stream in events:
        if action == "alloc":
            where[address] = allocator.malloc(size, stream)
            allocations += 1
            misplaced += where[address] != address
        else:
            allocator.free(where.pop(address))
    return Replay(allocator, allocations, misplaced)


def from_the_start(history: dict, steps: int = 3) -> CachingAllocator:
    """The allocator after ``steps`` steps of ``history``'s order, from an empty cache.

    What the warm-up does, in torch's order: the parameters are allocated first
    (``fs.materialize``); the first step runs without optimizer state, which AdamW makes in
    its first ``step()`` (after the backward's last reduce-scatter), two states the size of
    each parameter, so of the blocks every step keeps, a third of each size are
    parameters; each later step frees the previous one's gradients (``zero_grad``). Every
    step allocates and frees as the recorded one did. Its ``peak_reserved`` is then what
    the run's ``max_memory_reserved`` would be if only the step's order and torch's rules
    set it.
    """
    events = [e for e in history["events"] if e[0] in ("alloc", "free_completed")]
    live: set[int] = set()
    freed_first: set[int] = set()  # alive when the step began: the previous step's gradients
    for action, _, address, _ in events:
        if action == "alloc":
            live.add(address)
        elif address in live:
            live.remove(address)
        else:
            freed_first.add(address)
    kept_sizes: dict[int, int] = {}
    for segment in history["segments"]:
        address = segment["address"]
        for size, state in segment["blocks"]:
            if state.startswith("active") and address not in live and address not in freed_first:
                kept_sizes[size] = kept_sizes.get(size, 0) + 1
            address += size
    parameters = {size: max(1, count // 3) for size, count in kept_sizes.items()}
    states = [size for size, count in kept_sizes.items() for _ in range(count - parameters[size])]
    optimizer_step = max(i for i, e in enumerate(events) if e[0] == "alloc" and e[3] != 0) + 1
    allocator = CachingAllocator()
    for size, count in parameters.items():
        for _ in range(count):
            allocator.malloc(size)
    previous: dict[int, int] = {}
    for step in range(steps):
        current: dict[int, int] = {}
        for index, (action, size, address, stream) in enumerate(events):
            if step == 0 and index == optimizer_step:
                for state in states:
                    allocator.malloc(state)
            if action == "alloc":
                current[address] = allocator.malloc(size, stream)
            elif address in current:
                allocator.free(current.pop(address))
            elif address in previous:
                allocator.free(previous.pop(address))
        previous = current
    return allocator
