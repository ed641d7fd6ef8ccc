"""Tensor-parallel rules from Hugging Face models' own plans (pure: meta models, no process group)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import functional_shard as fs
from functional_shard import zoo
from functional_shard.planning.tp import hf_plans as hf

from .. import hf_cases

transformers = pytest.importorskip("transformers")


def meta(name: str, **overrides: object) -> nn.Module:
    class_name, values = hf_cases.CONFIGS[name]
    config = getattr(transformers, class_name)(**{**values, **overrides})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_llama_plan_maps_every_style_as_transformers_combines_it():
    rules = fs.rules.from_hf(meta("llama"))
    targets = {
        "model.embed_tokens.weight": "rowwise",
        "model.layers.1.self_attn.q_proj.weight": "colwise",
        "model.layers.1.self_attn.o_proj.weight": "rowwise",
        "model.layers.0.mlp.down_proj.weight": "rowwise",
        "lm_head.weight": "colwise_gather",
    }
    assert {path: rules.match(path).target for path in targets} == targets
    # the norms between the plan's modules: replicated, split over the sequence under sp
    norms = ("model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight")
    assert {rules.match(path).target for path in (*norms, "model.norm.weight")} == {"sequence"}
    assert rules.match("model.rotary_emb") is None
    assert rules.name == "hf"


def test_norms_inside_split_modules_keep_their_plan_style():
    rules = fs.rules.from_hf(meta("qwen3"))
    assert rules.match("model.layers.0.self_attn.q_norm.weight").target == "replicate_grad_allreduce"
    assert rules.match("model.layers.0.input_layernorm.weight").target == "sequence"


def test_a_config_gives_the_same_rules_as_its_model():
    config = hf_cases.config("phi3")
    assert fs.rules.from_hf(config) == fs.rules.from_hf(meta("phi3"))


def test_phi3_fused_projections_are_gathered_then_sliced():
    rules = fs.rules.from_hf(meta("phi3"))
    assert rules.match("model.layers.0.self_attn.qkv_proj.weight").target == "colwise_gather"
    assert rules.match("model.layers.0.self_attn.o_proj.weight").target == "rowwise_split_input"
    assert rules.match("model.layers.0.mlp.gate_up_proj.weight").target == "colwise_gather"


def test_qwen3_head_norms_are_replicated_with_gradients_all_reduced():
    rules = fs.rules.from_hf(meta("qwen3"))
    assert rules.match("model.layers.0.self_attn.q_norm.weight").target == "replicate_grad_allreduce"
    plan = fs.shard(meta("qwen3"), fs.Mesh(tp=2), fs.tp("hf", "tp"))
    assert plan.params["model.layers.0.self_attn.q_norm.weight"].compute.is_replicated
    assert ("model.layers.0.self_attn.k_norm", "replicate_grad_allreduce", "other") in plan.config.tp.styles


def test_every_style_transformers_uses_maps_or_is_refused_by_name():
    import transformers.models.auto.configuration_auto as auto

    seen = set()
    for class_name in auto.CONFIG_MAPPING_NAMES.values():
        config_class = getattr(transformers, class_name, None)
        seen |= set((getattr(config_class, "base_model_tp_plan", None) or {}).values())
    assert len(seen) > 10
    assert seen <= hf.HF_STYLES.keys() | hf.REFUSED_HF_STYLES.keys()


def test_mixture_of_experts_styles_split_the_3d_expert_tensors():
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    rules = fs.rules.from_hf(config)
    assert rules.match("model.layers.0.mlp.experts.gate_up_proj").target == "packed_colwise"
    assert rules.match("model.layers.0.mlp.experts.down_proj").target == "rowwise"
    with pytest.raises(fs.PolicyError, match=re.escape("style 'packed_rowwise'")):
        fs.rules.from_hf(_with_plan(config, {"layers.*.mlp.experts.down_proj": "packed_rowwise"}))


def _with_plan(config: object, plan: dict[str, str]) -> object:
    config.base_model_tp_plan = {**config.base_model_tp_plan, **plan}  # type: ignore[attr-defined]
    return config


def test_a_model_without_a_plan_is_refused_with_the_way_out():
    with pytest.raises(fs.PolicyError, match=re.escape("GPT2LMHeadModel has no tensor-parallel plan")):
        fs.rules.from_hf(meta("gpt2"))
    with pytest.raises(fs.PolicyError, match=re.escape("needs a transformers PreTrainedModel")):
        fs.rules.from_hf(nn.Linear(2, 2))


def test_for_model_picks_hf_rules_then_named_sets_by_their_names():
    assert fs.rules.for_model(meta("mistral")).name == "hf"
    assert fs.rules.for_model(meta("gpt2")).name == "gpt2_hf"
    assert fs.rules.for_model(zoo.Llama(zoo.LlamaConfig(64, 16, 32, num_layers=1))).name == "llama"
    with pytest.raises(fs.PolicyError, match=re.escape("llama: no parameter matches")) as error:
        fs.rules.for_model(nn.Sequential(nn.Linear(2, 2)))
    assert "hf: not a transformers PreTrainedModel" in str(error.value)
    assert "mlp: no parameter matches" in str(error.value)


def test_auto_splits_every_head_tied_to_the_split_token_embedding_alike():
    """BERT's pre-training heads: the masked-LM decoder, tied to the word embedding, comes before the
    next-sentence head; both split on their output, the decoder's (vocabulary, dim) weight as the
    embedding's (left whole, it would run a split weight on whole activations)."""
    import transformers

    _, values = hf_cases.MASKED["bert"]
    with torch.device("meta"):
        model = transformers.BertForPreTraining(transformers.BertConfig(**values))
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp("auto", "tp"))
    styles = {path: style for path, style, _ in plan.config.tp_styles}
    assert styles["bert.embeddings.word_embeddings"] == "rowwise"
    assert styles["cls.predictions.decoder"] == styles["cls.seq_relationship"] == "colwise_gather"
    assert plan.sharding("cls.predictions.decoder.weight").compute == fs.P("tp", None)


