"""Hugging Face causal LMs on packed documents, through `fs.packed_inputs`.

transformers finds the documents in ``position_ids`` that restart at each one and masks SDPA's
and eager attention block-diagonal; tiny Llama and Qwen2 (fp32, CPU) give a packed batch the
summed loss and the gradients of its documents run one by one. A model whose attention would
cross documents is refused, by class and attention implementation, before anything runs.
Flex attention's loss is checked in the slow suite (forward only: no backward on the CPU).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.core.document_attention import packed_forward, segment_bounds
from functional_shard.zoo import llama

from ..hf_cases import config
from ..strategies import documents

transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen2")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings off while a tiny model is made (its default token ids and sizes)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


IMPLEMENTATIONS = ("sdpa", "eager")


def _build(family: str, implementation: str) -> torch.nn.Module:
    """The tiny model in float32, weights drawn wide enough that attending across documents shows."""
    torch.manual_seed(0)
    with _quiet():
        model = transformers.AutoModelForCausalLM.from_config(
            config(family), attn_implementation=implementation
        )
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.2)
    return model


@functools.cache
def _model(family: str, implementation: str) -> torch.nn.Module:
    """`_build`'s model, one per family and implementation for the whole run (not to be changed)."""
    return _build(family, implementation)


def _pieces(docs: list[list[int]], seq_len: int) -> list[list[int]]:
    return [doc[start : start + seq_len] for doc in docs for start in range(0, len(doc), seq_len)]


def _packed_loss(model: torch.nn.Module, batch: fs.PackedBatch) -> torch.Tensor:
    logits = model(**fs.packed_inputs(model, batch)).logits
    return F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")


def _alone_loss(model: torch.nn.Module, pieces: list[list[int]]) -> torch.Tensor:
    """Each document in a forward of its own (no packing, no position ids): the summed token loss."""
    total = torch.zeros(())
    for piece in pieces:
        tokens = torch.tensor([piece])
        logits = model(input_ids=tokens, use_cache=False).logits
        total = total + F.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="sum")
    return total


def _assert_packed_equals_alone(model: torch.nn.Module, docs: list[list[int]], seq_len: int) -> None:
    batch = fs.pack(docs, seq_len, long="split")
    parameters = list(model.parameters())
    packed = _packed_loss(model, batch)
    alone = _alone_loss(model, _pieces(docs, seq_len))
    packed_grads = torch.autograd.grad(packed, parameters)
    alone_grads = torch.autograd.grad(alone, parameters)
    torch.testing.assert_close(packed.detach(), alone.detach(), atol=1e-5, rtol=1e-5)
    for (name, _), got, wanted in zip(model.named_parameters(), packed_grads, alone_grads, strict=True):
        torch.testing.assert_close(got, wanted, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=10)
@given(
    docs=documents(max_documents=5, max_length=12, vocab=128),
    seq_len=st.integers(4, 16),
    implementation=st.sampled_from(IMPLEMENTATIONS),
)
def test_a_packed_batch_has_the_loss_and_gradients_of_its_documents_alone(
    family, docs, seq_len, implementation
):
    _assert_packed_equals_alone(_model(family, implementation), docs, seq_len)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=30)
@given(docs=documents(max_documents=8, max_length=24, vocab=128), seq_len=st.integers(2, 32))
def test_packed_equals_alone_over_many_drawn_batches(family, implementation, docs, seq_len):
    _assert_packed_equals_alone(_model(family, implementation), docs, seq_len)


@pytest.mark.slow
def test_flex_attention_keeps_documents_apart_too():
    # forward only: flex attention has no backward on the CPU (torch 2.13), and transformers
    # compiles its block mask and kernel, a minute on the CPU. Rows of 16: torch 2.13's CPU flex
    # kernel returns different logits, often NaN, from one call to the next at 8 and 24 tokens
    # (a plain causal forward, no packing), and the same at every call at 16
    model = _build("llama", "flex_attention")
    docs = [[3, 4, 5, 6], [7, 8, 9, 10, 11], [1, 2]]
    with torch.no_grad():
        packed = _packed_loss(model, fs.pack(docs, 16))  # one row: the three documents side by side
        torch.testing.assert_close(packed, _alone_loss(model, docs))


