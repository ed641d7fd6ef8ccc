"""Plan files written before the config was split per parallelism (format version 1, one flat
config of 31 fields) still load, into the plans the same policies build today.

``data/old_format_plans.json`` was written by ``Plan.to_json`` before the split, from the
plans `_plans` builds; it is never regenerated (that would test nothing)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.nn as nn

import functional_shard as fs
from functional_shard.zoo import llama

OLD_PLANS = json.loads((pathlib.Path(__file__).parent / "data" / "old_format_plans.json").read_text())


def _moe() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _plan(name: str) -> fs.Plan:
    model = llama("tiny")
    if name == "hsdp_tp_options":
        policy = (
            fs.hsdp("rep", "dp", units=[("norm", "lm_head")])
            + fs.tp(fs.rules.llama, "tp", sequence_parallel=True, loss_parallel=True)
            + fs.checkpointing("layers.*", policy="selective")
            + fs.mixed_precision(torch.bfloat16)
            + fs.offload()
        )
        return fs.shard(model, fs.Mesh(rep=2, dp=2, tp=2), policy)
    if name == "pipeline_zbv_fsdp":
        policy = fs.pipeline("pp", microbatches=4, schedule="zbv", stages_per_rank=2) + fs.fsdp("dp")
        return fs.shard(model, fs.Mesh(pp=2, dp=2), policy)
    if name == "zero1_context":
        policy = fs.zero(1, "dp") + fs.replicate("cp") + fs.cp("cp", load_balance=False)
        return fs.shard(model, fs.Mesh(dp=2, cp=2), policy)
    if name == "moe_experts_tp":
        return fs.shard(_moe(), fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.ep("dp") + fs.tp("hf", "tp"))
    if name == "tp_only":
        return fs.shard(model, fs.Mesh(tp=2), fs.tp(fs.rules.llama, "tp"))
    assert name == "packed_pieces"
    packed = fs.tp([("0", fs.packed((4, 2, 2))), ("1", "rowwise")], "tp")
    return fs.shard(nn.Sequential(nn.Linear(2, 8), nn.Linear(8, 2)), fs.Mesh(tp=2), packed)


@pytest.mark.parametrize("name", sorted(OLD_PLANS))
def test_a_plan_file_of_the_flat_config_loads_as_the_plan_built_today(name):
    old = OLD_PLANS[name]
    assert old["version"] == 1
    assert "pipeline_axis" in old["config"]  # the flat format indeed
    fresh = _plan(name)
    loaded = fs.Plan.from_json(old)
    assert loaded == fresh
    assert fs.Plan.from_json(json.dumps(old)) == fresh
    assert fs.Plan.from_json(loaded.to_json()) == fresh  # and written again, it reads back


def test_a_flat_config_field_the_reader_does_not_know_is_refused_by_name():
    old = json.loads(json.dumps(OLD_PLANS["tp_only"]))
    old["config"]["pipeline_axes"] = "pp"
    with pytest.raises(fs.ShardingError, match=r"config\.pipeline_axes: not a field"):
        fs.Plan.from_json(old)


@pytest.mark.parametrize("version", [0, 3, True, "1"])
def test_only_format_versions_1_and_2_are_read(version):
    data = json.loads(_plan("tp_only").to_json())
    assert data["version"] == 2
    data["version"] = version
    with pytest.raises(fs.ShardingError, match="format version 1 to 2"):
        fs.Plan.from_json(data)


def test_diff_names_config_changes_by_their_flat_names():
    model, mesh = llama("tiny"), fs.Mesh(dp=2, tp=2)
    ddp = fs.shard(model, mesh, fs.replicate())
    fsdp_tp = fs.shard(model, mesh, fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"))
    changed = [change.what for change in ddp.diff(fsdp_tp) if change.path == "<plan>"]
    assert changed == [
        "data_parallel",
        "replicate_axes",
        "shard_axes",
        "tensor_parallel_axes",
        "tp_styles",
        "units",
    ]
