"""torchtitan's mixture of experts (main's ``GroupedExperts``) in the estimate, on `tests.titan_models`.

The trace runs the model's own router and token dispatcher on fake tensors and torchtitan's grouped
experts for loads fixed up front (`functional_shard.costing.trace.routing.titan_experts`): three
``torch._grouped_mm`` in bfloat16 a layer, ``2 x rows x d x f`` flops each forward and twice that
backward, whatever the implementation the tests' model loops with. Checked here:

- flops: against the dense model of the same sizes, the difference is exact: the router, the shared
  experts and ``tokens x top_k`` rows through the three grouped matmuls, less the dense feed-forward
  (tensor parallel divides all but the router, which stays whole);
- bytes: against what a real forward on the CPU keeps for backward with its router forced to the
  balanced pick, within the 3% of the transformers layout's check (test_moe_estimate.py); in
  bfloat16 they agree, in float32 the difference is torchtitan's bfloat16 casts, counted by hand.
"""

from __future__ import annotations

import re

import pytest
import torch

import functional_shard as fs
from functional_shard.costing.trace.activations import trace_activations
from functional_shard.search.candidates import model_facts

from ..titan_models import MoEConfig, TokenChoiceTopKRouter, titan_llama3, titan_moe
from ..unit_models import TitanConfig, TitanDeepSeek

BATCH, SEQ = 2, 16
TOKENS = BATCH * SEQ
EXPERTS, TOP_K, HIDDEN, SHARED = 4, 2, 32, 32
DIM, DENSE_HIDDEN = 64, 192  # titan_llama3("tiny")'s dim and feed-forward width
MOE_LAYERS = 1  # layer 0 stays dense (MoEConfig.first_moe_layer)


def moe_model(device: str = "meta") -> torch.nn.Module:
    config = MoEConfig(num_experts=EXPERTS, hidden_dim=HIDDEN, top_k=TOP_K, shared_hidden_dim=SHARED)
    return titan_moe("tiny", config, device=device, n_kv_heads=4)


def dense_model() -> torch.nn.Module:
    return titan_llama3("tiny", device="meta", n_kv_heads=4)


def plan_of(model: torch.nn.Module, tp: int) -> fs.Plan:
    if tp == 1:
        return fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp"))
    return fs.shard(model, fs.Mesh(dp=2, tp=tp), fs.fsdp("dp") + fs.tp("auto", "tp"))


def moe_less_dense_forward_flops(tp: int) -> float:
    """Forward flops a MoE layer adds over the dense feed-forward it replaces, on one tp rank."""
    router = 2 * TOKENS * DIM * EXPERTS  # whole on every rank
    routed = 3 * 2 * TOKENS * TOP_K * DIM * HIDDEN  # w1, w3 and w2's grouped matmuls
    shared = 3 * 2 * TOKENS * DIM * SHARED
    dense = 3 * 2 * TOKENS * DIM * DENSE_HIDDEN
    return MOE_LAYERS * (router + (routed + shared - dense) / tp)


@pytest.mark.parametrize("tp", [1, 2], ids=["fsdp", "fsdp+tp"])
def test_experts_flops_are_torchtitans_grouped_matmuls(tp):
    traces = {
        name: trace_activations(model, plan_of(model, tp), batch=BATCH, seq=SEQ)
        for name, model in (("moe", moe_model()), ("dense", dense_model()))
    }
    forward = traces["moe"].forward_flops - traces["dense"].forward_flops
    backward = traces["moe"].backward_flops - traces["dense"].backward_flops
    assert forward == moe_less_dense_forward_flops(tp)
    assert backward == 2 * moe_less_dense_forward_flops(tp)
    estimates = {
        name: fs.estimate(model, plan_of(model, tp), batch=BATCH, seq=SEQ, hardware="h100")
        for name, model in (("moe", moe_model()), ("dense", dense_model()))
    }
    assert estimates["moe"].flops - estimates["dense"].flops == 3 * moe_less_dense_forward_flops(tp)
    assert estimates["moe"].activation_bytes > 0


