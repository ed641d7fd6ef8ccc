"""Run a function on N local processes joined in a gloo process group (tests, demo, bench).

`LocalWorld` keeps its processes (and their process group) alive across calls, so a test
module pays the start-up once. A rank that raises ends the whole world at once, and its
exception is re-raised in the parent with the child's traceback attached.

The parent serves the rendezvous store itself on a port it holds until the world closes, so
two worlds started at the same moment cannot be handed the same port.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from functional_shard.core.validate import positive_int, refuse

from .timeouts import (
    CollectiveTimeoutError,
    RankFailedError,
    collective_timed_out,
    how_it_ended,
    peer_gone,
    set_timeout,
)

__all__ = ["CollectiveTimeoutError", "LocalWorld", "RankFailedError", "current_rank", "run_local"]


class _RemoteTracebackError(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


_HOST = "127.0.0.1"
_TIMEOUT = datetime.timedelta(seconds=300)  # to join the store
_GRACE = 15.0  # seconds the parent waits past the ranks' timeout for their own errors
_DEATH_GRACE = 5.0  # seconds it waits, once a rank died, for the others' errors
_STARTED = "functional_shard/started/"  # a store key each rank sets once it runs
_PARENT_POLL_S = 1.0  # how often a rank looks whether the process that started it still runs


@dataclass(frozen=True)
class _Rank:
    """What one spawned rank needs to join the world: sent to it whole, by pickle."""

    rank: int
    world_size: int
    port: int  # of the store the parent serves
    backend: str
    threads: int
    timeout: float  # seconds a collective waits for its peers
    parent: int  # the pid of the process that started the world


def _end_with(parent: int) -> None:
    """End this rank once ``parent`` is gone.

    A parent killed (SIGTERM, SIGKILL) runs no cleanup, and its ranks, daemons or not, would
    wait on their inboxes for ever, their gloo threads waking.
    """
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def _serve(me: _Rank, inbox: Any, outbox: Any) -> None:
    threading.Thread(target=_end_with, args=(me.parent,), daemon=True, name="parent-watch").start()
    rank = me.rank
    torch.set_num_threads(me.threads)
    if me.backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank % torch.cuda.device_count())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # a client of the store the parent serves: no rank ever binds a port of its own choosing
    store = dist.TCPStore(_HOST, me.port, me.world_size, is_master=False, timeout=_TIMEOUT)
    store.set(f"{_STARTED}{rank}", "")  # a rank that dies without it never ran our code: see `_died`
    # joining waits for every rank to start (a rank still importing torch is not hung); the
    # world's timeout is for the collectives after
    dist.init_process_group(me.backend, store=store, rank=rank, world_size=me.world_size, timeout=_TIMEOUT)
    set_timeout(me.timeout)
    try:
        while (task := inbox.get()) is not None:
            fn, args, kwargs = task
            try:
                outbox.put((rank, True, fn(*args, **kwargs)))
            except BaseException as error:  # sent back whole; the parent decides
                text = traceback.format_exc()
                named = isinstance(error, CollectiveTimeoutError)  # by watch_collectives already
                collective = None if named else collective_timed_out(error)
                if collective is not None:  # say where it waited, and for how long
                    tail = " (a peer died)" if peer_gone(error) else ", and its peers never joined it"
                    error = CollectiveTimeoutError(
                        f"rank {rank} {how_it_ended(error, collective, me.timeout)}{tail}"
                    )
                try:
                    outbox.put((rank, False, (error, text)))
                except Exception:  # an exception that does not pickle
                    outbox.put((rank, False, (RankFailedError(repr(error)), text)))
    finally:
        dist.destroy_process_group()


class LocalWorld:
    """``world_size`` local processes in one process group, reused across `run` calls.

    Args:
        world_size: number of ranks.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        timeout: seconds a collective waits for its peers, and a `run` (plus a grace) before killing ranks.

    Examples:
        >>> # with LocalWorld(4) as world:
        >>> #     ranks = world.run(torch.distributed.get_rank)   # [0, 1, 2, 3]
    """

    def __init__(self, world_size: int, backend: str = "gloo", timeout: float = 300.0) -> None:
        self.world_size = positive_int(world_size, "world_size", meaning="how many local ranks to start")
        self.timeout = timeout
        context = mp.get_context("spawn")
        self._outbox = context.Queue()
        self._inboxes = [context.SimpleQueue() for _ in range(world_size)]
        threads = max(1, (os.cpu_count() or 1) // world_size)
        # port 0: the kernel picks a free port, bound from now until this object's store goes
        self._store: dist.TCPStore | None = dist.TCPStore(
            _HOST, 0, None, is_master=True, timeout=_TIMEOUT, wait_for_workers=False
        )
        port = self._store.port
        self._processes: list[BaseProcess] = [
            context.Process(
                target=_serve,
                args=(
                    _Rank(rank, world_size, port, backend, threads, timeout, os.getpid()),
                    self._inboxes[rank],
                    self._outbox,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in self._processes:
            process.start()
        self._broken = False

    @property
    def closed(self) -> bool:
        """Whether the world was closed (by `close`, or by a rank's failure)."""
        return self._broken

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results by rank.

        ``fn`` must be importable (a module-level function): it is sent by reference.

        Raises:
            ShardingError: ``fn`` is no function, or it or its arguments do not pickle (a lambda); nothing
                is sent and the world stays open.
            RankFailedError: a rank died or the run timed out; the world is closed.
            BaseException: the exception a rank raised, re-raised with its traceback.
        """
        if self._broken:
            raise RankFailedError("this LocalWorld was closed after a failure; make a new one")
        _sendable(fn)
        try:
            # each put pickles first: a failure on the first one sends nothing
            for inbox in self._inboxes:
                inbox.put((fn, args, kwargs))
            unsent = None
        except Exception as pickling:  # pickle raises PicklingError, AttributeError or TypeError alike
            unsent = str(pickling)
        if unsent is not None:
            refuse(
                "args",
                "...",
                "arguments that pickle",
                meaning=f"they are sent to the spawned ranks: {unsent}",
            )
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        # past the ranks' own collective timeout, so that their error, naming where they
        # waited, arrives before the parent gives up on them
        deadline = time.monotonic() + self.timeout + _GRACE
        while pending:
            try:
                rank, ok, payload = self._outbox.get(timeout=0.25)
            except queue.Empty:
                dead = [r for r in pending if not self._processes[r].is_alive()]
                if dead and deadline > time.monotonic() + _DEATH_GRACE:
                    # the living ranks' errors name the collective the dead one left: a
                    # moment for them to arrive (gloo tells them at once)
                    deadline = time.monotonic() + _DEATH_GRACE
                    continue
                if time.monotonic() > deadline:
                    store = self._store
                    unstarted = [r for r in dead if store is not None and not store.check([f"{_STARTED}{r}"])]
                    self.close(force=True)
                    why = (
                        f"ranks {dead} died" if dead else f"ranks {sorted(pending)} ran past {self.timeout}s"
                    )
                    raise RankFailedError(
                        f"{why} in {getattr(fn, '__name__', fn)}{_died(unstarted)}"
                    ) from None
                continue
            if not ok:
                others = sorted(pending - {rank})
                dead = [r for r in others if not self._processes[r].is_alive()]
                self.close(force=True)  # the others may be blocked in a collective
                error, text = payload
                if isinstance(error, CollectiveTimeoutError):
                    waiting = [r for r in others if r not in dead]
                    reasons = [f"ranks {dead} died"] if dead else []
                    reasons += [f"ranks {waiting} had not returned: hung or dead"] if waiting else []
                    running = getattr(fn, "__name__", fn)
                    error = CollectiveTimeoutError(f"{error} (running {running}); {' and '.join(reasons)}")
                raise error from _RemoteTracebackError(f"rank {rank} of {self.world_size}:\n{text}")
            results[rank] = payload
            pending.discard(rank)
        return results

    def close(self, force: bool = False) -> None:
        """Stop every rank (at once when ``force``)."""
        self._broken = True
        if not force:
            for inbox in self._inboxes:
                inbox.put(None)
            for process in self._processes:
                process.join(timeout=30)
        for process in self._processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        self._store = None  # the ranks are gone: the port goes back to the kernel

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(force=exc_info[0] is not None)


def _died(unstarted: list[int]) -> str:
    """What to add where ranks died before running any of our code: most often an unguarded script."""
    if not unstarted:
        return ""
    return (
        f", ranks {unstarted} as they started, before joining the world (their own output above says "
        "why): a spawned rank imports the script that started it, so a script must start ranks under "
        '`if __name__ == "__main__":`'
    )


def _sendable(fn: object) -> None:
    # checked before anything is sent: a rank failing on it would close the whole world, and a
    # pickling error would otherwise come from inside multiprocessing
    if not callable(fn):
        refuse("fn", repr(fn), "a function", meaning="called on every rank")
    if _pickling_error(fn) is not None:
        refuse(
            "fn",
            getattr(fn, "__qualname__", type(fn).__name__),
            "a module-level function",
            meaning="the spawned ranks import it by name: not a lambda, a nested function, or a bound "
            "method of an object that does not pickle",
        )


def _pickling_error(value: object) -> str | None:
    try:
        pickle.dumps(value)  # a function pickles by reference: cheap, and no side effect
    except Exception as error:  # pickle raises PicklingError, AttributeError or TypeError alike
        return str(error)
    return None


def current_rank() -> int:
    """This process's rank in the running world (0 where no process group is running)."""
    return dist.get_rank() if dist.is_initialized() else 0


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` once on ``world_size`` fresh local ranks; results by rank.

    ``timeout`` is `LocalWorld`'s: a hung or dead peer ends the run with a `CollectiveTimeoutError`.
    ``fn`` must be importable (a module-level function), and its arguments must pickle.

    Examples:
        >>> # run_local(torch.distributed.get_world_size, 2) == [2, 2]
    """
    _sendable(fn)  # before any rank is started
    with LocalWorld(world_size, backend, timeout) as world:
        return world.run(fn, *args, **kwargs)
