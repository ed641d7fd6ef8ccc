"""Selective activation checkpointing: the policy, the plan that keeps it, and fs.apply running it."""

from __future__ import annotations

import dataclasses
import re
from copy import deepcopy

import pytest
import torch
from torch import nn

import functional_shard as fs
from functional_shard.costing.trace.activations import SAVED_OPS, selective_context
from functional_shard.runtime.apply import engine_problems
from functional_shard.runtime.engines.activation_checkpointing import apply_checkpointing
from functional_shard.zoo import Block, Llama, LlamaConfig

from .. import activation_cases, dist_cases

CONFIG = LlamaConfig(128, 32, 64, num_layers=2, num_heads=4, num_kv_heads=4)


def test_an_unknown_policy_names_the_value_and_the_choices():
    message = "checkpointing(policy='some'): one of 'full', 'selective'"
    with pytest.raises(fs.PolicyError, match=re.escape(message)):
        fs.checkpointing(Block, policy="some")


def test_the_plan_keeps_the_policy_through_json():
    with torch.device("meta"):
        model = Llama(CONFIG)
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp() + fs.checkpointing(Block, policy="selective"))
    assert plan.config.checkpointed == ("layers.0", "layers.1")
    assert plan.config.checkpoint_policy == "selective"
    assert fs.Plan.from_json(plan.to_json()) == plan
    # plans saved before the policy existed load as full checkpointing
    old = plan.to_json().replace('"checkpoint_policy": "selective", ', "")
    assert "checkpoint_policy" not in old
    assert fs.Plan.from_json(old).config.checkpoint_policy == "full"
    default = fs.shard(model, fs.Mesh(dp=2), fs.fsdp() + fs.checkpointing(Block))
    assert default.config.checkpoint_policy == "full"


def test_apply_and_the_trace_refuse_a_policy_they_do_not_know_as_the_plan_reader_does():
    with torch.device("meta"):
        model = Llama(CONFIG)
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate() + fs.checkpointing(Block))
    bad = dataclasses.replace(plan, config=dataclasses.replace(plan.config, checkpoint_policy="some"))
    said = "config.checkpoint_policy: 'some' is not one of ['full', 'selective', 'torchtitan']"
    problems = engine_problems(bad, model)  # what fs.apply checks before it changes the model
    assert f"plan.{said}" in problems
    with pytest.raises(fs.ShardingError, match=re.escape(f"* plan.{said}")):
        fs.trace_activations(model, bad, batch=2, seq=16)
    with pytest.raises(fs.ShardingError, match=re.escape(said)):
        fs.Plan.from_json(bad.to_json())


def test_the_saved_ops_are_matmuls_and_attention():
    names = {str(op) for op in SAVED_OPS}
    assert {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"} <= names
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in names
    assert not any("relu" in name or "silu" in name or "mul" in name for name in names)


def recomputed_ops(policy: str) -> list[str]:
    """The ops a checkpointed Block runs again in backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    model = Llama(CONFIG)
    with torch.device("meta"):
        plan = fs.shard(Llama(CONFIG), fs.Mesh(dp=1), fs.replicate() + fs.checkpointing(Block, policy=policy))
    apply_checkpointing(plan, model)
    output = model(torch.randint(0, 128, (2, 8)))
    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.is_grad_enabled():  # backward kernels run without grad; the recompute with it
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        output.sum().backward()
    return seen


def test_selective_recomputes_the_elementwise_ops_but_no_matmul():
    full, selective = recomputed_ops("full"), recomputed_ops("selective")
    assert "aten.mm.default" in full
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in full
    assert not {str(op) for op in SAVED_OPS} & set(selective)
    assert "aten.silu.default" in selective  # the MLP's activation is recomputed


def test_torchtitan_recomputes_every_second_matmul_of_each_block():
    """torchtitan's per-op selective checkpointing: of a Block's seven matmuls (q, k, v, o, gate, up,
    down, in its forward's order) it keeps the 1st, 3rd, 5th and 7th and recomputes the others."""
    forward = forward_matmuls()
    assert len(forward) == 2 * 7
    recomputed = [op for op in recomputed_ops("torchtitan") if op == "aten.mm.default"]
    assert len(recomputed) == 2 * 3
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in recomputed_ops("torchtitan")
    assert not [op for op in recomputed_ops("selective") if op == "aten.mm.default"]


def forward_matmuls() -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    model = Llama(CONFIG)
    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        for layer in model.layers:
            layer(torch.randn(2, 8, CONFIG.hidden_size))
    return [op for op in seen if op == "aten.mm.default"]


def test_selective_checkpointing_gives_the_same_gradients():
    grads = {}
    for policy in ("none", "full", "selective", "torchtitan"):
        torch.manual_seed(0)
        model = Llama(CONFIG)
        if policy != "none":
            plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate() + fs.checkpointing(Block, policy=policy))
            apply_checkpointing(plan, model)
        model(torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))).sum().backward()
        grads[policy] = {name: p.grad for name, p in model.named_parameters()}
    for policy in ("full", "selective", "torchtitan"):
        for name, grad in grads["none"].items():
            torch.testing.assert_close(grads[policy][name], grad, msg=name)


