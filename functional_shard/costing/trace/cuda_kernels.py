"""The kernels torch picks on CUDA, re-enacted in a trace that runs on fake CPU tensors.

Where torch picks a kernel by device, a trace on fake CPU tensors gets the CPU's. ``F.rms_norm``
differs in what it keeps: CUDA's fused kernel its input and a float32 inverse RMS a row, the CPU's
composite two float32 copies of the input (docs/torch-versions.md). `cuda_kernels` swaps in a function
keeping what the fused kernel keeps (a swap, not a function mode: checkpoint recomputes with none).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from .counting import fused_kernel

__all__ = ["cuda_kernels", "fused_rms_norm"]


class _FusedRMSNorm(torch.autograd.Function):
    """What CUDA's ``aten._fused_rms_norm`` keeps (input, weight, float32 inverse RMS a row).

    The values are the composite's; the backward recomputes it to give the same gradients.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, shape: tuple[int, ...], eps: float | None
    ) -> torch.Tensor:
        dims = tuple(range(-len(shape), 0))
        floor = torch.finfo(torch.float32).eps if eps is None else eps  # the composite's default
        rows = x.numel() // max(1, math.prod(shape))
        # the kernel reads its input and weight, writes its output and a float32 inverse RMS a row
        with fused_kernel(2 * _nbytes(x) + _nbytes(weight) + 4 * rows):
            inverse_rms = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + floor)
            ctx.shape, ctx.eps = shape, eps
            ctx.save_for_backward(x, weight, inverse_rms)
            return _COMPOSITE(x, list(shape), weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, inverse_rms = ctx.saved_tensors
        # reads the gradient, the input, the inverse RMS and the weight, writes both gradients
        moved = 3 * _nbytes(x) + _nbytes(inverse_rms) + 2 * _nbytes(weight)
        with fused_kernel(moved), torch.enable_grad():
            leaves = [x.detach().requires_grad_()]
            if weight is not None:
                leaves.append(weight.detach().requires_grad_())
            out = _COMPOSITE(leaves[0], list(ctx.shape), leaves[1] if weight is not None else None, ctx.eps)
            grads = torch.autograd.grad(out, leaves, grad)
        return grads[0], grads[1] if weight is not None else None, None, None


_COMPOSITE = F.rms_norm


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def fused_rms_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """``F.rms_norm`` keeping what CUDA's fused kernel keeps: its input and the inverse RMS.

    Examples:
        >>> x = torch.randn(2, 3, 8, requires_grad=True)
        >>> torch.allclose(fused_rms_norm(x, (8,)), F.rms_norm(x, (8,)))
        True
    """
    out: torch.Tensor = _FusedRMSNorm.apply(input, weight, tuple(normalized_shape), eps)
    return out


@contextlib.contextmanager
def cuda_kernels(cuda: bool) -> Iterator[None]:
    """Within the block, ``F.rms_norm`` runs as on CUDA (``cuda``), or is left as it is.

    Torch builds without ``aten._fused_rms_norm`` run the composite on CUDA too: left as they are.
    """
    if not cuda or not hasattr(torch.ops.aten, "_fused_rms_norm"):
        yield
        return
    before = F.rms_norm
    F.rms_norm = fused_rms_norm  # type: ignore[assignment]
    try:
        yield
    finally:
        F.rms_norm = before
