"""At scale, in one process: torch's fake process group builds the real DTensors."""

import pytest
import torch
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
