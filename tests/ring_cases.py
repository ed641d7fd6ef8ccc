"""torch's ring attention run on CPU ranks (test stand-ins; importable, so spawn can send them).

torch's context parallel reaches its ring only through the CUDA SDPA kernels, but the ring
itself, ``_templated_ring_attention`` and its backward (torch 2.13,
``torch/distributed/tensor/experimental/_context_parallel/_attention.py``), takes the attention
op as an argument: given the CPU flash kernels they run on gloo ranks, or on the fake process
group in one process. `ring_forward`/`ring_backward` call them directly; `model_step` runs a
model through the runtime's own ring engine, with CPU's kernel standing in for CUDA's in
torch's dispatcher (`tests.ring_standin`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel._attention import (
    _templated_ring_attention,
    _templated_ring_attention_backward,
)

import functional_shard as fs
from functional_shard.core.sequence import token_positions

from . import cp_cases
from .ring_standin import BACKWARD, FORWARD

SEQ_DIM = 2
RING_KINDS = ("all_gather", "all_to_all")


def ring_forward(group: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Any:
    """torch's ring forward over ``group`` with the CPU flash kernel: (output, logsumexp)."""
    return _templated_ring_attention(group, SEQ_DIM, FORWARD, query, key, value, is_causal=True, scale=None)


def ring_backward(group: Any, grad: torch.Tensor, *saved: torch.Tensor) -> Any:
    """torch's ring backward: the gradients of (query, keys, values) from SDPA's saved tensors."""
    query, key, value, out, logsumexp = saved
    return _templated_ring_attention_backward(
        group,
        SEQ_DIM,
        BACKWARD,
        grad,
        "grad_out",
        query,
        key,
        value,
        out,
        logsumexp,
        is_causal=True,
        dropout_p=0.0,
        scale=None,
    )


def attention_call(shape: tuple[int, int, int, int], dtype_name: str) -> dict[str, Any]:
    """One causal attention over ``shape`` (batch, heads, seq, dim) by torch's ring on this rank's
    load-balanced chunks: bytes sent forward and backward, and the errors against one SDPA."""
    dtype = getattr(torch, dtype_name)
    n, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(shape, generator=generator).to(dtype) for _ in range(4))
    mine = torch.tensor(token_positions(shape[2], n, rank, load_balance=True))
    local = [t[:, :, mine].contiguous() for t in (q, k, v, grad)]
    mesh = fs.Mesh(cp=n)
    forward, backward = fs.measure.CollectiveLog(mesh), fs.measure.CollectiveLog(mesh)
    with forward:
        out, logsumexp = ring_forward(dist.group.WORLD, *local[:3])
    with backward:
        grads = ring_backward(dist.group.WORLD, local[3], *local[:3], out, logsumexp)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    expected.backward(grad.float())
    return {
        "forward": forward.sent,
        "backward": backward.sent,
        "errors": [
            (got.float() - want[:, :, mine]).abs().max().item()
            for got, want in zip((out, *grads), (expected, *(leaf.grad for leaf in leaves)), strict=True)
        ],
        "dtypes": [str(t.dtype) for t in (out, logsumexp, *grads)],
    }


def model_step(kind: str, mesh: dict[str, int], policy: str, seq: int) -> dict[str, Any]:
    """A forward and backward of the model on this rank's chunks through the runtime's ring
    engine (torch's dispatcher with CPU's kernel standing in, `tests.ring_standin`): the ring's
    bytes on cp and what the forward keeps, measured, beside plan.cost and the trace."""
    from .ring_standin import cpu_ring_kernels

    model, plan = cp_cases.planned(kind, mesh, policy, applied=False)
    trace = fs.trace_activations(model, plan, batch=cp_cases.BATCH, seq=seq, rank=dist.get_rank())
    tokens = torch.randint(0, 128, (cp_cases.BATCH, seq), generator=torch.Generator().manual_seed(0))
    mine = fs.context_chunks(plan, tokens)[0]
    log = fs.measure.CollectiveLog(plan.mesh)
    with cpu_ring_kernels():
        fs.apply(plan, model)
        # two steps first: DDP makes its buckets in the first and rebuilds them in the second
        # forward, which the measured forward would otherwise count as kept
        for _ in range(2):
            with fs.sequence_context(plan, model, seq):
                cp_cases.logits_of(model(mine)).sum().backward()
        with fs.sequence_context(plan, model, seq), log:
            kept, output = fs.kept_activation_bytes(model, mine)
            cp_cases.logits_of(output).sum().backward()
    predicted = plan.cost(tokens=tokens.numel(), context_engine="ring").comm_bytes
    # the ring's kinds on cp (the data-parallel layer's collectives are other kinds or axes)
    return {
        "measured": {kind: log.sent.get(kind, {}).get("cp", 0.0) for kind in RING_KINDS},
        "predicted": {kind: predicted.get(kind, {}).get("cp", 0.0) for kind in RING_KINDS},
        "kept": kept,
        "traced": trace.activation_bytes,
    }
