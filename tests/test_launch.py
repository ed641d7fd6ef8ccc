"""LocalWorld isolation: worlds started at the same moment never join each other's group."""

from __future__ import annotations

import errno
import os
import re
import socket
import threading
import uuid

import pytest
import torch.distributed as dist

import functional_shard as fs


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
