"""A user's mistakes in the arguments of the checkpoint functions, refused by name.

Each is refused with a `ShardingError` that names the argument and the fix, before anything
is read or written, instead of an error from deep inside torch; a value refused on one rank
is refused on every rank.
"""

from __future__ import annotations

import re

import pytest
import torch

import functional_shard as fs
from functional_shard.zoo import Llama

from .. import dist_cases

CONFIG = dist_cases.EVEN


def parallel_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = Llama(dist_cases.EVEN)
    return fs.apply(fs.shard(model, fs.Mesh(dp=1), fs.fsdp("dp")), model)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, path: fs.checkpoint.save(path, "model"), "save(module=str): a Module"),
        (lambda m, path: fs.checkpoint.load(path, "model"), "load(module=str): a Module"),
        (lambda m, path: fs.checkpoint.save(path, m, "adamw"), "save(optimizer=str): an Optimizer"),
        (lambda m, path: fs.checkpoint.save(path, m, extra=[1, 2]), "save(extra=list): a dict"),
        (
            lambda m, path: fs.checkpoint.load(path, m, data=[1, 2]),
            "load(data=list): a ResumableLoader or ResumableSampler",
        ),
        # before: a truthy "no" trusted the checkpoint's pickled objects, which can run code
        (lambda m, path: fs.checkpoint.load(path, m, trust="no"), "load(trust=str): a bool (True rebuilds"),
        (
            lambda m, path: fs.checkpoint.convert(path, path.parent / "ckpt.pt", trust="no"),
            "convert(trust=str): a bool (True rebuilds",
        ),
        # before: "no" was truthy, and asynchronous="no" started a save nobody waited on
        (lambda m, path: fs.checkpoint.save(path, m, full="no"), "save(full=str): a bool"),
        (lambda m, path: fs.checkpoint.save(path, m, asynchronous="no"), "save(asynchronous=str): a bool"),
        (lambda m, path: fs.checkpoint.load(path, m, strict="no"), "load(strict=str): a bool"),
        (
            lambda m, path: fs.checkpoint.save(path, m, extra=(lambda d: d.update(me=d) or d)({})),
            "fs.checkpoint.save: extra['me'] is a dict that holds itself",
        ),
        (
            # built before fs.apply replaced the parameters
            lambda m, path: fs.checkpoint.save(path, m, torch.optim.AdamW(parallel_model(1).parameters())),
            "save(optimizer=AdamW): an optimizer of the module's parameters (20 of its parameters are not "
            "the module's) (build it from module.parameters() after fs.apply",
        ),
    ],
    ids=[
        "save-module",
        "load-module",
        "save-optimizer",
        "save-extra",
        "load-data",
        "load-trust",
        "convert-trust",
        "save-full",
        "save-asynchronous",
        "load-strict",
        "looped-extra",
        "foreign-optimizer",
    ],
)
def test_arguments_of_another_kind_are_refused_by_name(one_rank, tmp_path, call, message):
    model = parallel_model()
    path = fs.checkpoint.save(tmp_path / "ckpt", model, extra={"step": 1})
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        call(model, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_an_extra_refused_on_one_rank_is_refused_on_every_rank(world4, tmp_path):
    refusals = world4.run(
        dist_cases.save_with_extra_plain_on_rank_0_only, "zero3", CONFIG, str(tmp_path / "c")
    )
    assert all(len(refused) == 1 for refused in refusals)  # the second save went through on every rank
    assert all("extra['best'] is a builtins.object" in refused[0] for refused in refusals)
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "c"


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_a_module_still_on_the_meta_device_is_refused_before_anything_is_written(one_rank, tmp_path, full):
    with torch.device("meta"):
        model = Llama(dist_cases.EVEN)
    fs.apply(fs.shard(model, fs.Mesh(dp=1), fs.fsdp("dp")), model)  # applied, never materialized
    with pytest.raises(
        fs.ShardingError,
        match=re.escape("are on the meta device (built there and never filled, they hold no values)"),
    ):
        fs.checkpoint.save(tmp_path / "ckpt", model, full=full)
    assert list(tmp_path.iterdir()) == []
