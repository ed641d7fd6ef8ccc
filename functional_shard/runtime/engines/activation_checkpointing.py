"""Activation checkpointing on the plan's modules: their forward runs under torch's checkpoint.

Only the module's own forward is checkpointed, not its call, so the hooks other engines put
on the module (FSDP2's unshard and input casts, tensor-parallel redistributions) run outside
the recompute. Torch's composable ``checkpoint`` re-enters the whole call, and FSDP2's input
cast under mixed precision then breaks selective checkpointing ("encountered during backward
but not found in storage"). Parameter paths stay as they are; the cost model traces the same
wrapping (`functional_shard.costing.trace.checkpointing.checkpointed`).
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from functional_shard.planning.plan.plan import Plan

__all__ = ["apply_checkpointing", "is_checkpointed"]


def _checkpointed_forward(
    context_fn: Callable[[], tuple[Any, Any]] | None,
    inner: Callable[..., Any] | None,
    module: nn.Module,
    *args: Any,
    **kwargs: Any,
) -> Any:
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    # the class's forward is looked up on each call, so a deep copy of the module runs its own
    forward = inner if inner is not None else type(module).forward.__get__(module)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn or noop_context_fn, **kwargs)


def _without_kv_cache(module: nn.Module) -> None:
    """Turn off a Hugging Face model's key/value cache, which checkpointing cannot train with.

    Its forward fills a cache in training too unless told ``use_cache=False``; a checkpointed
    layer's recompute then sees the keys twice (selective checkpointing fails, "not found in
    storage"). Hugging Face's own gradient checkpointing turns it off the same way.
    """
    config: Any = getattr(module, "config", None)
    if getattr(config, "use_cache", False):
        # logged, as Hugging Face's own gradient checkpointing says it
        logging.getLogger(__name__).warning(
            "%s.config.use_cache set to False: a key/value cache filled by the forward cannot be "
            "trained through activation checkpointing (set it back for generation)",
            type(module).__name__,
        )
        config.use_cache = False


def apply_checkpointing(plan: Plan, module: nn.Module) -> None:
    """Run the forward of each of the plan's checkpointed modules under torch's checkpoint."""
    from functional_shard.costing.trace.checkpointing import context_of

    if plan.config.checkpointed:
        _without_kv_cache(module)
    context = context_of(plan.config.checkpoint_policy)
    for path in plan.config.checkpointed:
        target = module.get_submodule(path)
        inner = vars(target).get("forward")  # another engine's forward on this instance, if any
        run = functools.partial(_checkpointed_forward, context, inner)
        target.forward = types.MethodType(run, target)  # type: ignore[method-assign]


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `apply_checkpointing` made ``module``'s forward run under torch's checkpoint."""
    forward = vars(module).get("forward")
    run = getattr(forward, "__func__", None)
    return isinstance(run, functools.partial) and run.func is _checkpointed_forward
