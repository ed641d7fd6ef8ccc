"""Resume anywhere: a run stopped under one plan and world size goes on under another, its
losses those of the uninterrupted run, its data order continued (sampler state saved beside)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

import functional_shard as fs

from .. import resume_cases

# ---- the data order, pure --------------------------------------------------------------


def _plan(data_parallel: int) -> fs.Plan:
    # tp ranks beside each data-parallel rank: they must read the same samples
    policy = fs.fsdp("dp") + fs.tp([("*", "colwise")], "tp")
    return fs.shard(nn.Linear(4, 4), fs.Mesh(dp=data_parallel, tp=2), policy)


def _steps(loaders: list[fs.ResumableLoader], steps: int) -> list[list[int]]:
    """``steps`` global batches, each the ranks' slices joined in rank order."""
    iterators = [iter(loader) for loader in loaders]
    seen = []
    for _ in range(steps):
        slices = []
        for number, loader in enumerate(loaders):
            try:
                batch = next(iterators[number])
            except StopIteration:  # the epoch ended: the next one begins
                iterators[number] = iter(loader)
                batch = next(iterators[number])
            slices.append(batch.tolist())
        seen.append(slices)
    return [[sample for part in slices for sample in part] for slices in seen]


def _loaders(plan: fs.Plan, length: int, global_batch: int, seed: int, shuffle: bool):
    loaders = []
    for rank in range(plan.mesh.size):
        sampler = fs.ResumableSampler(
            length, plan=plan, rank=rank, batch_size=global_batch, seed=seed, shuffle=shuffle
        )
        loaders.append(sampler.loader(range(length)))
    # the tp rank beside each data-parallel rank reads the same samples; keep one of each pair
    return loaders[::2], loaders[1::2]


@st.composite
def _resumes(draw):
    global_batch = draw(st.integers(1, 12))
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    length = draw(st.integers(global_batch, 40))
    per_epoch = length // global_batch
    total = draw(st.integers(1, 3 * per_epoch))
    return {
        "length": length,
        "global_batch": global_batch,
        "before": draw(st.sampled_from(divisors)),
        "after": draw(st.sampled_from(divisors)),
        "stop": draw(st.integers(0, total)),
        "total": total,
        "seed": draw(st.integers(0, 2**16)),
        "shuffle": draw(st.booleans()),
    }


@given(_resumes())
def test_a_resume_on_any_data_parallel_size_continues_the_global_order(case):
    """Samples seen before a stop and after a resume (any dp sizes that divide the global
    batch, any stop point, across epochs) are the uninterrupted order, each step's global
    batch cut over the ranks; tp ranks read what their data-parallel rank reads."""
    order = (case["length"], case["global_batch"], case["seed"], case["shuffle"])
    alone, _ = _loaders(_plan(1), *order)
    uninterrupted = _steps(alone, case["total"])
    before, twins = _loaders(_plan(case["before"]), *order)
    seen = _steps(before, case["stop"])
    assert _steps(twins, case["stop"]) == seen
    state = before[0].state_dict()
    assert all(loader.state_dict() == state for loader in before)
    # built with another seed: the state brings the run's
    after, _ = _loaders(_plan(case["after"]), case["length"], case["global_batch"], 0, True)
    for loader in after:
        loader.load_state_dict(state)
    seen += _steps(after, case["total"] - case["stop"])
    assert seen == uninterrupted


def test_the_order_by_hand():
    # shuffle off: epoch after epoch the dataset's order, the tail (8, 9) left out
    sampler = fs.ResumableSampler(10, plan=_plan(2), rank=2, batch_size=4, shuffle=False)
    loader = sampler.loader(range(10))
    assert [b.tolist() for b in loader] == [[2, 3], [6, 7]]
    assert loader.state_dict() == {
        "dataset_len": 10,
        "global_batch": 4,
        "seed": 0,
        "shuffle": False,
        "epoch": 0,
        "consumed": 8,
        "steps": 2,
    }
    assert [b.tolist() for b in loader][:1] == [[2, 3]]  # the next epoch
    assert sampler.epoch == 1
    assert len(loader) == 2