def test_tp_by_name_resolves_against_the_model_in_shard():
    model = meta("llama_tied")
    by_name = fs.shard(model, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp("hf", "tp"))
    explicit = fs.shard(model, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp(fs.rules.from_hf(model), "tp"))
    assert by_name == explicit
    # tied: lm_head.weight is an alias of the vocabulary-split embedding
    assert by_name.aliases["model.embed_tokens.weight"] == ("model.embed_tokens.weight", "lm_head.weight")
    assert by_name.params["model.embed_tokens.weight"].storage == fs.P(("tp", "dp"), None)
    with pytest.raises(fs.PolicyError, match=re.escape("one of ('hf', 'auto')")):
        fs.tp("llama", "tp")


def test_tensor_parallel_over_more_ranks_than_heads_is_refused_naming_the_heads():
    model = meta("mistral", num_key_value_heads=2)
    plan = fs.shard(model, fs.Mesh(tp=4), fs.tp("auto", "tp"))
    with pytest.raises(fs.PlanError, match=re.escape("its 2 attention heads")) as error:
        fs.check_runnable(plan, model)
    assert "model.layers.0.self_attn.k_proj" in str(error.value)


def test_a_rowwise_layer_whose_feeding_layer_stays_whole_is_refused_naming_both():
    model = meta("phi3")
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp(fs.rules.llama, "tp"))
    with pytest.raises(fs.PlanError) as error:
        fs.check_runnable(plan, model)
    assert re.search(
        r"model\.layers\.0\.self_attn\.o_proj: split rowwise .* "
        r"\['model\.layers\.0\.self_attn\.qkv_proj'\] stay whole",
        str(error.value),
    )
    fs.check_runnable(fs.shard(model, fs.Mesh(tp=2), fs.tp("hf", "tp")), model)


def test_a_colwise_layer_nothing_reads_split_is_refused():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp([("0", "colwise")], "tp"))
    with pytest.raises(fs.PlanError, match=re.escape("0: split colwise (its output stays split")):
        fs.check_runnable(plan, model)
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp([("0", "colwise"), ("2", "rowwise")], "tp"))
    fs.check_runnable(plan, model)


