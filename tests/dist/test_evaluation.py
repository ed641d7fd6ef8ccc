"""fs.forward_only and fs.forward_loss: a module the plan was not applied to is refused; between
accumulating steps on 4 gloo ranks (slow) they leave the gradients whole; packed rows under a
pipeline evaluate as in one process; so does a V-shaped schedule's pipeline."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import functional_shard as fs

from .. import cp_cases, evaluation_cases, pipeline_cases

PIPELINE = {"pp": 2, "dp": 2}, "pipeline(pp, microbatches=2) + fsdp(dp)"


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("fs.forward_only", lambda plan, model: fs.forward_only(plan, model)),
        ("fs.forward_loss", lambda plan, model: fs.forward_loss(plan, model, F.mse_loss)),
    ],
)
def test_evaluating_a_module_the_plan_was_not_applied_to_is_refused(name, make):
    model = nn.Linear(4, 2)
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    message = f"{name} needs the module fs.apply(plan, module) returned, with the same plan"
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        make(plan, model)


def _per_element(outputs, targets):
    return F.mse_loss(outputs, targets, reduction="none")


def test_a_loss_fn_that_returns_no_single_number_is_refused(one_rank):
    # it came back as it was (a pipeline averaged the micro-batches' vectors): no "mean loss"
    model = nn.Linear(4, 2)
    plan = fs.shard(model, fs.Mesh(dp=1), fs.fsdp())
    fs.apply(plan, model)
    message = (
        "fs.forward_loss: loss_fn returned a tensor of shape (3, 2), but it returns the batch's mean loss"
    )
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.forward_loss(plan, model, _per_element)(torch.ones(3, 4), torch.zeros(3, 2))


@pytest.mark.slow
def test_evaluating_between_accumulating_steps_leaves_their_gradients_whole(world4):
    """torch's schedules divide every .grad by the micro-batch count at the end of a step,
    eval included: gradients held from an earlier step are set aside meanwhile."""
    losses, outputs, grads = evaluation_cases.reference()
    results = world4.run(evaluation_cases.accumulate_around_evaluation)
    for result in results:
        assert result["loss"] == pytest.approx(losses[result["index"]], abs=1e-5)
        torch.testing.assert_close(result["outputs"], outputs[result["index"]], atol=1e-5, rtol=1e-4)
    merged = pipeline_cases.merged_params(results)
    assert merged.keys() == grads.keys()
    for name, value in grads.items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_v_shaped_pipeline_evaluates_as_one_process_between_training_steps(worlds, schedule):
    # torch's eval ran the V's hand-over of gradients between a rank's two stages: one rank
    # raised an AssertionError and the other waited for it forever
    loss, outputs = evaluation_cases.one_process_evaluation()
    for result in worlds(2).run(evaluation_cases.evaluate_on_a_v, schedule):
        assert result["before"] == pytest.approx(loss, abs=1e-5)
        assert result["trained"] == pytest.approx(loss, abs=1e-5)
        assert result["after"] == pytest.approx(loss, abs=1e-5)  # no optimizer step between
        torch.testing.assert_close(result["outputs"], outputs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["hf_llama", pytest.param("zoo_untied", marks=pytest.mark.slow)])
def test_packed_rows_evaluate_under_a_pipeline_as_one_process(world4, kind):
    # every stage is given its micro-batch's rows of positions= and document_ids= (a Hugging Face
    # model's as position_ids=); forward_loss weights each micro-batch's mean by its targets, and
    # the last batch's micro-batches of padding alone (no target, a nan mean) add nothing
    mesh, policy = PIPELINE
    cp_cases.assert_packed_evaluation_as_one_process(
        world4.run(cp_cases.evaluate_packed, mesh, policy, kind), kind
    )
