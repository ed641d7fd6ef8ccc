"""apply() refuses what torch's engines cannot run, before any parameter changes."""

import re

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import functional_shard as fs
from functional_shard.zoo import Llama, llama

from ..dist_cases import UNEVEN
from ..strategies import linear_colwise


def params_untouched(model):
    return not any(isinstance(p, DTensor) for p in model.parameters())


def test_apply_needs_a_process_group():
    plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp())
    with pytest.raises(fs.MeshError, match=re.escape("call dist.init_process_group(...) first")):
        fs.apply(plan, nn.Linear(4, 4))


@pytest.mark.parametrize(
    "call",
    [
        lambda plan, model: fs.apply(model, plan),
        lambda plan, model: fs.materialize(model, plan),
        lambda plan, model: fs.optimizer(model, plan, torch.optim.AdamW),
        lambda plan, model: fs.check_runnable(model, plan),
        lambda plan, model: fs.forward_only(model, plan),
    ],
)
def test_a_module_and_plan_swapped_are_named_as_such(call):
    model = nn.Linear(4, 4)
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp())
    with pytest.raises(
        fs.ShardingError, match=r"takes the Plan first, then the nn.Module; it got Linear, then Plan: swap"
    ):
        call(plan, model)


def test_what_is_neither_a_plan_nor_a_module_is_named_with_its_fix():
    plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp())
    with pytest.raises(
        fs.ShardingError, match="it got Plan, then str: pass the model the plan was made from"
    ):
        fs.apply(plan, "model")
    with pytest.raises(
        fs.ShardingError, match=r"it got dict, then Linear: fs.shard\(model, mesh, policy\) makes"
    ):
        fs.materialize({"plan": 1}, nn.Linear(4, 4))


@pytest.mark.parametrize(
    ("wrap", "said"),
    [
        (fully_shard, "fully_shard (or FSDP) ran on the module itself"),
        (lambda model: fully_shard(model[1]) and model, "fully_shard (or FSDP) ran on '1'"),
        (DistributedDataParallel, "the module itself is a DistributedDataParallel (plan and apply its"),
    ],
    ids=["fully_shard", "fully_shard_inside", "ddp"],
)
def test_a_module_torch_parallelized_already_is_refused_by_how(one_rank, wrap, said):
    # before: fully_shard's raw AssertionError from inside apply; a DDP-wrapped module was sharded
    # under DDP's reducer, which held the parameters sharding replaced
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    wrapped = wrap(model)  # what the user holds
    plan = fs.shard(wrapped, fs.Mesh(dp=1), fs.fsdp())
    with pytest.raises(fs.ShardingError, match=re.escape(f"already parallelized by torch: {said}")):
        fs.apply(plan, wrapped)


def test_world_size_must_match_the_plan(fake_world):
    fake_world(4)
    plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp())
    with pytest.raises(fs.MeshError, match="has 2 devices but the world size is 4"):
        fs.apply(plan, nn.Linear(4, 4))


