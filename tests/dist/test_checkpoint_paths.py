"""Where a checkpoint goes: a save replaces only an earlier checkpoint, never the user's files.

A save to a folder of other files, or over a file no save wrote, is refused before anything
is written and leaves them byte for byte; an earlier checkpoint (folder or file, sharded or
full, asynchronous or not, Lightning's way through `write`) is replaced as before. A save
without a process group and a conversion of a file that holds no module are refused by name.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.runtime.checkpoint.integrity import MANIFEST, META, occupied_problems
from functional_shard.zoo import Llama

from .. import dist_cases
from ..sweeps import FEW

FOREIGN_FOLDER = "is a folder that is not a checkpoint"
FOREIGN_FILE = "is a file that is not a checkpoint"
FIX = "save to a new path, or delete"


def parallel_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = Llama(dist_cases.EVEN)
    return fs.apply(fs.shard(model, fs.Mesh(dp=1), fs.fsdp("dp")), model)


def contents(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (or ``path`` itself), by relative name: what a save must keep."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def first_weight(model: torch.nn.Module) -> torch.Tensor:
    state = fs.checkpoint.model_state(model, full=True)
    return next(iter(state.values())).clone()


def folder_of_runs(path: Path) -> None:
    (path / "run1").mkdir(parents=True)
    (path / "run1" / "notes.txt").write_text("important")


def folder_of_notes(path: Path) -> None:
    path.mkdir()
    (path / "notes.txt").write_text("important")


def plain_torch_file(path: Path) -> None:
    torch.save({"model": {"w": torch.ones(2)}}, path)


def text_file(path: Path) -> None:
    path.write_text("important")


def torch_dcp_folder(path: Path) -> None:
    # torch's own distributed checkpoint: no meta.pt, no manifest, so not a save of ours
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=path, no_dist=True)


OCCUPANTS = [
    (folder_of_runs, f"{FOREIGN_FOLDER} (it holds run1/)"),
    (folder_of_notes, f"{FOREIGN_FOLDER} (it holds notes.txt)"),
    (torch_dcp_folder, FOREIGN_FOLDER),
    (plain_torch_file, FOREIGN_FILE),
    (text_file, FOREIGN_FILE),
]


@pytest.mark.parametrize(("make", "what"), OCCUPANTS, ids=[make.__name__ for make, _ in OCCUPANTS])
@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_a_save_over_what_is_not_a_checkpoint_is_refused_and_keeps_it(one_rank, tmp_path, make, what, full):
    path = tmp_path / "runs"
    make(path)
    before = contents(path)
    refused = re.escape(f"fs.checkpoint.save wrote nothing to {path}")
    with pytest.raises(fs.ShardingError, match=refused) as error:
        fs.checkpoint.save(path, parallel_model(), full=full)
    assert what in str(error.value)
    assert FIX in str(error.value)
    assert contents(path) == before
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]  # nothing written aside either


@pytest.mark.parametrize(("make", "what"), OCCUPANTS[:1] + OCCUPANTS[3:4], ids=["folder", "file"])
def test_an_asynchronous_save_over_what_is_not_a_checkpoint_is_refused(one_rank, tmp_path, make, what):
    path = tmp_path / "runs"
    make(path)
    before = contents(path)
    with pytest.raises(fs.ShardingError, match=re.escape(what)):
        fs.checkpoint.save(path, parallel_model(), asynchronous=True)
    assert contents(path) == before


def test_what_comes_to_the_path_while_an_asynchronous_save_writes_is_kept(one_rank, tmp_path):
    path = tmp_path / "ckpt"
    pending = fs.checkpoint.save(path, parallel_model(), asynchronous=True)
    folder_of_notes(path)
    with pytest.raises(fs.ShardingError, match=re.escape(f"{FOREIGN_FOLDER} (it holds notes.txt)")):
        pending.wait()
    assert contents(path) == {"notes.txt": b"important"}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("first_full", [False, True], ids=["over-sharded", "over-full"])
@pytest.mark.parametrize(
    ("full", "asynchronous"), [(False, False), (True, False), (False, True)], ids=["sharded", "full", "async"]
)
def test_a_save_replaces_an_earlier_checkpoint(one_rank, tmp_path, first_full, full, asynchronous):
    path = tmp_path / "ckpt"
    fs.checkpoint.save(path, parallel_model(seed=0), full=first_full, extra={"step": 1})
    second = parallel_model(seed=1)
    saved = fs.checkpoint.save(path, second, full=full, extra={"step": 2}, asynchronous=asynchronous)
    if asynchronous:
        saved.wait()
    assert path.is_dir() is not full
    loaded = parallel_model(seed=2)
    assert fs.checkpoint.load(path, loaded) == {"step": 2}
    assert torch.equal(first_weight(loaded), first_weight(second))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_save_into_an_empty_folder_writes_there(one_rank, tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    fs.checkpoint.save(path, parallel_model())
    assert (path / MANIFEST).is_file()


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_a_save_under_a_file_is_refused_and_keeps_it(one_rank, tmp_path, full):
    text_file(tmp_path / "notes")
    path = tmp_path / "notes" / "runs" / "ckpt"
    refused = f"fs.checkpoint.save wrote nothing to {path}: {tmp_path / 'notes'} is a file, not a folder"
    with pytest.raises(fs.ShardingError, match=re.escape(refused)):
        fs.checkpoint.save(path, parallel_model(), full=full)
    assert contents(tmp_path) == {"notes": b"important"}


def test_a_save_inside_a_checkpoint_and_a_conversion_onto_its_source_are_refused(one_rank, tmp_path):
    model = parallel_model()
    outer = fs.checkpoint.save(tmp_path / "ckpt", model, extra={"step": 1})
    before = contents(outer)
    inside = f"{outer} is a checkpoint, which a save to its path replaces whole, with what is inside it"
    with pytest.raises(fs.ShardingError, match=re.escape(inside)):
        fs.checkpoint.save(outer / "inner", model)
    with pytest.raises(fs.ShardingError, match=re.escape(inside)):
        fs.checkpoint.convert(outer, outer / "whole.pt")
    with pytest.raises(fs.ShardingError, match=re.escape(f"the target {outer} is the source")):
        fs.checkpoint.convert(outer, tmp_path / "." / "ckpt")
    assert contents(outer) == before


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="Needs /proc, where no process may make files.")
@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_a_save_where_nothing_may_be_written_is_refused_on_every_rank(world4, full):
    path = "/proc/fs-checkpoint-test/ckpt"
    refusals = world4.run(dist_cases.save_where_nothing_may_be_written, "zero3", dist_cases.EVEN, path, full)
    assert all(refused.startswith(f"fs.checkpoint.save could not write {path} (") for refused in refusals)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="Needs /proc, where no process may make files.")
def test_a_conversion_to_where_nothing_may_be_written_is_refused(one_rank, tmp_path):
    folder = fs.checkpoint.save(tmp_path / "ckpt", parallel_model())
    whole = fs.checkpoint.convert(folder, tmp_path / "ckpt.pt")
    for source, target in ((folder, "/proc/fs-checkpoint-test.pt"), (whole, "/proc/fs-checkpoint-test")):
        with pytest.raises(
            fs.ShardingError, match=re.escape(f"fs.checkpoint.convert could not write {target} (")
        ):
            fs.checkpoint.convert(source, target)


def test_a_full_save_makes_its_missing_folders_as_a_sharded_one_does(one_rank, tmp_path):
    model = parallel_model()
    for full in (False, True):
        fs.checkpoint.save(
            tmp_path / f"full-{full}" / "runs" / "ckpt", model, full=full, extra={"full": full}
        )
        assert fs.checkpoint.load(tmp_path / f"full-{full}" / "runs" / "ckpt", model) == {"full": full}


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (text_file, "it is a file, but not one torch.save wrote (a zip archive)"),
        (
            folder_of_notes,
            "the folder holds none of meta.pt, manifest.json or .metadata (it holds notes.txt)",
        ),
    ],
    ids=["file", "folder"],
)
def test_loading_what_is_not_a_checkpoint_says_there_is_none(one_rank, tmp_path, make, what):
    path = tmp_path / "runs"
    make(path)
    with pytest.raises(fs.ShardingError, match=re.escape(f"there is no checkpoint at {path}: {what}")):
        fs.checkpoint.load(path, parallel_model())
    with pytest.raises(fs.ShardingError, match=re.escape(f"there is no checkpoint at {path}: {what}")):
        fs.checkpoint.convert(path, tmp_path / "converted")


def test_lightnings_write_refuses_the_users_files_and_replaces_its_own_checkpoint(one_rank, tmp_path):
    """Lightning's strategies save through `write`: ModelCheckpoint may save ``last`` again."""
    model = parallel_model()
    state = {"state_dict": fs.checkpoint.model_state(model)}
    path = tmp_path / "last.ckpt"
    for step in (1, 2):
        fs.checkpoint.write(path, state, full=False, meta={"global_step": step})
    assert fs.checkpoint.read(path, ("state_dict", parallel_model()), {})["global_step"] == 2
    user = tmp_path / "mine.ckpt"
    plain_torch_file(user)
    with pytest.raises(fs.ShardingError, match=re.escape(f"fs.checkpoint.write wrote nothing to {user}")):
        fs.checkpoint.write(user, state, full=True, meta={})


