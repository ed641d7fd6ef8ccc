"""The cost, the estimate and the search of mixture-of-experts plans (expert and tensor parallel).

Proofs:

- on 4 gloo ranks (one case in the default suite, in `test_moe_parallel`'s world; every
  strategy under -m slow), with every router forced to the balanced pick (`moe_cost_cases`), the
  bytes each collective sends in a training step equal `plan.cost(tokens=)` exactly, per
  rank, all-to-alls included; the parameters, gradients and optimizer state held equal
  the prediction; and the bytes the forward saves for backward equal what the trace
  (`trace.rank_experts`, re-enacting the engine's forward on fake tensors) counts for that rank;
- with the real router the prediction and the measurement are printed side by side;
- by hand: the all-to-all bytes of the tiny models, and (hypothesis) the expert tensors'
  memory and gradient traffic per rank over expert counts, ep sizes and dp sizes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard.costing.time.step_model import recomputed_collectives
from functional_shard.costing.trace.activations import trace_activations

from .. import moe_cost_cases
from ..unit.test_moe_estimate import build

transformers = pytest.importorskip("transformers")

TOKENS = 16  # moe_cases: 2 sequences of 8 tokens per data-parallel rank
TOP_K, HIDDEN, LAYERS = 2, 32, 2


def tiny(experts: int = 8) -> nn.Module:
    return moe_cost_cases.build_meta("mixtral", experts)


# ---------------------------------------------------------------- cost, by hand


@pytest.mark.parametrize(
    ("mesh", "policy", "axis", "ep"),
    [
        (fs.Mesh(dp=4), fs.fsdp("dp") + fs.ep("dp"), "dp", 4),
        (fs.Mesh(dp=2, ep=2), fs.fsdp(("dp", "ep")) + fs.ep("ep"), "ep", 2),
    ],
)
def test_all_to_all_bytes_are_counts_and_four_exchanges_of_the_token_copies(mesh, policy, axis, ep):
    plan = fs.shard(tiny(), mesh, policy)
    sent = plan.cost(tokens=TOKENS).comm_bytes["all_to_all"]
    # per layer: the 8 int64 counts, then dispatch and combine forward and backward, of the
    # 16 x 2 copies of 32 float32 features, each rank keeping its own 1/ep
    per_layer = (ep - 1) / ep * 8 * 8 + 4 * (ep - 1) / ep * TOKENS * TOP_K * HIDDEN * 4
    assert sent == {axis: LAYERS * per_layer}
    assert {mesh.size: sent[axis]} in ({4: 24672.0}, {4: 16448.0})  # what gloo measured


def test_tensor_parallel_experts_all_reduce_their_output_and_input_and_weight_gradients():
    model = tiny()
    plan = fs.shard(model, fs.Mesh(tp=4), fs.tp("hf", "tp"))
    whole = fs.Rules([("*.experts", "replicate")]) + fs.rules.llama
    without = fs.shard(model, fs.Mesh(tp=4), fs.tp(whole, "tp"))
    added = plan.cost(tokens=TOKENS).comm_bytes["all_reduce"]["tp"]
    added -= without.cost(tokens=TOKENS).comm_bytes["all_reduce"]["tp"]
    ring = 2 * 3 / 4
    # output forward and input gradient backward (16 x 32 float32), routing weights' gradient (16 x 2)
    assert added == LAYERS * ring * (2 * TOKENS * HIDDEN * 4 + TOKENS * TOP_K * 4)


def test_recomputed_experts_send_their_forward_again():
    # a checkpointed layer re-runs its experts' forward in backward: ep's counts, dispatch and
    # combine once more (6 exchanges of the copies, not 4); tp's output all-reduce once more
    model = tiny()
    block = type(model.model.layers[0])
    ep_plan = fs.shard(model, fs.Mesh(dp=4), fs.fsdp("dp") + fs.ep("dp") + fs.checkpointing(block))
    per_layer = 2 * 3 / 4 * 8 * 8 + 6 * 3 / 4 * TOKENS * TOP_K * HIDDEN * 4
    assert ep_plan.cost(tokens=TOKENS).comm_bytes["all_to_all"] == {"dp": LAYERS * per_layer}
    whole = fs.Rules([("*.experts", "replicate")]) + fs.rules.llama
    again = [
        recomputed_collectives(plan, plan.config.checkpointed, TOKENS)["all_reduce over tp"]
        for rules in ("hf", whole)
        for plan in [fs.shard(model, fs.Mesh(tp=2), fs.tp(rules, "tp") + fs.checkpointing(block))]
    ]
    assert again[0] - again[1] == LAYERS * 2 * 1 / 2 * TOKENS * HIDDEN * 4


def test_a_plan_of_a_state_dict_cannot_count_dispatch_without_top_k():
    state = {k: v for k, v in tiny().state_dict().items()}
    plan = fs.shard(state, fs.Mesh(dp=4), fs.fsdp("dp") + fs.ep("dp", experts="*.experts.*"))
    assert plan.cost().comm_bytes  # parameters and gradients need no top-k
    with pytest.raises(fs.ShardingError, match="num_experts_per_tok"):
        plan.cost(tokens=TOKENS)


class _Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden, device="meta"))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate, device="meta"))


class _Moe(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False, device="meta")
        self.gate.top_k = TOP_K  # type: ignore[assignment]
        self.experts = _Experts(experts, hidden, intermediate)


@settings(max_examples=30, deadline=None)
@given(
    ep=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 3),
    dp=st.integers(1, 5),
    hidden=st.integers(1, 6),
    intermediate=st.integers(1, 5),
    tokens=st.integers(1, 40),
)
def test_expert_memory_and_traffic_per_rank(ep, per_rank, dp, hidden, intermediate, tokens):
    # experts split whole over ep, FSDP2-sharded (dim 0, padded to rank 0's chunk) over dp;
    # their gradients reduce-scattered over dp only: the all-to-all's backward already
    # brought every rank's tokens to them
    experts = ep * per_rank
    assume(experts >= TOP_K)  # a router picks TOP_K of them
    model = nn.ModuleList([_Moe(experts, hidden, intermediate) for _ in range(2)])
    mesh = fs.Mesh(dp=dp, ep=ep)
    plan = fs.shard(model, mesh, fs.fsdp(("dp", "ep")) + fs.ep("ep", experts="*.experts.*"))
    c = plan.cost("adamw", tokens=tokens)
    expert_rows = math.ceil(per_rank / dp)
    expert_row = 3 * intermediate * hidden  # gate and up (2f x d) plus down (d x f) per expert
    gate_rows = math.ceil(experts / (dp * ep))
    params = 2 * (expert_rows * expert_row + gate_rows * hidden) * 4
    assert c.params_bytes == c.grads_bytes == params
    assert c.optimizer_bytes == 2 * params + 3 * 2 * 4  # rank 0's chunks are whole; 3 step counters
    sent: dict[str, float] = defaultdict(float)
    for kind, by_axes in c.comm_bytes.items():
        for axes, nbytes in by_axes.items():
            sent[kind] += nbytes
            if kind in ("reduce_scatter", "all_gather") and "ep" in axes.split(","):
                assert axes in ("dp,ep", "ep,dp", "ep")  # the gate's, over every data rank
    dense_rs = (dp * ep - 1) * gate_rows * hidden * 4 * 2
    experts_rs = (dp - 1) * expert_rows * expert_row * 4 * 2
    assert sent["reduce_scatter"] == pytest.approx(dense_rs + experts_rs)
    copies = tokens * TOP_K * hidden * 4
    all_to_all = 2 * (ep - 1) / ep * (experts * 8 + 4 * copies)
    assert sent["all_to_all"] == pytest.approx(all_to_all)


# ---------------------------------------------------------------- estimate


@pytest.mark.slow
def test_every_rank_of_an_ep_plan_estimates_and_balanced_ranks_do_equal_work():
    model = build("mixtral", attention="sdpa", experts="grouped_mm")
    plan = fs.shard(model, fs.Mesh(dp=4), fs.fsdp("dp") + fs.ep("dp"))
    dense = fs.estimate(model, fs.shard(model, fs.Mesh(dp=4), fs.fsdp("dp")), batch=2, seq=16)
    found = [fs.estimate(model, plan, batch=2, seq=16, rank=rank) for rank in range(4)]
    assert len({e.activation_bytes for e in found}) == len({e.flops for e in found}) == 1
    # each rank runs T x k token copies through its experts, as a data-parallel rank does
    assert found[0].flops == dense.flops
    assert found[0].exposed_seconds["expert all-to-all"] > 0
    assert any(key.startswith("all_to_all over dp") for key in found[0].comm_seconds)


def test_the_hot_experts_rank_is_the_worst():
    model = build("mixtral", attention="sdpa", experts="grouped_mm")
    plan = fs.shard(model, fs.Mesh(dp=4), fs.fsdp("dp") + fs.ep("dp"))
    # ep rank 0 holds expert 0, the hot one; the others share what is left
    hot = [fs.estimate(model, plan, batch=2, seq=16, rank=r, expert_imbalance=3.0) for r in (0, 1)]
    balanced = fs.estimate(model, plan, batch=2, seq=16, rank=0)
    assert hot[0].activation_bytes > balanced.activation_bytes > hot[1].activation_bytes
    assert hot[0].flops > balanced.flops > hot[1].flops
    assert fs.estimate(model, plan, batch=2, seq=16, expert_imbalance=3.0).rank == 0  # the default: the worst


def test_every_rank_of_an_ep_plan_under_a_pipeline_estimates_its_own_stages_experts():
    # three layers, two on the first stage and one on the last: each stage dispatches its
    # own layers' tokens (all micro-batches'), together what the flat plan dispatches
    model = build("mixtral", attention="sdpa", experts="grouped_mm")
    policy = fs.fsdp("dp") + fs.ep("dp")
    piped = fs.shard(model, fs.Mesh(pp=2, dp=2), fs.pipeline("pp", microbatches=2) + policy)
    flat = fs.estimate(model, fs.shard(model, fs.Mesh(dp=2), policy), batch=4, seq=16)
    seconds = [
        fs.estimate(model, piped, batch=4, seq=16, rank=rank).exposed_seconds["expert all-to-all"]
        for rank in range(4)
    ]
    assert seconds[0] == seconds[1] > seconds[2] == seconds[3]  # pp rank 0 holds two layers
    assert seconds[0] + seconds[2] == pytest.approx(flat.exposed_seconds["expert all-to-all"])


@pytest.mark.slow
def test_each_ep_size_runs_the_same_local_work_under_balanced_routing():
    # what lets the search trace one ep plan for every ep size (a rank's E/ep experts get ep
    # times each expert's share: T x k rows in all)
    model = build("mixtral", attention="sdpa", experts="grouped_mm")
    traces = [
        trace_activations(model, fs.shard(model, mesh, fs.fsdp(("dp", "ep")) + fs.ep("ep")), batch=2, seq=16)
        for mesh in (fs.Mesh(dp=4, ep=2), fs.Mesh(dp=2, ep=4), fs.Mesh(dp=1, ep=8))
    ]
    assert len({(t.activation_bytes, t.step_flops) for t in traces}) == 1


@pytest.mark.slow
def test_tensor_parallel_experts_estimate_with_their_slices():
    model = build("mixtral", attention="sdpa", experts="grouped_mm")
    whole = fs.estimate(model, fs.shard(model, fs.Mesh(dp=1), fs.replicate()), batch=2, seq=16)
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp("hf", "tp"))
    split = [fs.estimate(model, plan, batch=2, seq=16, rank=rank) for rank in range(2)]
    assert split[0].flops == split[1].flops < whole.flops
    assert split[0].exposed_seconds["tensor parallel"] > 0


# ---------------------------------------------------------------- gloo: measured = predicted


def check_measured(case: tuple[str, ...], results: list[dict[str, Any]]) -> None:
    print(moe_cost_cases.comparison_table(case, results))
    family, experts, strategy, _ = case
    traced = {}
    for result in results:
        label = f"{case} rank {result['rank']}"
        assert result["measured"] == result["predicted"], label
        assert result["resident"] == result["memory"], label
        saved = result["saved_bytes"]
        if saved not in traced:  # balanced ranks keep alike: one trace per distinct measurement
            traced[saved] = moe_cost_cases.traced_bytes(family, int(experts), strategy, result["rank"])
        assert saved == traced[saved], label


# the default suite's case runs in test_moe_parallel's world (a world start costs more than the case)
DEFAULT_GLOO = (("mixtral", "8", "ep_2d", "uniform"),)
SLOW = (
    ("mixtral", "8", "ep_2d", "uniform"),
    ("mixtral", "8", "ep_dp", "uniform"),
    ("qwen3_moe", "4", "ep_dp", "uniform"),
    ("qwen3_moe", "8", "ep_2d", "uniform"),
    ("mixtral", "4", "fsdp_tp", "uniform"),
    ("qwen2_moe", "4", "fsdp_tp", "uniform"),
    ("mixtral", "8", "ep_tp", "uniform"),
)


@pytest.mark.slow
def test_measured_bytes_equal_the_prediction_under_uniform_routing_for_every_strategy(world4):
    results = world4.run(moe_cost_cases.run_cases, SLOW)
    for index, case in enumerate(SLOW):
        check_measured(case, [r[index] for r in results])


@pytest.mark.slow
def test_with_the_real_router_prediction_and_measurement_are_reported_side_by_side(world4, capsys):
    cases = (("mixtral", "8", "ep_dp", "router"), ("mixtral", "8", "ep_2d", "router"))
    results = world4.run(moe_cost_cases.run_cases, cases)
    for index, case in enumerate(cases):
        rows = [r[index] for r in results]
        with capsys.disabled():
            print("\n" + moe_cost_cases.comparison_table(case, rows))
        for row in rows:  # the router moves the all-to-all only; everything else is exact
            assert {k: v for k, v in row["measured"].items() if k != "all_to_all"} == {
                k: v for k, v in row["predicted"].items() if k != "all_to_all"
            }
        total = sum(row["measured"]["all_to_all"][case_axis(case)] for row in rows)
        assert total > 0


def case_axis(case: tuple[str, ...]) -> str:
    return "dp" if case[2] == "ep_dp" else "ep"


# ---------------------------------------------------------------- search


def mixtral_8x7b() -> nn.Module:
    """A Mixtral-8x7B-shaped model on the meta device (its HF config's sizes)."""
    config = transformers.MixtralConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config)


