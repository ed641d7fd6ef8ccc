"""Checkpoints on real process groups: resume exactly, reshard between plans, convert offline."""

from __future__ import annotations

import pytest
import torch

import functional_shard as fs

from .. import dist_cases
from ..worlds import alone

CONFIG = dist_cases.EVEN


def assert_same_state(got, expected):
    assert got["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        torch.testing.assert_close(got["model"][name], value, atol=0, rtol=0, msg=name)
    for key, state in expected["optimizer"].items():
        for field, value in state.items():
            torch.testing.assert_close(got["optimizer"][key][field], value, atol=0, rtol=0)


@pytest.mark.parametrize("full_file", [False, True], ids=["sharded", "full"])
def test_resume_continues_exactly(world4, tmp_path, full_file):
    path = str(tmp_path / ("ckpt.pt" if full_file else "ckpt"))
    uninterrupted = dist_cases.reference(CONFIG, 4)[0]
    world4.run(dist_cases.save_after, "zero3", CONFIG, path, 2, full_file)
    resumed = world4.run(dist_cases.load_under, "zero3", CONFIG, path, 3)[0]
    assert resumed["losses"] == pytest.approx(uninterrupted[2:], abs=1e-5)


def test_a_checkpoint_moves_between_plans(world4, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = world4.run(dist_cases.save_after, "zero3", CONFIG, path, 2, False)[0]  # FSDP x4
    on_2d = world4.run(dist_cases.load_under, "fsdp_tp", CONFIG, path, 0)[0]  # FSDP x2 . TP x2
    assert_same_state(on_2d["state"], saved)
    # DDP x1 in this process, a gloo world of one: a spawned world of one rank was started for
    # this load alone in the default suite (a process importing torch, seconds)
    with alone():
        loaded = dist_cases.load_under("ddp", CONFIG, path, 0)
    assert loaded is not None
    assert_same_state(loaded["state"], saved)


def test_offline_conversion_round_trips(world4, tmp_path):
    sharded, full = tmp_path / "ckpt", tmp_path / "ckpt.pt"
    saved = world4.run(dist_cases.save_after, "fsdp_tp", CONFIG, str(sharded), 1, False)[0]
    fs.checkpoint.convert(sharded, full)
    loaded = world4.run(dist_cases.load_under, "zero3", CONFIG, str(full), 0)[0]
    assert_same_state(loaded["state"], saved)
    back = tmp_path / "again"
    fs.checkpoint.convert(full, back)
    assert back.is_dir()
    assert any(back.iterdir())


def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint(world4, tmp_path):
    path = tmp_path / "ckpt"
    saved = world4.run(dist_cases.save_after, "zero3", CONFIG, str(path), 2, False)[0]
    # rank 1's death reaches the parent as RankFailedError, or first as a peer's broken pipe
    with pytest.raises(RuntimeError):
        world4.run(dist_cases.save_crashing, "zero3", CONFIG, str(path))
    # the crash left its half-written folder aside, never in place of the checkpoint
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    loaded = world4.run(dist_cases.load_under, "zero3", CONFIG, str(path), 0)[0]
    assert loaded["step"] == 2
    assert_same_state(loaded["state"], saved)


@pytest.mark.parametrize("full_file", [False, True], ids=["sharded", "full"])
def test_zero1_checkpoints_move_to_and_from_fsdp(world4, tmp_path, full_file):
    """ZeRO-1 state (whole tensors, each on its owner rank) saves, resumes, and reshards."""
    path = str(tmp_path / ("zero1.pt" if full_file else "zero1"))
    uninterrupted = dist_cases.reference(CONFIG, 4)[0]
    saved = world4.run(dist_cases.save_after, "zero1", CONFIG, path, 2, full_file)[0]
    resumed = world4.run(dist_cases.load_under, "zero1", CONFIG, path, 3)[0]
    assert resumed["losses"] == pytest.approx(uninterrupted[2:], abs=1e-5)
    on_fsdp = world4.run(dist_cases.load_under, "zero3", CONFIG, path, 0)[0]
    assert_same_state(on_fsdp["state"], saved)
    back = str(tmp_path / "back")
    saved_by_fsdp = world4.run(dist_cases.save_after, "zero3", CONFIG, back, 2, False)[0]
    on_zero1 = world4.run(dist_cases.load_under, "zero1", CONFIG, back, 0)[0]
    assert_same_state(on_zero1["state"], saved_by_fsdp)


def test_a_checkpoint_that_does_not_fit_the_module_is_refused(world4, tmp_path):
    path = str(tmp_path / "ckpt")
    world4.run(dist_cases.save_after, "zero3", CONFIG, path, 1, False)
    fits = (
        r"ckpt does not fit this module: model\.embed_tokens\.weight: shape \[128, 32\] float32 in the "
        r"checkpoint, \[127, 30\] float32 in the module; .* \(and \d+ more\)\. Load it under a module"
    )
    with pytest.raises(fs.ShardingError, match=fits):
        world4.refusal(dist_cases.load_under, "zero3", dist_cases.UNEVEN, path, 0)


def test_an_asynchronous_save_lets_training_go_on_and_loads_as_saved(world4, tmp_path):
    """Saved in the background while a step trains: the folder appears only once finished
    (the next save waits for it), holds the state of the moment it was asked for, and
    resumes exactly; the second save resumes too."""
    path = str(tmp_path / "ckpt")
    saved = world4.run(dist_cases.save_asynchronously, "zero3", CONFIG, path, 2)[0]
    assert not saved["in_place_early"]
    assert saved["first_done"]
    moved = world4.run(dist_cases.load_under, "fsdp_tp", CONFIG, path, 0)[0]
    assert_same_state(moved["state"], saved["state"])
    uninterrupted = dist_cases.reference(CONFIG, 4)[0]
    resumed = world4.run(dist_cases.load_under, "zero3", CONFIG, f"{path}-next", 2)[0]
    assert resumed["losses"] == pytest.approx(uninterrupted[3:], abs=1e-5)


def test_an_asynchronous_full_save_is_refused(tmp_path):
    with pytest.raises(
        fs.ShardingError, match=r"full=True, asynchronous=True\): an asynchronous save writes shards"
    ):
        fs.checkpoint.save(tmp_path / "ckpt.pt", torch.nn.Linear(2, 2), full=True, asynchronous=True)