def _qwen2_vl() -> torch.nn.Module:
    """A tiny Qwen2-VL (text tokens alone are packed: its vision tower never runs)."""
    text = {**_TINY, "vocab_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
    torch.manual_seed(0)
    with _quiet():  # its default token ids lie past this vocabulary
        config = transformers.Qwen2VLConfig(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}},
            vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2, "patch_size": 2},
            image_token_id=120,
            video_token_id=121,
            vision_start_token_id=122,
        )
        model = transformers.Qwen2VLForConditionalGeneration(config)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.2)
    return model


def test_a_model_that_finds_documents_in_the_first_of_four_rows_of_positions_gets_them_so():
    # Qwen2-VL hands its mask builder position_ids[0] of [4, rows, seq] ones (the text positions,
    # then the rotary temporal, height and width ones) and, given [rows, seq], none at all
    model = _qwen2_vl()
    docs = [[3, 4, 5, 6, 7, 8], [9, 10], [11], [12, 13, 14, 15, 16]]
    batch = fs.pack(docs, 8)
    positions = fs.packed_inputs(model, batch)["position_ids"]
    assert positions.shape == (4, 2, 8)
    assert all(torch.equal(row, batch.positions) for row in positions)
    with torch.no_grad():
        torch.testing.assert_close(_packed_loss(model, batch), _alone_loss(model, docs))


def test_the_check_would_see_documents_attend_to_each_other():
    # the same packed row with transformers' default cache on: its search for packed documents
    # is off, attention runs causal over the whole row, and the loss is not the documents' own
    model = _model("llama", "sdpa")
    docs = [[3, 4, 5, 6], [7, 8, 9, 10, 11]]
    batch = fs.pack(docs, 9)
    with torch.no_grad():
        crossing = model(input_ids=batch.tokens, position_ids=batch.positions, use_cache=True).logits
        loss = F.cross_entropy(crossing.flatten(0, 1), batch.labels.flatten(), reduction="sum")
        alone = _alone_loss(model, docs)
        assert not torch.allclose(loss, alone, atol=1e-3)
        torch.testing.assert_close(_packed_loss(model, batch), alone)


