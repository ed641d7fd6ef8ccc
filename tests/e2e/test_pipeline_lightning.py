"""Pipeline plans under Lightning: a real Trainer and a Fabric loop (4 CPU processes) train, validate,
test and predict as one process."""

from __future__ import annotations

import pytest
import torch

import functional_shard as fs

from .. import pipeline_cases
from .. import pipeline_lightning_cases as cases


@pytest.fixture(scope="module")
def world(world4):
    return world4


def assert_matches_one_process(results, reference):
    # pp=2 x dp=2: two data-parallel slices; each rank holds its stage's parameters
    losses, params = reference
    for result in results:
        assert result["losses"] == pytest.approx(losses, abs=1e-5)
    merged = pipeline_cases.merged_params(results)
    assert merged.keys() == params.keys()
    for name, value in params.items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_a_trainer_trains_a_pipeline_plan_as_one_process(world):
    """ShardStrategy(pipeline + fsdp): training_step returns training_loss, the schedule runs
    the backward, Lightning's automatic optimization steps."""
    # the global batches as Lightning's DistributedSampler shuffles them
    assert_matches_one_process(world.run(cases.fit), cases.reference(2))


@pytest.mark.slow
def test_a_fabric_loop_trains_a_pipeline_plan_as_one_process(world):
    results = world.run(cases.fabric_loop)
    assert_matches_one_process(results, pipeline_cases.reference(cases.SPEC, 2))
    assert all("fabric.backward under a pipeline plan" in r["backward_refused"] for r in results)


def assert_evaluates_as_one_process(results, reference):
    params, before, after, outputs = reference
    rows = cases.evaluation_tokens()
    for result in results:
        index = result["index"]
        # the sanity check's two batches before training, the epoch's two after
        mine = before[2 * index : 2 * index + 2] + after[2 * index : 2 * index + 2]
        assert result["evaluated"] == pytest.approx(mine, abs=1e-5)
        # logged with sync_dist: the mean over every rank, the same on each
        assert result["val_loss"] == pytest.approx(sum(after) / len(after), abs=1e-5)
        torch.testing.assert_close(result["predictions"], outputs[index::2], atol=1e-5, rtol=1e-4)
        assert len(rows[index::2]) == len(result["predictions"])
    merged = pipeline_cases.merged_params(results)
    assert merged.keys() == params.keys()
    for name, value in params.items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_a_pipeline_plan_validates_accumulates_and_predicts_as_one_process(world):
    """One fit under pp=2 x FSDP(dp=2) with accumulate_grad_batches=2 and validation (the
    sanity check and the epoch's), then trainer.predict on the same Trainer: the schedule's
    forward-only path gives one process's losses on every rank and its whole outputs."""
    results = world.run(cases.fit_evaluate_predict)
    assert_evaluates_as_one_process(results, cases.evaluation_reference())


@pytest.mark.slow
def test_a_plan_without_pp_evaluates_and_predicts_as_the_pipeline_does(world):
    # FSDP(dp=2) x TP(2): the same two data-parallel slices as pp=2 x dp=2, no pipeline
    policy = fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")
    results = world.run(cases.fit_evaluate_predict, policy, fs.Mesh(dp=2, tp=2))
    assert_evaluates_as_one_process(results, cases.evaluation_reference())


@pytest.mark.slow
def test_evaluation_under_a_pipeline_and_cp_is_refused_as_fs_forward_loss_refuses_it(world):
    # each rank once ran the plain forward of its stages alone: the first stage's hidden states
    # taken for logits, a raw torch error on the last
    for said in world.run(cases.evaluated_under_cp):
        assert all(
            s.startswith("ShardingError: ") and "under a context-parallel plan is not built" in s
            for s in said
        ), said


@pytest.mark.slow
def test_validate_and_test_run_the_schedule_forward_only(world):
    _, before, _, _ = cases.evaluation_reference()
    for result in world.run(cases.validate_and_test):
        assert result["val_loss"] == pytest.approx(sum(before) / len(before), abs=1e-5)
        assert result["test_loss"] == pytest.approx(sum(before) / len(before), abs=1e-5)


@pytest.mark.slow
def test_manual_optimization_under_a_pipeline_plan_trains_as_one_process(world):
    assert_matches_one_process(world.run(cases.fit_manually), cases.reference(2))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "dtype", "steps"), [("bf16-true", torch.bfloat16, 3), ("16-true", torch.float16, 1)]
)
def test_half_precision_trains_a_pipeline_plan(world, precision, dtype, steps):
    """The module cast to half precision: the stages send half activations, the losses stay
    within half precision's rounding of one float32 process's. In float16, AdamW (eps=1e-6)
    turns the second step's loss into nan in one process too, so only the first is compared."""
    losses, _ = cases.reference(2)
    for result in world.run(cases.fit, precision=precision):
        assert result["losses"][:steps] == pytest.approx(losses[:steps], abs=2e-2)
        assert {value.dtype for value in result["params"].values()} == {dtype}


@pytest.mark.slow
def test_what_a_schedule_cannot_run_is_refused_before_fit(world):
    messages = world.run(cases.fit_refused, precision="64-true")
    assert all("the precision plugin DoublePrecision" in message for message in messages), messages[0]


def test_weight_averaging_is_refused_under_a_pipeline_plan(world):
    """StochasticWeightAveraging copies the whole module before the plan splits it: the ranks
    hung in its first update; now every rank refuses at setup."""
    messages = world.run(cases.fit_refused_averaging)
    expected = "StochasticWeightAveraging averages a copy of the whole module made before the plan applies"
    assert all(expected in message and "pipeline stages" in message for message in messages), messages[0]


@pytest.mark.slow
def test_a_trainer_checkpoint_of_a_pipeline_plan_resumes_without_pp(world, tmp_path):
    path = str(tmp_path / "pp.ckpt")
    saved = pipeline_cases.merged_params(world.run(cases.fit, save_to=path))
    loaded = world.run(cases.resume_without_pp, path)[0]
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, atol=0, rtol=0, msg=name)
