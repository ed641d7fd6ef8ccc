"""`fs.forward_backward`'s step under context parallel: each rank runs its share of the batch. Effects.

Whole sequences are cut into the plan's chunks (`SequenceShard.of`), packed rows by attention
work (`SequenceShard.packed`); attention runs split (`splitting_attention`) and the ranks' losses
are averaged over the cp group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from functional_shard.core.document_masks import check_packed_inputs, rank_share
from functional_shard.core.packing import IGNORE_INDEX, counted_share
from functional_shard.planning.plan.plan import Plan

from .arguments import sequence_dim, share_check
from .parallel import SequenceShard, check_attention_split, cut_tensors, splitting_attention

__all__ = ["Run", "context_parallel_step"]

Run = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor], float, torch.Tensor], torch.Tensor
]
"""``run(inputs, targets, positions, packed, weight, counted)``: forward and backward on this rank's share.

``positions``: the share's global positions; ``packed``: its share of the packed keywords given to
the step (``positions``, ``document_ids``; empty for whole sequences); ``weight``: what to scale the
loss by before the backward; ``counted``: the step's count of counted targets over every rank's
share (a tensor, read from no device), for a ``run`` that weighs parts of its share itself."""


def context_parallel_step(
    plan: Plan,
    device_mesh: DeviceMesh,
    run: Run,
    *,
    stages: dist.ProcessGroup | None = None,
    weighs: bool = True,
) -> Callable[..., torch.Tensor]:
    """`fs.forward_backward`'s step under context parallel: ``run`` on this rank's chunks.

    ``step(inputs, targets, **packed)`` returns the mean loss over the cp group; ``packed``: the packed
    rows' keywords that were given (``positions``, ``document_ids``), as `fs.forward_backward`'s step
    hands them on. Packed rows (``document_ids``, `functional_shard.core.packing`) are cut by attention
    work (`SequenceShard.packed`). Each rank's loss, a mean over the targets it counts (not
    `IGNORE_INDEX`), is weighted by its share of them, packed or not (whole sequences only with
    ``weighs``; without, ``run`` weighs its parts by ``counted`` itself, as a pipeline its
    micro-batches). This rank's forward must reach attention; under a pipeline, whose ``stages``
    group (the pp group) runs the model a stage each, one of theirs must (a stage may hold none).
    """
    context = plan.config.context
    assert context is not None
    mesh = device_mesh[context.axis]
    group = mesh.get_group()
    split_share = share_check(plan)
    stages_split = False  # under a pipeline: a step has seen its stages' attention split

    def step(inputs: torch.Tensor, targets: torch.Tensor, **packed: torch.Tensor) -> torch.Tensor:
        sequence_dim(
            "fs.forward_backward under context parallel", (inputs, targets), 1, ("inputs", "targets")
        )
        if packed:
            return packed_step(inputs, targets, packed)
        shard = SequenceShard.of(
            mesh,
            inputs.shape[1],
            load_balance=context.load_balance,
            device=inputs.device,
            engine=context.engine,
            name="inputs.shape[1]",
        )
        if split_share is not None:
            split_share(inputs.shape[1])
        mine = cut_tensors(shard, inputs, targets)
        # each rank's loss is the mean over its counted targets; ignored ones (IGNORE_INDEX: a
        # masked prompt, padding) fall unevenly on the chunks, so each is weighted by its share
        # of them, as packed rows are (1.0 when every target counts)
        weight = counted_share(mine[1], targets, shard.size) if weighs else 1.0
        return run_share(shard, mine[0], mine[1], {}, weight, targets)

    def packed_step(
        inputs: torch.Tensor, targets: torch.Tensor, packed: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        positions, document_ids = packed.get("positions"), packed.get("document_ids")
        who = "fs.forward_backward under context parallel"
        check_packed_inputs(inputs, positions=positions, document_ids=document_ids, who=who)
        # positions alone that never restart: one document a row
        shard = SequenceShard.packed(mesh, torch.zeros_like(inputs) if document_ids is None else document_ids)
        if split_share is not None:
            split_share(inputs.shape[1])
        mine = cut_tensors(shard, inputs, targets, *packed.values())
        # the loss is a mean over counted targets, which the ranks hold unevenly: weighted by
        # each rank's share of them, the ranks' mean is the rows'
        weight = counted_share(mine[1], targets, shard.size)
        with rank_share():
            return run_share(
                shard, mine[0], mine[1], dict(zip(packed, mine[2:], strict=True)), weight, targets
            )

    def run_share(
        shard: SequenceShard,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        packed: dict[str, torch.Tensor],
        weight: float,
        whole_targets: torch.Tensor,
    ) -> torch.Tensor:
        nonlocal stages_split
        counted = (whole_targets != IGNORE_INDEX).sum()
        with splitting_attention(shard) as split:
            loss = run(inputs, targets, shard.positions, packed, weight, counted)
        if stages is None:
            check_attention_split(split, context.axis)
        elif not stages_split:
            # the stages' calls summed over the pp group on the first step only: a forward that
            # reaches attention once reaches it every step, and the sum costs a read of the device
            total = torch.tensor(split[0], device=loss.device)
            dist.all_reduce(total, group=stages)
            check_attention_split([int(total)], context.axis)
            stages_split = True
        # a share of padding alone counts no target: its loss, a mean over none, is nan (its
        # gradient, scaled by the weight 0, is zero); it adds nothing to the rows' mean
        mean = loss.detach().clone() * weight if weight else torch.zeros_like(loss.detach())
        dist.all_reduce(mean, group=group)
        return mean / shard.size

    return step
