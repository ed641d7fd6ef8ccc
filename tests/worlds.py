"""A LocalWorld that a test's intended failure does not take from the next test."""

from __future__ import annotations

from typing import Any

import functional_shard as fs


class RestartingWorld:
    """``size`` ranks, restarted when a test's intended failure closed them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.current = fs.LocalWorld(size)

    def run(self, *args: Any, **kwargs: Any) -> list[Any]:
        if self.current.closed:
            self.current = fs.LocalWorld(self.size)
        return self.current.run(*args, **kwargs)
