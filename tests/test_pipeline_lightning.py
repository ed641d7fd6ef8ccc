"""Pipeline plans under Lightning: a real Trainer and a Fabric loop (4 CPU processes) train as one process."""

from __future__ import annotations

import pytest
import torch

from . import pipeline_cases
from . import pipeline_lightning_cases as cases


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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"accumulate_grad_batches": 2}, "accumulate_grad_batches=2"),
        ({"validate": True}, "validation (validation_step"),
        ({"precision": "bf16-true"}, "the precision plugin HalfPrecision"),
        ({"manual": True}, "manual optimization (automatic_optimization = False)"),
    ],
    ids=["accumulate", "validate", "precision", "manual"],
)
def test_what_a_schedule_cannot_run_is_refused_before_fit(world, options, named):
    messages = world.run(cases.fit_refused, **options)
    assert all(named in message for message in messages), messages[0]


@pytest.mark.slow
def test_a_trainer_checkpoint_of_a_pipeline_plan_resumes_without_pp(world, tmp_path):
    path = str(tmp_path / "pp.ckpt")
    saved = pipeline_cases.merged_params(world.run(cases.fit, save_to=path))
    loaded = world.run(cases.resume_without_pp, path)[0]
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, atol=0, rtol=0, msg=name)
