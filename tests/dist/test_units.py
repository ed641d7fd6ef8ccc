"""FSDP units for any model: repeated blocks found wherever they live, groups, and why.

Models the library has no rules for (torchtitan's Llama with its blocks in a ModuleDict, a
DeepSeek-shaped MoE, a timm-shaped ViT whose blocks are a Sequential, Hugging Face T5 and
ViT built from configs) get one unit per block; ``fsdp(units=...)`` takes groups of
modules; ``explain()`` says why each unit is one; on 4 gloo ranks what FSDP2 gathers per
unit, and what it keeps, equal the plan's prediction.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard.core.units import format_bytes
from functional_shard.zoo import Block, Llama

from .. import dist_cases, unit_cases
from ..unit_models import DeepSeekMoE, SequentialViT, TitanConfig, TitanLlama, TransformerBlock

MESH = fs.Mesh(dp=4)


class Blocks(nn.ModuleList):
    """A ModuleList subclass, as some codebases keep their stacks."""


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def _stack(kind: str, count: int) -> tuple[nn.Module, list[str]]:
    """A container of ``count`` blocks, and the relative paths of the blocks it should give."""
    blocks = [_block() for _ in range(count)]
    if kind == "ModuleList":
        return nn.ModuleList(blocks), [str(i) for i in range(count)]
    if kind == "subclass":
        return Blocks(blocks), [str(i) for i in range(count)]
    if kind == "ModuleDict":
        return nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}), [str(i) for i in range(count)]
    if kind == "named ModuleDict":
        names = [f"block_{chr(97 + i)}" for i in range(count)]
        return nn.ModuleDict(dict(zip(names, blocks, strict=True))), names
    # a Sequential's elements are blocks when their kind repeats
    return nn.Sequential(*blocks), [str(i) for i in range(count)] if count > 1 else []


@given(
    kinds=st.lists(
        st.sampled_from(["ModuleList", "subclass", "ModuleDict", "named ModuleDict", "Sequential"]),
        min_size=1,
        max_size=2,
    ),
    counts=st.lists(st.integers(1, 4), min_size=2, max_size=2),
)
def test_repeated_blocks_are_units_wherever_they_live(kinds, counts):
    # one stack, or two (an encoder's and a decoder's), beside a head that is no block
    model, expected = nn.Module(), []
    for name, kind, count in zip(("encoder", "decoder"), kinds, counts, strict=False):
        stack, blocks = _stack(kind, count)
        model.add_module(name, nn.Module())
        model.get_submodule(name).add_module("layers", stack)
        expected += [f"{name}.layers.{block}" for block in blocks]
    model.head = nn.Linear(4, 2)
    plan = fs.shard(model, MESH, fs.fsdp("dp"))
    assert plan.config.fsdp.units == ("", *expected)
    reasons = dict(plan.config.fsdp.unit_reasons)
    for unit in expected:
        assert re.fullmatch(r"a repeated block: \d+ × Sequential in .*\.layers \(\w+\)", reasons[unit])
    assert plan.unit_of("head.weight") == ""


def test_torchtitans_llama_gets_a_unit_per_block_and_a_group_for_norm_and_head():
    model = TitanLlama(TitanConfig(layers=3))
    plan = fs.shard(model, MESH, fs.fsdp("dp"))
    assert plan.config.fsdp.units == ("", "layers.0", "layers.1", "layers.2")
    grouped = fs.shard(model, MESH, fs.fsdp("dp", units=(TransformerBlock, ("norm", "output"))))
    assert grouped.config.fsdp.unit_groups == (("norm", "output"),)
    assert grouped.unit_of("output.weight") == grouped.unit_of("norm.weight") == "norm+output"
    assert grouped.unit_of("tok_embeddings.weight") == ""
    explained = grouped.explain()
    assert "layers.* ×3" in explained
    assert re.search(r"norm\+output\s+\S+ \S+\s+fsdp\(units=\.\.\.\) groups norm, output", explained)
    assert "fsdp(units=...) selects it (TransformerBlock)" in explained
    assert fs.Plan.from_json(grouped.to_json()) == grouped
    # the root no longer holds the norm and the head while the blocks run: a smaller peak
    assert grouped.cost().gathered_bytes < plan.cost().gathered_bytes
    text = "fsdp(dp, units=(TransformerBlock, ('norm', 'output',),))"
    assert fs.format_policy(fs.parse_policy(text, model=model)) == text


def test_a_deepseek_shaped_moe_and_a_sequential_vit_get_their_blocks():
    moe = fs.shard(DeepSeekMoE(TitanConfig()), MESH, fs.fsdp("dp"))
    assert moe.config.fsdp.units == ("", "layers.0", "layers.1", "layers.2")
    vit = fs.shard(SequentialViT(depth=3), MESH, fs.fsdp("dp"))
    assert vit.config.fsdp.units == ("", "blocks.0", "blocks.1", "blocks.2")
    assert (
        dict(vit.config.fsdp.unit_reasons)["blocks.1"]
        == "a repeated block: 3 × VisionBlock in blocks (Sequential)"
    )


def test_hugging_face_encoder_decoders_and_vits_get_both_stacks():
    from transformers import T5Config, T5ForConditionalGeneration, ViTConfig, ViTModel

    with torch.device("meta"):
        t5 = T5ForConditionalGeneration(
            T5Config(
                vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=3, num_heads=2
            )
        )
        vit = ViTModel(
            ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
        )
    units = fs.shard(t5, MESH, fs.fsdp("dp")).config.fsdp.units
    blocks = {"encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1", "decoder.block.2"}
    assert blocks <= set(units)  # and, inside each, the elements of its own ModuleList of sublayers
    assert all(
        unit == "" or any(unit == b or unit.startswith(f"{b}.layer.") for b in blocks) for unit in units
    )
    vit_units = fs.shard(vit, MESH, fs.fsdp("dp")).config.fsdp.units
    assert [type(vit.get_submodule(unit)).__name__ for unit in vit_units] == [
        "ViTModel",
        "ViTLayer",
        "ViTLayer",
    ]


def test_a_model_without_repeated_blocks_is_one_unit_and_explain_says_what_it_costs():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = fs.shard(model, MESH, fs.fsdp("dp"))
        explained = plan.explain()
    assert plan.config.fsdp.units == ("",)
    gathered = format_bytes(plan.cost().gathered_bytes)
    assert re.search(
        rf"\(root\)\s+{re.escape(gathered)}\s+the root: every parameter no other unit holds", explained
    )
    assert "One unit: the model has no repeated blocks" in explained


@pytest.mark.parametrize(
    ("units", "message"),
    [
        ((("norm", "head"),), r"the group \('norm', 'head'\) names 'head', which is no module of the model"),
        ((("layers.0", "layers.0.attention"),), r"holds 'layers\.0\.attention' inside 'layers\.0'"),
        (("norm", ("norm", "output")), r"'norm' is both a unit of its own and in a group"),
        ((("norm", 3),), r"FSDP unit \('norm', 3\): a module class, a module-path pattern, or a tuple"),
    ],
)
def test_bad_unit_groups_are_refused_by_name(units, message):
    with pytest.raises(fs.PolicyError, match=message):
        fs.shard(TitanLlama(TitanConfig()), MESH, fs.fsdp("dp", units=units))


def test_a_group_across_pipeline_stages_is_refused():
    policy = fs.fsdp("dp", units=(("tok_embeddings", "output"),)) + fs.pipeline("pp", microbatches=2)
    with pytest.raises(
        fs.PolicyError, match=r"spans pipeline stages \(tok_embeddings on stage 0, output on stage 1\)"
    ):
        fs.shard(TitanLlama(TitanConfig()), fs.Mesh(pp=2, dp=2), policy)


def test_torchtitans_names_split_over_tp_and_train_as_one_process(world4):
    assert fs.rules.for_model(TitanLlama(TitanConfig())).name == "torchtitan"  # tp("auto") finds them
    result = world4.run(unit_cases.titan_runs, "fsdp+tp")[0]
    for part, predicted in result["predicted"].items():
        assert result["resident"][part] == predicted, part
    assert result["losses"] == pytest.approx(result["alone"], abs=1e-5)


@pytest.mark.parametrize("name", ["blocks", "blocks+group"])
def test_what_fsdp2_gathers_and_keeps_is_what_the_plan_says(world4, name):
    result = world4.run(unit_cases.titan_runs, name)[0]
    assert result["gathered"] == result["predicted_gathered"]
    assert set(result["gathered"]) == set(result["units"])
    root = result["gathered"].pop("")
    assert result["gathered_bytes"] == root + max(result["gathered"].values())
    for part, predicted in result["predicted"].items():
        assert result["resident"][part] == predicted, part
    assert result["losses"] == pytest.approx(result["alone"], abs=1e-5)


@pytest.mark.parametrize(
    ("policy", "other"),
    [(fs.fsdp("dp"), fs.replicate("dp")), (fs.replicate("dp"), fs.fsdp("dp"))],
    ids=["fsdp", "replicate"],
)
def test_a_parallelized_module_plans_as_the_model_it_was(one_rank, policy, other):
    """FSDP2 and replicate swap a wrapped module's class (Block for FSDPBlock): planned again,
    the module gives its plan, unit reasons included; another policy still another plan."""
    model = Llama(dist_cases.EVEN)
    mesh = fs.Mesh(dp=1)
    plan = fs.shard(model, mesh, policy)
    classes = {type(m) for m in model.modules()}
    fs.apply(plan, model)
    assert {type(m) for m in model.modules()} != classes  # torch swapped some
    again = fs.shard(model, mesh, policy)
    assert again.config.fsdp.unit_reasons == plan.config.fsdp.unit_reasons
    assert again == plan
    assert fs.shard(model, mesh, other) != plan
    # the policy's text names the classes as the model's code does
    assert fs.parse_policy("fsdp(dp, units=Block)", model) == fs.fsdp("dp", units=Block)
