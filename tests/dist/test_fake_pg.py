"""At scale, in one process: torch's fake process group builds the real DTensors."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, distribute_tensor

import functional_shard as fs
from functional_shard.zoo import Llama, LlamaConfig

from ..reference import fsdp_tp_by_hand

# dims chosen not to divide by 8: the nested FSDP-in-TP splits are uneven
CONFIG = LlamaConfig(
    vocab_size=1001, hidden_size=96, intermediate_size=260, num_layers=2, num_heads=8, num_kv_heads=8
)
MESH = fs.Mesh(dp=8, tp=8)
RANKS = [0, 1, 9, 37, 62, 63]


def meta_llama():
    with torch.device("meta"):
        return Llama(CONFIG)


@pytest.mark.parametrize("rank", RANKS)
def test_plan_local_shapes_equal_fsdp2_and_tp_on_64_ranks(fake_world, rank):
    fake_world(MESH.size, rank)
    plan = fs.shard(meta_llama(), MESH, fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"))
    model = fsdp_tp_by_hand(meta_llama(), MESH.device_mesh("cpu"))
    checked = 0
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        assert plan.local_shape(name, rank) == tuple(param.to_local().shape), name
        checked += 1
    assert checked == len(plan.params)


@pytest.mark.parametrize("rank", [0, 63])
def test_placements_build_the_dtensors_the_plan_describes(fake_world, rank):
    fake_world(MESH.size, rank)
    device_mesh = MESH.device_mesh("cpu")
    plan = fs.shard(meta_llama(), MESH, fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"))
    described = 0
    for path, sharding in plan.params.items():
        shape = plan.tensors[path].shape
        try:
            placements = sharding.storage.to_placements(MESH, shape)
        except fs.SpecError:
            continue  # uneven nesting torch's placements cannot describe (tested elsewhere)
        # src_data_rank=None: split locally, no scatter (the fake group sends nothing anyway)
        dtensor = distribute_tensor(
            torch.empty(shape, device="meta"), device_mesh, placements, src_data_rank=None
        )
        assert tuple(dtensor.to_local().shape) == plan.local_shape(path, rank)
        described += 1
    assert described >= len(plan.params) // 2


# FSDP2 flattens several shard axes into one mesh dim and cuts each tensor once over their
# product; uneven dims (vocab 1001 over 3 x 4 or 3 x 5 ranks) tell that apart from cutting in turn
UNEVEN = LlamaConfig(
    vocab_size=1001, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=4
)


def meta_of(config):
    with torch.device("meta"):
        return Llama(config)


@pytest.mark.parametrize("rank", [4, 7, 11])
def test_fsdp_over_two_axes_keeps_the_rows_the_plan_names(fake_world, rank):
    mesh = fs.Mesh(dp=3, ep=4)
    torch.manual_seed(0)
    whole = dict(Llama(UNEVEN).named_parameters())
    plan = fs.shard(Llama(UNEVEN), mesh, fs.fsdp(("dp", "ep")))
    fake_world(mesh.size, rank)
    torch.manual_seed(0)
    # FSDP2 cuts each rank's shard out of its own whole copy: the fake group's silence loses nothing
    model = fs.apply(plan, Llama(UNEVEN), mesh.device_mesh("cpu"))
    for name, param in model.named_parameters():
        shape, offset = plan.local_shape_and_offset(name, rank)
        window = tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))
        assert torch.equal(param.to_local(), whole[name].detach()[window]), name


@pytest.mark.parametrize("rank", [4, 28, 29])
def test_fsdp_over_two_axes_around_tp_shapes_as_torch(fake_world, rank):
    mesh = fs.Mesh(a=3, tp=2, b=5)
    plan = fs.shard(Llama(UNEVEN), mesh, fs.fsdp(("a", "b")) + fs.tp(fs.rules.llama, "tp"))
    fake_world(mesh.size, rank)
    with torch.device("meta"):
        model = fs.apply(plan, Llama(UNEVEN), mesh.device_mesh("cpu"))
    for name, param in model.named_parameters():
        assert plan.local_shape(name, rank) == tuple(param.to_local().shape), name


@pytest.mark.parametrize("rank", [7, 11])
def test_optimizer_bytes_per_rank_follow_fsdp_over_two_axes(fake_world, rank):
    # AdamW keeps two states the size of the unpadded local shard, and one float32 step each
    mesh = fs.Mesh(dp=3, ep=4)
    plan = fs.shard(Llama(UNEVEN), mesh, fs.fsdp(("dp", "ep")))
    fake_world(mesh.size, rank)
    with torch.device("meta"):
        model = fs.apply(plan, Llama(UNEVEN), mesh.device_mesh("cpu"))
    params = list(model.parameters())
    local = sum(param.to_local().numel() * param.element_size() for param in params)
    assert plan.cost(rank=rank).optimizer_bytes == 2 * local + 4 * len(params)


@pytest.mark.slow
# fake_world joins afresh on every call, so one fixture serves every draw
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    outer=st.integers(1, 5),
    inner=st.integers(1, 5),
    tp=st.sampled_from([1, 2, 4]),
    vocab=st.integers(5, 300),
    where=st.floats(0, 1),
)
def test_drawn_fsdp_over_two_axes_shapes_as_torch(fake_world, outer, inner, tp, vocab, where):
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=4, num_kv_heads=4
    )
    mesh = fs.Mesh(a=outer, tp=tp, b=inner)
    policy = fs.fsdp(("a", "b")) + fs.tp(fs.rules.llama, "tp")
    rank = min(int(where * mesh.size), mesh.size - 1)
    with torch.device("meta"):
        plan = fs.shard(Llama(config), mesh, policy)
        fake_world(mesh.size, rank)
        model = fs.apply(plan, Llama(config), mesh.device_mesh("cpu"))
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        assert plan.local_shape(name, rank) == tuple(local.shape), name


@pytest.mark.parametrize("rank", [4, 11])
def test_materialize_fills_the_rows_fsdp_over_two_axes_holds(fake_world, rank):
    # rank 4's shard has the size a cut in turn gives, at another offset: once silently other rows
    mesh = fs.Mesh(dp=3, ep=4)
    torch.manual_seed(0)
    whole = {name: param.detach() for name, param in Llama(UNEVEN).named_parameters()}
    plan = fs.shard(meta_of(UNEVEN), mesh, fs.fsdp(("dp", "ep")))
    fake_world(mesh.size, rank)
    model = fs.materialize(plan, fs.apply(plan, meta_of(UNEVEN), mesh.device_mesh("cpu")), seed=0)
    for name, param in model.named_parameters():
        local = param.to_local()
        rows = torch.arange(whole[name].shape[0]).chunk(mesh.size)
        held = rows[rank] if rank < len(rows) else rows[0][:0]
        assert torch.equal(local, whole[name][held]), name
