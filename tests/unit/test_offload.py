"""CPU offload: which tensors live in host memory (FSDP2 refuses offloaded shards elsewhere)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import functional_shard as fs
from functional_shard.adapters.lightning import ShardStrategy
from functional_shard.runtime.engines.data_parallel import host_params
from functional_shard.runtime.engines.materialize import allocate
from functional_shard.runtime.engines.optimizer import reduced_on


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(1.0))  # 0-d: FSDP2 leaves it alone
        self.register_buffer("steps", torch.zeros(()))


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (fs.fsdp() + fs.offload(), {"proj.weight", "proj.bias"}),
        (fs.zero(2) + fs.offload(), {"proj.weight", "proj.bias"}),
        (fs.fsdp() + fs.offload(params=False, grads=False), set()),
        (fs.fsdp(), set()),
        (fs.zero(1), set()),
    ],
)
def test_host_params_are_fsdp2s_offloaded_ones(policy, expected):
    plan = fs.shard(_Scaled(), fs.Mesh(dp=2), policy)
    assert host_params(plan) == expected
    assert host_params(plan, prefix="model.") == {f"model.{path}" for path in expected}


def test_allocate_makes_host_params_in_host_memory_and_the_rest_on_the_device():
    with torch.device("meta"):
        module = _Scaled()
    module.register_buffer("real", torch.ones(2))
    # "meta" stands for the accelerator this machine lacks: only the host parameters leave it
    allocate(module, "meta", {"proj.weight", "proj.bias"})
    where = {name: t.device.type for name, t in (*module.named_parameters(), *module.named_buffers())}
    assert where == {
        "proj.weight": "cpu",
        "proj.bias": "cpu",
        "scale": "meta",
        "steps": "meta",
        "real": "meta",
    }


def test_allocate_keeps_tied_host_params_tied():
    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    module[1].weight = module[0].weight
    allocate(module, "meta", {"0.weight"})
    assert module[1].weight is module[0].weight
    assert module[0].weight.device.type == "cpu"


def test_the_trainer_strategy_moves_all_but_the_offloaded_shards():
    module = _Scaled()
    module.proj.weight.grad = torch.zeros(4, 4)
    stand_in = SimpleNamespace(model=module, root_device=torch.device("meta"), _host={"proj.weight"})
    ShardStrategy.model_to_device(stand_in)
    assert (module.proj.weight.device.type, module.proj.weight.grad.device.type) == ("cpu", "cpu")
    assert {module.proj.bias.device.type, module.scale.device.type, module.steps.device.type} == {"meta"}


@pytest.mark.parametrize(
    ("device", "backends", "expected"),
    [
        ("cpu", "cuda:nccl", "cuda"),  # offloaded gradients' overflow flags, on an NCCL world
        ("cpu", "cpu:gloo,cuda:nccl", "cpu"),
        ("cpu", "cpu:gloo,cuda:gloo", "cpu"),
        ("cuda:1", "cuda:nccl", "cuda:1"),
    ],
)
def test_flags_are_reduced_where_the_process_group_can(device, backends, expected):
    assert reduced_on(torch.device(device), backends) == torch.device(expected)
