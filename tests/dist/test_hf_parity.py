"""Hugging Face transformers models (tiny configs, no download) train as one process on 4 gloo ranks.

Tensor parallel follows each model's own plan (``fs.tp("auto", "tp")``; GPT-2, which has
none, gets ``fs.rules.gpt2_hf``: Conv1D layers and the packed ``c_attn`` split for real).
Every case runs 3 AdamW steps (lr 1e-2, eps 1e-6, fp32) and is compared with one process
training on the whole global batch: the first step's gradients elementwise within 1e-6
absolute plus 1e-4 relative (AdamW would hide a gradient off by a constant factor: its
step is scale-free), losses within 1e-5, parameters within 5e-4 absolute plus 1e-4
relative: AdamW scales each step to about lr, so the float32 reordering noise of sharded
reductions in a near-zero gradient element moves it visibly (measured up to 1.3e-4, Qwen2's
embedding under ddp); a wrong gradient moves parameters by a step, 1e-2.
Cases are batched into few runs of one world: starting ranks and importing transformers
dominates.
"""

from __future__ import annotations

import pytest
import torch

import functional_shard as fs

from .. import activation_cases, hf_cases

pytest.importorskip("transformers")

STRATEGIES = ("ddp", "zero1", "fsdp", "fsdp_tp", "tp")
# sequence parallel (tp = 4 alone, tp = 2 under FSDP), the way torchtitan runs it: GPT-2's Conv1D
# and packed layers are refused under it (test_sequence_parallel.py)
SEQUENCE = ("sp", "fsdp_sp")
MODELS = {name: STRATEGIES + (SEQUENCE if name != "gpt2" else ()) for name in hf_cases.CONFIGS}

# the riskiest case of each kind: tied weights under 2-D, biases, fused and packed
# projections split by tensor parallel, a scaled embedding under FSDP, ZeRO-1; sequence
# parallel with tied weights under FSDP (tp = 2) and with Phi-3's gathered and sliced
# projections (tp = 4)
DEFAULT = (
    ("llama_tied", "fsdp_tp"),
    ("llama_tied", "zero1"),
    ("qwen2", "tp"),
    ("gemma", "fsdp"),
    ("phi3", "tp"),
    ("gpt2", "fsdp_tp"),
    ("llama_tied", "fsdp_sp"),
    ("phi3", "sp"),
)
EVERY = tuple((model, strategy) for model, strategies in MODELS.items() for strategy in strategies)


@pytest.fixture(scope="module")
def world(world4):
    return world4


def check(world: fs.LocalWorld, cases: tuple[tuple[str, str], ...]) -> None:
    results = world.run(hf_cases.run_cases, tuple(("train", m, s) for m, s in cases))[0]
    references: dict[tuple[str, int], tuple[list[float], dict[str, torch.Tensor]]] = {}
    for (model, strategy), result in zip(cases, results, strict=True):
        key = (model, result["data_parallel"])
        if key not in references:
            references[key] = hf_cases.reference(*key)
        losses, params, grads = references[key]
        label = f"{model} under {strategy}"
        assert result["grads"].keys() == grads.keys(), label
        for name, value in grads.items():
            gap = (result["grads"][name] - value).abs().max().item()
            torch.testing.assert_close(
                result["grads"][name],
                value,
                atol=1e-6,
                rtol=1e-4,
                msg=f"{label}: grad of {name} off by {gap}",
            )
        assert result["losses"] == pytest.approx(losses, abs=1e-5), label
        assert result["params"].keys() == params.keys(), label
        for name, value in params.items():
            gap = (result["params"][name] - value).abs().max().item()
            torch.testing.assert_close(
                result["params"][name], value, atol=5e-4, rtol=1e-4, msg=f"{label}: {name} off by {gap}"
            )


def test_hf_models_train_as_one_process(world):
    """The riskiest strategy of each architecture; the slow test runs every other pair."""
    check(world, DEFAULT)


def test_qwen3_under_the_named_llama_rules_trains_as_one_process(world):
    """Its q_norm and k_norm, one weight all heads share, have their gradients all-reduced
    (``*norm`` as "sequence" left each rank its own heads' part)."""
    check(world, (("qwen3", "tp_llama_rules"),))


@pytest.mark.parametrize("strategy", ["tp", pytest.param("fsdp_tp", marks=pytest.mark.slow)])
def test_bert_whose_head_is_tied_to_the_split_embedding_trains_as_one_process(world, strategy):
    """tp("auto") splits BERT from its structure: the masked-LM decoder, tied to the word embedding
    split over the vocabulary, is split alike (left whole, its DTensor weight met plain
    activations), and its bias, tied to the prediction head's, is split once for both names."""
    check(world, (("bert", strategy),))


@pytest.mark.slow
def test_every_hf_model_under_every_strategy_trains_as_one_process(world):
    check(world, tuple(case for case in EVERY if case not in DEFAULT))


