import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard.core.layout import local_numel
from functional_shard.costing.cost.census import zero1_owners
from functional_shard.costing.cost.cost_model import unit_gathered
from functional_shard.zoo import Llama, LlamaConfig, llama

from ..strategies import data_policies, linear_colwise, module_trees
from ..unit_models import DeepSeekMoE, TitanConfig

MB = 10**6


def block_model():
    # one 1000x1000 fp32 weight (4 MB) inside a ModuleList, so it is its own FSDP unit
    return nn.ModuleList([nn.Linear(1000, 1000, bias=False)])


# Hand-computed: Ψ = 4 MB of weights on 4 ranks, AdamW (2 states + a 4-byte step).
@pytest.mark.parametrize(
    ("policy", "params", "grads", "optim", "gathered", "comm"),
    [
        (fs.replicate(), 4 * MB, 4 * MB, 8 * MB + 4, 0, {"all_reduce": 6 * MB}),
        (fs.zero(1), 4 * MB, 4 * MB, 8 * MB + 4, 0, {"all_reduce": 6 * MB, "broadcast": 3 * MB}),
        (fs.zero(2), MB, MB, 2 * MB + 4, 4 * MB, {"all_gather": 3 * MB, "reduce_scatter": 3 * MB}),
        (fs.zero(3), MB, MB, 2 * MB + 4, 4 * MB, {"all_gather": 6 * MB, "reduce_scatter": 3 * MB}),
        (fs.fsdp(), MB, MB, 2 * MB + 4, 4 * MB, {"all_gather": 6 * MB, "reduce_scatter": 3 * MB}),
    ],
)
def test_cost_of_classic_strategies(policy, params, grads, optim, gathered, comm):
    cost = fs.shard(block_model(), fs.Mesh(dp=4), policy).cost("adamw")
    assert (cost.params_bytes, cost.grads_bytes, cost.optimizer_bytes) == (params, grads, optim)
    assert cost.gathered_bytes == gathered
    assert cost.total_bytes == params + grads + optim + gathered
    assert {kind: by_axis["dp"] for kind, by_axis in cost.comm_bytes.items()} == comm
    assert cost.comm_total_bytes == sum(comm.values())


class WithTable(nn.Module):
    """block_model's weight beside an int64 table of the same shape (8 MB) in its unit, always frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = block_model()
        self.blocks[0].table = nn.Parameter(torch.zeros(1000, 1000, dtype=torch.int64), requires_grad=False)


class WithFrozenTable(WithTable):
    """WithTable's table as float64, frozen by its module (a LoRA base weight) rather than by its dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[0].table = nn.Parameter(torch.zeros(1000, 1000, dtype=torch.float64), requires_grad=False)


@pytest.mark.parametrize("model", [WithTable, WithFrozenTable], ids=["integer", "frozen"])
@pytest.mark.parametrize(
    "policy", [fs.replicate(), fs.zero(1), fs.zero(2), fs.fsdp()], ids=["ddp", "zero1", "zero2", "fsdp"]
)
def test_an_integer_or_frozen_parameter_has_no_gradient_optimizer_state_or_gradient_traffic(policy, model):
    # before: counted as if trained, 8 MB of gradients and 16 MB of AdamW state each rank never holds
    # (measured with fs.resident_bytes and fs.CollectiveLog: tests/dist/test_zero_dim.py for frozen ones)
    plain = fs.shard(nn.ModuleDict({"blocks": block_model()}), fs.Mesh(dp=4), policy).cost("adamw")
    with_table = fs.shard(model(), fs.Mesh(dp=4), policy).cost("adamw")
    assert with_table.params_bytes == 3 * plain.params_bytes  # it is held all the same
    assert (with_table.grads_bytes, with_table.optimizer_bytes) == (plain.grads_bytes, plain.optimizer_bytes)
    for kind in ("reduce_scatter", "all_reduce"):
        assert with_table.comm_bytes.get(kind) == plain.comm_bytes.get(kind)


def test_root_unit_is_gathered_once():
    # a weight owned by the root itself: FSDP2 does not reshard the root after forward
    cost = fs.shard(nn.Linear(1000, 1000, bias=False), fs.Mesh(dp=4), fs.fsdp()).cost()
    assert cost.comm_bytes["all_gather"]["dp"] == 3 * MB


