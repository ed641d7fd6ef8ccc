"""Checkpoints from elsewhere are data: no code runs, a failed load changes nothing.

Real checkpoints (saved by FSDP on gloo ranks, by a Trainer) are loaded into a module and
optimizer; files carrying a pickled object that would create a file when rebuilt are
refused and the file never appears; corruptions drawn by hypothesis (cut, flipped,
deleted files; renamed keys, other shapes and dtypes) are refused by name, and the
module and its optimizer stay exactly as they were.
"""

from __future__ import annotations

import copy
import fractions
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.runtime.checkpoint import api as checkpoint_api
from functional_shard.runtime.checkpoint.integrity import MANIFEST, seal, write_manifest
from functional_shard.zoo import Llama

from .. import dist_cases, lightning_cases
from ..sweeps import FEW

CONFIG = dist_cases.EVEN


class CreatesAFile:
    """Rebuilding this from a pickle opens (creates) ``path``: the stand-in for any code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, world4):
    """A folder and a full file, saved by FSDP on 4 gloo ranks after a step."""
    root = tmp_path_factory.mktemp("saved")
    for name, full_file in (("ckpt", False), ("ckpt.pt", True)):
        world4.run(dist_cases.save_after, "zero3", CONFIG, str(root / name), 1, full_file)
    return root


def module_and_optimizer(stepped: bool = True):
    torch.manual_seed(1)
    model = Llama(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=dist_cases.LR)
    if stepped:
        tokens = torch.randint(0, CONFIG.vocab_size, (2, dist_cases.SEQ + 1))
        dist_cases.loss_of(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def snapshot(model, optimizer):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def assert_untouched(model, optimizer, before):
    params, optim = before
    now_params, now_optim = snapshot(model, optimizer)
    assert now_params.keys() == params.keys()
    for key, value in params.items():
        assert torch.equal(now_params[key], value), key
    assert now_optim["param_groups"] == optim["param_groups"]
    assert now_optim["state"].keys() == optim["state"].keys()
    for index, state in optim["state"].items():
        for field, value in state.items():
            assert torch.equal(now_optim["state"][index][field], value), (index, field)


def rewrite_file(path: Path, change) -> None:
    """Change a full file's contents and seal it again, as a writer would."""
    content = torch.load(path, weights_only=True)
    change(content)
    torch.save(content, path)
    seal(path)


def rewrite_folder(path: Path, change) -> None:
    """Change a folder's contents and write it again whole: meta.pt and the manifest agree."""
    full = path.with_name(path.name + ".pt")
    fs.checkpoint.convert(path, full)
    rewrite_file(full, change)
    shutil.rmtree(path)
    fs.checkpoint.convert(full, path)
    full.unlink()


def files_of(path: Path) -> list[Path]:
    return sorted(path.iterdir()) if path.is_dir() else [path]


# ---------------------------------------------------------------- no code runs


