"""A collective whose peers never come: an error naming it and them, under any launcher.

torch's timeout error names neither the collective nor the rank that never came (gloo:
``Timed out waiting 3000ms for recv operation to complete``). `watch_collectives` turns it
into a `CollectiveTimeoutError` naming this rank, the collective, the wait, and the ranks that
hung or died: every rank whose wait ran out says so in the group's store, and after a short
grace the silent ones are those that never came.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import entry_point, positive_number

__all__ = [
    "CollectiveTimeoutError",
    "RankFailedError",
    "collective_timed_out",
    "how_it_ended",
    "init_distributed",
    "peer_gone",
    "set_timeout",
    "share_timeout",
    "timeout_error",
    "watch_collectives",
]

_GRACE = 10.0  # at most this long, after its own wait, a rank waits to hear from the others
_DEATH_GRACE = 2.0  # as long, after a peer's connection closed
_POLL = 0.05


class RankFailedError(RuntimeError):
    """A rank died, hung past the timeout, or raised something that cannot be sent back."""


class CollectiveTimeoutError(RankFailedError):
    """A rank's collective ended without its peers.

    It waited past the process group's timeout, or a peer's connection closed under it
    (the peer died).
    """


for _error in (RankFailedError, CollectiveTimeoutError):
    _error.__module__ = "functional_shard"


def collective_timed_out(error: BaseException) -> str | None:
    """The collective a rank waited in when ``error``, a timeout, ended its wait; None for other errors.

    The innermost public ``torch.distributed`` function in the traceback (``all_reduce``, ...),
    else the module and function that waited (FSDP's all-gather), else the backward pass.

    Examples:
        >>> collective_timed_out(ValueError("not a timeout")) is None
        True
    """
    text = str(error).lower()
    if "timed out" not in text and "timeout" not in text and not peer_gone(error):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    public = [
        f.name for f in frames if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")
    ]
    if public:
        return f"torch.distributed.{public[-1]}"
    inside = [f for f in frames if f"torch{os.sep}distributed{os.sep}" in f.filename]
    if inside:
        where = inside[-1].filename.rpartition(f"torch{os.sep}distributed{os.sep}")[2]
        module = where.removesuffix(".py").replace(os.sep, ".")
        return f"a collective waited for in torch.distributed.{module}.{inside[-1].name}"
    if any(f.name in ("run_backward", "_engine_run_backward") for f in frames):
        return "a collective of the backward pass (a gradient reduction)"
    # a torch error that names a timeout but reached Python through no collective: not ours to rename
    return None


# what gloo says when a peer's process is gone (killed, crashed) in mid-collective
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe")


def peer_gone(error: BaseException) -> bool:
    """Whether ``error`` is gloo's word that a peer's process went away in mid-collective."""
    text = str(error).lower()
    return any(words in text for words in _PEER_GONE)


def _group_timeout() -> float:
    # the default group's timeout is its store's: init_process_group gives both the same
    # (checked on torch 2.13 with gloo); private, hence read in this one place
    store = dist.distributed_c10d._get_default_store()
    return store.timeout.total_seconds()  # type: ignore[attr-defined]  # there, not in the stubs


def set_timeout(seconds: float) -> None:
    """Make the default process group (its collectives and its store) wait ``seconds`` for a peer.

    For a launcher that must join with a longer timeout than its collectives should wait
    (processes that are still starting are not hung).
    """
    waits = datetime.timedelta(seconds=seconds)
    dist.distributed_c10d._set_pg_timeout(waits)
    dist.distributed_c10d._get_default_store().set_timeout(waits)


def share_timeout(groups: list[dist.ProcessGroup]) -> None:
    """Give ``groups`` the default process group's timeout.

    torch creates a DeviceMesh's groups with the backend's default timeout (30 minutes for
    gloo, 10 for NCCL), not the one ``init_process_group`` was given: without this, a peer
    that hangs in a tensor-parallel or FSDP collective would hold the job for half an hour
    whatever the user asked.
    """
    if not dist.is_initialized():
        return
    if dist.get_backend() not in ("gloo", "nccl"):  # torch sets timeouts of these only (not "fake")
        return
    waits = datetime.timedelta(seconds=_group_timeout())
    default = dist.distributed_c10d._get_default_group()
    for group in groups:
        if group is not default:
            dist.distributed_c10d._set_pg_timeout(waits, group)


def _silent_ranks(collective: str, grace: float) -> list[int] | None:
    """The ranks that never said their wait ran out, once this rank said so in the store.

    Waits ``grace`` seconds, or until every rank has said so. None when the store is gone too.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        keys = [f"functional_shard/timed_out/{r}" for r in range(world)]
        store.set(keys[rank], collective)
        deadline = time.monotonic() + grace
        while True:
            silent = [r for r in range(world) if not store.check([keys[r]])]
            if not silent or time.monotonic() > deadline:
                return silent
            time.sleep(_POLL)
    except (RuntimeError, ValueError):  # the store's server went with a dead rank 0
        return None


def timeout_error(error: BaseException, seconds: float | None = None) -> CollectiveTimeoutError | None:
    """The `CollectiveTimeoutError` that ``error``, a collective's timeout, stands for; None otherwise.

    Names this rank, the collective, the wait (``seconds``, default the group's timeout) and
    the ranks that hung or died. Asks every other rank through the store first: the caller
    waits up to the group's timeout (10 s at most) longer.

    Examples:
        >>> timeout_error(KeyError("step")) is None
        True
    """
    if isinstance(error, CollectiveTimeoutError):
        return error
    collective = collective_timed_out(error)
    if collective is None or not dist.is_initialized():
        return None
    waited = _group_timeout() if seconds is None else seconds
    rank = dist.get_rank()
    # a peer that died never says so: those that live say so at once (gloo tells every rank
    # connected to it), so a short grace finds it
    died = peer_gone(error)
    silent = _silent_ranks(collective, min(waited, _DEATH_GRACE if died else _GRACE))
    if silent is None:
        who = "its peers never joined it (the group's store is gone: rank 0 died)"
    elif silent:
        who = f"ranks {silent} never joined it: hung or dead"
    else:
        who = "every rank timed out waiting for another (a collective some rank never called)"
    return CollectiveTimeoutError(f"rank {rank} {how_it_ended(error, collective, waited)}; {who}")


def how_it_ended(error: BaseException, collective: str, seconds: float) -> str:
    """How a collective ended for this rank: ``waited 3s in torch.distributed.all_reduce``.

    Where gloo said a peer died (at once, without waiting out the timeout): ``lost a peer's
    connection in ...``.

    Examples:
        >>> how_it_ended(RuntimeError("Timed out"), "torch.distributed.barrier", 3.0)
        'waited 3s in torch.distributed.barrier'
    """
    if peer_gone(error):
        return f"lost a peer's connection in {collective}"
    return f"waited {seconds:g}s in {collective}"


@contextmanager
def watch_collectives() -> Iterator[None]:
    """Turn torch's timeout of a collective in the block into a `CollectiveTimeoutError`.

    So does gloo's word that a peer died in it. Wrap a training step in it; the process group's
    ``timeout`` (`init_distributed`'s) decides how long a rank waits. Other errors pass unchanged.

    Raises:
        CollectiveTimeoutError: a collective in the block waited past the group's timeout, or lost a peer.

    Examples:
        >>> # device = fs.init_distributed(timeout=60)
        >>> # with fs.watch_collectives():
        >>> #     loss = step(batch)
    """
    try:
        yield
    except Exception as error:
        named = timeout_error(error)
        if named is None or named is error:
            raise
        raise named from error


_LAUNCHED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what env:// reads, a launcher sets


@entry_point
def init_distributed(
    backend: str | None = None, *, timeout: float | datetime.timedelta = 300.0
) -> torch.device:
    """Join the process group torchrun (or any ``env://`` launcher) set up; return this rank's device.

    Restart-safe under ``torchrun --max-restarts``: each attempt meets under keys of its own.

    Args:
        backend: by default NCCL when CUDA is there (one GPU per process, by ``LOCAL_RANK``), else gloo.
        timeout: seconds (or a timedelta) a collective waits for its peers before raising.

    Raises:
        functional_shard.ShardingError: a timeout that is not positive, or no launcher's environment
            (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

    Examples:
        >>> # device = fs.init_distributed(timeout=60)   # under torchrun, on every rank
        >>> # with fs.watch_collectives():
        >>> #     train_step()
    """
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    meaning = "seconds, or a timedelta: a collective waits that long for a hung or dead peer"
    seconds = positive_number(seconds, "timeout", meaning=meaning)
    if unset := [name for name in _LAUNCHED if name not in os.environ]:
        raise ShardingError(
            f"init_distributed: {', '.join(unset)} unset, so no launcher started this process; run it under "
            "torchrun --nproc-per-node N (or any env:// launcher), or start local ranks with fs.run_local"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # joining waits for every process to start (one still importing torch is not hung);
    # ``timeout`` is for the collectives after
    waits = max(datetime.timedelta(seconds=seconds), dist.distributed_c10d.default_pg_timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's workers share its agent's store, and a restart's workers read the
        # addresses the attempt before left there (gloo then connects to dead ranks: torch
        # issue 135712); each attempt's keys under a prefix of their own keep them apart
        store, rank, world_size = next(dist.rendezvous("env://", timeout=waits))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"functional_shard/attempt-{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=waits)
    else:
        dist.init_process_group(backend, timeout=waits)
    set_timeout(seconds)
    return device