def test_fsdp_padding_is_counted_on_every_rank():
    # 3 rows over 4 ranks: torch.chunk gives 1, 1, 1, 0 rows; FSDP2 allocates 1 row everywhere
    plan = fs.shard(nn.Linear(10, 3, bias=False), fs.Mesh(dp=4), fs.fsdp())
    assert plan.local_shape("weight", 3) == (0, 10)
    assert all(plan.cost(rank=r).params_bytes == 40 for r in range(4))
    assert plan.cost().comm_bytes["all_gather"]["dp"] == 3 / 4 * (4 * 40)


def test_hsdp_reduce_scatters_within_and_all_reduces_across():
    cost = fs.shard(block_model(), fs.Mesh(node=2, gpu=2), fs.hsdp("node", "gpu")).cost()
    assert cost.params_bytes == 2 * MB
    assert cost.comm_bytes["reduce_scatter"] == {"gpu": 2 * MB}
    assert cost.comm_bytes["all_reduce"] == {"node": 2 * MB}


def test_tensor_parallel_activations_follow_torchs_styles():
    plan = fs.shard(block_model(), fs.Mesh(tp=2), fs.tp([("0", "colwise")], "tp"))
    assert plan.cost().params_bytes == 2 * MB
    assert plan.cost().comm_bytes == {}
    # colwise Linear: input gradient all-reduced in backward, 100 tokens x 1000 x 4 bytes
    assert plan.cost(tokens=100).comm_bytes == {"all_reduce": {"tp": 400_000}}
    sequence = fs.shard(block_model(), fs.Mesh(tp=2), fs.tp([("0", "colwise")], "tp", sequence_parallel=True))
    assert sequence.cost(tokens=100).comm_bytes == {
        "all_gather": {"tp": 200_000},
        "reduce_scatter": {"tp": 200_000},
    }


def test_mixed_precision_gathers_in_param_dtype_and_reduces_in_reduce_dtype():
    plan = fs.shard(
        block_model(), fs.Mesh(dp=4), fs.fsdp() + fs.mixed_precision(torch.bfloat16, torch.float32)
    )
    cost = plan.cost()
    assert cost.comm_bytes["all_gather"]["dp"] == 3 * MB  # half of fp32's 6 MB
    assert cost.comm_bytes["reduce_scatter"]["dp"] == 3 * MB
    assert cost.params_bytes == MB  # the fp32 shard stays the master copy


def test_mixed_precision_without_a_reduce_dtype_reduces_in_the_compute_dtype():
    # FSDP2's MixedPrecisionPolicy: reduce_dtype None reduces in param_dtype (measured on gloo:
    # half the fp32 bytes; the cost counted fp32's)
    plan = fs.shard(block_model(), fs.Mesh(dp=4), fs.fsdp() + fs.mixed_precision(torch.bfloat16, None))
    assert plan.cost().comm_bytes["reduce_scatter"]["dp"] == 3 * MB / 2  # fp32 reduces 3 MB
    # a 0-d parameter FSDP2 leaves whole is not cast: its gradient is all-reduced in fp32
    model = block_model()
    model.register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp() + fs.mixed_precision(torch.bfloat16, None))
    assert plan.cost().comm_bytes["all_reduce"]["dp"] == 4


def test_offload_moves_bytes_to_the_host():
    cost = fs.shard(block_model(), fs.Mesh(dp=4), fs.fsdp() + fs.offload()).cost()
    assert (cost.params_bytes, cost.grads_bytes, cost.optimizer_bytes) == (0, 0, 0)
    assert cost.host_bytes == MB + MB + 2 * MB + 4


def test_explain_puts_offloaded_parameters_where_cost_does():
    on_device = fs.shard(block_model(), fs.Mesh(dp=4), fs.fsdp()).explain()
    assert on_device.endswith("at rest: 3.81 MiB in all, 976.56 KiB on the largest device (rank 0)")
    offloaded = fs.shard(block_model(), fs.Mesh(dp=4), fs.fsdp() + fs.offload()).explain()
    assert "bytes/device" not in offloaded
    assert offloaded.endswith(
        "at rest: 3.81 MiB in all, 976.56 KiB on the largest rank (rank 0), "
        "its parameters offloaded to host memory"
    )


