"""torchtitan 0.3.0's Llama 3 as torchtitan writes it (`tests.titan_models`): planned by its
names and by its structure alike, and trained under FSDP × TP like one process; its main
branch's mixture of experts planned by its names and trained under tp like one process.

Parity as in test_hf_parity.py: 3 AdamW steps (lr 1e-2, eps 1e-6, fp32) against one process
on the whole global batch; the first gradients within 1e-6 + 1e-4 relative, losses within
1e-5, parameters within 5e-4 + 1e-4 relative.
"""

from __future__ import annotations

import re

import pytest
import torch

import functional_shard as fs
from functional_shard.planning.tp.structural_rules import structural_rules

from .. import titan_cases, tp_any_cases
from ..titan_models import SIZES, MoEConfig, fuse_qkv, split_qkv, titan_llama3, titan_moe
from ..unit_models import TitanConfig, TitanLlama

BLOCK = (
    "attention.qkv_linear.wqkv.weight",
    "attention.wo.weight",
    "feed_forward.w1.weight",
    "feed_forward.w2.weight",
    "feed_forward.w3.weight",
    "attention_norm.weight",
    "ffn_norm.weight",
)


def test_the_model_has_torchtitans_names_and_builds_on_meta():
    model = titan_llama3("tiny", device="meta")
    names = [name for name, _ in model.named_parameters()]
    blocks = [f"layers.{i}.{name}" for i in range(2) for name in BLOCK]
    assert names == ["tok_embeddings.weight", *blocks, "norm.weight", "lm_head.weight"]
    assert isinstance(model.layers, torch.nn.ModuleDict)
    # the rotary table: a non-persistent complex buffer per attention, computed in __init__
    cache = model.layers["0"].attention.rope.cache
    assert (cache.dtype, tuple(cache.shape), cache.is_meta) == (torch.complex64, (64, 8), True)
    assert not any("rope" in key for key in model.state_dict())
    # grouped-query: 4 query heads and 2 key/value heads of 16 in one wqkv; torchtitan's 8B sizes
    assert model.layers["1"].attention.qkv_linear.wqkv.out_features == (4 + 2 * 2) * 16
    big = titan_llama3("8B", device="meta")
    assert tuple(big.layers["31"].feed_forward.w1.weight.shape) == (14336, 4096)
    assert tuple(big.lm_head.weight.shape) == (128256, 4096)
    unfused = [name for name, _ in titan_llama3("tiny", device="meta", fuse_qkv=False).named_parameters()]
    assert "layers.0.attention.qkv_linear.wk.weight" in unfused


def test_wqkv_is_laid_out_by_key_value_group_as_torchtitans():
    # the fused model, its wqkv made from an unfused twin's wq, wk, wv, computes the same logits
    unfused = titan_llama3("tiny", fuse_qkv=False)
    fused = titan_llama3("tiny")
    state = dict(unfused.state_dict())
    for i in range(SIZES["tiny"].n_layers):
        prefix = f"layers.{i}.attention.qkv_linear."
        parts = [state.pop(f"{prefix}{name}.weight") for name in ("wq", "wk", "wv")]
        state[f"{prefix}wqkv.weight"] = fuse_qkv(*parts, n_kv_heads=2)
        again = split_qkv(state[f"{prefix}wqkv.weight"], n_heads=4, n_kv_heads=2)
        assert all(torch.equal(a, b) for a, b in zip(again, parts, strict=True))
    fused.load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(fused(tokens), unfused(tokens))


@pytest.mark.parametrize("changes", [{}, {"fuse_qkv": False}], ids=["fused", "unfused"])
def test_names_and_structure_give_one_plan(changes):
    # tp("auto") picks fs.rules.torchtitan by the names; the structure, traced on meta
    # tensors, gives the same: wqkv colwise (a split along its group rows is local to a
    # group), wo rowwise, lm_head gathered
    model = titan_llama3("tiny", device="meta", **changes)
    assert fs.rules.for_model(model).name == "torchtitan"
    mesh = fs.Mesh(dp=2, tp=2)
    plans = [
        fs.shard(model, mesh, fs.fsdp("dp") + fs.tp(rules, "tp"))
        for rules in ("auto", fs.rules.torchtitan, structural_rules(model))
    ]
    assert plans[0].params == plans[1].params == plans[2].params
    assert plans[0].config.tp.styles == plans[1].config.tp.styles == plans[2].config.tp.styles
    q = "layers.1.attention.qkv_linear." + ("wqkv" if not changes else "wk")
    assert plans[0].sharding(f"{q}.weight").compute == fs.P("tp", None)
    assert plans[0].sharding("layers.1.attention.wo.weight").compute == fs.P(None, "tp")
    assert ("lm_head", "colwise_gather", "linear") in plans[0].config.tp.styles
    fs.check_runnable(plans[0], model)


