"""Activation checkpointing as a trace runs it: torch's own checkpoint, op-level selective or whole.

`context_of` is the ``context_fn`` `functional_shard.apply` and the trace both give torch's checkpoint
for a policy (`keeps` says which outputs it keeps); `checkpointed` wraps the plan's checkpointed modules
for a trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = [
    "SAVED_OPS",
    "CallKeeps",
    "RecomputeCounter",
    "checkpointed",
    "context_of",
    "keeps",
    "one_unkept_kernel",
    "selective_context",
]

_aten = torch.ops.aten
# Selective checkpointing keeps matmul and attention outputs and recomputes the rest (torchtitan's
# `_save_list`, but every mm kept, as Korthikanti et al. 2022). Collectives are recomputed, unlike
# torchtitan, so that the trace, which re-enacts them on plain tensors, counts exactly what is kept.
SAVED_OPS = frozenset(
    op
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if (op := getattr(getattr(_aten, name, None), "default", None)) is not None
)


class RecomputeCounter(Protocol):
    """What `checkpointed` reads and moves on the flop counter (`counting.Flops` is one).

    Said here, not imported: `counting` counts what `keeps` keeps, so it sits above this module.
    """

    backward: bool  # the backward is running (checkpoint's recompute runs inside it)
    checkpointed: int  # how deep inside checkpointed forwards the forward is
    call: CallKeeps  # what the running checkpointed call keeps
    inside: dict[str, int]  # forward flops inside them: "all", and "saved" (what the policy `keeps`)
    rerun: int  # of those, the flops up to each call's last saved tensor (what recompute runs)
    memory_inside: int  # bytes memory-bound ops move inside them
    memory_rerun: int  # of those, the bytes up to each call's last saved tensor
    # per checkpointed call, the storages autograd asked it to save, with their bytes
    packed: list[dict[Any, int]]

    def note_packed(self, call: dict[Any, int], tensor: torch.Tensor) -> None:
        """Record in ``call`` (one of ``packed``) the storage of ``tensor``, which it saves."""


_MM = _aten.mm.default

# how deep inside a trace's stand-in for one kernel that no policy keeps the running ops are
_unkept_kernel: contextvars.ContextVar[int] = contextvars.ContextVar("_unkept_kernel", default=0)


@contextlib.contextmanager
def one_unkept_kernel() -> Iterator[None]:
    """Within the block, ops are a trace's stand-in for one kernel outside `SAVED_OPS`: none is kept.

    The stand-in runs the kernel as ops of its own (``torch._grouped_mm`` as one ``mm`` per expert):
    a policy asked about them keeps none, as it keeps none of the kernel's output, and counts none
    of them among its ``mm`` ops.

    Examples:
        >>> call, mm = CallKeeps("selective"), torch.ops.aten.mm.default
        >>> with one_unkept_kernel():
        ...     inside = call.keeps(mm)
        >>> inside, call.keeps(mm), call.matmuls
        (False, True, 1)
    """
    token = _unkept_kernel.set(_unkept_kernel.get() + 1)
    try:
        yield
    finally:
        _unkept_kernel.reset(token)


def keeps(policy: str, func: Any, matmuls: int) -> bool:
    """Whether ``policy`` keeps the output of ``func``, the ``matmuls``-th ``mm`` of its call if it is one.

    ``"selective"`` keeps `SAVED_OPS`' outputs; ``"torchtitan"`` too, but recomputes every second
    ``mm`` of each checkpointed call (torchtitan's per-op selective checkpointing); ``"full"`` none.

    Examples:
        >>> mm = torch.ops.aten.mm.default
        >>> [keeps("torchtitan", mm, n) for n in (1, 2, 3)], keeps("selective", mm, 2), keeps("full", mm, 1)
        ([True, False, True], True, False)
    """
    if policy == "full" or func not in SAVED_OPS:
        return False
    return not (policy == "torchtitan" and func is _MM and matmuls % 2 == 0)


class CallKeeps:
    """`keeps` for one checkpointed call's ops, in their order: it counts the call's ``mm`` ops itself.

    torch's checkpoint asks it in the call's forward and again in its recompute (one each); the trace
    asks it in the forward.

    Examples:
        >>> call, mm = CallKeeps("torchtitan"), torch.ops.aten.mm.default
        >>> [call.keeps(mm) for _ in range(3)]
        [True, False, True]
    """

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.matmuls = 0

    def keeps(self, func: Any) -> bool:
        """Whether the policy keeps ``func``'s output, the call's next op."""
        if _unkept_kernel.get():
            return False
        self.matmuls += func is _MM
        return keeps(self.policy, func, self.matmuls)


def _policy_of(policy: str) -> Any:
    calls = {"forward": CallKeeps(policy), "recompute": CallKeeps(policy)}

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        kept = calls["recompute" if ctx.is_recompute else "forward"].keeps(func)
        return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def selective_context() -> tuple[Any, Any]:
    """Torch's selective-checkpoint contexts for ``policy="selective"`` (a ``context_fn``).

    Examples:
        >>> layer = nn.Linear(4, 4)
        >>> x = torch.ones(2, 4, requires_grad=True)
        >>> from torch.utils.checkpoint import checkpoint
        >>> out = checkpoint(layer, x, use_reentrant=False, context_fn=selective_context)
        >>> out.sum().backward()
        >>> x.grad.shape
        torch.Size([2, 4])
    """
    return create_selective_checkpoint_contexts(_policy_of("selective"))


def _torchtitan_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_policy_of("torchtitan"))


def context_of(policy: str) -> Callable[[], tuple[Any, Any]] | None:
    """The ``context_fn`` torch's checkpoint takes for ``policy``; None for ``"full"``.

    Examples:
        >>> context_of("full") is None, context_of("selective") is selective_context
        (True, True)
    """
    return {"selective": selective_context, "torchtitan": _torchtitan_context}.get(policy)


@contextlib.contextmanager
def checkpointed(
    model: nn.Module, paths: tuple[str, ...], policy: str, flops: RecomputeCounter
) -> Iterator[None]:
    """Within the block, the modules at ``paths`` run under torch's checkpoint, as apply runs them."""
    # wrap each module's forward in torch's checkpoint for the trace, and put it back after;
    # ``flops`` learns when a checkpointed forward runs (recompute calls the inner one)
    context = context_of(policy)
    wrapped = []
    try:
        for path in paths:
            module = model.get_submodule(path)
            inner = module.forward

            def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                extra: dict[str, Any] = {"context_fn": context} if context is not None else {}
                flops.checkpointed += 1
                outer, flops.call = flops.call, CallKeeps(policy)  # each call counts its own, as torch's
                run = _inner if flops.backward else functools.partial(_saves_noted, _inner, flops)
                try:
                    return checkpoint(
                        run, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs
                    )
                finally:
                    flops.checkpointed -= 1
                    flops.call = outer

            module.forward = forward  # type: ignore[method-assign]
            wrapped.append(module)
        yield
    finally:
        for module in wrapped:
            del module.forward


def _saves_noted(inner: Any, flops: RecomputeCounter, *args: Any, **kwargs: Any) -> Any:
    # wrap checkpoint's own saved-tensor hooks: each tensor packed notes the flops counted so far
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    start, start_memory = flops.inside["all"], flops.memory_inside
    if hooks is None:  # not under checkpoint's hooks: count all of it, the most it can re-run
        out = inner(*args, **kwargs)
        flops.rerun += flops.inside["all"] - start
        flops.memory_rerun += flops.memory_inside - start_memory
        return out
    pack, unpack = hooks
    last = [start, start_memory]
    packed: dict[Any, int] = {}
    flops.packed.append(packed)

    def noted(tensor: torch.Tensor) -> Any:
        last[:] = [flops.inside["all"], flops.memory_inside]
        flops.note_packed(packed, tensor)
        return pack(tensor)

    with torch.autograd.graph.saved_tensors_hooks(noted, unpack):
        out = inner(*args, **kwargs)
    flops.rerun += last[0] - start
    flops.memory_rerun += last[1] - start_memory
    return out