def test_optimizer_kinds():
    plan = fs.shard(block_model(), fs.Mesh(dp=4), fs.fsdp())
    assert plan.cost("sgd").optimizer_bytes == 0
    assert plan.cost(12.0).optimizer_bytes == 12 * 250_000
    with pytest.raises(fs.ShardingError, match="optimizer='lion'"):
        plan.cost("lion")


@given(module_trees(), st.integers(1, 3), st.integers(1, 3), st.data())
def test_param_bytes_equal_the_sum_of_local_shards(model, dp, tp, data):
    policy = data.draw(data_policies("dp")) + linear_colwise
    model.append(nn.Linear(5, 7, device="meta"))  # something for the tp axis to split
    mesh = fs.Mesh(dp=dp, tp=tp)
    if policy.data_parallel[0].kind == "zero1":
        with pytest.raises(fs.PlanError, match="ZeRO-1 keeps optimizer state whole"):
            fs.shard(model, mesh, policy)
        return
    plan = fs.shard(model, mesh, policy)
    tensors = {path: torch.zeros(spec.shape, dtype=spec.dtype) for path, spec in plan.tensors.items()}
    totals = []
    for rank in range(mesh.size):
        expected = 0
        for path, sharding in plan.params.items():
            # engines pad: along FSDP2's axes (or, for a tensor-parallel-only split, along
            # distribute_tensor's) every rank holds what coordinate 0 holds
            padding = plan.padded_axes(path) or set(sharding.storage.axes)
            coords = {**mesh.coords(rank), **dict.fromkeys(padding, 0)}
            shard = fs.shard_tensor(tensors[path], sharding.storage, mesh)[mesh.rank(coords)]
            expected += shard.numel() * shard.element_size()
        assert plan.cost(rank=rank).params_bytes == expected
        totals.append(plan.cost(rank=rank).total_bytes)
    assert plan.cost().total_bytes == max(totals)


@given(module_trees(tie=False), st.integers(2, 4))
def test_ddp_and_fsdp_traffic_formulas(model, n):
    mesh = fs.Mesh(dp=n)
    ddp = fs.shard(model, mesh, fs.replicate()).cost()
    total = sum(t.nbytes for t in fs.read_model(model).params.values())
    assert ddp.comm_bytes.get("all_reduce", {}).get("dp", 0) == pytest.approx(2 * (n - 1) / n * total)
    plan = fs.shard(model, mesh, fs.fsdp())
    # every rank holds a padded shard; reduce-scatter sends all but its own
    padded = plan.cost().params_bytes
    assert plan.cost().comm_bytes.get("reduce_scatter", {}).get("dp", 0) == pytest.approx((n - 1) * padded)


# fake_world re-joins the group on each call, so sharing it across examples is safe
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(module_trees(tie=False), st.integers(2, 5))
def test_zero1_owners_equal_torchs_partition(fake_world, model, n):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    fake_world(n)
    model = model.to_empty(device="cpu")
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    names = {id(p): name for name, p in model.named_parameters()}
    torch_owner = {
        names[id(p)]: rank
        for rank, groups in enumerate(optimizer._partition_parameters())
        for group in groups
        for p in group["params"]
    }
    assert zero1_owners(fs.shard(model, fs.Mesh(dp=n), fs.zero(1))) == torch_owner


@given(
    module_trees(tie=False),
    st.integers(1, 6),
    st.integers(1, 3),
    st.sampled_from(["adamw", "sgd", 2.5]),
)
def test_zero1_worst_rank_is_the_heaviest_of_every_rank(model, n, other, optimizer):
    # cost() finds ZeRO-1's heaviest owner in one pass over the owned state; rank by rank
    # is the slow path it must agree with (total and which rank)
    mesh = fs.Mesh(dp=n, other=other)
    plan = fs.shard(model, mesh, fs.zero(1, "dp") + fs.replicate("other"))
    by_rank = [plan.cost(optimizer, rank=rank) for rank in range(mesh.size)]
    worst = max(by_rank, key=lambda c: c.total_bytes)
    assert plan.cost(optimizer) == worst