def test_older_torchtitan_names_still_fit():
    # attention.wq/wk/wv and output (torchtitan before 0.3.0)
    model = TitanLlama(TitanConfig())
    assert fs.rules.for_model(model).name == "torchtitan"
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp(fs.rules.torchtitan, "tp"))
    assert plan.sharding("layers.0.attention.wk.weight").compute == fs.P("tp", None)
    assert plan.sharding("output.weight").compute == fs.P("tp", None)


EXPERTS = "layers.1.moe.routed_experts.inner_experts"


def test_todays_moe_names_fit_and_split_each_expert_on_its_hidden_features():
    # torchtitan's main branch: w1_EFD/w3_EFD [E, F, D] split on F (dim 1), w2_EDF [E, D, F] on F
    # (dim 2), the router whole, the shared experts as a feed-forward; layer 0 stays dense
    model = titan_moe("tiny", MoEConfig(num_experts=4, hidden_dim=32), device="meta")
    assert fs.rules.for_model(model).name == "torchtitan"
    plan = fs.shard(model, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp("auto", "tp"))
    specs = {name: plan.sharding(f"{EXPERTS}.{name}").compute for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
    assert specs == {
        "w1_EFD": fs.P(None, "tp", None),
        "w2_EDF": fs.P(None, None, "tp"),
        "w3_EFD": fs.P(None, "tp", None),
    }
    assert plan.local_shape_and_offset(f"{EXPERTS}.w1_EFD", 1, "compute") == ((4, 16, 64), (0, 16, 0))
    assert plan.local_shape_and_offset(f"{EXPERTS}.w2_EDF", 1, "compute") == ((4, 64, 16), (0, 0, 16))
    assert plan.sharding("layers.1.moe.router.gate.weight").compute.is_replicated
    assert plan.sharding("layers.1.moe.shared_experts.w1.weight").compute == fs.P("tp", None)
    assert plan.sharding("layers.1.moe.shared_experts.w2.weight").compute == fs.P(None, "tp")
    assert plan.sharding("layers.0.feed_forward.w2.weight").compute == fs.P(None, "tp")
    assert plan.config.tp.experts == (EXPERTS,)
    fs.check_runnable(plan, model)
    # the buffers stay whole on every rank (torchtitan: replicated over tp without ep)
    assert plan.sharding("layers.1.moe.expert_bias_E").compute.is_replicated
    # between May and July 2026 the same weights sat under moe.experts
    rules = fs.rules.torchtitan
    assert [rules.match(f"layers.3.moe.experts.{n}").target for n in ("w1_EFD", "w2_EDF")] == [
        "colwise",
        "rowwise",
    ]
    # each expert's hidden features must split evenly over tp
    odd = titan_moe("tiny", MoEConfig(hidden_dim=30), device="meta")
    refusal = f"{EXPERTS}: each expert's 30 intermediate features (gate and up each) do not split over 4"
    with pytest.raises(fs.ShardingError, match=re.escape(refusal)):
        fs.check_runnable(fs.shard(odd, fs.Mesh(tp=4), fs.tp("auto", "tp")), odd)


def test_todays_moe_trains_under_tp_like_one_process(world4):
    # tp = 4 (four key/value groups): loss and every rank's gradient shares against one process
    result = world4.run(tp_any_cases.parity, "titan_moe_today", fs.rules.torchtitan)[0]
    # wqkv and wo twice, the dense feed-forward, the experts, the shared experts, embedding and head
    assert result["split"] == 15
    assert result["loss"] < 1e-5
    assert result["grad"] < 1e-5
    assert result["buffers"] == 0  # tokens_per_expert_E counted alike on every rank
    assert result["measured"].keys() == result["predicted"].keys(), result["ops"]
    for kind, by_axis in result["predicted"].items():
        assert result["measured"][kind] == pytest.approx(by_axis), (kind, result["ops"])


def test_qwen3_per_head_norms_train_under_tp_like_one_process(world4):
    # q_norm and k_norm each have one weight all heads share: a tp rank's gradient of it is its
    # heads' part, all-reduced (under "sequence", as *norm matched them before, each rank kept its own)
    plan = fs.shard(
        titan_llama3("tiny", device="meta", qk_norm=True), fs.Mesh(tp=4), fs.tp(fs.rules.torchtitan)
    )
    assert ("layers.0.attention.q_norm", "replicate_grad_allreduce", "other") in plan.config.tp_styles
    result = world4.run(tp_any_cases.parity, "titan_qk_norm", fs.rules.torchtitan)[0]
    assert result["loss"] < 1e-5
    assert result["grad"] < 1e-5


def test_checkpointed_titan_experts_recompute_their_routed_copies_all_reduce():
    # a checkpointed block runs its forward's tp collectives again: torchtitan's experts all-reduce
    # their output per routed copy (top_k a token), where the dense feed-forward's w2 sent one a token
    from functional_shard.costing.time.step_model import _recomputed_now
    from tests.titan_models import TransformerBlock

    tokens, tp = 64, 2
    sent = {}
    for name, model in (
        ("moe", titan_moe("tiny", MoEConfig(num_experts=8), device="meta", n_kv_heads=4)),
        ("dense", titan_llama3("tiny", device="meta", n_kv_heads=4)),
    ):
        policy = fs.tp(fs.rules.torchtitan, "tp") + fs.checkpointing(TransformerBlock)
        plan = fs.shard(model, fs.Mesh(tp=tp), policy)
        sent[name] = _recomputed_now(plan, plan.config.checkpointed, tokens).sent["all_reduce over tp"]
        if name == "moe":
            top_k, dim = plan.config.experts.top_k, model.config.dim
    moe_layers = 1  # layer 0 stays dense (MoEConfig.first_moe_layer)
    experts = 2 * (tp - 1) / tp * tokens * top_k * dim * 4  # float32
    assert sent["moe"] - sent["dense"] == pytest.approx(moe_layers * experts)


def test_a_tp_size_that_cuts_a_key_value_group_is_refused_by_name():
    model = titan_llama3("tiny", device="meta")  # 2 key/value groups
    plan = fs.shard(model, fs.Mesh(tp=4), fs.tp("auto", "tp"))
    refusal = (
        "layers.0.attention.qkv_linear.wqkv: its 2 key/value groups (each 4 heads of head_dim 16: its "
        "query heads, a key and a value) do not split over 4 tensor-parallel ranks; use a "
        "tensor-parallel size that divides 2"
    )
    with pytest.raises(fs.ShardingError, match=re.escape(refusal)):
        fs.check_runnable(plan, model)


def check(results, cases):
    for (changes, strategy, meta), result in zip(cases, results, strict=True):
        expected = titan_cases.reference(changes, result["data_parallel"])
        label = f"{changes} under {strategy}" + (" (built on meta)" if meta else "")
        for kind, atol in (("grads", 1e-6), ("params", 5e-4)):
            assert result[kind].keys() == expected[kind].keys(), label
            for name, value in expected[kind].items():
                gap = (result[kind][name] - value).abs().max().item()
                message = f"{label}: {kind} {name} off by {gap}"
                torch.testing.assert_close(result[kind][name], value, atol=atol, rtol=1e-4, msg=message)
        assert result["losses"] == pytest.approx(expected["losses"], abs=1e-5), label


def test_trains_under_fsdp_and_tp_auto_like_one_process_from_the_meta_device(world4):
    # dp = 2, tp = 2: built on meta, fs.materialize (seed 0) and the rotary tables computed
    # again, then trained: one process's model built on the CPU with seed 0, step for step
    cases = (({}, "fsdp_tp", True),)
    results = world4.run(titan_cases.train_all, cases)[0]
    assert results[0]["styles"]["layers.0.attention.qkv_linear.wqkv"] == "colwise"
    check(results, cases)


@pytest.mark.slow
def test_every_way_of_naming_and_splitting_trains_like_one_process(world4):
    cases = (
        ({}, "fsdp_tp_names", False),  # fs.rules.torchtitan given by hand, built on the CPU
        ({"fuse_qkv": False}, "fsdp_tp", True),  # 0.3.0's unfused wq/wk/wv
        ({"n_kv_heads": 4}, "tp", False),  # tp = 4 over 4 key/value groups
        ({}, "fsdp_sp", False),  # sequence parallel, as torchtitan runs it
    )
    check(world4.run(titan_cases.train_all, cases)[0], cases)