def test_a_full_file_carrying_code_is_refused_and_the_code_never_runs(saved, tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "evil.pt"
    rewrite_file_from(saved / "ckpt.pt", path, lambda c: c["extra"].update(evil=CreatesAFile(marker)))
    assert_refused_harmlessly(
        path, marker, r"evil\.pt holds a io\.open, .*trust=True", tmp_path / "converted"
    )


def assert_refused_harmlessly(path: Path, marker: Path, refusal: str, converted: Path) -> None:
    """Loading and converting ``path`` are refused; the code never ran; the module is as it was."""
    model, optimizer = module_and_optimizer()
    before = snapshot(model, optimizer)
    with pytest.raises(fs.ShardingError, match=refusal):
        fs.checkpoint.load(path, model, optimizer)
    assert not marker.exists()
    assert_untouched(model, optimizer, before)
    with pytest.raises(fs.ShardingError, match=r"holds a "):
        fs.checkpoint.convert(path, converted)
    assert not marker.exists()
    assert not converted.exists()


def rewrite_file_from(source: Path, target: Path, change) -> None:
    shutil.copy(source, target)
    rewrite_file(target, change)


def _evil_meta(folder: Path, marker: Path) -> None:
    meta = torch.load(folder / "meta.pt", weights_only=True)
    meta["extra"]["evil"] = CreatesAFile(marker)
    torch.save(meta, folder / "meta.pt")


def _evil_index(folder: Path, marker: Path) -> None:
    with open(folder / ".metadata", "rb") as stream:
        index = pickle.load(stream)  # our own file, trusted here
    index.planner_data = {"evil": CreatesAFile(marker)}
    with open(folder / ".metadata", "wb") as stream:
        pickle.dump(index, stream)


def _evil_value(folder: Path, marker: Path) -> None:
    # a non-tensor value of the optimizer's (its learning rate) becomes the object
    full = folder.with_name("whole.pt")
    fs.checkpoint.convert(folder, full)
    content = torch.load(full, weights_only=True)
    content["optimizer"]["param_groups"][0]["lr"] = CreatesAFile(marker)
    shutil.rmtree(folder)
    dcp.save({k: content.pop(k) for k in ("model", "optimizer")}, checkpoint_id=folder, no_dist=True)
    torch.save(content, folder / "meta.pt")


@pytest.mark.parametrize(
    "plant", [_evil_meta, _evil_index, _evil_value], ids=["meta.pt", ".metadata", "value"]
)
def test_a_folder_carrying_code_is_refused_and_the_code_never_runs(saved, tmp_path, plant):
    marker, folder = tmp_path / "ran", tmp_path / "evil"
    shutil.copytree(saved / "ckpt", folder)
    plant(folder, marker)
    write_manifest(folder, alone=True)  # a careful attacker writes the digests too
    refusal = r"holds a .*(io\.open|builtins\.open).*trust=True"
    assert_refused_harmlessly(folder, marker, refusal, tmp_path / "converted.pt")


def test_a_lightning_checkpoint_carrying_code_is_refused_and_the_code_never_runs(world4, tmp_path):
    path, marker = tmp_path / "epoch1.ckpt", tmp_path / "ran"
    world4.run(lightning_cases.fit_epochs, "fs_fsdp", CONFIG, 1, None, str(path), True)
    rewrite_file(path, lambda c: c["callbacks"].update(evil=CreatesAFile(marker)))
    with pytest.raises(fs.ShardingError, match=r"holds a io\.open.*weights_only=False"):
        world4.refusal(lightning_cases.fit_epochs, "fs_fsdp", CONFIG, 2, str(path), None, True)
    assert not marker.exists()


def test_trust_loads_what_only_code_rebuilds(saved, tmp_path):
    path = tmp_path / "fraction.pt"
    rewrite_file_from(saved / "ckpt.pt", path, lambda c: c["extra"].update(third=fractions.Fraction(1, 3)))
    model, optimizer = module_and_optimizer()
    with pytest.raises(fs.ShardingError, match=r"holds a fractions\.Fraction"):
        fs.checkpoint.load(path, model, optimizer)
    extra = fs.checkpoint.load(path, model, optimizer, trust=True)
    assert extra == {"step": 1, "third": fractions.Fraction(1, 3)}


def test_save_keeps_only_plain_values_beside(tmp_path):
    # refused before any shard is gathered or written: no process group is needed to see it
    model, optimizer = module_and_optimizer(stepped=False)
    with pytest.raises(
        fs.ShardingError, match=r"extra\['when'\] is a fractions\.Fraction: a checkpoint keeps"
    ):
        fs.checkpoint.save(
            tmp_path / "ckpt", model, optimizer, extra={"step": 1, "when": fractions.Fraction(1, 2)}
        )
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------- nothing changes


def _key_changes(keys: list[str]) -> st.SearchStrategy:
    renamed = st.sampled_from(keys).map(lambda k: ("rename", k))
    reshaped = st.sampled_from(keys).map(lambda k: ("reshape", k))
    retyped = st.sampled_from(keys).map(lambda k: ("retype", k))
    moments = st.sampled_from(keys).map(lambda k: ("moment", k))
    return st.one_of(renamed, reshaped, retyped, moments)


def _changed(kind: str, key: str):
    def change(content):
        model, state = content["model"], content["optimizer"]["state"]
        if kind == "rename":
            model[key + "_renamed"] = model.pop(key)
        elif kind == "reshape":
            model[key] = model[key][..., :-1].clone()
        elif kind == "retype":
            model[key] = model[key].double()
        else:  # an Adam moment of another shape
            state[key]["exp_avg"] = state[key]["exp_avg"][..., :-1].clone()

    return change


def _damage(path: Path, data: st.DataObject) -> None:
    target = data.draw(st.sampled_from(files_of(path)), label="file")
    size = target.stat().st_size
    how = data.draw(st.sampled_from(["cut", "flip", "delete"]), label="how")
    if how == "delete":
        target.unlink()
    elif how == "cut":
        target.write_bytes(target.read_bytes()[: data.draw(st.integers(0, size - 1), label="to")])
    else:
        content = bytearray(target.read_bytes())
        content[data.draw(st.integers(0, size - 1), label="at")] ^= data.draw(
            st.integers(1, 255), label="bits"
        )
        target.write_bytes(bytes(content))


KEYS = sorted(name for name, _ in Llama(CONFIG).named_parameters())


@settings(max_examples=FEW)  # a checkpoint copied and damaged on disk per example
@given(data=st.data(), full_file=st.booleans(), stepped=st.booleans(), semantic=st.booleans())
def test_a_damaged_or_unfitting_checkpoint_is_refused_and_changes_nothing(
    saved, data, full_file, stepped, semantic
):
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / ("ckpt.pt" if full_file else "ckpt")
        (shutil.copy if full_file else shutil.copytree)(saved / path.name, path)
        if semantic:
            kind, key = data.draw(_key_changes(KEYS), label="change")
            (rewrite_file if full_file else rewrite_folder)(path, _changed(kind, key))
        else:
            _damage(path, data)
        model, optimizer = module_and_optimizer(stepped)
        before = snapshot(model, optimizer)
        with pytest.raises(fs.ShardingError) as refused:
            fs.checkpoint.load(path, model, optimizer)
        assert str(path) in str(refused.value)
        if semantic:
            assert key in str(refused.value)
        assert_untouched(model, optimizer, before)


@pytest.mark.slow  # the profile's count of examples
@given(data=st.data(), full_file=st.booleans(), stepped=st.booleans(), semantic=st.booleans())
def test_a_damaged_or_unfitting_checkpoint_is_refused_and_changes_nothing_full_sweep(
    saved, data, full_file, stepped, semantic
):
    test_a_damaged_or_unfitting_checkpoint_is_refused_and_changes_nothing.hypothesis.inner_test(
        saved, data, full_file, stepped, semantic
    )


def test_a_damaged_shard_is_refused_on_every_rank_and_changes_nothing(world4, saved, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", folder)
    shard = folder / "__1_0.distcp"
    content = bytearray(shard.read_bytes())
    content[len(content) // 2] ^= 0x10
    shard.write_bytes(bytes(content))
    result = world4.run(dist_cases.load_refused, "fsdp_tp", CONFIG, str(folder))[0]
    assert len(set(result["errors"])) == 1
    assert "__1_0.distcp: its contents changed since it was written" in result["errors"][0]
    assert_same(result["after"], result["before"])


def assert_same(got, expected):
    for key, value in expected["model"].items():
        assert torch.equal(got["model"][key], value), key
    for key, state in expected["optimizer"].items():
        for field, value in state.items():
            assert torch.equal(got["optimizer"][key][field], value), (key, field)


def test_checkpoints_from_before_digests_load_as_before(saved, tmp_path):
    # the current version's files without their seal, its folders without their manifest
    old_file, old_folder = tmp_path / "old.pt", tmp_path / "old"
    torch.save(torch.load(saved / "ckpt.pt", weights_only=True), old_file)
    content = torch.load(old_file, weights_only=True)
    dcp.save({k: content.pop(k) for k in ("model", "optimizer")}, checkpoint_id=old_folder, no_dist=True)
    torch.save(content, old_folder / "meta.pt")
    assert not (old_folder / MANIFEST).exists()
    reference, _ = module_and_optimizer()
    fs.checkpoint.load(saved / "ckpt.pt", reference, torch.optim.AdamW(reference.parameters()))
    for path in (old_file, old_folder):
        model, optimizer = module_and_optimizer(stepped=False)
        assert fs.checkpoint.load(path, model, optimizer) == {"step": 1}
        for key, value in reference.state_dict().items():
            assert torch.equal(model.state_dict()[key], value), key


def test_latest_finds_the_newest_whole_checkpoint_and_it_loads(saved, tmp_path):
    """A crash mid-save leaves its files aside (``.tmp-``); a cut shard or file is not
    whole; the previous checkpoint left as ``.old`` between the renames counts."""
    runs = tmp_path / "runs"
    runs.mkdir()
    assert fs.checkpoint.latest(runs) is None

    def put(source: Path, name: str, age: int) -> Path:
        target = runs / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
        os.utime(target, (1_000_000 + age, 1_000_000 + age))
        return target

    put(saved / "ckpt", "step-1", 1)
    second = put(saved / "ckpt", "step-2", 2)
    put(saved / "ckpt", "step-3.tmp-0a1b2c3d", 3)  # a save that crashed: newest, aside
    assert fs.checkpoint.latest(runs) == second
    (second / "__1_0.distcp").write_bytes(b"cut")
    assert fs.checkpoint.latest(runs) == runs / "step-1"
    file = put(saved / "ckpt.pt", "step-4.pt", 4)
    assert fs.checkpoint.latest(runs) == file
    file.write_bytes(file.read_bytes()[:-100])
    os.utime(file, (1_000_004, 1_000_004))
    older = put(saved / "ckpt", "step-5.old", 5)  # a crash between the two renames
    assert fs.checkpoint.latest(runs) == older
    model, optimizer = module_and_optimizer(stepped=False)
    assert fs.checkpoint.load(fs.checkpoint.latest(runs), model, optimizer) == {"step": 1}
    with pytest.raises(fs.ShardingError, match=r"is not a folder of checkpoints"):
        fs.checkpoint.latest(runs / "nowhere")


def test_latest_passes_over_files_no_save_sealed(tmp_path):
    """A save seals its file before the rename: a newer unsealed zip (a crash's leftover, another
    tool's torch.save) is no checkpoint of a save, whatever its name."""
    sealed = tmp_path / "step-1.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, sealed)
    seal(sealed)
    os.utime(sealed, (1_000_000, 1_000_000))
    for age, name in enumerate(("step-2.pt", "step-2.zip"), start=2):
        torch.save({"model": {"w": torch.ones(2)}}, tmp_path / name)
        os.utime(tmp_path / name, (1_000_000 + age, 1_000_000 + age))
    assert fs.checkpoint.latest(tmp_path) == sealed


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_latest_passes_over_a_checkpoint_removed_while_it_looks(tmp_path, monkeypatch, kind):
    """Lightning's ModelCheckpoint (save_top_k) removes older checkpoints while another process
    looks: one gone between the listing and its turn is passed over, not a FileNotFoundError."""
    for age, name in enumerate(("step-1", "step-2"), start=1):
        if kind == "file":
            torch.save({"model": {"w": torch.zeros(2)}}, tmp_path / name)
            seal(tmp_path / name)
        else:
            (tmp_path / name).mkdir()
            torch.save({"w": torch.zeros(2)}, tmp_path / name / "__0_0.distcp")
            write_manifest(tmp_path / name, alone=True)
        os.utime(tmp_path / name, (1_000_000 + age, 1_000_000 + age))
    recognised = checkpoint_api.is_ours

    def recognised_then_removed(path: Path) -> bool:
        ours = recognised(path)
        if path.name == "step-2":
            (shutil.rmtree if path.is_dir() else Path.unlink)(path)
        return ours

    monkeypatch.setattr(checkpoint_api, "is_ours", recognised_then_removed)
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "step-1"
