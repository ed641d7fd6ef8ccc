"""The engine's per-expert loop and its stand-in in the estimate's trace.

`functional_shard.runtime.engines.experts._run_experts` takes the experts by ``unbind``, gathers the
rows once in expert order and adds each expert's output in place: its backward makes one gradient of
each weight and of the rows, where indexing ``gate_up[e]`` and ``rows[index]`` per expert would make a
full-size zero-filled one per expert (and an out-of-place add copy the whole output per expert). The
trace (`functional_shard.costing.trace.rank_experts._run_local`) re-enacts the same ops, so its
memory-bound bytes grow linearly with the number of experts, not with its square.
"""

from __future__ import annotations

import types

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.profiler import ProfilerActivity, profile

from functional_shard.costing.trace.rank_experts import _run_local
from functional_shard.runtime.engines.experts import _run_experts

from ..moe_cost_cases import traced_memory_bytes


def per_expert_indexing(
    rows: torch.Tensor, expert_of_row: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The plain loop the engine's arithmetic must match: ``gate_up[e]``, ``rows[index]``, ``index_add``."""
    out = rows.new_zeros(rows.shape[0], down.shape[1])
    for expert in range(gate_up.shape[0]):
        index = (expert_of_row == expert).nonzero().squeeze(1)
        gate, up = nn.functional.linear(rows[index], gate_up[expert]).chunk(2, dim=-1)
        out = out.index_add(0, index, nn.functional.linear(nn.functional.silu(gate) * up, down[expert]))
    return out


@settings(max_examples=15, deadline=None)
@given(
    experts=st.integers(1, 6),
    rows=st.integers(1, 24),
    hidden=st.integers(1, 8),
    intermediate=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_the_engine_runs_each_expert_without_full_size_gradients_per_expert(
    experts, rows, hidden, intermediate, seed
):
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * intermediate, hidden, generator=generator, requires_grad=True)
    down = torch.randn(experts, hidden, intermediate, generator=generator, requires_grad=True)
    x = torch.randn(rows, hidden, generator=generator, requires_grad=True)
    expert_of_row = torch.randint(0, experts, (rows,), generator=generator)
    upstream = torch.randn(rows, hidden, generator=generator)
    leaves = (x, gate_up, down)

    expected = per_expert_indexing(x, expert_of_row, gate_up, down)
    expected_grads = torch.autograd.grad(expected, leaves, upstream, allow_unused=True)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        out = _run_experts(x, expert_of_row, gate_up, down, nn.functional.silu)
        grads = torch.autograd.grad(out, leaves, upstream, allow_unused=True)
    counts = {event.key: event.count for event in profiler.key_averages()}

    # the same arithmetic (each row has one expert, so adding into zeros places it exactly); the
    # matmul's kernel may round a last bit differently on rows that start at another address
    torch.testing.assert_close(out, expected)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert (grad is None) == (expected_grad is None)
        if grad is not None:
            torch.testing.assert_close(grad, expected_grad)
    assert counts.get("aten::select_backward", 0) == 0
    assert counts.get("aten::index_add", 0) == 0  # only the in-place add
    assert counts.get("aten::_index_put_impl_", 0) <= 1  # the rows' one gather, zero-filled once


def trace_memory_bytes(experts: int, load: int, hidden: int, intermediate: int) -> int:
    """Memory-bound bytes of `_run_local`'s forward and backward in the trace, ``load`` rows an expert."""
    module = types.SimpleNamespace(act_fn=nn.functional.silu)
    with torch.device("meta"):
        gate_up = torch.empty(experts, 2 * intermediate, hidden, requires_grad=True)
        down = torch.empty(experts, hidden, intermediate, requires_grad=True)
        rows = torch.empty(experts * load, hidden, requires_grad=True)
    return traced_memory_bytes(lambda: _run_local(module, rows, [load] * experts, gate_up, down))


@settings(max_examples=15, deadline=None)
@given(
    experts=st.integers(1, 6),
    load=st.integers(1, 8),
    hidden=st.integers(1, 16),
    intermediate=st.integers(1, 16),
)
def test_the_traced_expert_loop_moves_bytes_linear_in_the_number_of_experts(
    experts, load, hidden, intermediate
):
    # every expert adds its rows, its weights and their gradient once; a full-size gradient or
    # output copy per expert would add a term in the square of the number of experts
    one, two, three = (trace_memory_bytes(experts + extra, load, hidden, intermediate) for extra in range(3))
    assert three - two == two - one