def test_a_global_batch_that_does_not_divide_is_refused_naming_both_numbers():
    with pytest.raises(fs.ShardingError, match=re.escape("global batch of 6 samples does not divide over 4")):
        fs.ResumableSampler(24, plan=_plan(4), rank=0, batch_size=6)
    saved = fs.ResumableSampler(24, plan=_plan(3), rank=0, batch_size=6).state_dict()
    on_four = fs.ResumableSampler(24, plan=_plan(4), rank=0, batch_size=8)
    with pytest.raises(
        fs.ShardingError, match=re.escape("global batch of 6 samples does not divide over this plan's 4")
    ):
        on_four.load_state_dict(saved)
    other = fs.ResumableSampler(24, plan=_plan(2), rank=0, batch_size=8)
    with pytest.raises(fs.ShardingError, match=re.escape("saved with a global batch of 6 samples")):
        other.load_state_dict(saved)
    with pytest.raises(fs.ShardingError, match=re.escape("['batch_size'] are the sampler's to set")):
        other.loader(range(24), batch_size=2)


def test_a_plan_of_another_kind_is_refused_by_name():
    with pytest.raises(fs.ShardingError, match=re.escape("plan=str: a Plan (fs.ResumableSampler takes")):
        fs.ResumableSampler(24, plan="dp=4", rank=0, batch_size=8)


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("consumed", -6, "consumed=-6: an int of at least 0"),
        ("consumed", 5, "consumed=5: a whole number of global batches of 6 samples"),
        ("epoch", "2", "epoch='2': an int of at least 0"),
        ("shuffle", 1, "shuffle=int: a bool"),
        ("global_batch", 0, "global_batch=0: a positive int"),
    ],
)
def test_a_sampler_state_edited_by_hand_is_refused_by_its_value_and_changes_nothing(key, value, says):
    sampler = fs.ResumableSampler(24, batch_size=6)
    before = sampler.state_dict()
    edited = {**before, key: value}
    with pytest.raises(fs.ShardingError, match=re.escape(says)):
        sampler.load_state_dict(edited)
    assert sampler.state_dict() == before


@pytest.mark.parametrize(
    ("options", "says"), [({"seed": "x"}, "seed='x'"), ({"shuffle": "yes"}, "shuffle=str: a bool")]
)
def test_a_seed_or_shuffle_of_another_kind_is_refused(options, says):
    with pytest.raises(fs.ShardingError, match=re.escape(says)):
        fs.ResumableSampler(24, batch_size=6, **options)


