"""fs.estimate's wait for the busiest cp rank follows what each engine's kernels run per rank.

Each rank's pairs come from the engines themselves: the all-gather engine's SDPA reads its boolean
mask for every query against every key (`SequenceShard.causal_mask`), and torch's ring runs, chunk
pair by chunk pair, a causal kernel, a full one or none (its ``_is_causal_behavior``).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_ring

import functional_shard as fs
from functional_shard.core.sequence import token_positions
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
