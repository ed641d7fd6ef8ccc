"""examples/train_torchrun.py with a rank that dies or hangs where a test says (run by torchrun).

The example stays free of test hooks: this script arms one, then runs it as ``__main__``
with the same arguments. ``CRASH_AT`` says where, ``CRASH_MARKER`` (a file) makes it happen in
the first attempt only — torchrun restarts every worker, and the restarted ones must run
through:

- ``step:S:R`` — rank R is killed (SIGKILL) in step S (1-based), after its forward and
  backward, before its optimizer step;
- ``save:K:R`` — rank R is killed in the K-th checkpoint save, once its own shards are
  written (the others' are written or being written; none is renamed into place);
- ``hang:S:R`` — rank R sleeps (for an hour) in step S, before its forward: its peers wait
  in a collective until their timeout.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import signal
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter

import functional_shard as fs

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "train_torchrun.py"


def _armed() -> tuple[str, int, int] | None:
    where = os.environ.get("CRASH_AT")
    marker = pathlib.Path(os.environ.get("CRASH_MARKER", "crash-marker"))
    if not where or marker.exists():
        return None
    kind, count, rank = where.split(":")
    return kind, int(count), int(rank)


def _strike(kind: str) -> None:
    # the marker first: the restarted workers must not strike again
    pathlib.Path(os.environ.get("CRASH_MARKER", "crash-marker")).touch()
    if kind == "hang":
        time.sleep(3600)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def _arm(kind: str, count: int, rank: int) -> None:
    calls = {"n": 0}

    def due() -> bool:
        calls["n"] += 1
        return calls["n"] == count and dist.get_rank() == rank

    if kind in ("step", "hang"):
        forward_backward = fs.forward_backward

        def striking_forward_backward(*args: Any, **kwargs: Any) -> Any:
            run = forward_backward(*args, **kwargs)

            def step(*inputs: Any) -> Any:
                if kind == "hang" and due():
                    _strike(kind)
                loss = run(*inputs)
                if kind == "step" and due():
                    _strike(kind)
                return loss

            return step

        fs.forward_backward = striking_forward_backward  # type: ignore[assignment]
    else:
        write_data = FileSystemWriter.write_data

        def striking_write_data(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
            written = write_data(self, *args, **kwargs)
            if due():
                written.wait()  # this rank's shards are on disk
                _strike(kind)
            return written

        FileSystemWriter.write_data = striking_write_data  # type: ignore[method-assign]


if __name__ == "__main__":
    armed = _armed()
    if armed is not None:
        _arm(*armed)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
