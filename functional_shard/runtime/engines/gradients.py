"""Gradients set aside while torch runs something that must not see them, and gradient hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["gradients_set_aside", "hook_accumulated_grad"]


def hook_accumulated_grad(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """``param.register_post_accumulate_grad_hook(hook)``, for a frozen parameter too.

    torch refuses the hook on a tensor that does not require grad, yet a parameter frozen now
    (a LoRA base weight) may be unfrozen later, and its gradient must then be handled as any
    other's; so the hook is registered with ``requires_grad`` set for the moment. An integer or
    bool parameter never has a gradient: it gets no hook.

    Examples:
        >>> frozen = nn.Parameter(torch.ones(2), requires_grad=False)
        >>> seen = []
        >>> hook_accumulated_grad(frozen, seen.append)
        >>> (frozen.requires_grad, seen)
        (False, [])
        >>> (frozen.requires_grad_() * 2).sum().backward()
        >>> len(seen)
        1
    """
    if not (param.dtype.is_floating_point or param.dtype.is_complex):
        return
    frozen = not param.requires_grad
    param.requires_grad_(True)
    try:
        param.register_post_accumulate_grad_hook(hook)
    finally:
        param.requires_grad_(not frozen)


@contextmanager
def gradients_set_aside(parameters: Iterable[nn.Parameter]) -> Iterator[None]:
    """Run with ``parameters``' gradients at None; then each held gradient is back, plus any made meanwhile.

    Examples:
        >>> import torch
        >>> weight = nn.Parameter(torch.ones(2))
        >>> weight.grad = torch.ones(2)
        >>> with gradients_set_aside([weight]):
        ...     seen = weight.grad
        ...     weight.grad = torch.full((2,), 2.0)
        >>> seen, weight.grad
        (None, tensor([3., 3.]))
    """
    held = [(parameter, parameter.grad) for parameter in parameters]
    for parameter, _ in held:
        parameter.grad = None
    try:
        yield
    finally:
        for parameter, before in held:
            if before is not None:
                if parameter.grad is not None:
                    before.add_(parameter.grad)
                parameter.grad = before
