"""Sequence parallel as torchtitan runs it: refusals before anything runs, and parity on gloo.

The residual stream is split on the sequence (a DTensor whose shape reads whole); each
module that holds column-split layers (attention, MLP: `fs.rules.sequence_gathers`)
gathers its input once on entry (torch's ``PrepareModuleInput``); row-split layers
reduce-scatter their output back. Hugging Face parity, traffic and the activation trace
on real ranks are in test_hf_parity.py and test_activations.py; these are the pure
refusals and the zoo model's parity.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.costing.trace import activations
from functional_shard.costing.trace.activations import trace_activations
from functional_shard.planning.tp.rules import sequence_gathers
from functional_shard.zoo import CONFIGS, llama

from .. import dist_cases, hf_cases

SP = fs.tp(fs.rules.llama, "tp", sequence_parallel=True)


def test_attention_and_mlp_gather_and_lm_head_gathers_its_own_input():
    plan = fs.shard(llama("tiny"), fs.Mesh(tp=2), SP)
    gathers = sequence_gathers(plan.config.tp.styles)
    assert gathers == ("layers.0.self_attn", "layers.0.mlp", "layers.1.self_attn", "layers.1.mlp")


def test_an_uneven_sequence_is_refused_before_tracing(monkeypatch):
    def no_trace(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced before refusing")

    monkeypatch.setattr(activations._Run, "trace", no_trace)
    model = llama("tiny")
    plan = fs.shard(model, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + SP)
    message = (
        "trace_activations(seq=7): sequence parallel over 'tp' splits the sequence evenly over its 2 ranks"
    )
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        trace_activations(model, plan, batch=1, seq=7)
    with pytest.raises(fs.ShardingError, match=re.escape("2 does not divide 7")):
        fs.estimate(model, plan, batch=1, seq=7)


def test_gpt2_conv1d_and_packed_layers_are_refused_under_sequence_parallel():
    pytest.importorskip("transformers")
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cases.config("gpt2"))
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp("auto", "tp", sequence_parallel=True))
    why = "transformer.h.0.attn.c_attn: style 'packed_colwise' on a Conv1D with sequence parallel"
    with pytest.raises(fs.PlanError, match=re.escape(why)):
        fs.check_runnable(plan, model)
    with pytest.raises(fs.PlanError, match=re.escape(why)):
        trace_activations(model, plan, batch=1, seq=8)
    # without sequence parallel the same rules run (test_hf_parity)
    fs.check_runnable(fs.shard(model, fs.Mesh(tp=2), fs.tp("auto", "tp")), model)


def test_a_module_with_weights_left_outside_the_gathered_ones_is_refused():
    model = llama("tiny")
    no_norms = fs.rules.Rules([rule for rule in fs.rules.llama if rule.target != "sequence"], name="no_norms")
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp(no_norms, "tp", sequence_parallel=True))
    why = "layers.0.input_layernorm: a RMSNorm with weights but no tensor-parallel style"
    with pytest.raises(fs.PlanError, match=re.escape(why)):
        fs.check_runnable(plan, model)
    # tiny's 2 key/value heads do not split over 4 ranks: refused as without sequence parallel
    with pytest.raises(fs.PlanError, match=re.escape("do not split over 4 tensor-parallel ranks")):
        fs.check_runnable(fs.shard(model, fs.Mesh(tp=4), SP), model)


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "strategy"), [(2, "tp_sp"), (4, "fsdp_tp_sp")])
def test_the_zoo_llama_trains_as_one_process_under_sequence_parallel(worlds, world_size, strategy):
    """fs.rules.llama on zoo.llama("tiny"): sp over tp = 2 alone and under FSDP (dp = 2).

    5 AdamW steps (eps 1e-8) turn the float32 reordering noise of sharded reductions in
    near-zero gradient elements into visible parameter gaps (measured 4.4e-5 under plain tp,
    3.5e-5 under sp); a wrong gradient moves a parameter by a step, lr = 1e-2."""
    config = CONFIGS["tiny"]
    result = worlds(world_size).run(dist_cases.train, strategy, config)[0]
    losses, params = dist_cases.reference(config, result["data_parallel"])
    assert result["losses"] == pytest.approx(losses, abs=1e-5)
    for name, value in params.items():
        torch.testing.assert_close(result["params"][name], value, atol=5e-4, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_measured_sequence_parallel_traffic_of_hugging_face_models_equals_the_cost_model(world4):
    """One all-gather per attention and MLP input (and lm_head's), a reduce-scatter per row-split
    output, Phi-3's gathered/sliced and Qwen3's head norms: bytes per collective and axis."""
    pytest.importorskip("transformers")
    cases = (("comm", "phi3", "sp"), ("comm", "qwen3", "sp"), ("comm", "llama", "fsdp_sp"))
    results = world4.run(hf_cases.run_cases, cases)
    for rank, per_rank in enumerate(results):
        for (_, model, strategy), result in zip(cases, per_rank, strict=True):
            where = f"{model} {strategy}, rank {rank}"
            assert result["measured"].keys() == result["predicted"].keys(), where
            for kind, by_axis in result["predicted"].items():
                assert result["measured"][kind] == pytest.approx(by_axis), f"{where}: {kind}"


_names = st.sampled_from(["a", "b", "layers", "0", "1", "mlp", "attn"])
_paths = st.lists(_names, min_size=1, max_size=4).map(".".join)
_styles = st.sampled_from(["colwise", "colwise_gather", "packed_colwise", "rowwise", "sequence"])
_kinds = st.sampled_from(["linear", "linear", "embedding", "conv1d"])


@given(st.lists(st.tuples(_paths, _styles, _kinds), max_size=12))
def test_gathering_modules_are_the_innermost_parents_holding_no_embedding(tp_styles):
    # the definition, spelled out pair by pair
    def inside(path, parent):
        return path != parent and (not parent or path.startswith(f"{parent}."))

    parents = dict.fromkeys(
        path.rpartition(".")[0]
        for path, style, kind in tp_styles
        if style in ("colwise", "colwise_gather", "packed_colwise") and kind != "embedding"
    )
    embeddings = [path for path, _, kind in tp_styles if kind == "embedding"]
    expected = tuple(
        parent
        for parent in parents
        if not any(inside(other, parent) for other in parents)
        and not any(inside(path, parent) for path in embeddings)
    )
    assert sequence_gathers(tp_styles) == expected