def test_selective_context_works_with_torchs_own_checkpoint():
    layer = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, context_fn=selective_context)
    out.sum().backward()
    expected = torch.autograd.grad(layer(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp_tp_full", "fsdp_tp_selective"])
def test_fsdp_tp_with_checkpointing_trains_as_one_process(world4, name):
    result = world4.run(activation_cases.train, name)[0]
    losses, params = dist_cases.reference(activation_cases.CONFIG, result["data_parallel"])
    assert result["losses"] == pytest.approx(losses, abs=1e-5)
    for key, value in params.items():
        torch.testing.assert_close(result["params"][key], value, atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.slow
def test_a_lightning_strategy_runs_selective_checkpointing(worlds):
    pytest.importorskip("lightning")
    from .. import lightning_cases

    results = worlds(2).run(activation_cases.fit_selective)
    losses, params = lightning_cases.reference(activation_cases.CONFIG, 2)
    assert results[0]["checkpointed"] == ["model.layers.0", "model.layers.1"]
    assert results[0]["selective_calls"] >= 2 * 5  # each checkpointed layer, every step
    assert results[0]["losses"] == pytest.approx(losses, abs=1e-5)
    for key, value in params.items():
        torch.testing.assert_close(results[0]["params"][key], value, atol=1e-5, rtol=1e-4, msg=key)


def test_checkpointing_under_bf16_fsdp_gives_the_gradients_of_no_checkpointing(world4):
    # FSDP2 casts a block's inputs to bf16 in a hook; the recompute must not run that hook again
    # (selective checkpointing refused it as an op "not found in storage" under torch's
    # composable checkpoint)
    expected = world4.run(activation_cases.mixed_precision_grads, "none")[0]
    for policy in ("full", "selective", "torchtitan"):
        grads = world4.run(activation_cases.mixed_precision_grads, policy)[0]
        for name, value in expected.items():
            torch.testing.assert_close(grads[name], value, atol=0, rtol=0, msg=f"{policy}: {name}")


def test_a_deep_copy_of_a_checkpointed_model_runs_its_own_parameters():
    # the checkpointed forward is bound to its module, so a copy (an EMA, say) binds to the copy
    from functional_shard.runtime.engines.activation_checkpointing import is_checkpointed

    torch.manual_seed(0)
    model = Llama(CONFIG)
    with torch.device("meta"):
        plan = fs.shard(Llama(CONFIG), fs.Mesh(dp=1), fs.replicate() + fs.checkpointing(Block))
    apply_checkpointing(plan, model)
    copy = deepcopy(model)
    assert all(is_checkpointed(block) for block in copy.layers)
    tokens = torch.randint(0, 128, (2, 8))
    expected = model(tokens)
    with torch.no_grad():
        for p in copy.parameters():
            p.mul_(1.5)
    assert not torch.allclose(copy(tokens), expected)
    torch.testing.assert_close(model(tokens), expected)
