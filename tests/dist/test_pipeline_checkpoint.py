"""Checkpoints move between pipeline plans and plans without pp, both ways, sharded or full (4 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from .. import pipeline_cases
from .. import pipeline_checkpoint_cases as cases


def assert_same_state(got, expected):
    assert got["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        torch.testing.assert_close(got["model"][name], value, atol=0, rtol=0, msg=name)
    assert got["optimizer"].keys() == expected["optimizer"].keys()
    for name, state in expected["optimizer"].items():
        for field, value in state.items():
            torch.testing.assert_close(got["optimizer"][name][field], value, atol=0, rtol=0, msg=name)


def round_trip(world4, tmp_path, saved_under, loaded_under, full_file):
    path = str(tmp_path / ("ckpt.pt" if full_file else "ckpt"))
    saved_by_rank = world4.run(cases.save_after, saved_under, path, 2, full_file)
    loaded_by_rank = world4.run(cases.load_under, loaded_under, path, 0)
    saved, loaded = cases.merged(saved_by_rank), cases.merged(loaded_by_rank)
    # every parameter and its AdamW state, stage by stage, gathered whole
    assert len(saved["model"]) == len(pipeline_cases.build(cases.PLANS["pp2_fsdp2"]).state_dict())
    assert_same_state(loaded, saved)
    # every rank's optimizer keeps its own parameters with the saved hyperparameters
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in saved_by_rank[0]["groups"]]
    for rank in loaded_by_rank:
        assert [{k: v for k, v in g.items() if k != "params"} for g in rank["groups"]] == hyper
        assert sum(g["params"] for g in rank["groups"]) == len(rank["model"])


def test_a_pipeline_checkpoint_loads_without_pp(world4, tmp_path):
    round_trip(world4, tmp_path, "pp2_fsdp2", "fsdp4", full_file=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved_under", "loaded_under", "full_file"),
    [
        ("fsdp4", "pp2_fsdp2", False),
        ("pp2_fsdp2", "fsdp4", True),
        ("fsdp4", "pp2_fsdp2", True),
        ("pp4", "pp2_fsdp2", False),
        ("pp2_fsdp2", "pp4", True),
    ],
)
def test_checkpoints_move_between_pipeline_and_flat_plans(
    world4, tmp_path, saved_under, loaded_under, full_file
):
    round_trip(world4, tmp_path, saved_under, loaded_under, full_file)


@pytest.mark.slow
@pytest.mark.parametrize("full_file", [False, True], ids=["sharded", "full"])
def test_a_pipeline_run_resumes_exactly(world4, tmp_path, full_file):
    path = str(tmp_path / ("ckpt.pt" if full_file else "ckpt"))
    uninterrupted = pipeline_cases.reference(cases.PLANS["pp2_fsdp2"], 2)[0]
    world4.run(cases.save_after, "pp2_fsdp2", path, 2, full_file)
    resumed = world4.run(cases.load_under, "pp2_fsdp2", path, 1)[0]
    assert resumed["losses"] == pytest.approx(uninterrupted[2:], abs=1e-5)


@pytest.mark.slow
def test_a_pipeline_checkpoint_loads_in_one_process(world4, worlds, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = cases.merged(world4.run(cases.save_after, "pp2_fsdp2", path, 2, False))
    alone = worlds(1).run(cases.load_under, "ddp1", path, 0)[0]
    assert_same_state(alone, saved)
