"""Pictures of a plan: the bars are plan.cost(), the blocks are the layout, from shapes alone."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from torch import nn

import functional_shard as fs
from functional_shard.frontends.pictures import visualize
from functional_shard.zoo import llama

from ..strategies import mesh_shape_spec

pytest.importorskip("matplotlib")


def _plan_of(mesh: fs.Mesh, shape: tuple[int, ...], spec: fs.P) -> fs.Plan:
    """A one-tensor plan placing ``shape`` as ``spec`` (a policy function does it)."""
    model = nn.ParameterDict({"x": nn.Parameter(torch.empty(shape, device="meta"))})

    def place(path, tensor, mesh):
        return fs.ParamSharding.uniform(spec)

    return fs.shard(model, mesh, fs.replicate() + place)


@settings(max_examples=40)
@given(mesh_shape_spec())
def test_blocks_tile_the_tensor_and_every_rank_is_accounted_for(case):
    mesh, shape, spec = case
    try:
        plan = _plan_of(mesh, shape, spec)
    except fs.ShardingError:
        return  # e.g. every axis already split by the spec, none left for the batch
    found, empty, elsewhere = visualize.blocks(plan, "x")
    ranks = sorted([r for holders in found.values() for r in holders] + empty + elsewhere)
    assert ranks == list(range(mesh.size))
    rows = shape[0] if shape else 1
    cols = shape[1] if len(shape) >= 2 else 1
    if math.prod(shape) == 0:
        assert not found or len(shape) == 0
        return
    cells = set()
    for (row, height, col, width), holders in found.items():
        block = {(r, c) for r in range(row, row + height) for c in range(col, col + width)}
        assert not block & cells, "blocks overlap"
        cells |= block
        for rank in holders:  # each holder's own shard is this block
            local, offset = plan.local_shape_and_offset("x", rank)
            expected = (
                offset[0] if shape else 0,
                local[0] if shape else 1,
                offset[1] if len(shape) >= 2 else 0,
                local[1] if len(shape) >= 2 else 1,
            )
            assert expected == (row, height, col, width)
    assert len(cells) == rows * cols  # the slice is covered exactly once


def test_the_blocks_of_a_colwise_weight_under_fsdp_and_tp():
    model = nn.Sequential(nn.Linear(8, 6, bias=False))
    plan = fs.shard(model, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp([("*", "colwise")], "tp"))
    found, empty, _ = visualize.blocks(plan, "0.weight")
    # P(('tp', 'dp'), None): dim 0 (6) in 4 nested chunks, tp major: 2, 1 | 2, 1
    assert found == {(0, 2, 0, 8): [0], (2, 1, 0, 8): [2], (3, 2, 0, 8): [1], (5, 1, 0, 8): [3]}
    assert not empty
    found, _, _ = visualize.blocks(plan, "0.weight", "compute")
    assert found == {(0, 3, 0, 8): [0, 2], (3, 3, 0, 8): [1, 3]}


def test_zero1_optimizer_state_lives_whole_on_its_owner():
    plan = fs.shard(llama("tiny", device="meta"), fs.Mesh(dp=4), fs.zero(1, "dp"))
    found, empty, _ = visualize.blocks(plan, "lm_head.weight", "optim")
    assert list(found) == [(0, 256, 0, 64)]
    assert len(found[(0, 256, 0, 64)]) == 1
    assert len(empty) == 3


def test_the_figure_draws_each_ranks_predicted_memory(tmp_path):
    model = nn.Linear(10, 3)
    plan = fs.shard(model, fs.Mesh(dp=8), fs.fsdp())
    figure = plan.visualize("bias", path=tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    memory_axes, blocks_axes = figure.axes
    assert memory_axes.get_ylabel() == "bytes per device"
    heights = {}
    for container in memory_axes.containers:
        heights[container.get_label()] = [bar.get_height() for bar in container]
    for rank in range(8):
        cost = plan.cost("adamw", rank=rank)
        assert heights["params"][rank] == cost.params_bytes
        assert heights["optimizer"][rank] == cost.optimizer_bytes
        assert sum(h[rank] for h in heights.values()) == cost.total_bytes
    assert "ranks 3-7 hold none of it" in blocks_axes.get_title()
    assert len(blocks_axes.patches) == 3


class _Estimate:
    memory = {"params": 1, "activations": 3 * 2**30, "logits": 2**30}  # noqa: RUF012


def test_an_estimate_stacks_activations_on_every_bar():
    plan = fs.shard(llama("llama-7b"), fs.Mesh(dp=8), fs.fsdp())
    figure = plan.visualize(estimate=_Estimate(), budget=40 * 2**30)
    memory_axes = figure.axes[0]
    labels = [c.get_label() for c in memory_axes.containers]
    assert labels[-2:] == ["activations", "logits"]
    assert all(bar.get_height() == 3 for bar in memory_axes.containers[-2])
    assert memory_axes.get_title().startswith("memory per device (predicted) with activations")
    assert any(line.get_label() == "budget 40 GiB" for line in memory_axes.get_lines())
    # a budget far above the bars is named, not drawn, so the bars stay readable
    memory_axes = plan.visualize(estimate=_Estimate(), budget=800 * 2**30).axes[0]
    assert not memory_axes.get_lines()
    assert memory_axes.get_title().endswith("Mesh(dp=8); budget 800 GiB, off the scale")


@pytest.mark.parametrize("policy", [fs.fsdp(), fs.zero(1)], ids=["fsdp", "zero1"])
def test_with_an_estimate_the_bar_of_its_rank_is_its_peak(policy):
    # at the peak (the start of backward) no gradient exists yet and FSDP holds the units it
    # prefetched: the bar draws those, not plan.cost()'s gradients and one gathered unit
    model = llama("tiny")
    plan = fs.shard(model, fs.Mesh(dp=3), policy)
    estimate = fs.estimate(model, plan, batch=2, seq=16)
    memory_axes = plan.visualize(estimate=estimate).axes[0]
    assert memory_axes.get_ylabel() == "MiB per device"
    bars = [sum(container[rank].get_height() for container in memory_axes.containers) for rank in range(3)]
    assert bars[estimate.rank] * 2**20 == pytest.approx(estimate.peak_bytes, rel=1e-12)
    for rank in range(3):  # what rests on each rank is its own
        resting = plan.cost(rank=rank).params_bytes + plan.cost(rank=rank).optimizer_bytes
        assert bars[rank] - bars[estimate.rank] == pytest.approx(
            (resting - estimate.memory["params"] - estimate.memory["optimizer"]) / 2**20
        )


def test_with_a_pipelines_estimate_each_bar_is_its_own_stages_peak():
    # the estimate is the worst pp rank's (the last stage, with the loss): each bar drew its
    # activations and loss, the first stage's too
    model = llama("tiny")
    plan = fs.shard(model, fs.Mesh(pp=2, dp=2), fs.pipeline("pp", microbatches=2) + fs.fsdp("dp"))
    estimate = fs.estimate(model, plan, batch=4, seq=16)
    peaks = estimate.pipeline.rank_peak_bytes
    assert plan.mesh.coords(estimate.rank)["pp"] == 1
    assert peaks[0] < peaks[1]
    memory_axes = plan.visualize(estimate=estimate).axes[0]
    bars = [sum(container[rank].get_height() for container in memory_axes.containers) for rank in range(4)]
    for rank in range(4):
        assert bars[rank] * 2**20 == pytest.approx(peaks[plan.mesh.coords(rank)["pp"]], rel=1e-12), rank
    assert [c.get_label() for c in memory_axes.containers if c[0].get_height() == 0] == ["loss workspace"]


def test_a_big_mesh_draws_evenly_spread_ranks_and_a_subset_of_labels():
    plan = fs.shard(llama("llama-70b"), fs.Mesh(dp=16, tp=8), fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"))
    figure = plan.visualize()
    memory_axes, blocks_axes = figure.axes
    assert memory_axes.get_xlabel() == "rank (32 of 128)"
    assert [t.get_text() for t in memory_axes.get_xticklabels()][:3] == ["0", "4", "8"]
    assert blocks_axes.get_title().startswith("lm_head.weight  128256×8192")  # the largest by default
    assert "128 blocks, labelled by the ranks holding them (every 8th)" in blocks_axes.get_title()
    assert len(blocks_axes.texts) == 16


def test_bad_requests_are_named():
    plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp())
    with pytest.raises(fs.ShardingError, match=re.escape("the plan has no tensor 'wieght'")):
        plan.visualize("wieght")
    with pytest.raises(
        fs.ShardingError, match=re.escape("spec='stored': one of storage, compute, grad, optim")
    ):
        plan.visualize("weight", spec="stored")
    with pytest.raises(fs.ShardingError, match=re.escape("ranks [5] are outside the mesh of 2 devices")):
        plan.visualize(ranks=[0, 5])


def test_without_matplotlib_the_error_says_how_to_install_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp())
    with pytest.raises(fs.ShardingError, match=re.escape("pip install 'functional-shard[plot]'")):
        plan.visualize()
