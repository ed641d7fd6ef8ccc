"""A pipeline stage's failure, raised on every pp rank.

Raised on its own rank alone, it leaves the other ranks waiting for what that rank's stages
send, past the process group's timeout. The ranks agree first on who failed and how; running
out of memory is raised as what it is, on every rank, never turned into a `ShardingError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from functional_shard.core.errors import ShardingError, one_line

# what a forward raises when the device (or the host) runs out of memory: raised as it is, on
# the rank it happened on, never turned into a refusal of the inputs
OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError)


def _memory_class(error: BaseException) -> type[BaseException] | None:
    return type(error) if isinstance(error, OUT_OF_MEMORY) else None


def raise_first_stage_failure(
    failure: BaseException | None,
    inputs: torch.Tensor,
    group: dist.ProcessGroup,
    device: torch.device,
    source: int,
) -> None:
    """Raise on every pp rank what the first stage's check forward raised on pp rank ``source``, if anything.

    ``failure``: what it raised, on that rank (None on the others). Inputs it cannot run are refused;
    running out of memory is raised as it is there, and as one of its class naming that rank elsewhere.
    """
    said: tuple[type[BaseException] | None, str] | None = None
    if failure is not None:
        said = (_memory_class(failure), one_line(failure))
    sent: list[Any] = [said]
    dist.broadcast_object_list(sent, group=group, group_src=source, device=device)
    if sent[0] is None:
        return
    memory, message = sent[0]
    if memory is not None:
        if failure is not None:
            raise failure  # a caller that handles running out of memory (a smaller batch) sees it
        raise memory(
            f"the pipeline's first stage (pp rank {source}) ran out of memory on a micro-batch of inputs of "
            f"shape {tuple(inputs.shape)}; every pp rank stops here: {message}"
        )
    raise ShardingError(
        f"the pipeline's first stage cannot run a micro-batch of inputs of shape {tuple(inputs.shape)} "
        f"and dtype {inputs.dtype}; every pp rank stops here: {message}. Fix: the inputs its forward "
        "takes (a language model's: integer token ids, [rows, sequence])"
    ) from failure


def raise_any_failure(
    group: dist.ProcessGroup,
    stages: Sequence[Sequence[str]],
    stage_failure: tuple[int, BaseException] | None,
    loss_failure: BaseException | None,
) -> None:
    """Raise on every pp rank what a stage's forward after the first, or loss_fn, raised in a step.

    ``stages``: each stage's module paths. ``stage_failure``: the stage on this rank whose forward
    failed, and its error; ``loss_failure``: what loss_fn raised on this rank's last stage. The
    earliest stage's failure is raised, a forward's before loss_fn's: the stages after it ran on
    the stand-in it handed on.
    """
    failed, in_loss = stage_failure, False
    if failed is None and loss_failure is not None:
        failed, in_loss = (len(stages) - 1, loss_failure), True
    mine: tuple[int, bool, type[BaseException] | None, str] | None = None
    if failed is not None:
        mine = (failed[0], in_loss, _memory_class(failed[1]), one_line(failed[1]))
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    said = sorted((report[:2], rank, report) for rank, report in enumerate(reports) if report is not None)
    if not said:
        return
    _, rank, (stage, loss, memory, message) = said[0]
    own = failed[1] if failed is not None and rank == dist.get_rank(group) else None
    if memory is not None and own is not None:
        raise own  # a caller that handles running out of memory (a smaller batch) sees it
    where = (
        f"last stage (pp rank {rank}) ran loss_fn"
        if loss
        else f"stage {stage} (pp rank {rank}) ran its forward"
    )
    if memory is not None:
        raise memory(
            f"the pipeline's {where} on a micro-batch, and ran out of memory; every pp rank stops here: "
            + message
        )
    if loss:
        raise ShardingError(
            f"the pipeline's {where} on a micro-batch, and it failed; every pp rank stops here: {message}"
        ) from own
    modules = stages[stage]
    raise ShardingError(
        f"the pipeline's {where} on a micro-batch, and it failed; every pp rank stops here: {message}. "
        f"Fix: the forward of its modules ({modules[0]} … {modules[-1]}) on the hidden states the stage "
        "before hands on, or the batch"
    ) from own