@pytest.mark.parametrize("full", [True, False], ids=["file", "folder"])
def test_a_data_order_that_cannot_go_on_changes_nothing(one_rank, tmp_path, full):
    # a load with data= is refused before any tensor is set: another global batch, or a
    # checkpoint saved without a data order, leave the module and the sampler as they were
    torch.manual_seed(0)
    saved_model = nn.Linear(4, 4)
    loader = fs.ResumableSampler(24, plan=_plan(1), rank=0, batch_size=6).loader(range(24))
    next(iter(loader))
    with_order, without = tmp_path / "with", tmp_path / "without"
    fs.checkpoint.save(with_order, saved_model, data=loader, full=full)
    fs.checkpoint.save(without, saved_model, full=full)
    model = nn.Linear(4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    other = fs.ResumableSampler(24, plan=_plan(1), rank=0, batch_size=8).loader(range(24))
    with pytest.raises(fs.ShardingError, match="saved with a global batch of 6 samples"):
        fs.checkpoint.load(with_order, model, data=other)
    same = fs.ResumableSampler(24, plan=_plan(1), rank=0, batch_size=6).loader(range(24))
    with pytest.raises(fs.ShardingError, match=r"holds no data order.*Nothing was loaded"):
        fs.checkpoint.load(without, model, data=same)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert same.state_dict()["consumed"] == other.state_dict()["consumed"] == 0
    fs.checkpoint.load(with_order, model, data=same)  # the one that can go on does
    assert torch.equal(model.weight, saved_model.weight)
    assert same.state_dict()["consumed"] == 6


# ---- on real process groups ------------------------------------------------------------


def _rank0(worlds, ranks: int, fn, *args):
    """Rank 0's result of ``fn`` on the run's shared world of ``ranks`` ranks."""
    return worlds(ranks).run(fn, *args)[0]


def _resume(worlds, tmp_path, saved_under: tuple[str, int], resumed_under: tuple[str, int]) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = resume_cases.reference(2 * resume_cases.STOP)

    def on(ranks: int, *args):
        return _rank0(worlds, ranks, resume_cases.train_and_save, *args)

    stop = resume_cases.STOP
    first = on(saved_under[1], saved_under[0], path, stop, False)
    assert first["state"]["consumed"] == stop * resume_cases.GLOBAL_BATCH
    second = on(resumed_under[1], resumed_under[0], path, stop, True)
    # first a sampler of another global batch: refused before any tensor loaded
    assert (
        "saved with a global batch of 8 samples, this sampler has batch_size=16"
        in second["refused"]["message"]
    )
    assert second["refused"]["unchanged"]
    assert second["refused"]["position"] == 0
    assert second["state"]["epoch"] == 1  # three steps an epoch: the resume crossed into the next
    assert first["losses"] + second["losses"] == pytest.approx(uninterrupted, abs=1e-5)


def test_fs_checkpoint_resumes_on_half_the_ranks_with_the_data_order(worlds, tmp_path):
    """fsdp on 4 ranks, 2 steps, save; fsdp on 2 ranks, 2 more: the uninterrupted losses."""
    _resume(worlds, tmp_path, ("fsdp4", 4), ("fsdp2", 2))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved_under", "resumed_under"),
    [
        (("fsdp2", 2), ("fsdp4", 4)),
        (("fsdp2_tp2", 4), ("pp2_fsdp2", 4)),
        (("pp2_fsdp2", 4), ("tp2", 2)),
    ],
    ids=["fsdp2-to-fsdp4", "fsdp2xtp2-to-pp2xfsdp2", "pp2xfsdp2-to-tp2"],
)
def test_fs_checkpoint_resumes_under_other_plans_and_world_sizes(
    worlds, tmp_path, saved_under, resumed_under
):
    _resume(worlds, tmp_path, saved_under, resumed_under)


def _fit_and_resume(worlds, tmp_path, saved_under: tuple[str, int], resumed_under: tuple[str, int]) -> None:
    folder = str(tmp_path / "ckpts")
    uninterrupted = resume_cases.reference(2 * resume_cases.STOP)

    def on(ranks: int, *args):
        return _rank0(worlds, ranks, resume_cases.fit, *args)

    stop = resume_cases.STOP
    first = on(saved_under[1], saved_under[0], folder, stop, None)
    assert first["held"] == [f"epoch=0-step={stop}.ckpt"]
    second = on(resumed_under[1], resumed_under[0], folder, 2 * stop, f"{folder}/epoch=0-step={stop}.ckpt")
    assert second["step"] == 2 * stop
    assert first["losses"] + second["losses"] == pytest.approx(uninterrupted, abs=1e-5)


def test_a_trainer_resumes_mid_epoch_on_half_the_ranks_under_another_plan(worlds, tmp_path):
    """ModelCheckpoint at step 2 of fsdp on 4 processes; fit(ckpt_path=...) under tp on 2:
    the data order goes on mid-epoch and into the next, the losses the uninterrupted run's."""
    _fit_and_resume(worlds, tmp_path, ("fsdp4", 4), ("tp2", 2))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved_under", "resumed_under"),
    [(("fsdp2", 2), ("fsdp2_tp2", 4)), (("fsdp2_tp2", 4), ("pp2_fsdp2", 4))],
    ids=["fsdp2-to-fsdp2xtp2", "fsdp2xtp2-to-pp2xfsdp2"],
)
def test_a_trainer_resumes_under_other_plans_and_world_sizes(worlds, tmp_path, saved_under, resumed_under):
    _fit_and_resume(worlds, tmp_path, saved_under, resumed_under)
