"""A CPU stand-in for torch's CUDA ring kernels, so that the ring engine's wiring runs on gloo.

torch's context parallel maps only CUDA's SDPA kernels to its ring (its CP dispatcher has
handlers for flash, memory-efficient and cuDNN attention). The ring itself
(``_templated_ring_attention`` and its backward) takes the kernel as an argument and its
collectives are plain c10d ones, so this adds CPU's flash kernel to the dispatcher's table
while it is on: our engine (`functional_shard.runtime.engines.context.ring`) then runs
unchanged on CPU: q, k, v wrapped as ``Shard(2)`` DTensors, torch's dispatcher on through
the backward, its load-balance flag, our chunk layout. What it cannot show is the CUDA
kernels themselves: the GPU test does (skipped without one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._context_parallel import _attention

from functional_shard.runtime.engines.context import ring

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _wrap(tensor: torch.Tensor, like: DTensor) -> DTensor:
    return DTensor.from_local(tensor, like.device_mesh, [Shard(2)], run_check=False)


def _forward(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    query, key, value, *rest = args
    options = dict(zip(("dropout_p", "is_causal"), rest, strict=False)) | kwargs
    out, logsumexp = _attention._templated_ring_attention(
        query.device_mesh.get_group(),
        2,
        FORWARD,
        _local(query),
        _local(key),
        _local(value),
        is_causal=options.pop("is_causal", False),
        **options,
    )
    return _wrap(out, query), _wrap(logsumexp, query)


def _backward(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args
    grads = _attention._templated_ring_attention_backward(
        query.device_mesh.get_group(),
        2,
        BACKWARD,
        grad_out=_local(grad_out),
        grad_out_name="grad_out",
        query=_local(query),
        key=_local(key),
        value=_local(value),
        out=_local(out),
        logsumexp=_local(logsumexp),
        is_causal=is_causal,
        dropout_p=dropout_p,
        **kwargs,
    )
    return tuple(_wrap(grad, query) for grad in grads[:3])


@contextlib.contextmanager
def cpu_ring_kernels() -> Iterator[None]:
    """Within it, torch's ring runs CPU's flash kernel and the engine allows a ring on CPU."""
    handlers = {FORWARD: _forward, BACKWARD: _backward}
    devices = ring.RING_DEVICES
    _attention.custom_ops.update(handlers)
    ring.RING_DEVICES = devices | {"cpu"}
    try:
        yield
    finally:
        ring.RING_DEVICES = devices
        for op in handlers:
            _attention.custom_ops.pop(op)
