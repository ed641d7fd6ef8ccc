"""Expert parallelism in a real Lightning Trainer (accelerator="cpu", 4 processes) against one process.

A LightningModule wraps a tiny transformers 5 Mixtral (8 experts, top-2); ``ShardStrategy`` runs
an expert-parallel plan given as a policy (planned on the module, or under a pipeline on its
model, at setup). Losses within 1e-5 and every whole parameter within 5e-4 absolute plus 1e-4
relative of one process training on the global batches Lightning's DistributedSampler makes
(`test_moe_parallel`'s tolerances). The default suite's Trainer run under ``fsdp("dp") +
ep("dp")`` lives in `test_moe_parallel` (it shares that module's four ranks, which have
transformers imported already); these are the slower ones.
"""

from __future__ import annotations

import pytest
import torch

import functional_shard as fs

from .. import moe_cases
from .. import moe_lightning_cases as cases

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def world(world4):
    return world4


@pytest.mark.slow
def test_a_trainer_clips_and_validates_under_a_2d_expert_parallel_plan(world):
    """fsdp(("dp", "ep")) + ep("ep") on Mesh(dp=2, ep=2): experts split over ep and FSDP-sharded
    over dp; Lightning clips the global gradient norm (experts and dense parameters on different
    meshes) and runs a validation loop whose forward dispatches tokens without gradients."""
    policy = fs.fsdp(("dp", "ep")) + fs.ep("ep")
    results = world.run(cases.fit, policy, fs.Mesh(dp=2, ep=2), validate=True, gradient_clip_val=0.5)
    cases.assert_matches_one_process(results, cases.reference(4, clip=0.5), validated=True)


@pytest.mark.slow
def test_a_trainer_accumulates_gradients_under_expert_parallelism(world):
    """accumulate_grad_batches=2 under fsdp("dp") + ep("dp"): FSDP2 holds the dense gradients'
    reduction to the last micro-batch, each micro-batch's tokens are dispatched (and its
    experts' gradients made) as it runs; the sum equals one process's step on both."""
    results = world.run(cases.fit, fs.fsdp("dp") + fs.ep("dp"), fs.Mesh(dp=4), accumulate=2)
    cases.assert_matches_one_process(results, cases.reference(4, accumulate=2))


@pytest.mark.slow
def test_a_trainer_trains_expert_parallelism_under_a_pipeline_as_one_process(world):
    """pipeline("pp", microbatches=2) + fsdp("dp") + ep("dp") on Mesh(pp=2, dp=2), a 4-layer
    Mixtral: training_step returns training_loss, the schedule dispatches each micro-batch's
    tokens among the two ranks of each stage; every rank holds its stage's parameters."""
    results = world.run(cases.fit, moe_cases.pipeline_policy(2), fs.Mesh(pp=2, dp=2), layers=4)
    cases.assert_matches_one_process(results, cases.reference(2, layers=4))
    stage_0, stage_1 = results[0]["placements"].keys(), results[2]["placements"].keys()
    assert {p.split(".")[3] for p in stage_0} == {"0", "1"}, stage_0
    assert {p.split(".")[3] for p in stage_1} == {"2", "3"}, stage_1


@pytest.mark.slow
def test_a_trainer_runs_expert_parallelism_in_bfloat16_autocast(world):
    """Trainer(precision="bf16-mixed"): the experts' linears in bfloat16 under autocast, their sum
    in float32 (as transformers' own experts): one process under the same autocast, to within
    bfloat16's rounding on the losses."""
    results = world.run(cases.fit, fs.fsdp("dp") + fs.ep("dp"), fs.Mesh(dp=4), precision="bf16-mixed")
    in_bf16 = cases.reference(4, autocast=torch.bfloat16)
    cases.assert_matches_one_process(results, in_bf16, loss_tolerance=1e-2)