@settings(max_examples=20)
@given(st.integers(1, 4), st.integers(2, 3), st.integers(2, 3), st.sampled_from(["adamw", "sgd", 2.5]))
def test_zero1_worst_rank_under_a_pipeline_is_the_heaviest_of_every_rank(layers, pp, dp, optimizer):
    # a stage's ranks own the state of that stage's tensors only, not of every stage's
    with torch.device("meta"):
        model = Llama(LlamaConfig(16, 8, 16, num_layers=layers, num_heads=2, num_kv_heads=2))
    mesh = fs.Mesh(pp=pp, dp=dp)
    plan = fs.shard(model, mesh, fs.pipeline("pp", microbatches=pp) + fs.zero(1, "dp"))
    by_rank = [plan.cost(optimizer, rank=rank) for rank in range(mesh.size)]
    assert plan.cost(optimizer) == max(by_rank, key=lambda c: c.total_bytes)


@given(module_trees(tie=False), st.integers(2, 4))
def test_worst_memory_of_candidates_whose_shards_differ_is_found_rank_by_rank(model, n):
    # the general path of _worst_memory: candidates differ along an axis the storage names
    from functional_shard.costing.cost.census import census_of
    from functional_shard.costing.cost.cost_model import _memory, _worst_memory

    plan = fs.shard(model, fs.Mesh(dp=n), fs.fsdp("dp"))
    census = census_of(plan, {})
    candidates = [{"dp": i} for i in range(n)]
    expected = max(
        ((_memory(plan, c, "adamw", census), c) for c in candidates), key=lambda item: sum(item[0].values())
    )
    assert _worst_memory(plan, candidates, "adamw", census) == expected


@given(
    st.lists(st.sampled_from([(4, 8), (4, 6), (6, 4)]), min_size=1, max_size=6), st.integers(1, 4), st.data()
)
def test_gathered_bytes_per_unit_equal_the_sum_over_its_parameters(sizes, dp, data):
    # the census counts alike units once (blocks of equal sizes here); every unit must
    # still get exactly its own parameters' gathered bytes
    model = nn.Sequential(
        nn.Linear(4, 4, device="meta"),
        nn.ModuleList(nn.Sequential(nn.Linear(i, o, device="meta"), nn.ReLU()) for i, o in sizes),
    )
    policy = data.draw(st.sampled_from([fs.fsdp("dp"), fs.zero(2, "dp"), fs.zero(3, "dp")]))
    plan = fs.shard(model, fs.Mesh(dp=dp), policy)
    expected: dict[str, int] = {}
    origin = {"dp": 0}
    for path, sharding in plan.params.items():
        padded = sharding.at_rest_axes
        if padded:
            tensor = plan.tensors[path]
            shard = local_numel(tensor.shape, sharding.storage, plan.mesh, origin, padded)
            unit = plan.unit_of(path)
            expected[unit] = (
                expected.get(unit, 0) + shard * plan.mesh.axes_size(tuple(padded)) * tensor.itemsize
            )
    assert unit_gathered(plan) == expected
    assert len(expected) == 1 + len(sizes)  # the root and each block


@pytest.mark.parametrize("pattern", ["*norm", "*embed_tokens", "*.q_proj"])
def test_moe_tp_experts_on_a_module_without_expert_weights_leaves_it_whole(pattern):
    # the style splits 3-D expert weights only; apply gives such a module no style
    model, mesh = llama("tiny"), fs.Mesh(tp=2)
    plan = fs.shard(model, mesh, fs.tp(fs.Rules([(pattern, "moe_tp_experts")]), "tp"))
    whole = fs.shard(model, mesh, fs.tp(fs.Rules([(pattern, "replicate")]), "tp"))
    assert plan == whole
    assert plan.cost(tokens=8) == whole.cost(tokens=8)


def test_a_plan_whose_model_names_no_top_k_says_where_the_model_can_name_it():
    with torch.device("meta"):
        model = DeepSeekMoE(TitanConfig())  # its routers have no top_k, its config no num_experts_per_tok
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp") + fs.ep("dp"))
    with pytest.raises(fs.ShardingError, match="num_experts_per_tok or a router module's int top_k"):
        plan.cost(tokens=8)
