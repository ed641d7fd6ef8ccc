"""Gradients held out of the way while torch runs something that must not see them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["gradients_set_aside"]


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
