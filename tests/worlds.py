"""Worlds for tests: this process alone, and LocalWorlds shared by the whole run, one per
size, that a test's intended failure does not take from the next test."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

import functional_shard as fs


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """This process as a gloo world of one: a real group (loss parallel all-reduces,
    checkpoints agree over it), for a test or one drawn example of it."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def refusing(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> fs.ShardingError | None:
    """On a rank: the `ShardingError` ``fn`` raised, caught and sent back; None if it ran through."""
    try:
        fn(*args, **kwargs)
    except fs.ShardingError as error:
        return error
    return None


# torch keeps every group a test made (a mesh's dimensions) until it is destroyed, and the threads
# of an idle gloo group keep waking: on 4 ranks, 120 leftover groups cost 14% of a core per rank
# doing nothing, and a default run left hundreds, which made the whole suite twice as slow (seen).
# Destroying them between tests is not an option (torch's DTensor caches keep their meshes), so a
# world that has made this many is started again instead. A restart costs 8-28 s (the new ranks
# import lightning and transformers again); with coarse timers 120 idle groups cost 4% of a core
GROUPS_BEFORE_A_RESTART = 120


def reset_rank() -> int:
    """On each rank between two tests: the state a test may leave behind, set back; the groups it holds."""
    gc.collect()  # the last test's models and groups, before the next one allocates
    # what outlives a full collection (torch, lightning and transformers as imported, their
    # caches) is never scanned again: the next reset's collection walks only what the next test
    # made, not half a million objects on each rank (0.4-0.8 s a test, seen)
    gc.freeze()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    dist.barrier()  # every rank is alive and past the last test's collectives
    return len(dist.distributed_c10d._world.pg_map)


# Each gloo group's transport keeps a thread that wakes every 10 ms, message or not: idle, 4
# ranks holding 40 groups spent 20.7% of a core on it (measured), taken from every test that
# ran beside them. Timer slack lets the kernel delay and batch such timeouts (never a wake-up
# by an arriving message): with 50 ms, 4.2%. Only the shared worlds' ranks get it; the tests
# of timeouts and hung peers start worlds of their own.
TIMER_SLACK_NS = 50_000_000
_PR_SET_TIMERSLACK = 29


def coarse_timers() -> None:
    """On a rank: the kernel may delay this thread's timeouts, and those of the threads it starts
    from now on (each group's transport thread), by up to TIMER_SLACK_NS (Linux only)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(TIMER_SLACK_NS), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_TIMERSLACK) failed")


def _started(size: int) -> fs.LocalWorld:
    world = fs.LocalWorld(size)
    world.run(coarse_timers)  # before any test makes a group on it
    return world


class RestartingWorld:
    """``size`` ranks, restarted when a test's intended failure closed them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.current = _started(size)
        self.used = False  # since the last reset

    def run(self, *args: Any, **kwargs: Any) -> list[Any]:
        if self.current.closed:
            self.current = _started(self.size)
        self.used = True
        return self.current.run(*args, **kwargs)

    def refusal(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``fn`` where every rank refuses at the same check, and raise rank 0's refusal.

        Each rank catches its own `ShardingError`, so the ranks come back idle and the world
        lives on; raised through `run`, the error would close the world and the next test would
        start four processes again. A rank that ran through fails the test.
        """
        refusals = self.run(refusing, fn, *args, **kwargs)
        through = [rank for rank, refused in enumerate(refusals) if refused is None]
        assert not through, f"ranks {through} ran {getattr(fn, '__name__', fn)} without a refusal"
        raise refusals[0]  # type: ignore[misc]

    def reset(self) -> None:
        """Set the ranks back after a test that used them (a closed world restarts at its next run)."""
        if self.used and not self.current.closed:
            groups = self.current.run(reset_rank)
            if max(groups) > GROUPS_BEFORE_A_RESTART:
                self.current.close()  # started again at its next run
        self.used = False

    def close(self) -> None:
        if not self.current.closed:
            self.current.close()


class Worlds:
    """One `RestartingWorld` per size for the whole test run, each started when first asked for.

    Starting 4 ranks (4 processes importing torch) costs seconds; a world per module paid
    it some twenty times a run. Tests that need a world of their own (a timeout, a crash, a
    fresh process's memory) still start one, and say why.
    """

    def __init__(self) -> None:
        self._started: dict[int, RestartingWorld] = {}

    def __call__(self, size: int) -> RestartingWorld:
        if size not in self._started:
            self._started[size] = RestartingWorld(size)
        return self._started[size]

    def reset(self) -> None:
        for world in self._started.values():
            world.reset()

    def close(self) -> None:
        # side by side: each world's ranks take a second or more to leave their group and exit
        with ThreadPoolExecutor() as pool:
            list(pool.map(RestartingWorld.close, self._started.values()))
