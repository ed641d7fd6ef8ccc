import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.core.layout import chunk, local_numel

from ..strategies import mesh_shape_spec


@pytest.mark.parametrize(
    ("size", "parts", "lengths"),
    [
        (100, 8, [13] * 7 + [9]),
        (10, 8, [2, 2, 2, 2, 2, 0, 0, 0]),
        (8, 4, [2, 2, 2, 2]),
        (0, 3, [0, 0, 0]),
        (5, 1, [5]),
    ],
)
def test_chunk_follows_torch_chunk(size, parts, lengths):
    assert [chunk(size, parts, i)[1] for i in range(parts)] == lengths
    reference = [len(c) for c in torch.arange(size).chunk(parts)] if size else []
    assert lengths[: len(reference)] == reference


def test_nested_split_examples():
    mesh = fs.Mesh(dp=2, tp=2)
    rows = fs.shard_tensor(torch.arange(10), fs.P(("tp", "dp")), mesh)
    # tp splits 10 into 5 + 5, then dp splits each 5 into 3 + 2; rank = dp * 2 + tp
    assert [r.tolist() for r in rows] == [[0, 1, 2], [5, 6, 7], [3, 4], [8, 9]]


@given(mesh_shape_spec(), st.integers(0, 2**31 - 1))
def test_unshard_inverts_shard(case, seed):
    mesh, shape, spec = case
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    shards = fs.shard_tensor(x, spec, mesh)
    assert torch.equal(fs.unshard_tensor(shards, spec, mesh), x)
    for rank, shard in enumerate(shards):
        local, offset = fs.local_shape_and_offset(shape, spec, mesh, rank)
        assert tuple(shard.shape) == local
        index = tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))
        assert torch.equal(shard, x[index])


@given(mesh_shape_spec())
def test_padded_numel_is_rank_zeros_everywhere(case):
    mesh, shape, spec = case
    padded = frozenset(spec.axes)
    expected = local_numel(shape, spec, mesh, 0)
    assert all(local_numel(shape, spec, mesh, r, padded) == expected for r in range(mesh.size))
    assert all(local_numel(shape, spec, mesh, r) <= expected for r in range(mesh.size))


def test_unshard_rejects_differing_replicas():
    mesh = fs.Mesh(dp=2)
    with pytest.raises(fs.ShardingError, match="holds a replica that differs"):
        fs.unshard_tensor([torch.zeros(2), torch.ones(2)], fs.P(), mesh)