def counting_traces(monkeypatch) -> list[int]:
    import importlib

    module = importlib.import_module("functional_shard.costing.estimate.estimate")
    trace, calls = module._trace, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return trace(*args, **kwargs)

    monkeypatch.setattr(module, "_trace", counted)
    return calls


def test_the_search_tries_ep_sizes_dividing_the_experts_and_tp_inside_them():
    report = fs.search_plans(tiny(4), devices=2, memory_budget="1GiB", batch=2, seq=8, hardware="h100")
    assert report.no_tensor_parallel is None
    sizes = {c.expert_parallel: c for c in report.candidates if c.expert_parallel > 1}
    assert sorted(sizes) == [2]  # divides the 4 experts and the 2 data-parallel ranks
    assert sizes[2].mesh == fs.Mesh(dp=1, ep=2)
    assert sizes[2].policy_text.startswith("fsdp(dp, ep) + ep(ep)")
    assert all(c.fits for c in report.expert_parallel_candidates)
    tensor_parallel = {c.policy_text for c in report.candidates if c.tensor_parallel == 2}
    assert "fsdp(dp) + tp(hf, tp) + bf16" in tensor_parallel  # tp inside the experts
    assert not any(c.sequence_parallel for c in report.candidates)  # apply refuses it inside experts
    assert "expert parallel, the best of each ep size:" in str(report)


