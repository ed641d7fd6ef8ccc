"""Plans read from disk are checked: a broken file is refused with every problem named,
never half-read into a plan that fails later (hypothesis mutates real plans' JSON)."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard.zoo import llama


def _plans() -> list[fs.Plan]:
    model = llama("tiny")
    return [
        fs.shard(model, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")),
        fs.shard(model, fs.Mesh(pp=2, dp=2), fs.pipeline("pp", microbatches=2) + fs.fsdp("dp")),
        fs.shard(model, fs.Mesh(dp=2, cp=2), fs.zero(1, "dp") + fs.replicate("cp") + fs.cp("cp")),
    ]


PLANS = _plans()
TEXTS = [plan.to_json() for plan in PLANS]


def _places(data, path=()):
    """Every (container, key) in the JSON tree, for mutations to pick from."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield data, key
            yield from _places(value, (*path, key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield data, index
            yield from _places(value, (*path, index))


ODD_VALUES = [None, 0, -1, 1.5, "zz", "", [], {}, [None], ["dp", "dp"], {"entries": 3}, True]


def _mutated(data, choice: int, how: str, value_index: int):
    data = copy.deepcopy(data)
    places = list(_places(data))
    container, key = places[choice % len(places)]
    if how == "drop":
        if isinstance(container, dict):
            del container[key]
        else:
            container.pop(key)
    elif how == "retype":
        container[key] = ODD_VALUES[value_index % len(ODD_VALUES)]
    elif how == "rename" and isinstance(container.get("axes") if isinstance(container, dict) else None, list):
        container["axes"][0][0] = "zz"
    elif how == "rename":
        container[key] = "zz" if isinstance(container[key], str) else container[key]
    return data


def _must_hold(read: fs.Plan) -> None:
    """What a plan read back must do without raising anything but a ShardingError."""
    read.explain()
    read.cost("adamw")
    for rank in range(read.mesh.size):
        read.data_parallel_rank(rank)
    assert fs.Plan.from_json(read.to_json()) == read


@given(
    plan=st.integers(0, len(PLANS) - 1),
    choice=st.integers(0, 10_000),
    how=st.sampled_from(["drop", "retype", "rename"]),
    value=st.integers(0, len(ODD_VALUES) - 1),
)
def test_a_mutated_plan_file_is_refused_or_reads_back_whole(plan, choice, how, value):
    data = _mutated(json.loads(TEXTS[plan]), choice, how, value)
    try:
        read = fs.Plan.from_json(json.dumps(data))
    except fs.ShardingError:
        return
    _must_hold(read)


@given(plan=st.integers(0, len(PLANS) - 1), cut=st.integers(0, 10_000))
def test_a_cut_plan_file_is_refused(plan, cut):
    text = TEXTS[plan]
    with pytest.raises(fs.ShardingError, match="not a plan file"):
        fs.Plan.from_json(text[: cut % len(text)])


class _WithActivations(nn.Module):
    """Two blocks, then an activation and a dropout, which hold no tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.act = nn.GELU()
        self.drop = nn.Dropout()


@pytest.mark.parametrize(
    ("mesh", "policy"),
    [
        (fs.Mesh(dp=2), fs.fsdp("dp") + fs.checkpointing(nn.GELU)),
        (fs.Mesh(dp=2), fs.fsdp("dp", units=["drop"])),
        (fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2, split=[["layers.0"], ["layers.1", "act", "drop"]])),
    ],
    ids=["checkpointed", "fsdp unit", "pipeline stage"],
)
def test_a_plan_naming_modules_that_hold_no_tensors_reads_back(mesh, policy):
    plan = fs.shard(_WithActivations(), mesh, policy)
    assert fs.Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.__setitem__("tensors", 5), "tensors: must be an object"),
        (lambda d: d.__setitem__("config", []), "config: must be an object"),
        (
            lambda d: d["tensors"]["lm_head.weight"].__setitem__("shape", None),
            "tensors['lm_head.weight'].shape",
        ),
        (
            lambda d: d["tensors"]["lm_head.weight"].__setitem__("shape", "zz"),
            "tensors['lm_head.weight'].shape",
        ),
        (lambda d: d["tensors"]["norm.weight"].__setitem__("kind", "weights"), "tensors['norm.weight'].kind"),
        (
            lambda d: d["tensors"]["norm.weight"].__setitem__("frozen", "yes"),
            "tensors['norm.weight'].frozen: must be true or false",
        ),
        (
            lambda d: d["tensors"]["norm.weight"]["sharding"].__setitem__("storage", ["ep"]),
            "axis 'ep' is not an axis",
        ),
        (
            lambda d: d["config"]["fsdp"].__setitem__("units", ["nowhere"]),
            "config.fsdp.units: 'nowhere' is no module",
        ),
        (lambda d: d["config"].__setitem__("microbatches", 2), "config.microbatches: not a field"),
        (lambda d: d["config"]["tp"].__setitem__("styles", "two"), "config.tp.styles"),
        (lambda d: d["config"].__setitem__("pipeline", {"microbatches": 2}), "config.pipeline.axis: missing"),
        (lambda d: d["config"]["fsdp"].__setitem__("kind", "none"), "config.fsdp.kind: 'none'"),
        (
            lambda d: d["config"].__setitem__("param_dtype", "int8"),
            "config.param_dtype: 'int8' is not a floating",
        ),
        (
            lambda d: d["config"].__setitem__("reduce_dtype", "float8_e5m2"),
            "config.reduce_dtype: 'float8_e5m2'",
        ),
        (lambda d: d["mesh"].__setitem__("axes", [["dp", 0]]), "mesh:"),
    ],
)
def test_each_kind_of_damage_is_named_by_path_and_field(edit, message):
    data = json.loads(TEXTS[0])
    edit(data)
    with pytest.raises(fs.ShardingError, match=r"does not hold together|not a plan") as error:
        fs.Plan.from_json(json.dumps(data))
    assert message in str(error.value)


def test_a_frozen_parameter_reads_back_frozen_and_the_others_as_before():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp())
    data = json.loads(plan.to_json())
    assert data["tensors"]["0.weight"]["frozen"] is True
    assert "frozen" not in data["tensors"]["0.bias"]  # plan files of models with none frozen are unchanged
    assert fs.Plan.from_json(data) == plan
    assert plan != fs.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), fs.Mesh(dp=2), fs.fsdp())


def test_every_problem_is_reported_at_once():
    data = json.loads(TEXTS[0])
    data["tensors"]["norm.weight"]["kind"] = "weights"
    data["tensors"]["lm_head.weight"]["dtype"] = "float99"
    data["config"]["fsdp"]["shard_axes"] = ["zz"]
    with pytest.raises(fs.ShardingError) as error:
        fs.Plan.from_json(data)
    text = str(error.value)
    for part in ("norm.weight'].kind", "lm_head.weight'].dtype", "axis 'zz'"):
        assert part in text


def test_the_cli_refuses_a_broken_plan_file_in_one_line(tmp_path, capsys):
    from functional_shard.cli import main

    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(TEXTS[0])
    bad.write_text(TEXTS[0][: len(TEXTS[0]) // 2])
    assert main(["diff", str(good), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "not a plan file" in err[0]
