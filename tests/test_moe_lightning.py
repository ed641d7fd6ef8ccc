"""Expert parallelism in a real Lightning Trainer (accelerator="cpu", 4 processes) against one process.

A LightningModule wraps a tiny transformers 5 Mixtral (8 experts, top-2); ``ShardStrategy`` runs
an expert-parallel plan given as a policy (planned on the module at setup). Losses within 1e-5
and every whole parameter within 5e-4 absolute plus 1e-4 relative of one process training on
the global batches Lightning's DistributedSampler makes (`test_moe_parallel`'s tolerances).
"""

from __future__ import annotations

import pytest
import torch

import functional_shard as fs

from . import moe_lightning_cases as cases

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def world(world4):
    return world4


def assert_matches_one_process(results, reference, validated=False):
    losses, params = reference
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        assert result["losses"] == pytest.approx(losses, abs=1e-5)
        merged.update(result["params"])
        # the experts really are split by expert index on every rank
        assert all("Shard(dim=0)" in p for p in result["placements"].values()), result["placements"]
        assert result["placements"], "no expert tensor on this rank"
        if validated:
            assert len(result["validation"]) == 1
    assert merged.keys() == params.keys()
    for name, value in params.items():
        torch.testing.assert_close(merged[name], value, atol=5e-4, rtol=1e-4, msg=name)


def test_a_trainer_trains_mixtral_under_expert_parallelism_as_one_process(world):
    """fsdp("dp") + ep("dp") on Mesh(dp=4): two experts per rank, tokens dispatched by all-to-all
    inside Lightning's training_step; Lightning's own backward and optimizer step."""
    results = world.run(cases.fit, fs.fsdp("dp") + fs.ep("dp"), fs.Mesh(dp=4))
    assert_matches_one_process(results, cases.reference(4))


@pytest.mark.slow
def test_a_trainer_clips_and_validates_under_a_2d_expert_parallel_plan(world):
    """fsdp(("dp", "ep")) + ep("ep") on Mesh(dp=2, ep=2): experts split over ep and FSDP-sharded
    over dp; Lightning clips the global gradient norm (experts and dense parameters on different
    meshes) and runs a validation loop whose forward dispatches tokens without gradients."""
    policy = fs.fsdp(("dp", "ep")) + fs.ep("ep")
    results = world.run(cases.fit, policy, fs.Mesh(dp=2, ep=2), validate=True, gradient_clip_val=0.5)
    assert_matches_one_process(results, cases.reference(4, clip=0.5), validated=True)