def test_gpt2_conv1d_layers_split_as_their_stored_layout():
    """Conv1D keeps its weight (in, out): colwise splits dim 1, rowwise dim 0; c_attn's packed
    q, k, v are split piece by piece (the spec says how much, the style which part), its bias whole."""
    model = meta("gpt2")
    assert fs.rules.for_model(model).name == "gpt2_hf"
    plan = fs.shard(model, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp("auto", "tp"))
    specs = {path: plan.params[path].compute for path in plan.params}
    assert specs["transformer.h.0.attn.c_attn.weight"] == fs.P(None, "tp")
    assert specs["transformer.h.0.attn.c_attn.bias"].is_replicated
    assert specs["transformer.h.0.attn.c_proj.weight"] == fs.P("tp", None)
    assert specs["transformer.h.0.mlp.c_fc.bias"] == fs.P("tp")
    assert ("transformer.h.0.attn.c_attn", "packed_colwise", "conv1d") in plan.config.tp.styles
    fs.check_runnable(plan, model)


def test_gpt2_packed_pieces_that_do_not_split_are_refused_naming_the_heads():
    model = meta("gpt2", n_head=2, n_embd=16)
    plan = fs.shard(model, fs.Mesh(tp=4), fs.tp("auto", "tp"))
    with pytest.raises(fs.PlanError, match=re.escape("its 2 attention heads")) as error:
        fs.check_runnable(plan, model)
    assert "transformer.h.0.attn.c_attn" in str(error.value)


def test_gpt2_conv1d_splits_that_are_not_even_are_refused():
    model = meta("gpt2", n_inner=66)
    plan = fs.shard(model, fs.Mesh(tp=4), fs.tp("auto", "tp"))
    with pytest.raises(fs.PlanError, match=re.escape("c_fc: colwise Conv1D with 66 output features over 4")):
        fs.check_runnable(plan, model)


def test_packed_colwise_needs_an_attention_that_says_its_piece_size():
    model = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 8))
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp([("0", "packed_colwise"), ("2", "rowwise")], "tp"))
    with pytest.raises(fs.PlanError, match=re.escape("0: 'packed_colwise' needs an nn.Linear or Conv1D")):
        fs.check_runnable(plan, model)


def test_conv1d_styles_other_than_the_split_ones_are_refused():
    model = meta("gpt2")
    rules = fs.Rules([("*.mlp.c_fc", "colwise_gather"), *fs.rules.gpt2_hf])
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp(rules, "tp"))
    with pytest.raises(fs.PlanError, match=re.escape("style 'colwise_gather' on a Conv1D")):
        fs.check_runnable(plan, model)


def test_gemma_scaled_embedding_buffer_stays_replicated_under_tensor_parallel():
    model = meta("gemma")
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp("hf", "tp"))
    assert plan.buffers["model.embed_tokens.embed_scale"].storage == fs.P()
    fs.check_runnable(plan, model)


def test_rowwise_split_input_traffic_gathers_the_input_gradient():
    plan = fs.shard(meta("phi3"), fs.Mesh(tp=2), fs.tp("hf", "tp"))
    tokens = 16
    comm = plan.cost("adamw", tokens=tokens).comm_bytes
    hidden, inner, vocab, layers = 32, 64, hf_cases.VOCAB, 2
    qkv = 3 * hidden
    # per layer: qkv and gate_up all-reduce their input gradients (hidden) and all-gather their
    # outputs; o_proj and down_proj all-reduce their outputs (hidden) and all-gather their input
    # gradients; embedding all-reduces its output; lm_head all-reduces its input gradient and
    # all-gathers its output
    reduced = layers * 4 * hidden + 2 * hidden
    gathered = layers * (qkv + 2 * inner + hidden + inner) + vocab
    assert comm["all_reduce"]["tp"] == 2 * (2 - 1) / 2 * reduced * tokens * 4
    assert comm["all_gather"]["tp"] == (2 - 1) / 2 * gathered * tokens * 4
