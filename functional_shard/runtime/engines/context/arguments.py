"""What `fs.context_chunks` and the context-parallel step refuse before cutting anything. Pure.

Checked at the entry, cheaply, so that a wrong argument is named with its fix instead of
failing deep in torch (an index out of range, a missing process group).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from functional_shard.core.errors import ShardingError
from functional_shard.core.sequence import check_split_share
from functional_shard.core.validate import instance_of, refuse
from functional_shard.planning.plan.plan import Plan

__all__ = ["chunk_rank", "plan_given", "sequence_dim", "share_check"]


def sequence_dim(who: str, tensors: tuple[Any, ...], dim: Any, names: tuple[str, ...] = ()) -> None:
    """Refuse what is not a tensor, or a tensor without ``dim``, before any length is read.

    ``names``: what the caller calls each tensor (the step's ``inputs``, ``targets``; its
    sequence dim is fixed, so no other ``dim=`` is offered); by default ``tensor i``.

    Examples:
        >>> sequence_dim("fs.context_chunks", (torch.arange(8)[None],), 1)  # (batch, seq): fine
        >>> sequence_dim("fs.context_chunks", (torch.arange(8),), 1)
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: fs.context_chunks: tensor 0 has shape (8,), no dim 1: ..., or dim=0
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        refuse("dim", repr(dim), "an int", meaning="the sequence dim")
    named = [(names[i] if i < len(names) else f"tensor {i}", tensor) for i, tensor in enumerate(tensors)]
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise ShardingError(
                f"{who}: expected a torch.Tensor for {name}, got {type(tensor).__name__}; "
                "pass tensors (torch.as_tensor(...))"
            )
    ranks = {tensor.dim() for tensor in tensors}
    for name, tensor in named:
        if not -tensor.dim() <= dim < tensor.dim():
            # another dim only helps where every tensor has the sequence on it
            other = f", or dim={tensor.dim() - 1}" if tensor.dim() and not names and len(ranks) == 1 else ""
            raise ShardingError(
                f"{who}: {name} has shape {tuple(tensor.shape)}, no dim {dim}: pass (batch, seq) tensors "
                f"(x[None] for one sequence){other}"
            )


def chunk_rank(plan: Plan, rank: Any, own: int | None) -> int:
    """``rank`` checked, or ``own`` (this process's global rank; ``None``: no process group).

    Examples:
        >>> plan = fs.shard(torch.nn.Linear(2, 2), fs.Mesh(cp=2), fs.replicate() + fs.cp("cp"))
        >>> chunk_rank(plan, 1, None), chunk_rank(plan, None, 0)
        (1, 0)
    """
    if rank is None:
        if own is None:
            fix = "pass rank=, or call dist.init_process_group(...) first"
            refuse("rank", "None", "the rank whose chunks to cut, outside a process group", meaning=fix)
        return own
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.mesh.size:
        meaning = f"a global rank of the plan's {plan.mesh!r}"
        refuse("rank", repr(rank), f"an int in [0, {plan.mesh.size})", meaning=meaning)
    return rank


def plan_given(plan: Any) -> Plan:
    """``plan``, if it is one: not a policy, a mesh or a model."""
    return instance_of(plan, Plan, "plan", meaning="fs.shard(model, mesh, policy) makes one")


def share_check(plan: Plan) -> Callable[[int], None] | None:
    """Under cp and sequence parallel, the check of a whole length's share on each cp rank.

    The model's own check (`tensor_parallel.refuse_uneven_sequences`) sees a rank's share
    only, so its message would name a length the caller never passed.
    """
    context, tp = plan.config.context, plan.config.tp
    if context is None or tp is None or not (tp.sequence_parallel and tp.axes):
        return None
    return functools.partial(
        check_split_share,
        cp=context.size(plan.mesh),
        tp=plan.mesh[tp.axes[0]],
        load_balance=context.load_balance,
        axis=tp.axes[0],
        who="fs.forward_backward",
    )