def test_a_users_folder_named_like_the_previous_checkpoint_is_kept(one_rank, tmp_path):
    """``NAME.old`` is where a save moves the checkpoint it replaces: the user's is not touched."""
    path, old = tmp_path / "ckpt", tmp_path / "ckpt.old"
    folder_of_notes(old)
    fs.checkpoint.save(path, parallel_model())  # nothing at the path: the .old stays as it is
    assert contents(old) == {"notes.txt": b"important"}
    with pytest.raises(fs.ShardingError, match=re.escape(f"{old} {FOREIGN_FOLDER} (it holds notes.txt)")):
        fs.checkpoint.save(path, parallel_model())  # replacing ckpt would move it onto ckpt.old
    assert contents(old) == {"notes.txt": b"important"}
    assert (path / MANIFEST).is_file()


def test_a_previous_checkpoint_a_crash_left_beside_is_replaced_too(one_rank, tmp_path):
    """A crash after the new checkpoint's rename leaves the previous one as ``NAME.old``."""
    path = tmp_path / "ckpt"
    fs.checkpoint.save(path, parallel_model())
    shutil.copytree(path, tmp_path / "ckpt.old")
    fs.checkpoint.save(path, parallel_model(seed=1), extra={"step": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert fs.checkpoint.load(path, parallel_model()) == {"step": 2}


_NAMES = st.text(st.sampled_from("abcxyz_.-0"), min_size=1, max_size=8).filter(lambda n: n.strip("."))


FOLDERS = {
    "files": st.lists(_NAMES, min_size=1, max_size=9, unique=True),
    "folders": st.lists(_NAMES, max_size=3, unique=True),
    "marked": st.sampled_from([None, META, MANIFEST]),
}


@settings(max_examples=FEW)  # a folder written per example
@given(**FOLDERS)
def test_a_folder_may_be_replaced_only_when_it_is_a_checkpoint(files, folders, marked):
    """Any folder of files is refused, naming a few of its entries, unless a save's own file marks it."""
    folders = [name for name in folders if name not in files]
    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / "target"
        path.mkdir()
        for name in folders:
            (path / name).mkdir()
        for name in files + ([marked] if marked else []):
            (path / name).write_text("x")
        problems = occupied_problems(path)
        if marked:
            assert problems == []
        else:
            entries = {*files, *(f"{name}/" for name in folders)}
            (problem,) = problems
            opening = f"{path} {FOREIGN_FOLDER} (it holds "
            assert problem.startswith(opening)
            assert problem.endswith(")")
            named = problem[len(opening) : -1].split(", ")
            if len(entries) > 5:  # a few, and a sign of more
                assert named[5:] == ["..."]
                assert set(named[:5]) <= entries
            else:
                assert sorted(named) == sorted(entries)


@pytest.mark.slow  # the profile's count of examples
@given(**FOLDERS)
def test_a_folder_may_be_replaced_only_when_it_is_a_checkpoint_full_sweep(files, folders, marked):
    test_a_folder_may_be_replaced_only_when_it_is_a_checkpoint.hypothesis.inner_test(files, folders, marked)


def test_a_save_without_a_process_group_says_to_initialise_one(tmp_path):
    assert not dist.is_initialized()
    model = Llama(dist_cases.EVEN)
    needs = "needs torch.distributed: call dist.init_process_group(...) first"
    with pytest.raises(fs.ShardingError, match=re.escape(f"fs.checkpoint.save {needs}")):
        fs.checkpoint.save(tmp_path / "ckpt", model)
    with pytest.raises(fs.ShardingError, match=re.escape(f"fs.checkpoint.write {needs}")):
        fs.checkpoint.write(tmp_path / "ckpt", {"model": model.state_dict()}, full=True, meta={})
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "content",
    [{"a": torch.zeros(2)}, {"weights": {"w": torch.ones(3)}, "step": 3}, {}],
    ids=["tensor", "nested", "empty"],
)
def test_converting_a_file_that_holds_no_module_is_refused_as_load_refuses_it(tmp_path, content):
    source, target = tmp_path / "plain.pt", tmp_path / "converted"
    torch.save(content, source)
    held = "holds no 'model' or 'state_dict' state"
    with pytest.raises(fs.ShardingError, match=re.escape(f"the checkpoint at {source} {held}")):
        fs.checkpoint.convert(source, target)
    assert [p.name for p in tmp_path.iterdir()] == ["plain.pt"]
    with pytest.raises(fs.ShardingError, match=re.escape("it is not a checkpoint of this kind")):
        fs.checkpoint.load(source, Llama(dist_cases.EVEN))


def test_converting_onto_the_users_files_is_refused(one_rank, tmp_path):
    source, target = tmp_path / "ckpt", tmp_path / "runs"
    fs.checkpoint.save(source, parallel_model())
    folder_of_runs(target)
    with pytest.raises(fs.ShardingError, match=re.escape(f"fs.checkpoint.convert wrote nothing to {target}")):
        fs.checkpoint.convert(source, target)
    assert contents(target) == {"run1/notes.txt": b"important"}