@pytest.mark.slow
def test_the_search_traces_at_most_twice_what_it_does_without_experts(monkeypatch):
    import importlib

    candidates = importlib.import_module("functional_shard.search.candidates")
    model = tiny(4)
    calls = counting_traces(monkeypatch)
    # each search traces afresh: its traces are its own
    fs.search_plans(model, devices=4, memory_budget="1GiB", batch=4, seq=8, hardware="h100")
    with_experts = calls[0]
    monkeypatch.setattr(candidates, "expert_count", lambda model, tree: 0)
    fs.search_plans(model, devices=4, memory_budget="1GiB", batch=4, seq=8, hardware="h100")
    without = calls[0] - with_experts
    assert without < with_experts <= 2 * without  # one trace serves every ep size


@pytest.mark.slow
def test_a_mixtral_8x7b_on_64_h100s_gets_a_plan_and_the_report_shows_ep(monkeypatch):
    calls = counting_traces(monkeypatch)
    report = fs.search_plans(mixtral_8x7b(), devices=64, memory_budget="80GiB", batch=64, seq=4096)
    assert report.best is not None
    print(report)
    assert [c.expert_parallel for c in report.expert_parallel_candidates] == [2, 4, 8]
    assert "ep(ep)" in str(report)
    assert calls[0] <= 16


@pytest.mark.slow
def test_the_cli_plans_a_mixtral_8x7b_config_with_auto(capsys, tmp_path):
    from functional_shard.cli import main

    mixtral_8x7b().config.save_pretrained(tmp_path)
    model = ["--model", str(tmp_path / "config.json")]
    code = main(
        ["plan", *model, "--auto", "--devices", "64", "--budget", "80GiB", "--seq", "4096", "--top", "3"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "expert parallel (experts split by index over ep), the best of each ep size:" in out
    assert "Mesh(dp=8, ep=8)" in out
    assert "fsdp(dp, ep) + ep(ep)" in out
    assert "chosen:" in out
