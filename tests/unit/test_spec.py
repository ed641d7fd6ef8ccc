import re

import pytest
from hypothesis import assume, given
from torch.distributed.tensor import Replicate, Shard

# the one place tests read torch's private layout arithmetic, as the reference
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

import functional_shard as fs

from ..spec_helpers import torch_describes
from ..strategies import mesh_shape_spec


@pytest.mark.parametrize(
    ("spec", "text", "length", "axes"),
    [
        (fs.P(), "P()", 0, ()),
        (fs.P("dp", None), "P('dp', None)", 2, ("dp",)),
        (fs.P(("tp",), None), "P('tp', None)", 2, ("tp",)),
        (fs.P(("tp", "dp"), None), "P(('tp', 'dp'), None)", 2, ("tp", "dp")),
        (fs.P([], "tp"), "P(None, 'tp')", 2, ("tp",)),
    ],
)
def test_spec_examples(spec, text, length, axes):
    assert repr(spec) == text
    assert len(spec) == length
    assert spec.axes == axes
    assert list(spec) == list(spec.entries)
    assert hash(spec) == hash(eval(text, {"P": fs.P}))


def test_spec_rejects_bad_entries():
    with pytest.raises(fs.SpecError, match="must be None, an axis name or a tuple"):
        fs.P(3)


def test_param_sharding_rejects_non_specs():
    with pytest.raises(fs.SpecError, match=re.escape("ParamSharding.storage must be a P")):
        fs.ParamSharding(storage=None)


@pytest.mark.parametrize(
    ("mesh", "spec", "shape", "placements"),
    [
        (fs.Mesh(dp=2, tp=4), fs.P(None, "tp"), (8, 8), (Replicate(), Shard(1))),
        (fs.Mesh(dp=2, tp=4), fs.P(("dp", "tp")), (8, 8), (Shard(0), Shard(0))),
        (fs.Mesh(dp=2, tp=4), fs.P("dp", "tp"), (8, 8), (Shard(0), Shard(1))),
    ],
)
def test_placements_examples(mesh, spec, shape, placements):
    assert spec.to_placements(mesh, shape) == placements
    assert fs.P.from_placements(placements, mesh, shape) == spec.normalized(len(shape))


def test_nested_uneven_split_that_torch_cannot_describe_is_refused():
    # torch's _StridedShard interleaves when 7 rows do not divide by tp=2
    with pytest.raises(fs.SpecError, match=re.escape("only when 7 % 2 == 0")):
        fs.P(("tp", "dp")).to_placements(fs.Mesh(dp=3, tp=2), (7,))


@given(mesh_shape_spec())
def test_local_shapes_and_offsets_equal_torch(case):
    mesh, shape, spec = case
    try:
        placements = spec.to_placements(mesh, shape)
    except fs.SpecError:
        assume(False)
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        expected = _compute_local_shape_and_global_offset(
            shape, mesh.sizes, [coords[a] for a in mesh.axis_names], placements
        )
        assert fs.local_shape_and_offset(shape, spec, mesh, rank) == expected


@given(mesh_shape_spec())
def test_placements_round_trip_or_refuse(case):
    mesh, shape, spec = case
    if not torch_describes(mesh, shape, spec):
        with pytest.raises(fs.SpecError, match="_StridedShard describes that layout only when"):
            spec.to_placements(mesh, shape)
        return
    placements = spec.to_placements(mesh, shape)
    back = fs.P.from_placements(placements, mesh, shape)
    # specs are not unique (an axis of size 1 nests anywhere); the layout they give is
    assert back.to_placements(mesh, shape) == placements
    for rank in range(mesh.size):
        assert fs.local_shape_and_offset(shape, back, mesh, rank) == fs.local_shape_and_offset(
            shape, spec, mesh, rank
        )


@given(mesh_shape_spec())
def test_param_sharding_json_round_trip(case):
    mesh, _, spec = case
    sharding = fs.ParamSharding(spec, fs.P(), spec, fs.Owned(mesh.axis_names[0]))
    assert fs.ParamSharding.from_json(sharding.to_json()) == sharding


def test_specs_are_pytree_leaves():
    import optree

    tree = {"w": fs.P("dp", None), "s": fs.ParamSharding.uniform(fs.P("tp")), "o": fs.Owned("dp")}
    leaves = optree.tree_leaves(tree, namespace="functional_shard")
    assert leaves == [tree["o"], tree["s"], tree["w"]]  # optree sorts dict keys
