"""torch's ring attention's own elementwise passes: `ring_merge_bytes` against torch's code.

torch's ``_templated_ring_attention`` and its backward run on a fake process group as cp
rank ``rank`` of ``cp``, with the attention kernels stood in for by functions that only
make their outputs: a dispatch mode adds up the bytes every other op reads and writes
(views and collectives move none here). That is exactly what `ring_merge_bytes` counts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import functional_shard as fs
from functional_shard.costing.time.context_engines import ring_merge_seconds
from functional_shard.costing.time.hardware import hardware
from functional_shard.costing.time.ring_merges import ring_merge_bytes
from functional_shard.zoo import llama

_MOVE_NOTHING = {"view", "_unsafe_view", "slice", "split", "unsqueeze", "squeeze", "detach", "alias", "t"}


class _Traffic(TorchDispatchMode):
    """Bytes each op dispatched outside the stand-in kernels reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if self.in_kernel or name in _MOVE_NOTHING or func.namespace == "_c10d_functional":
            return out
        reads = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        writes = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name == "zeros_like":
            reads = []  # only the shape is read
        if name == "log_sigmoid_forward":
            writes = writes[:1]  # CUDA's kernel makes no buffer (the CPU's does: not the ring's device)
        self.total += sum(t.numel() * t.element_size() for t in reads + writes)
        return out


def _torch_ring_bytes(cp: int, rank: int, load_balance: bool, shape: tuple[int, ...]) -> tuple[int, int]:
    from torch.distributed.tensor.experimental._context_parallel import _attention

    traffic = _Traffic()

    def forward_kernel(query, key, value, is_causal, **kwargs):
        traffic.in_kernel = True
        made = torch.empty_like(query), torch.empty(query.shape[:3], dtype=torch.float32)
        traffic.in_kernel = False
        return made

    def backward_kernel(query, key, value, out, logsumexp, is_causal, **kwargs):
        traffic.in_kernel = True
        made = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        traffic.in_kernel = False
        return made

    options = _attention._cp_options
    before = options.enable_load_balance
    options.enable_load_balance = load_balance
    try:
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16) for _ in range(3))
        group = dist.group.WORLD
        with traffic:
            out, lse = _attention._templated_ring_attention(group, 2, forward_kernel, q, k, v, is_causal=True)
        forward, traffic.total = traffic.total, 0
        grad = torch.randn_like(out)
        with traffic:
            _attention._templated_ring_attention_backward(
                group, 2, backward_kernel, grad, "grad_out", q, k, v, out, lse, is_causal=True
            )
        return forward, traffic.total
    finally:
        options.enable_load_balance = before


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, max_examples=25)
@given(
    cp=st.integers(2, 8),
    data=st.data(),
    load_balance=st.booleans(),
    batch=st.integers(1, 2),
    heads=st.integers(2, 3),  # with one row a chunk of the logsumexp is contiguous already
    chunk=st.integers(1, 3),
    head_dim=st.sampled_from([2, 8, 16]),
)
def test_the_ring_moves_the_bytes_counted(fake_world, cp, data, load_balance, batch, heads, chunk, head_dim):
    rank = data.draw(st.integers(0, cp - 1), label="rank")
    seq = 2 * chunk if load_balance else chunk  # this rank's tokens: two chunks under load balancing
    fake_world(cp, rank)
    shape = (batch, heads, seq, head_dim)
    counted = ring_merge_bytes(
        cp,
        rank,
        load_balance=load_balance,
        queries=batch * heads * seq * head_dim,
        rows=batch * heads * seq,
    )
    assert counted == _torch_ring_bytes(cp, rank, load_balance, shape)


def test_the_busiest_rank_sets_the_seconds_and_compile_speeds_them():
    plan = fs.shard(
        llama("tiny"), fs.Mesh(cp=4), fs.replicate() + fs.cp("cp", engine="ring") + fs.mixed_precision()
    )
    h100 = hardware("h100")
    seq, queries = 2048, 4 * 512 * 16  # 4 heads of 16 on a rank's 512 tokens: one layer
    flops = 3 * 4 * queries * seq  # forward and backward (twice it), no recompute
    worst = max(
        f + b for f, b in (ring_merge_bytes(4, r, load_balance=True, queries=queries) for r in range(4))
    )
    rate = h100.memory_bandwidth * h100.memory_efficiency
    assert ring_merge_seconds(plan, flops, seq, h100) == pytest.approx(worst / rate)
    assert ring_merge_seconds(plan, flops, seq, h100, speedup=2.0) == pytest.approx(worst / rate / 2)
    gather = fs.shard(llama("tiny"), fs.Mesh(cp=4), fs.replicate() + fs.cp("cp", engine="all_gather"))
    assert ring_merge_seconds(gather, flops, seq, h100) == 0.0


def test_the_estimate_adds_them_to_the_step_whether_or_not_communication_overlaps():
    import dataclasses

    model = llama("tiny")
    plan = fs.shard(model, fs.Mesh(cp=4), fs.fsdp("cp") + fs.cp("cp", engine="ring") + fs.mixed_precision())
    for profile in (hardware("h100"), dataclasses.replace(hardware("h100"), overlap_communication=False)):
        found = fs.estimate(model, plan, batch=1, seq=256, hardware=profile)
        merges = found.exposed_seconds["context parallel ring merges"]
        assert merges > 0
        assert found.step_seconds == pytest.approx(
            found.compute_seconds + sum(found.exposed_seconds.values())
        )