def _balanced_pick(
    module: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    # visit j goes to expert j mod E: each token's top_k experts differ, every expert gets as many.
    # Only the choice is replaced: the routing weights keep the graph (and saved tensors) they had
    scores, expert_ids, all_scores = output
    tokens, top_k = expert_ids.shape
    forced = (torch.arange(tokens * top_k) % all_scores.shape[-1]).view(tokens, top_k)
    return scores, forced, all_scores


def kept_with_balanced_routing(dtype: torch.dtype) -> int:
    torch.manual_seed(0)
    model = moe_model("cpu")
    for module in model.modules():
        if isinstance(module, TokenChoiceTopKRouter):
            module.register_forward_hook(_balanced_pick)
    for param in model.parameters():  # the buffers (the rotary table, the router's bias) stay as built
        param.data = param.data.to(dtype)
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return fs.kept_activation_bytes(model, tokens)[0]


def test_in_bfloat16_the_trace_keeps_what_a_balanced_real_forward_keeps():
    # torchtitan's grouped matmuls run in bfloat16: under mixed precision its casts copy nothing,
    # and its saved tensors are the tests' loop's (the rows, and four [rows, f] per layer)
    model = moe_model()
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp") + fs.mixed_precision())
    trace = trace_activations(model, plan, batch=BATCH, seq=SEQ)
    assert trace.activation_bytes == pytest.approx(kept_with_balanced_routing(torch.bfloat16), rel=0.03)


def test_in_float32_the_trace_adds_torchtitans_bfloat16_copies():
    # torchtitan casts each grouped matmul's operands to bfloat16, where the tests' loop runs in
    # float32: its matmuls keep bfloat16 copies of w1, w3 and w2, and of the rows once per matmul
    # that reads them (w1's and w3's), and their [rows, f] outputs at half the width; and
    # torch._grouped_mm keeps its int32 offsets, one an expert, which the loop has none of
    model = moe_model()
    trace = trace_activations(model, fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp")), batch=BATCH, seq=SEQ)
    rows = TOKENS * TOP_K
    weight_copies = 3 * EXPERTS * HIDDEN * DIM * 2
    row_copies = 2 * rows * DIM * 2 - rows * DIM * 4
    narrower = 4 * rows * HIDDEN * (2 - 4)
    offsets = EXPERTS * 4
    explained = MOE_LAYERS * (weight_copies + row_copies + narrower + offsets)
    assert trace.activation_bytes - kept_with_balanced_routing(torch.float32) == explained


def test_under_tp_every_rank_runs_every_copy_so_imbalance_moves_no_work():
    model = moe_model()
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp("auto", "tp"))
    balanced = fs.estimate(model, plan, batch=BATCH, seq=SEQ)
    skewed = fs.estimate(model, plan, batch=BATCH, seq=SEQ, expert_imbalance=2.0)
    assert skewed.flops == balanced.flops
    assert skewed.memory == balanced.memory
    with pytest.raises(fs.ShardingError, match=re.escape("use at most 2 (experts / top-k)")):
        fs.estimate(model, plan, batch=BATCH, seq=SEQ, expert_imbalance=2.5)


def test_titan_experts_under_expert_parallelism_are_refused_by_name():
    model = moe_model()
    plan = fs.shard(model, fs.Mesh(dp=2, ep=2), fs.fsdp(("dp", "ep")) + fs.ep("ep"))
    refusal = (
        "trace_activations: layers.1.moe.routed_experts.inner_experts (GroupedExperts) holds torchtitan's "
        "grouped experts, which expert parallelism does not run"
    )
    with pytest.raises(fs.PlanError, match=re.escape(refusal)):
        fs.estimate(model, plan, batch=BATCH, seq=SEQ)


def test_torchtitan_0_3_0_experts_are_refused_by_name():
    model = TitanDeepSeek(TitanConfig())
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp"))
    refusal = "layers.1.moe.experts (GroupedExperts) holds torchtitan's grouped experts under 0.3.0's names"
    with pytest.raises(fs.PlanError, match=re.escape(refusal)):
        fs.estimate(model, plan, batch=BATCH, seq=SEQ)


def test_search_plans_finds_plans_that_fit():
    report = fs.search_plans(moe_model(), devices=4, memory_budget="1GiB", batch=8, seq=SEQ)
    fitting = [c for c in report.candidates if c.fits]
    assert report.best is not None
    assert any(c.tensor_parallel == 2 for c in fitting)
    # the experts engine runs torchtitan's grouped experts under tensor parallel only: no ep point
    assert not [c for c in report.candidates if c.expert_parallel > 1]
    assert model_facts(moe_model()).experts > 0


def test_search_plans_under_a_tight_budget_estimates_the_pipelines_too():
    # nothing flat fits 200 kB a device: the pipelines' stage costs count the tp experts' traffic,
    # which needs the experts a token visits (the model's, as for the flat candidates)
    report = fs.search_plans(moe_model(), devices=4, memory_budget=200_000, batch=8, seq=SEQ)
    pipelines = [c for c in report.candidates if c.pipeline is not None]
    assert any(c.peak_bytes is not None for c in pipelines)