# tp("auto") under sequence parallel, refused by name: experts split by tp and GPT-2's own split
# take whole activations; Falcon's fused query_key_value has no plan and its structure gives none;
# OPT and BERT keep learned position (and token type) tables whole outside the gathering modules
REFUSED = {
    ("falcon", "tp"): "shard",
    ("falcon", "sp"): "shard",
    **{(name, "sp"): "apply" for name in ("opt", "deepseek_v3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt2")},
    ("bert", "sp"): "apply",
}


@pytest.mark.slow
def test_every_hf_family_under_tp_auto_trains_as_one_process_or_is_refused_by_name(worlds):
    """On 2 ranks, tp("auto") alone and with sequence parallel: one step's loss and every gradient
    as one process's, or a refusal by name at shard() or apply(), never a raw error in the forward."""
    names = (*hf_cases.CONFIGS, *hf_cases.MASKED, *hf_cases.SWEEP)
    cases = tuple(("tp_auto", name, strategy) for name in names for strategy in ("tp", "sp"))
    results = worlds(2).run(hf_cases.run_cases, cases)[0]
    for (_, name, strategy), result in zip(cases, results, strict=True):
        label = f"{name} under {strategy}"
        assert result["refused"] == REFUSED.get((name, strategy)), f"{label}: {result.get('why')}"
        if result["refused"]:
            continue
        model = hf_cases.build(name)
        loss = hf_cases.loss_of(model, hf_cases.batches(1)[0][: hf_cases.MICRO_BATCH])
        loss.backward()
        assert result["loss"] == pytest.approx(loss.item(), abs=1e-5), label
        grads = {k: v.grad for k, v in model.named_parameters() if v.grad is not None}
        assert result["grads"].keys() == grads.keys(), label
        for key, value in grads.items():
            torch.testing.assert_close(
                result["grads"][key], value, atol=1e-6, rtol=1e-4, msg=f"{label}: {key}"
            )


def test_measured_tensor_parallel_traffic_equals_the_cost_model(world):
    """Phi-3's gathered qkv / sliced o_proj, Qwen3's head norms and GPT-2's Conv1D layers with
    the packed c_attn (its whole bias's gradient gathered): bytes each rank sends, per
    collective and axis, as the cost model predicts."""
    cases = (("comm", "phi3", "tp"), ("comm", "qwen3", "tp"), ("comm", "gpt2", "tp"))
    results = world.run(hf_cases.run_cases, cases)
    for rank, per_rank in enumerate(results):
        for (_, model, _), result in zip(cases, per_rank, strict=True):
            assert result["measured"].keys() == result["predicted"].keys(), f"{model}, rank {rank}"
            for kind, by_axis in result["predicted"].items():
                assert result["measured"][kind] == pytest.approx(by_axis), f"{model}, rank {rank}: {kind}"


def test_packed_weights_materialize_checkpoint_and_trace_as_they_run(world):
    """GPT-2's packed c_attn, split piece by piece (and by FSDP2 on top): filled from whole values
    on the meta device; saved whole under one plan and loaded under another exactly; a sharded
    save (DCP cannot describe a strided split) refused by name; the activations the meta trace
    predicts (Conv1D and packed layers re-enacted) equal what a real forward keeps."""
    cases = (
        ("materialize", "gpt2", "tp"),
        ("materialize", "gpt2", "fsdp_tp"),
        ("checkpoint", "gpt2", "fsdp_tp>tp"),
        ("activations", "gpt2", "tp"),
        ("activations", "gpt2", "fsdp_tp"),
    )
    for rank, results in enumerate(world.run(hf_cases.run_cases, cases)):
        under_tp, under_fsdp_tp, saved, *traced = results
        for label, result in (("tp", under_tp), ("fsdp_tp", under_fsdp_tp)):
            assert "transformer.h.0.attn.c_attn.weight" in result["gaps"]
            assert max(result["gaps"].values()) == 0, f"{label}, rank {rank}: {result['gaps']}"
        assert saved["gap"] == 0, f"rank {rank}"
        refusal = "transformer.h.0.attn.c_attn (2 layers in all) holds a packed weight"
        assert refusal in saved["refused"], f"rank {rank}: {saved['refused']!r}"
        for (_, _, strategy), result in zip(cases[3:], traced, strict=True):
            assert result["traced"] == result["kept"], f"{strategy}, rank {rank}"


def test_sequence_parallel_traces_what_it_keeps_and_refuses_an_uneven_sequence(world):
    """Under fsdp + sp (HF Llama, 3 layers: two traced, the third extrapolated) the activations
    the meta trace predicts equal what saved_tensors_hooks sees, on every rank. A sequence of 7
    tokens under sp over 4 ranks is refused by name on every rank before any collective: the
    same process group then trains a step."""
    for rank, cases in enumerate(world.run(activation_cases.measure, ["hf_fsdp_sp"])):
        result = cases["hf_fsdp_sp"]
        assert result["traced"] == result["saved"], f"rank {rank}: {result}"
    for rank, (uneven,) in enumerate(world.run(hf_cases.run_cases, (("uneven", "llama", "sp"),))):
        assert uneven["tp"] == 4
        expected = "this input's sequence length is 7, which 4 does not divide"
        assert expected in uneven["refused"], f"rank {rank}: {uneven['refused']!r}"
        assert uneven["loss"] > 0