def with_table() -> nn.Module:
    """A linear layer beside an integer parameter (a lookup table, always frozen)."""
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_parameter("table", nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
    return model


def with_bfloat16(frozen: bool = False) -> nn.Module:
    """A float32 linear layer beside a bfloat16 one (frozen, as an adapter's quantised base is)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    return model[1].requires_grad_(not frozen) and model


@pytest.mark.parametrize(
    ("model", "mesh", "policy", "message"),
    [
        # before: torch's ValueError from inside ZeroRedundancyOptimizer at fs.optimizer, and
        # FSDP2's AssertionError at the first forward
        (
            with_table,
            fs.Mesh(dp=2),
            fs.zero(1),
            "zero1 steps parameters of several dtypes (int64: 'table', float32: '0.weight'), and torch's "
            "ZeroRedundancyOptimizer takes one; use fs.zero(2)",
        ),
        (
            with_bfloat16,
            fs.Mesh(dp=2),
            fs.fsdp(),
            "FSDP unit '(root)' trains parameters of several dtypes (float32: '0.weight', bfloat16: "
            "'1.weight'), and torch's FSDP2 takes one; give them one dtype",
        ),
        (
            lambda: Llama(UNEVEN),
            fs.Mesh(tp=3),
            fs.tp(fs.rules.llama, "tp"),
            "layers.0.mlp.down_proj: rowwise Linear with in_features=50 over 'tp' (size 3)",
        ),
        (
            lambda: llama("tiny", device="cpu"),
            fs.Mesh(dp=2, tp=2),
            fs.replicate("dp") + fs.tp(fs.rules.llama, "tp"),
            "ddp with tensor parallel: torch's DDP does not run over DTensor shards",
        ),
        (
            lambda: nn.Sequential(nn.Linear(4, 4)),
            fs.Mesh(tp=2),
            linear_colwise,
            "0.weight: compute P('tp', None) comes from no tensor-parallel style",
        ),
        (
            lambda: nn.Sequential(nn.Linear(4, 4)),
            fs.Mesh(dp=2),
            fs.fsdp() + fs.offload(params=False),
            "offload of only some of params/grads/optimizer",
        ),
        (
            lambda: nn.Sequential(nn.Linear(4, 4)),
            fs.Mesh(dp=2),
            fs.replicate() + fs.mixed_precision(torch.bfloat16),
            "mixed precision with ddp",
        ),
        (
            lambda: nn.Sequential(nn.Linear(4, 4)),
            fs.Mesh(tp=2),
            fs.tp([("0", "colwise")], "tp") + fs.mixed_precision(torch.bfloat16),
            "mixed precision without a data-parallel layer: apply() casts through FSDP2",
        ),
        (
            lambda: llama("tiny", device="cpu"),  # 4 query heads, 2 key/value heads
            fs.Mesh(tp=4),
            fs.tp(fs.rules.llama, "tp"),
            "layers.0.self_attn.k_proj: its 2 attention heads (32 features, head_dim 16) do not split "
            "over 4 tensor-parallel ranks",
        ),
    ],
)
def test_unrunnable_plans_fail_before_touching_data(fake_world, model, mesh, policy, message):
    fake_world(mesh.size)
    module = model()
    plan = fs.shard(module, mesh, policy)
    with pytest.raises(fs.PlanError, match=re.escape(message)):
        fs.apply(plan, module)
    assert params_untouched(module)


def test_a_device_mesh_that_is_no_device_mesh_is_named(fake_world):
    fake_world(2)
    model = nn.Linear(4, 4)
    with pytest.raises(fs.MeshError, match=re.escape("apply(device_mesh=str): a torch DeviceMesh, or None")):
        fs.apply(fs.shard(model, fs.Mesh(dp=2), fs.fsdp()), model, "cpu")
    assert params_untouched(model)


def test_plan_must_fit_the_module(fake_world):
    fake_world(2)
    plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp())
    message = "weight: shape (8, 8) in the module, (4, 4) in the plan"
    with pytest.raises(fs.PlanError, match=re.escape(message)):
        fs.apply(plan, nn.Linear(8, 8))


def test_an_optimizer_built_before_sharding_is_refused(fake_world):
    fake_world(2)
    model = llama("tiny", device="cpu")
    early = torch.optim.AdamW(model.parameters())
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp())
    fs.apply(plan, model)
    with pytest.raises(fs.ShardingError, match="built before sharding replaced them"):
        fs.check_optimizer(early, model)
    fs.check_optimizer(fs.optimizer(plan, model, torch.optim.AdamW), model)


def test_a_group_mixing_dtensors_and_tensors_steps_per_tensor_or_is_refused(fake_world):
    # tp without sp leaves the norms plain beside DTensor projections: torch's foreach kernels
    # (its default on CUDA) refuse the mix at the first step
    fake_world(2)
    model = llama("tiny", device="cpu")
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp(fs.rules.llama, "tp"))
    fs.apply(plan, model)
    assert {isinstance(p, DTensor) for p in model.parameters()} == {True, False}
    adamw = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-3)
    assert adamw.param_groups[0]["foreach"] is False
    before = [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    adamw.step()  # per tensor
    after = [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in model.parameters()]
    assert not any(torch.equal(b, a) for b, a in zip(before, after, strict=True))
    example = "'layers.0.input_layernorm.weight'"
    for option in ("foreach", "fused"):
        message = f"optimizer param group 0: {option}=True steps DTensors and plain tensors (e.g. {example})"
        with pytest.raises(fs.ShardingError, match=re.escape(message)):
            fs.optimizer(plan, model, torch.optim.AdamW, **{option: True})
    one_kind = [p for p in model.parameters() if isinstance(p, DTensor)]
    assert torch.optim.AdamW(one_kind).param_groups[0]["foreach"] is None  # untouched: no mix
    fs.check_optimizer(torch.optim.AdamW(one_kind), model)


def test_optimizer_needs_the_applied_module(fake_world):
    fake_world(2)
    plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp())
    with pytest.raises(fs.ShardingError, match=re.escape("needs the module fs.apply(plan, module) returned")):
        fs.optimizer(plan, nn.Linear(4, 4), torch.optim.SGD, lr=0.1)


def test_the_optimizer_class_and_the_loss_function_are_checked_before_any_step(fake_world):
    fake_world(2)
    model = nn.Linear(4, 4)
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp())
    fs.apply(plan, model)
    built = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        fs.ShardingError, match=re.escape("optimizer(optimizer_class=SGD): a torch.optim.Optimizer class")
    ):
        fs.optimizer(plan, model, built)
    for evaluate in (fs.forward_backward, fs.forward_loss):
        with pytest.raises(
            fs.ShardingError, match=re.escape("(loss_fn='mse'): a function loss_fn(outputs, targets)")
        ):
            evaluate(plan, model, "mse")


def test_a_step_with_no_gradient_to_run_or_no_scaler_says_why(one_rank):
    model = nn.Linear(4, 2)
    plan = fs.shard(model, fs.Mesh(dp=1), fs.fsdp())
    fs.apply(plan, model)
    with pytest.raises(fs.ShardingError, match=re.escape("forward_backward(scaler=str): a GradScaler")):
        fs.forward_backward(plan, model, nn.functional.mse_loss, scaler="float16")
    step = fs.forward_backward(plan, model, nn.functional.mse_loss)
    with (
        torch.no_grad(),
        pytest.raises(fs.ShardingError, match=re.escape("a loss that no gradient flows back")),
    ):
        step(torch.ones(3, 4), torch.ones(3, 2))
    assert step(torch.ones(3, 4), torch.ones(3, 2)).ndim == 0  # outside no_grad it runs


def test_ddp_refuses_a_meta_device_model(fake_world):
    fake_world(2)
    module = llama("tiny")  # meta device
    plan = fs.shard(module, fs.Mesh(dp=2), fs.replicate())
    with pytest.raises(fs.PlanError, match="ddp on a meta-device module"):
        fs.apply(plan, module)


def test_materialize_needs_reset_parameters_or_init(fake_world):
    fake_world(2)

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4, device="meta"))

    module = nn.Sequential(Scale())
    plan = fs.shard(module, fs.Mesh(dp=2), fs.fsdp())
    fs.apply(plan, module)
    message = "* 0 (Scale): cannot initialise its parameters (gain): it has no reset_parameters. Pass init="
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.materialize(plan, module)
    assert module[0].gain.is_meta  # refused before any change


@pytest.mark.parametrize(
    ("options", "said"),
    [
        # "meta" left every tensor on meta, silently; "bogus" ended in torch's own parse error
        ({"device": "meta"}, "materialize(device='meta'): a device this machine has"),
        ({"device": "bogus"}, "materialize(device='bogus'): a torch device"),
        # a bad seed raised in torch.manual_seed after the tensors were allocated (or was cut to an
        # int); an init that is no function was passed over for reset_parameters, without a word
        ({"seed": "a"}, "materialize(seed='a'): a whole number from"),
        ({"seed": 2**64}, "materialize(seed=18446744073709551616): a whole number from"),
        ({"seed": 1.5}, "materialize(seed=1.5): a whole number from"),
        ({"init": 3}, "materialize(init=int): a function"),
    ],
)
def test_materialize_refuses_its_arguments_before_any_change(fake_world, options, said):
    fake_world(2)
    module = nn.Sequential(nn.Linear(4, 4, device="meta"))
    plan = fs.shard(module, fs.Mesh(dp=2), fs.fsdp())
    fs.apply(plan, module)
    with pytest.raises(fs.ShardingError, match=re.escape(said)):
        fs.materialize(plan, module, **options)
    assert module[0].weight.is_meta


@pytest.mark.parametrize(
    ("model", "policy"),
    [
        (with_table, fs.fsdp()),  # FSDP2 gathers it, and trains float32 alone
        (lambda: with_bfloat16(frozen=True), fs.fsdp()),
        (with_bfloat16, fs.fsdp(units=["1"])),  # a unit of each dtype
    ],
)
def test_parameters_of_several_dtypes_fsdp2_takes_are_runnable(model, policy):
    module = model()
    fs.check_runnable(fs.shard(module, fs.Mesh(dp=2), policy), module)


def test_heads_that_split_evenly_are_runnable():
    """tp=2 keeps whole heads (2 of 4 query heads, 1 of 2 key/value heads per rank)."""
    model = llama("tiny", device="cpu")
    fs.check_runnable(fs.shard(model, fs.Mesh(tp=2), fs.tp(fs.rules.llama, "tp")), model)


def test_an_init_that_raises_is_refused_by_module_not_replaced_by_reset_parameters(fake_world):
    # before: the error was swallowed and nn.Linear's reset_parameters drew in its place
    fake_world(2)
    module = nn.Sequential(nn.Linear(4, 4, device="meta"))
    plan = fs.shard(module, fs.Mesh(dp=2), fs.fsdp())
    fs.apply(plan, module)

    def init(sub):
        raise RuntimeError("a typo in init")

    said = "fs.materialize(init=...) raised RuntimeError: a typo in init on 0 (Linear), on meta tensors"
    with pytest.raises(fs.ShardingError, match=re.escape(said)) as raised:
        fs.materialize(plan, module, init=init)
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert module[0].weight.is_meta


def test_an_init_that_leaves_a_module_alone_falls_back_to_its_own_initialiser(one_rank):
    module = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.LayerNorm(4, device="meta"))
    plan = fs.shard(module, fs.Mesh(dp=1), fs.fsdp())
    fs.apply(plan, module)

    def init(sub):  # Linear layers only: the LayerNorm takes its reset_parameters (ones, zeros)
        if isinstance(sub, nn.Linear):
            nn.init.constant_(sub.weight, 0.5)
            nn.init.zeros_(sub.bias)

    fs.materialize(plan, module, init=init)
    assert torch.equal(module[0].weight.full_tensor(), torch.full((4, 4), 0.5))
    assert torch.equal(module[1].weight.full_tensor(), torch.ones(4))


@pytest.mark.parametrize(
    ("layer", "said"),
    [
        (
            lambda: nn.Linear(4, 4, device="meta"),
            "fs.materialize(init=...) raised RuntimeError: an .item() on real values on 0 (Linear), "
            "on real tensors, after passing on meta tensors",
        ),
        (
            lambda: nn.BatchNorm1d(4, device="meta"),
            "0 (BatchNorm1d): its initialiser raised RuntimeError: an .item() on real values on real "
            "buffers, after passing on meta tensors",
        ),
    ],
    ids=["parameters", "buffers"],
)
def test_an_init_that_raises_only_on_real_tensors_is_refused_by_module(fake_world, layer, said):
    # before: its error came through raw, from inside materialize's drawing loop or restore_buffers
    fake_world(2)
    module = nn.Sequential(layer())
    plan = fs.shard(module, fs.Mesh(dp=2), fs.fsdp())
    fs.apply(plan, module)

    def init(sub):  # passes the dry run on meta tensors
        tensors = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if not all(tensor.is_meta for tensor in tensors):
            raise RuntimeError("an .item() on real values")
        for tensor in tensors:
            tensor.zero_()

    with pytest.raises(fs.ShardingError, match=re.escape(said)) as raised:
        fs.materialize(plan, module, init=init)
    assert isinstance(raised.value.__cause__, RuntimeError)
