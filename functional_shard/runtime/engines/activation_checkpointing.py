"""Activation checkpointing on the plan's modules (torch's composable ``checkpoint``)."""

from __future__ import annotations

from torch import nn

from functional_shard.planning.plan import Plan


def apply_checkpointing(plan: Plan, module: nn.Module) -> None:
    """Wrap the plan's checkpointed modules in torch's composable ``checkpoint``."""
    # the composable checkpoint works through hooks: parameter paths stay as they are
    from torch.distributed._composable import checkpoint

    from functional_shard.costing.trace_checkpointing import selective_context

    selective = plan.config.checkpoint_policy == "selective"
    for path in plan.config.checkpointed:
        if selective:
            checkpoint(module.get_submodule(path), context_fn=selective_context)
        else:
            checkpoint(module.get_submodule(path))