def test_the_arguments_carry_positions_no_mask_and_no_cache():
    batch = fs.pack([[1, 2, 3], [4, 5]], 4)
    inputs = fs.packed_inputs(_model("qwen2", "sdpa"), batch)
    assert sorted(inputs) == ["input_ids", "position_ids", "use_cache"]
    assert inputs["use_cache"] is False
    assert inputs["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]


def test_flash_attention_gets_each_documents_boundaries_over_the_flattened_rows():
    # transformers' flash path finds documents in position_ids in one row only; with the
    # boundaries given it runs varlen over every row (not run here: flash attention needs a GPU)
    model = _build("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    batch = fs.pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 5)
    inputs = fs.packed_inputs(model, batch)
    assert inputs["cu_seq_lens_q"].tolist() == inputs["cu_seq_lens_k"].tolist() == [0, 3, 5, 9, 10]
    assert inputs["cu_seq_lens_q"].dtype == torch.int32
    assert inputs["max_length_q"] == inputs["max_length_k"] == 4


@settings(max_examples=30)
@given(docs=documents(max_documents=8, max_length=24, vocab=128), seq_len=st.integers(2, 32))
def test_the_boundaries_read_from_document_ids_are_the_batchs_own(docs, seq_len):
    # fs.forward_backward has the rows' tensors only: their ids give the boundaries pack() knew
    batch = fs.pack(docs, seq_len, long="split")
    assert segment_bounds(batch.document_ids).tolist() == batch.cu_seqlens.tolist()


def test_packed_rows_by_tensors_get_the_arguments_packed_inputs_gives():
    model = _build("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    batch = fs.pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 5)
    inputs = fs.packed_inputs(model, batch)
    forward = packed_forward(model)
    for positions, ids in ((batch.positions, batch.document_ids), (None, batch.document_ids)):
        keywords = forward.keywords(batch.tokens, positions, ids, who="step")
        assert keywords.keys() == inputs.keys() - {"input_ids"}
        for name, value in keywords.items():
            assert (
                value.tolist() == inputs[name].tolist() if torch.is_tensor(value) else value == inputs[name]
            )


def test_the_zoo_llama_gets_its_own_keywords():
    model = llama("tiny", device="cpu")
    batch = fs.pack([[1, 2, 3], [4, 5]], 6)
    inputs = fs.packed_inputs(model, batch)
    assert sorted(inputs) == ["document_ids", "positions", "tokens"]
    assert model(**inputs).shape[:2] == (1, 6)


class OptimizedModule(torch.nn.Module):
    """Stands for torch.compile's wrapper, whose first making in a process takes seconds: it holds the
    model as ``_orig_mod``, and its forward takes ``(*args, **kwargs)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self._orig_mod = model

    def forward(self, *args: object, **kwargs: object) -> object:
        return self._orig_mod(*args, **kwargs)


def _assert_compiled_gets_the_same(model: torch.nn.Module, compiled: torch.nn.Module) -> None:
    batch = fs.pack([[1, 2, 3], [4, 5]], 6)
    got, wanted = fs.packed_inputs(compiled, batch), fs.packed_inputs(model, batch)
    assert got.keys() == wanted.keys()
    assert all(torch.equal(got[n], wanted[n]) for n in wanted if isinstance(wanted[n], torch.Tensor))


@pytest.mark.parametrize("kind", ["zoo", "hf"])
def test_a_compiled_model_gets_the_arguments_of_the_model_it_compiled(kind):
    # the wrapper's (*args, **kwargs) was read as a forward taking no document boundaries: refused
    model = llama("tiny", device="cpu") if kind == "zoo" else _model("llama", "sdpa")
    _assert_compiled_gets_the_same(model, OptimizedModule(model))


@pytest.mark.slow
def test_torch_compiles_own_wrapper_gets_them_too():
    model = llama("tiny", device="cpu")
    _assert_compiled_gets_the_same(model, torch.compile(model, backend="eager"))  # read, never called


def _refusal(model: torch.nn.Module, batch: object = None) -> str:
    with pytest.raises(fs.ShardingError) as raised:
        fs.packed_inputs(model, fs.pack([[1, 2], [3]], 4) if batch is None else batch)
    return str(raised.value)


def test_an_attention_that_cannot_keep_documents_apart_is_refused_by_name():
    model = _build("llama", "sdpa")
    model.config._attn_implementation = "paged|sdpa"
    assert _refusal(model) == (
        "packed_inputs(LlamaForCausalLM): its attention implementation 'paged|sdpa' cannot keep packed "
        "documents apart; transformers does so for 'sdpa', 'eager', 'flex_attention' (a block-diagonal "
        "mask from position_ids) and 'flash_attention_2', 'flash_attention_3', 'flash_attention_4' "
        "(each document's own varlen call). Load it with attn_implementation='sdpa' (or call "
        "model.set_attn_implementation('sdpa'))."
    )


def test_bidirectional_attention_is_refused():
    model = _build("qwen2", "sdpa")
    model.config.is_causal = False
    assert _refusal(model).startswith(
        "packed_inputs(Qwen2ForCausalLM): its attention is bidirectional (config.is_causal=False)"
    )


def test_an_encoder_whose_layers_attend_both_ways_is_refused_by_layer():
    # BERT's config says nothing (no is_causal); its layers do, and it builds its masks with the
    # same create_causal_mask import as a decoder
    model = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    )
    model.config._attn_implementation = "sdpa"
    assert _refusal(model).startswith(
        "packed_inputs(BertModel): its attention encoder.layer.0.attention.self (BertSelfAttention) "
        "is bidirectional"
    )
    with pytest.raises(fs.ShardingError, match=re.escape("packed_inputs(model=NoneType): pass the model")):
        fs.packed_inputs(None, fs.pack([[1, 2]], seq_len=2))  # type: ignore[arg-type]


def test_a_model_that_builds_no_mask_from_position_ids_is_refused():
    # Mamba has no attention: its recurrent state runs on from one document into the next
    with _quiet():
        model = transformers.MambaForCausalLM(
            transformers.MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=1)
        )
    model.config._attn_implementation = "sdpa"
    assert re.match(
        re.escape(
            "packed_inputs(MambaForCausalLM): transformers.models.mamba.modeling_mamba builds its "
            "attention without transformers.masking_utils.create_causal_mask"
        ),
        _refusal(model),
    )


@pytest.mark.parametrize(
    ("family", "sizes", "builder"),
    [
        # OPT imports create_causal_mask but hands it no position_ids: its mask never finds documents
        ("OPT", {"ffn_dim": 32, "word_embed_proj_dim": 16}, "opt.modeling_opt.OPTDecoder"),
        # GPT-OSS hands them to its rotary embedding, not to its masks (a dict built without them)
        (
            "GptOss",
            {"intermediate_size": 32, "num_local_experts": 2, "num_experts_per_tok": 1, "head_dim": 8},
            "gpt_oss.modeling_gpt_oss.GptOssModel",
        ),
    ],
)
def test_a_model_that_hands_its_mask_no_position_ids_is_refused(family, sizes, builder):
    config = getattr(transformers, f"{family}Config")(
        vocab_size=32, hidden_size=16, num_attention_heads=2, num_hidden_layers=1, **sizes
    )
    with _quiet():
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    model.config._attn_implementation = "eager"
    message = _refusal(model)
    file = builder.split(".")[1]
    assert re.match(
        re.escape(f"packed_inputs({family}ForCausalLM): transformers.models.{builder}")
        + re.escape(" builds its attention mask (line ")
        + rf"\d+ of {file}\.py\) without handing it position_ids",
        message,
    ), message
    assert message.endswith(
        "Pack documents for a model that hands them to its mask (Llama, Qwen2, Mistral, ...), or pad them."
    )


_TINY = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}


@pytest.mark.parametrize(
    ("family", "sizes", "named"),
    [
        # a Mamba layer beside an attention one: the mask reaches the attention layer only
        (
            "Jamba",
            {"attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 4, "mamba_dt_rank": 4},
            "its layers model.layers.0.mamba (JambaMambaMixer)",
        ),
        (
            "Qwen3Next",
            {"linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "head_dim": 8},
            "its layers model.layers.0.linear_attn (Qwen3NextGatedDeltaNet), model.layers.1.linear_attn",
        ),
        # a short causal convolution reaches a few tokens back, into the document before
        (
            "Lfm2",
            {"layer_types": ["conv", "full_attention"]},
            "its layers model.layers.0.conv (Lfm2ShortConv)",
        ),
    ],
)
def test_a_hybrid_model_whose_layers_carry_state_across_documents_is_refused(family, sizes, named):
    config = getattr(transformers, f"{family}Config")(
        **_TINY, num_attention_heads=2, num_key_value_heads=1, **sizes
    )
    with _quiet():
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    model.config._attn_implementation = "sdpa"
    message = _refusal(model)
    assert message.startswith(f"packed_inputs({family}ForCausalLM): {named}"), message
    assert message.endswith("Pack documents for a model of attention layers alone, or pad them.")


def test_recurrent_layers_named_only_in_the_config_are_refused_too():
    model = _build("qwen2", "sdpa")
    model.config.layer_types = ["full_attention", "linear_attention"]
    assert "its layers [1] (linear_attention in config.layer_types) carry a state" in _refusal(model)


def test_a_module_without_document_boundaries_and_a_batch_not_packed_are_refused():
    assert _refusal(torch.nn.Linear(2, 2)).startswith(
        "packed_inputs(Linear): its forward takes no document boundaries"
    )
    assert _refusal(_model("llama", "sdpa"), batch=torch.zeros(1, 4)) == (
        "packed_inputs(LlamaForCausalLM, batch=Tensor): pass the PackedBatch that fs.pack returns"
    )
