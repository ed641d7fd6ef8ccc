"""Tensor parallel for any transformer: torchtitan's MoE names, fused projections, structural tp("auto")."""

from __future__ import annotations

import functional_shard as fs

from . import tp_any_cases
from .unit_models import TitanConfig, TitanDeepSeek


def test_torchtitans_moe_names_plan_and_train_as_one_process(world4):
    model = TitanDeepSeek(TitanConfig())
    assert fs.rules.for_model(model).name == "torchtitan"
    plan = fs.shard(model, fs.Mesh(tp=4), fs.tp("auto", "tp"))
    assert plan.sharding("layers.1.moe.experts.w1").compute == fs.P(None, "tp", None)
    assert plan.sharding("layers.1.moe.experts.w2").compute == fs.P(None, None, "tp")
    assert plan.sharding("layers.1.moe.router.gate.weight").compute.is_replicated
    assert plan.sharding("layers.1.moe.shared_experts.w2.weight").compute == fs.P(None, "tp")
    result = world4.run(tp_any_cases.parity, "titan_moe", fs.rules.torchtitan)[0]
    assert result["split"] >= 14  # attention, feed-forward, experts, shared experts, embedding, head
    assert result["loss"] < 1e-5
    assert result["grad"] < 1e-5
