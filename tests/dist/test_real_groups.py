"""DESIGN's invariants, drawn by hypothesis, on 4 real gloo processes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_shard as fs

from .. import dist_cases
from ..spec_helpers import torch_distributes
from ..strategies import shapes, specs
from ..sweeps import FEW

WORLD = 4
MESHES = [fs.Mesh(a=4), fs.Mesh(a=2, b=2), fs.Mesh(a=1, b=4), fs.Mesh(a=4, b=1), fs.Mesh(a=2, b=1, c=2)]
# the world is shared by every example (its processes and groups are the expensive part)
SHARED = settings(
    max_examples=FEW, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
SWEEP = settings(SHARED, max_examples=25)  # the slow twins


@pytest.fixture(scope="module")
def world(worlds):
    return worlds(WORLD)


@st.composite
def layouts(draw):
    mesh = draw(st.sampled_from(MESHES))
    shape = draw(shapes(max_dims=3, max_size=9))
    return mesh, shape, draw(specs(mesh, len(shape)))


@SHARED
@given(layouts(), st.integers(0, 2**16))
def test_local_shards_equal_the_virtual_mesh_and_gather_back(world, layout, seed):
    mesh, shape, spec = layout
    if not torch_distributes(mesh, shape, spec):
        return  # no placement, or one distribute_tensor cannot scatter (see torch_distributes)
    for rank, (local_equal, gathered_equal) in enumerate(
        world.run(dist_cases.check_layout, mesh, shape, spec, seed)
    ):
        assert local_equal, f"rank {rank}: local shard differs from fs.shard_tensor"
        assert gathered_equal, f"rank {rank}: full_tensor() differs from the global tensor"


@pytest.mark.slow
@SWEEP
@given(layouts(), st.integers(0, 2**16))
def test_local_shards_equal_the_virtual_mesh_and_gather_back_full_sweep(world, layout, seed):
    test_local_shards_equal_the_virtual_mesh_and_gather_back.hypothesis.inner_test(world, layout, seed)


@SHARED
@given(st.sampled_from(MESHES), st.integers(0, 7), st.integers(0, 2**16), st.data())
def test_reduce_scatter_then_all_gather_equals_all_reduce(world, mesh, chunk, seed, data):
    axis = data.draw(st.sampled_from(mesh.axis_names))
    differences = world.run(dist_cases.check_reduce_scatter_all_gather, mesh, axis, chunk, seed)
    assert max(differences) <= 1e-5


@pytest.mark.slow
@SWEEP
@given(st.sampled_from(MESHES), st.integers(0, 7), st.integers(0, 2**16), st.data())
def test_reduce_scatter_then_all_gather_equals_all_reduce_full_sweep(world, mesh, chunk, seed, data):
    test_reduce_scatter_then_all_gather_equals_all_reduce.hypothesis.inner_test(
        world, mesh, chunk, seed, data
    )


@st.composite
def mlp_plans(draw):
    mesh = draw(st.sampled_from([fs.Mesh(a=4), fs.Mesh(a=2, b=2), fs.Mesh(a=1, b=4)]))
    tp_axis = mesh.axis_names[-1] if len(mesh) > 1 else None
    dp_axis = mesh.axis_names[0]
    # DDP does not run over tensor-parallel shards, so it is drawn only without TP
    choices = [fs.fsdp(dp_axis), fs.zero(2, dp_axis)] + ([] if tp_axis else [fs.replicate(dp_axis)])
    data = draw(st.sampled_from(choices))
    policy = data + fs.tp(fs.rules.mlp, tp_axis) if tp_axis else data
    tp = mesh[tp_axis] if tp_axis else 1
    # rowwise fc2 needs its input width to divide by the tp size (torch's RowwiseParallel)
    sizes = (draw(st.integers(1, 9)), tp * draw(st.integers(1, 4)), draw(st.integers(1, 9)))
    return mesh, policy, sizes


@SHARED
@given(mlp_plans(), st.integers(0, 2**16))
def test_gathered_gradients_equal_one_process(world, case, seed):
    mesh, policy, sizes = case
    plan = fs.shard(dist_cases.mlp(sizes, seed), mesh, policy)
    data_parallel = mesh.axes_size(plan.config.data_axes)
    expected = dist_cases.reference_mlp_grads(sizes, seed, data_parallel)
    for rank, grads in enumerate(world.run(dist_cases.mlp_grads, mesh, policy, sizes, seed)):
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-4, msg=f"rank {rank} {name}")


@pytest.mark.slow
@SWEEP
@given(mlp_plans(), st.integers(0, 2**16))
def test_gathered_gradients_equal_one_process_full_sweep(world, case, seed):
    test_gathered_gradients_equal_one_process.hypothesis.inner_test(world, case, seed)
