"""fs.estimate's attention under context parallel follows what each engine's kernels run per rank.

Each rank's pairs come from the engines themselves: the all-gather engine's SDPA reads its boolean
mask for every query against every key (`SequenceShard.causal_mask`), and torch's ring runs, chunk
pair by chunk pair, a causal kernel, a full one or none (its ``_is_causal_behavior``), on the halves
of each pair's chunks it needs under load balancing (its ``_templated_ring_attention``, run here).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_ring

import functional_shard as fs
from functional_shard.core.sequence import token_positions
from functional_shard.costing.time.flops import attention_forward, causal_fraction
from functional_shard.zoo import llama

_MODEL = llama("tiny")


def _all_gather_pairs(seq: int, cp: int, rank: int, *, load_balance: bool) -> int:
    """The pairs one rank's masked SDPA scores: its queries against every key, the mask read for each."""
    return len(token_positions(seq, cp, rank, load_balance=load_balance)) * seq


def _ring_pairs(seq: int, cp: int, rank: int, *, load_balance: bool) -> int:
    """The pairs one rank's kernels score under torch's ring (causal attention, one chunk a rank)."""
    assert not load_balance  # balanced, every rank scores the same by construction
    chunk = seq // cp
    pairs = {
        torch_ring._CausalBehavior.IS_CAUSAL: chunk * (chunk + 1) // 2,
        torch_ring._CausalBehavior.NOT_IS_CAUSAL: chunk * chunk,
        torch_ring._CausalBehavior.SKIP: 0,
    }
    options = torch_ring._cp_options
    before, options.enable_load_balance = options.enable_load_balance, load_balance
    try:
        return sum(
            pairs[torch_ring._is_causal_behavior(rank=rank, world_size=cp, i=i, is_causal=True)]
            for i in range(cp)
        )
    finally:
        options.enable_load_balance = before


_PAIRS = {"all_gather": _all_gather_pairs, "ring": _ring_pairs}


@settings(max_examples=8, deadline=None)
@given(
    cp=st.sampled_from([2, 4, 8]),
    per_chunk=st.sampled_from([8, 16, 64]),
    engine=st.sampled_from(["all_gather", "ring"]),
)
def test_an_unbalanced_step_waits_for_the_rank_whose_kernels_run_the_most(cp, per_chunk, engine):
    seq = 2 * cp * per_chunk
    policy = fs.fsdp("cp") + fs.cp("cp", load_balance=False, engine=engine) + fs.mixed_precision()
    found = fs.estimate(_MODEL, fs.shard(_MODEL, fs.Mesh(cp=cp), policy), batch=1, seq=seq, hardware="h100")
    work = [_PAIRS[engine](seq, cp, rank, load_balance=False) for rank in range(cp)]
    # the trace times every rank alike (its attention part), the busiest's excess is exposed
    excess = max(work) * cp / sum(work) - 1
    waited = found.exposed_seconds.get("unbalanced causal attention", 0.0)
    assert waited == pytest.approx(found.compute_parts["attention"] * excess, rel=1e-9, abs=1e-15)


def _torch_ring_kernel_flops(cp: int, rank: int, load_balance: bool, shape: tuple[int, ...]) -> float:
    """The attention flops torch's ring runs on cp rank ``rank``, forward and backward, as kernels run them.

    torch's ``_templated_ring_attention`` and its backward run on a fake process group, their kernels
    stood in for by functions that note each call's query and key lengths and whether it is causal.
    """
    calls: list[tuple[int, int, bool, bool]] = []  # (queries, keys, causal, backward)

    def forward_kernel(query, key, value, is_causal, **kwargs):
        calls.append((query.shape[2], key.shape[2], is_causal, False))
        return torch.empty_like(query), torch.empty(query.shape[:3], dtype=torch.float32)

    def backward_kernel(query, key, value, out, logsumexp, is_causal, **kwargs):
        calls.append((query.shape[2], key.shape[2], is_causal, True))
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)

    options = torch_ring._cp_options
    before, options.enable_load_balance = options.enable_load_balance, load_balance
    try:
        q, k, v = (torch.zeros(shape) for _ in range(3))
        group = dist.group.WORLD
        out, lse = torch_ring._templated_ring_attention(group, 2, forward_kernel, q, k, v, is_causal=True)
        torch_ring._templated_ring_attention_backward(
            group, 2, backward_kernel, torch.zeros_like(out), "grad_out", q, k, v, out, lse, is_causal=True
        )
    finally:
        options.enable_load_balance = before
    batch, heads, _, dim = shape
    total = 0.0
    for queries, keys, causal, backward in calls:
        model = attention_forward(
            (batch, heads, queries, dim), (batch, heads, keys, dim), (batch, heads, keys, dim)
        )
        share = causal_fraction(queries, keys) if causal else 1.0
        total += model * share * (2 * 1.25 if backward else 1.0)  # a fused backward: 2.5 forwards
    return total


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=8, deadline=None)
@given(
    cp=st.sampled_from([2, 4, 8]),
    per_chunk=st.sampled_from([4, 8, 16]),
    load_balance=st.booleans(),
)
def test_the_estimate_counts_the_attention_torchs_ring_runs(fake_world, cp, per_chunk, load_balance):
    seq = 2 * cp * per_chunk
    config = _MODEL.config
    shape = (1, config.num_heads, seq // cp, config.hidden_size // config.num_heads)
    ranks = []
    for rank in range(cp):
        fake_world(cp, rank)
        ranks.append(_torch_ring_kernel_flops(cp, rank, load_balance, shape))
    if load_balance:
        assert max(ranks) == pytest.approx(min(ranks))  # balanced: every rank runs alike
    policy = fs.fsdp("cp") + fs.cp("cp", load_balance=load_balance, engine="ring") + fs.mixed_precision()
    h100 = fs.hardware("h100")
    found = fs.estimate(_MODEL, fs.shard(_MODEL, fs.Mesh(cp=cp), policy), batch=1, seq=seq, hardware=h100)
    counted = found.compute_parts["attention"] * h100.kernel_rates.attention
    # the trace counts the mean rank (the busiest's excess is exposed apart: the test above)
    assert counted == pytest.approx(config.num_layers * sum(ranks) / cp, rel=1e-9)
