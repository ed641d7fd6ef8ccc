"""torch's ring attention run on CPU ranks (test stand-ins; importable, so spawn can send them).

torch's context parallel reaches its ring only through the CUDA SDPA kernels, but the ring
itself, ``_templated_ring_attention`` and its backward (torch 2.13,
``torch/distributed/tensor/experimental/_context_parallel/_attention.py``), takes the attention
op as an argument: given the CPU flash kernels they run on gloo ranks, or on the fake process
group in one process. `CpuRing` is SDPA as torch's CP dispatcher runs it on CUDA (the
forward and backward kernels swapped for the ring functions, with SDPA's own saved tensors:
query, keys, values, output, logsumexp); `ring_route` reaches it from a model's
``F.scaled_dot_product_attention`` calls, key/value heads repeated to the query heads first,
as the runtime's ring does for grouped-query attention.
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
from functional_shard.costing.trace_context_parallel import routing_attention
from functional_shard.runtime.engines.activation_checkpointing import apply_checkpointing

from . import cp_cases

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
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


class CpuRing(torch.autograd.Function):
    """Causal SDPA over the cp group's whole sequence by torch's ring, saving what SDPA saves."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> torch.Tensor:
        query, key, value, group = args
        out, logsumexp = ring_forward(group, query, key, value)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return (*ring_backward(ctx.group, grads[0], *ctx.saved_tensors), None)


def ring_route(group: Any) -> Any:
    """A `routing_attention` route sending causal SDPA calls to `CpuRing` over ``group``."""

    def attend(query: Any, key: Any, value: Any, attn_mask: Any = None, **options: Any) -> torch.Tensor:
        heads = query.shape[-3]
        if key.shape[-3] != heads:  # the runtime's ring repeats grouped key/value heads (torchtitan)
            key = key.repeat_interleave(heads // key.shape[-3], dim=-3)
            value = value.repeat_interleave(heads // value.shape[-3], dim=-3)
        return CpuRing.apply(query, key, value, group)

    return attend


def cp_group(mesh: fs.Mesh, axis: str = "cp") -> Any:
    """This rank's group along ``axis`` (every rank makes every group, in one order)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        groups.setdefault(tuple(c for a, c in coords.items() if a != axis), []).append(rank)
    mine = None
    for ranks in groups.values():
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


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
    """A forward and backward of the model on this rank's chunks, attention by torch's ring:
    the ring's bytes on cp and what the forward keeps, measured, beside plan.cost and the trace."""
    model, plan = cp_cases.planned(kind, mesh, policy, applied=False)
    trace = fs.trace_activations(model, plan, batch=cp_cases.BATCH, seq=seq, rank=dist.get_rank())
    # the plan's checkpointing as apply runs it; no data-parallel engine: its gradient
    # all-reduce is no ring collective, and DDP's lazy buckets are born in the first forward
    apply_checkpointing(plan, model)
    group = cp_group(plan.mesh)
    tokens = torch.randint(0, 128, (cp_cases.BATCH, seq), generator=torch.Generator().manual_seed(0))
    mine = fs.context_chunks(plan, tokens)[0]
    log = fs.measure.CollectiveLog(plan.mesh)
    with routing_attention(ring_route(group)), log:
        kept, output = fs.kept_activation_bytes(model, mine)
        cp_cases.logits_of(output).sum().backward()
    predicted = plan.cost(tokens=tokens.numel()).comm_bytes
    # the ring's kinds on cp (the data-parallel layer's gradient all-reduce is another kind)
    return {
        "measured": {kind: log.sent.get(kind, {}).get("cp", 0.0) for kind in RING_KINDS},
        "predicted": {kind: predicted.get(kind, {}).get("cp", 0.0) for kind in RING_KINDS},
        "kept": kept,
        "traced": trace.activation_bytes,
    }
