"""0-d parameters and buffers (CLIP's ``logit_scale``, Gemma's ``embed_scale``).

FSDP2 cannot shard a 0-d tensor, so every data-parallel family keeps one whole on every
rank and all-reduces its gradient over the data axes, as DDP does; a 0-d buffer is
replicated under tensor parallel. The plan says so, the cost model counts it, and a
model holding both trains on 4 gloo ranks as one process does, sending exactly the
bytes the cost model predicts. Tolerances as in tests/dist/test_apply_parity.py.
"""

from __future__ import annotations

import pytest
import torch

import functional_shard as fs

from .. import dist_cases, zero_dim_cases
from ..zero_dim_cases import CONFIG, ScaledLlama

FAMILIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp", "tp", "fsdp_tp", "hsdp_tp"]
WHOLE = fs.ParamSharding.replicated()


@pytest.mark.parametrize("name", FAMILIES)
def test_zero_dim_tensors_stay_whole_under_every_family(name):
    mesh, policy = zero_dim_cases.strategy(name, 8 if name == "hsdp_tp" else 4)
    plan = fs.shard(ScaledLlama(CONFIG), mesh, policy)
    assert plan.buffers["embed_scale"] == WHOLE
    scale = plan.params["logit_scale"]
    if name == "zero1":  # ZeroRedundancyOptimizer keeps its state on one rank, as any tensor's
        assert scale == fs.ParamSharding(optim=fs.Owned("dp"))
    else:
        assert scale == WHOLE
    assert plan.local_shape_and_offset("logit_scale", 1) == ((), ())
    assert fs.Plan.from_json(plan.to_json()) == plan


def test_explain_says_how_a_zero_dim_parameter_is_kept():
    plan = fs.shard(ScaledLlama(CONFIG), fs.Mesh(dp=4), fs.fsdp())
    text = plan.explain()
    row = next(line for line in text.splitlines() if line.startswith("logit_scale "))
    assert row.split()[1:7] == ["()", "float32", "P()", "P()", "P()", "P()"]
    assert (
        "0-d parameters, which FSDP2 cannot shard, stay whole on every rank; their gradients are "
        "all-reduced over ('dp',): logit_scale"
    ) in text
    assert "0-d parameters" not in fs.shard(ScaledLlama(CONFIG), fs.Mesh(dp=4), fs.replicate()).explain()


@pytest.mark.parametrize(
    ("name", "axes"), [("fsdp", "dp"), ("zero2", "dp"), ("hsdp", ("node", "gpu")), ("fsdp_tp", "dp")]
)
def test_the_cost_model_counts_the_gradient_all_reduce(name, axes):
    """One all-reduce of the 4-byte gradient over the data axes, beside what the model
    without the scale sends; the 0-d buffer sends nothing."""
    mesh, policy = zero_dim_cases.strategy(name, 4)
    scaled = fs.shard(ScaledLlama(CONFIG), mesh, policy).cost("adamw", tokens=24)
    plain = fs.shard(zero_dim_cases.Llama(CONFIG), mesh, policy).cost("adamw", tokens=24)
    key = ",".join(axes) if isinstance(axes, tuple) else axes
    n = 4 if isinstance(axes, tuple) else 2 if name == "fsdp_tp" else 4
    expected = {kind: dict(by_axes) for kind, by_axes in plain.comm_bytes.items()}
    expected.setdefault("all_reduce", {})
    expected["all_reduce"][key] = expected["all_reduce"].get(key, 0) + 2 * (n - 1) / n * 4
    assert {kind: dict(by_axes) for kind, by_axes in scaled.comm_bytes.items()} == expected
    assert scaled.params_bytes - plain.params_bytes == 4
    assert scaled.grads_bytes - plain.grads_bytes == 4
    assert scaled.optimizer_bytes - plain.optimizer_bytes == 12  # exp_avg, exp_avg_sq, step
    assert scaled.buffers_bytes - plain.buffers_bytes == 4


@pytest.fixture(scope="module")
def world(world4):
    return world4


@pytest.mark.parametrize("name", ["ddp", "zero1", "fsdp", "hsdp", "fsdp_tp"])
def test_a_zero_dim_parameter_trains_as_one_process_and_sends_what_the_cost_model_says(world, name):
    results = world.run(zero_dim_cases.train_and_measure, name)
    _assert_trained_as_one_process_as_the_cost_model_says(results, ScaledLlama)
    assert results[0]["params"]["logit_scale"] != 0.75  # it learned


# every family measured in test_a_zero_dim_parameter_...; here the engines that treat a frozen
# parameter differently (ZeroRedundancyOptimizer still broadcasts it, FSDP2 still gathers it)
@pytest.mark.parametrize(
    "name", ["zero1", "fsdp", *(pytest.param(name, marks=pytest.mark.slow) for name in ("ddp", "fsdp_tp"))]
)
def test_frozen_parameters_hold_no_gradient_or_state_as_the_cost_model_says(world, name):
    """A frozen float parameter (a LoRA base weight) gets no gradient, no optimizer state and no
    gradient collective; the plan marks it, so plan.cost counts none (before: as a trained one)."""
    results = world.run(zero_dim_cases.train_and_measure, name, zero_dim_cases.FrozenScaleLlama)
    _assert_trained_as_one_process_as_the_cost_model_says(results, zero_dim_cases.FrozenScaleLlama)
    assert results[0]["params"]["logit_scale"] == 0.75  # frozen


def _assert_trained_as_one_process_as_the_cost_model_says(results, model_type):
    losses, params = dist_cases.reference(CONFIG, results[0]["data_parallel"], model_type=model_type)
    assert results[0]["losses"] == pytest.approx(losses, abs=1e-5)
    assert results[0]["params"].keys() == params.keys()
    for key, value in params.items():
        torch.testing.assert_close(results[0]["params"][key], value, atol=1e-5, rtol=1e-4, msg=key)
    for rank, result in enumerate(results):
        measured, predicted = result["comm"]
        assert measured.keys() == predicted.keys(), f"rank {rank}"
        for kind, by_axes in predicted.items():
            assert measured[kind] == pytest.approx(by_axes), f"rank {rank}: {kind}"
        assert result["memory"][0] == result["memory"][1], f"rank {rank}"


def test_a_zero_dim_parameter_built_on_meta_trains_as_one_process(world):
    """materialize replaces the meta parameter: the gradient hook goes on the real one."""
    params = world.run(zero_dim_cases.meta_init, "fsdp_tp")[0]
    _, expected = zero_dim_cases.reference(2)
    for key, value in expected.items():
        torch.testing.assert_close(params[key], value, atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("name", ["fsdp", "tp"])
def test_frozen_parameters_train_as_one_process_frozen_and_once_unfrozen(world, name):
    """A frozen 0-d parameter (kept whole beside FSDP2), a frozen tensor-parallel weight and an
    integer 0-d parameter apply (before: torch refused the gradient hook on them), stay put while
    frozen, and once unfrozen their gradients are averaged and placed as any other's."""
    result = world.run(zero_dim_cases.train_unfreezing, name)[0]
    expected = zero_dim_cases.unfreezing_reference(result["data_parallel"])
    assert result["params"].keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(result["params"][key], value, atol=1e-5, rtol=1e-4, msg=key)
    assert result["params"]["logit_scale"] != 0.75  # it learned once unfrozen
