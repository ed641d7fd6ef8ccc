"""LocalWorld isolation: worlds started at the same moment never join each other's group."""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch.distributed as dist

import functional_shard as fs

# worlds of their own here, never the run's shared ones: what is tested is LocalWorld itself
# (worlds started at one moment, the port it holds, a run past its timeout)


def gather_tokens(token: str) -> tuple[int, list[str]]:
    """This rank's view of its group: its size and every member's token."""
    tokens: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(tokens, token)
    return dist.get_world_size(), tokens


def start_together(count: int, size: int) -> list[tuple[str, list[tuple[int, list[str]]]]]:
    """``count`` worlds of ``size`` ranks, started at one moment (threads); each gathers its token."""
    start = threading.Barrier(count)
    seen: list[tuple[str, list[tuple[int, list[str]]]] | BaseException] = [None] * count  # type: ignore[list-item]

    def one(i: int) -> None:
        token = uuid.uuid4().hex
        try:
            start.wait()
            with fs.LocalWorld(size, timeout=120) as world:
                seen[i] = (token, world.run(gather_tokens, token))
        except BaseException as error:  # re-raised in the test's thread
            seen[i] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in seen:
        if isinstance(result, BaseException):
            raise result
    return seen  # type: ignore[return-value]


def test_worlds_started_together_see_only_their_own_ranks():
    for token, by_rank in start_together(count=2, size=2):
        assert by_rank == [(2, [token, token])] * 2


def test_the_rendezvous_port_is_held_by_the_parent_before_any_rank_joins():
    # the old scheme chose a free port, released it and left rank 0 to bind it once started:
    # in between, the port was free for a second world (or anything else) to take
    with fs.LocalWorld(2, timeout=120) as world:
        port = world._store.port
        with socket.socket() as sock, pytest.raises(OSError, match=re.escape(os.strerror(errno.EADDRINUSE))):
            sock.bind(("127.0.0.1", port))
        assert world.run(dist.get_world_size) == [2, 2]


def one_rank_hangs() -> float:
    """Rank 1 never reaches the all-reduce the others wait in (as a hung or dead peer)."""
    import time

    import torch

    if dist.get_rank() == 1:
        time.sleep(60)
        return 0.0
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def test_a_hung_peer_ends_the_run_within_the_timeout_naming_the_collective_and_ranks():
    import time

    from functional_shard.runtime.launch import CollectiveTimeoutError

    start = time.monotonic()
    with pytest.raises(
        CollectiveTimeoutError,
        match=r"rank 0 waited 3s in torch\.distributed\.all_reduce, and its peers never joined it "
        r"\(running one_rank_hangs\); ranks \[1\] had not returned: hung or dead",
    ):
        fs.run_local(one_rank_hangs, 2, timeout=3)
    assert time.monotonic() - start < 40  # the wait, not the sleeping rank's 60 s


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one reaps does not: an orphan's in a container often is)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def test_a_killed_parent_takes_its_ranks_with_it():
    # a parent ended by SIGTERM runs no cleanup: its ranks must notice and end (before, they
    # waited on their inboxes for ever, each spinning its gloo threads)
    script = "import os, time, functional_shard as fs\n" + (
        "world = fs.LocalWorld(1)\nprint(*world.run(os.getpid), flush=True)\ntime.sleep(600)\n"
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as parent:
        try:
            rank = int(parent.stdout.readline())  # type: ignore[union-attr]
        finally:
            parent.terminate()
            parent.wait(timeout=60)
    deadline = time.monotonic() + 20
    while _running(rank) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(rank), f"rank {rank} still runs after its parent was killed"
