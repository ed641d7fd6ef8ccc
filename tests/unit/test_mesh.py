import re

import pytest
import torch
from hypothesis import given

import functional_shard as fs

from ..strategies import meshes


@pytest.mark.parametrize(
    ("mesh", "names", "sizes", "size"),
    [
        (fs.Mesh(dp=2, tp=4), ("dp", "tp"), (2, 4), 8),
        (fs.Mesh(dp=8), ("dp",), (8,), 8),
        (fs.Mesh({"node": 2}, gpu=8), ("node", "gpu"), (2, 8), 16),
    ],
)
def test_mesh_examples(mesh, names, sizes, size):
    assert mesh.axis_names == names
    assert mesh.sizes == sizes
    assert mesh.size == size
    assert mesh.shape == dict(zip(names, sizes, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 0}, "axis 'dp' has size 0"),
        ({"dp": -1, "tp": -1}, "more than one axis has size -1"),
        ({"dp": 2.0}, "axis 'dp' has size 2.0"),
        ({}, "a mesh needs at least one axis"),
    ],
)
def test_mesh_rejects_bad_axes(kwargs, message):
    with pytest.raises(fs.MeshError, match=re.escape(message)):
        fs.Mesh(**kwargs)


def test_mesh_rejects_duplicate_and_bad_names():
    with pytest.raises(fs.MeshError, match="axis 'dp' is named twice"):
        fs.Mesh({"dp": 2}, **{"dp": 2})
    with pytest.raises(fs.MeshError, match="not a Python identifier"):
        fs.Mesh({"data parallel": 2})


def test_resolve_fills_the_rest_and_checks_sizes():
    assert fs.Mesh(dp=-1, tp=2).resolve(8) == fs.Mesh(dp=4, tp=2)
    with pytest.raises(fs.MeshError, match=re.escape("does not divide 7")):
        fs.Mesh(dp=-1, tp=2).resolve(7)
    with pytest.raises(fs.MeshError, match="has 8 devices but the world size is 4"):
        fs.Mesh(dp=2, tp=4).resolve(4)
    with pytest.raises(fs.MeshError, match=re.escape("Call mesh.resolve(world_size) first")):
        _ = fs.Mesh(dp=-1).size


@given(meshes(max_axes=4))
def test_coords_follow_init_device_mesh_numbering(mesh):
    # init_device_mesh lays ranks out as torch.arange(world).view(sizes)
    grid = torch.arange(mesh.size).view(mesh.sizes)
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        assert grid[tuple(coords[a] for a in mesh.axis_names)].item() == rank
        assert mesh.rank(coords) == rank


@pytest.mark.parametrize(
    ("coords", "message"),
    [
        ({"dp": 1}, "axis 'tp' is missing"),
        ({"dp": 5, "tp": 0}, "dp=5 is outside 0..1"),
        ({"dp": -1, "tp": 0}, "dp=-1 is outside 0..1"),
        ({"dp": 1, "tp": 1, "pp": 0}, "'pp' is not an axis"),
        ({"dp": 1.0, "tp": 1}, "dp=1.0 is outside 0..1"),
        ((1, 1), "expected coordinates by axis"),
    ],
)
def test_rank_refuses_coordinates_off_the_mesh(coords, message):
    # a rank worked out from them would be another rank's, or none at all
    with pytest.raises(fs.MeshError, match=re.escape(message)):
        fs.Mesh(dp=2, tp=4).rank(coords)


@pytest.mark.parametrize("rank", [1.5, True, "3"])
def test_coords_refuse_what_is_no_rank(rank):
    with pytest.raises(fs.MeshError, match="is outside Mesh"):
        fs.Mesh(dp=2, tp=4).coords(rank)


@given(meshes(max_axes=4))
def test_json_round_trip(mesh):
    assert fs.Mesh.from_json(mesh.to_json()) == mesh
    assert eval(repr(mesh), {"Mesh": fs.Mesh}) == mesh


def test_device_mesh_bridge(fake_world):
    fake_world(8)
    mesh = fs.Mesh(dp=2, tp=4)
    device_mesh = mesh.device_mesh("cpu")
    assert device_mesh.mesh_dim_names == ("dp", "tp")
    assert fs.Mesh.from_device_mesh(device_mesh) == mesh


@pytest.mark.parametrize(
    ("device_type", "says"),
    [
        # before: each built a DeviceMesh that failed only at its first collective
        ("tpu", "device_mesh(device_type='tpu'): a torch device (the type of device the ranks compute on"),
        ("meta", "device_mesh(device_type='meta'): a device this machine has"),
        ("cpu:0", "device_mesh(device_type='cpu:0'): a device type, without an index"),
    ],
)
def test_a_device_type_torch_cannot_build_a_mesh_on_here_is_refused_by_name(fake_world, device_type, says):
    fake_world(2)
    with pytest.raises(fs.MeshError, match=re.escape(says)):
        fs.Mesh(dp=2).device_mesh(device_type)
