"""Worlds for tests: this process alone, and a LocalWorld that a test's intended failure
does not take from the next test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

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


class RestartingWorld:
    """``size`` ranks, restarted when a test's intended failure closed them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.current = fs.LocalWorld(size)

    def run(self, *args: Any, **kwargs: Any) -> list[Any]:
        if self.current.closed:
            self.current = fs.LocalWorld(self.size)
        return self.current.run(*args, **kwargs)
