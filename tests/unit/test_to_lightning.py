"""to_lightning: Lightning's own strategies, built on the CPU and inspected (DeepSpeed and
FSDP1 refuse to run on the CPU, as Lightning's own CPU tests only build them too)."""

import re

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import ShardingStrategy

import functional_shard as fs
from functional_shard.adapters.lightning import deepspeed_config, to_lightning
from functional_shard.zoo import Block, llama

MODEL = llama("tiny", device="cpu")


def plan(policy, mesh=None):
    return fs.shard(MODEL, mesh or fs.Mesh(dp=4), policy)


@pytest.mark.parametrize(
    ("policy", "mesh", "sharding"),
    [
        (fs.fsdp(), None, ShardingStrategy.FULL_SHARD),
        (fs.zero(3), None, ShardingStrategy.FULL_SHARD),
        (fs.zero(2), None, ShardingStrategy.SHARD_GRAD_OP),
        (fs.hsdp("node", "gpu"), fs.Mesh(node=2, gpu=2), ShardingStrategy.HYBRID_SHARD),
    ],
)
def test_fsdp_plans_become_fsdp_strategy(policy, mesh, sharding):
    strategy = to_lightning(plan(policy, mesh), MODEL)
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.sharding_strategy == sharding


def test_units_checkpointing_offload_and_precision_carry_over():
    p = plan(fs.fsdp() + fs.checkpointing(Block) + fs.offload() + fs.mixed_precision(torch.bfloat16))
    strategy = to_lightning(p, MODEL)
    wrapped = [name for name, m in MODEL.named_modules() if strategy.kwargs["auto_wrap_policy"]._lambda_fn(m)]
    assert wrapped == ["layers.0", "layers.1"]
    checkpointed = strategy._activation_checkpointing_kwargs["auto_wrap_policy"]
    assert [name for name, m in MODEL.named_modules() if checkpointed._lambda_fn(m)] == [
        "layers.0",
        "layers.1",
    ]
    assert strategy.cpu_offload.offload_params
    assert strategy.mixed_precision.param_dtype == torch.bfloat16
    assert strategy.mixed_precision.reduce_dtype == torch.float32


def test_ddp_plan_becomes_ddp_strategy():
    assert isinstance(to_lightning(plan(fs.replicate())), DDPStrategy)


@pytest.mark.parametrize(
    ("policy", "offload", "stage"),
    [
        (fs.zero(1), set(), 1),
        (fs.zero(2) + fs.offload(params=False, grads=False), {"offload_optimizer"}, 2),
        (fs.fsdp() + fs.offload(), {"offload_optimizer", "offload_param"}, 3),
    ],
)
def test_deepspeed_config_from_zero_plans(policy, offload, stage):
    config = deepspeed_config(plan(policy))
    zero = config["zero_optimization"]
    assert zero["stage"] == stage
    assert {k for k in zero if k.startswith("offload")} == offload
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 200_000_000  # Lightning's defaults
    assert zero["overlap_comm"] is True


def test_deepspeed_config_carries_mixed_precision():
    assert deepspeed_config(plan(fs.zero(2) + fs.mixed_precision(torch.bfloat16)))["bf16"] == {
        "enabled": True
    }


@pytest.mark.parametrize(
    ("p", "target", "message"),
    [
        (
            lambda: plan(fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"), fs.Mesh(dp=2, tp=2)),
            "fsdp",
            "tensor parallel over ('tp',)",
        ),
        (
            lambda: plan(fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"), fs.Mesh(tp=2, dp=2)),
            None,
            "runs FSDP over one axis and tensor parallel over the next",
        ),
        (
            lambda: plan(fs.hsdp("r", "s") + fs.tp(fs.rules.llama, "tp"), fs.Mesh(r=2, s=2, tp=2)),
            "model_parallel",
            "this plan is 'hsdp' over ('r', 's')",
        ),
        (
            lambda: plan(fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"), fs.Mesh(dp=2, tp=2)),
            "deepspeed",
            "tensor parallel",
        ),
        (lambda: plan(fs.fsdp()), "ddp", "DDPStrategy runs replicated plans"),
        # options DDPStrategy and FSDPStrategy do not take were dropped without a word
        (lambda: plan(fs.replicate() + fs.offload(params=False)), "ddp", "DDPStrategy runs replicated plans"),
        (
            lambda: plan(fs.replicate() + fs.mixed_precision(None, torch.bfloat16)),
            "ddp",
            "DDPStrategy runs replicated plans",
        ),
        # the fix named ShardStrategy(plan), which refuses mixed precision beside DDP as well
        (
            lambda: plan(fs.replicate() + fs.mixed_precision(torch.bfloat16)),
            "ddp",
            "this plan sets param_dtype, reduce_dtype. Drop them from the plan "
            "(Trainer(precision='bf16-mixed') casts under DDPStrategy), or plan with fs.fsdp(...): "
            "param_dtype, reduce_dtype run through FSDP2 only, so ShardStrategy(plan) refuses them beside "
            "DDP too",
        ),
        (
            lambda: plan(fs.replicate() + fs.checkpointing(Block)),
            "ddp",
            "this plan sets checkpointed. Drop them from the plan, or use ShardStrategy(plan)",
        ),
        (
            lambda: plan(fs.fsdp() + fs.offload(params=False, grads=False)),
            "fsdp",
            "FSDPStrategy offloads params, grads and optimizer state together; this plan offloads only opt",
        ),
        (
            lambda: plan(fs.zero(2) + fs.offload()),
            "deepspeed",
            "DeepSpeed offloads parameters only at ZeRO stage 3",
        ),
        (
            lambda: plan(fs.pipeline("pp", microbatches=2) + fs.fsdp("dp"), fs.Mesh(pp=2, dp=2)),
            None,
            "the plan runs pipeline parallel, which none of Lightning's own strategies runs",
        ),
        (
            lambda: plan(fs.fsdp("cp") + fs.cp("cp"), fs.Mesh(cp=2)),
            "fsdp",
            "the plan runs context parallel, which none of Lightning's own strategies runs",
        ),
        (
            lambda: fs.fsdp(),
            None,
            "to_lightning(plan=Policy): a Plan (fs.shard(model, mesh, policy) makes one)",
        ),
    ],
)
def test_targets_that_cannot_express_a_plan_say_why(p, target, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        to_lightning(p(), MODEL, target=target)


def test_2d_plans_give_lightnings_model_parallel_strategy_with_their_sizes():
    strategy = to_lightning(plan(fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"), fs.Mesh(dp=2, tp=4)))
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 4)


def test_hsdp_gives_fsdp_strategy_the_plans_replicate_and_shard_sizes():
    # no units to wrap by: FSDPStrategy would refuse HYBRID_SHARD, or guess the sizes from the nodes
    linear = torch.nn.Linear(4, 4)
    strategy = to_lightning(fs.shard(linear, fs.Mesh(r=2, s=4), fs.hsdp("r", "s")))
    assert strategy.sharding_strategy == ShardingStrategy.HYBRID_SHARD
    assert strategy.kwargs["device_mesh"] == (2, 4)
    with pytest.raises(fs.ShardingError, match=re.escape("list the replicate axes first in the mesh")):
        to_lightning(fs.shard(linear, fs.Mesh(s=2, r=2), fs.hsdp("r", "s")))


@pytest.mark.parametrize(
    ("module", "target", "message"),
    [
        # raw AttributeErrors from get_submodule before
        (
            torch.nn.Linear(2, 2),
            None,
            "to_lightning(module=Linear): the module the plan was made for (the plan's FSDP units name",
        ),
        ("model", None, "to_lightning(module=str): a Module"),
        # a misspelt target read as an unknown strategy for this plan's kind
        (
            MODEL,
            "DeepSpeed",
            "to_lightning(target='DeepSpeed'): one of 'ddp', 'fsdp', 'deepspeed', 'model_parallel'",
        ),
    ],
)
def test_a_wrong_module_or_target_is_named(module, target, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        to_lightning(plan(fs.fsdp()), module, target=target)


def test_deepspeed_config_of_a_policy_says_to_shard_it_first():
    # a raw AttributeError ('Policy' object has no attribute 'config') before
    with pytest.raises(fs.ShardingError, match=re.escape("deepspeed_config(plan=Policy): a Plan")):
        deepspeed_config(fs.zero(2))


def test_units_need_the_module():
    with pytest.raises(fs.ShardingError, match=re.escape("pass the module: to_lightning(plan, module)")):
        to_lightning(plan(fs.fsdp()))


def test_deepspeed_target_without_deepspeed_says_so(monkeypatch):
    import lightning.pytorch.strategies.deepspeed as lightning_deepspeed

    monkeypatch.setattr(lightning_deepspeed, "_DEEPSPEED_AVAILABLE", False)
    with pytest.raises(fs.ShardingError, match="DeepSpeedStrategy could not be built"):
        to_lightning(plan(fs.zero(2)), target="deepspeed")


DEEPSPEED_PLANS = [
    (fs.zero(1), 1, "none"),
    (fs.zero(2) + fs.offload(params=False, grads=False), 2, "none"),
    (fs.zero(3) + fs.mixed_precision(torch.float16), 3, "none"),
    (fs.fsdp() + fs.offload() + fs.mixed_precision(torch.bfloat16), 3, "cpu"),
    (fs.zero(2) + fs.mixed_precision(torch.float32), 2, "none"),
    (fs.zero(2) + fs.mixed_precision(torch.bfloat16, torch.bfloat16), 2, "none"),
]


@pytest.mark.parametrize(("policy", "stage", "param_offload"), DEEPSPEED_PLANS)
def test_deepspeed_strategy_built_and_its_config_read_by_deepspeed(policy, stage, param_offload):
    """The real DeepSpeedStrategy (DeepSpeed runs only on CUDA; building works anywhere),
    its config parsed and validated by DeepSpeed's own config classes."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is in the dev extra; CI installs it")
    from deepspeed.runtime.config import DeepSpeedConfig
    from lightning.pytorch.strategies import DeepSpeedStrategy

    the_plan = plan(policy)
    strategy = to_lightning(the_plan, MODEL, target="deepspeed")
    assert isinstance(strategy, DeepSpeedStrategy)
    assert strategy.config == deepspeed_config(the_plan)
    # Lightning adds the micro-batch size from the DataLoader at fit time
    parsed = DeepSpeedConfig({**strategy.config, "train_micro_batch_size_per_gpu": 1})
    assert parsed.zero_optimization_stage == stage
    device = getattr(parsed.zero_config.offload_param, "device", "none")
    assert getattr(device, "value", device) == param_offload
    assert parsed.bfloat16_config.enabled == (the_plan.config.param_dtype == "bfloat16")
    assert parsed.float16_config.enabled == (the_plan.config.param_dtype == "float16")
    reduce_dtype = the_plan.config.reduce_dtype
    assert parsed.communication_data_type == (getattr(torch, reduce_dtype) if reduce_dtype else None)


def _deepspeed(**expected):
    def check(config):
        return {key: config.get(key) for key in expected} == expected

    return check


def _zero(**expected):
    def check(config):
        zero = config["zero_optimization"]
        return {key: zero.get(key) for key in expected} == expected

    return check


def _fsdp(sharding, **expected):
    def check(strategy):
        precision = strategy.mixed_precision
        found = {
            "param_dtype": precision and precision.param_dtype,
            "reduce_dtype": precision and precision.reduce_dtype,
            "cpu_offload": strategy.cpu_offload.offload_params,
            "device_mesh": strategy.kwargs.get("device_mesh"),
        }
        return strategy.sharding_strategy == sharding and {k: found[k] for k in expected} == expected

    return check


OFF = {"enabled": False}
ON = {"enabled": True}
HALVES = fs.Mesh(r=2, s=2)
SQUARE = fs.Mesh(dp=2, tp=2)

# every option of a plan, for every target: the strategy built carries it, or the call names it
OPTIONS = [
    # deepspeed: each option a DeepSpeed config key (https://www.deepspeed.ai/docs/config-json/)
    (
        "deepspeed",
        fs.zero(2) + fs.mixed_precision(torch.bfloat16),
        _deepspeed(bf16=ON, fp16=OFF, communication_data_type="fp32"),
    ),
    (
        "deepspeed",
        fs.zero(2) + fs.mixed_precision(torch.float16, None),
        _deepspeed(fp16=ON, bf16=OFF, communication_data_type=None),
    ),
    (
        "deepspeed",
        fs.zero(2) + fs.mixed_precision(torch.float32),
        _deepspeed(bf16=OFF, fp16=OFF, communication_data_type="fp32"),
    ),
    (
        "deepspeed",
        fs.zero(2) + fs.mixed_precision(None, torch.bfloat16),
        _deepspeed(bf16=None, communication_data_type="bf16"),
    ),
    (
        "deepspeed",
        fs.zero(2) + fs.mixed_precision(torch.float64, None),
        "* param_dtype float64: DeepSpeed trains and communicates in bfloat16, float16, float32 only",
    ),
    ("deepspeed", fs.zero(2) + fs.mixed_precision(torch.bfloat16, torch.float64), "* reduce_dtype float64"),
    (
        "deepspeed",
        fs.zero(3) + fs.offload(),
        _zero(stage=3, offload_param={"device": "cpu", "pin_memory": False}),
    ),
    (
        "deepspeed",
        fs.zero(2) + fs.offload(params=False),
        _zero(offload_optimizer={"device": "cpu", "pin_memory": False}, offload_param=None),
    ),
    (
        "deepspeed",
        fs.zero(2) + fs.offload(params=False, optimizer=False),
        "* offload_grads without offload_optimizer: DeepSpeed moves gradients to the host only",
    ),
    (
        "deepspeed",
        fs.zero(2) + fs.offload(params=False, grads=False),
        _zero(offload_optimizer={"device": "cpu", "pin_memory": False}, offload_param=None),
    ),
    (
        "deepspeed",
        fs.zero(1) + fs.offload(),
        "* offload_params: DeepSpeed offloads parameters only at ZeRO stage 3",
    ),
    (
        "deepspeed",
        fs.zero(2) + fs.checkpointing(Block),
        "* checkpointed modules ['layers.0', 'layers.1']: DeepSpeed recomputes only",
    ),
    ("deepspeed", fs.fsdp(reshard_after_forward=False), _zero(stage=2)),
    (
        "deepspeed",
        fs.hsdp("r", "s"),
        "DeepSpeed runs ZeRO over one data-parallel axis; this plan is 'hsdp'",
        HALVES,
    ),
    # fsdp (FSDP1): MixedPrecision, CPUOffload, the sharding strategy, the wrap policies
    (
        "fsdp",
        fs.fsdp() + fs.mixed_precision(None, torch.bfloat16),
        _fsdp(ShardingStrategy.FULL_SHARD, param_dtype=None, reduce_dtype=torch.bfloat16),
    ),
    ("fsdp", fs.zero(2) + fs.offload(), _fsdp(ShardingStrategy.SHARD_GRAD_OP, cpu_offload=True)),
    ("fsdp", fs.fsdp(reshard_after_forward=False), _fsdp(ShardingStrategy.SHARD_GRAD_OP)),
    ("fsdp", fs.hsdp("r", "s"), _fsdp(ShardingStrategy.HYBRID_SHARD, device_mesh=(2, 2)), HALVES),
    (
        "fsdp",
        fs.hsdp("r", "s", reshard_after_forward=False),
        _fsdp(ShardingStrategy._HYBRID_SHARD_ZERO2, device_mesh=(2, 2)),
        HALVES,
    ),
    ("fsdp", fs.fsdp() + fs.offload(grads=False), "this plan offloads only params and optimizer"),
    (
        "fsdp",
        fs.fsdp() + fs.checkpointing(Block, policy="selective"),
        "checkpoint_policy 'selective': FSDPStrategy recomputes whole modules",
    ),
    (
        "fsdp",
        fs.fsdp(units=[("norm", "lm_head")]),
        "FSDP units of several modules [['norm', 'lm_head']]: FSDPStrategy wraps one module per unit",
    ),
    ("fsdp", fs.zero(1), "no Lightning strategy 'fsdp' for a 'zero1' plan"),
    # ddp: DDPStrategy takes none of the options
    ("ddp", fs.replicate() + fs.checkpointing(Block), "this plan sets checkpointed."),
    ("ddp", fs.replicate() + fs.mixed_precision(torch.bfloat16), "this plan sets param_dtype, reduce_dtype."),
    ("ddp", fs.replicate() + fs.offload(), "this plan sets offload."),
    # model_parallel: the LightningModule's configure_model runs fs.apply(plan), which applies every option
    (
        "model_parallel",
        fs.fsdp("dp")
        + fs.tp(fs.rules.llama, "tp")
        + fs.mixed_precision(torch.bfloat16)
        + fs.checkpointing(Block),
        lambda strategy: isinstance(strategy, ModelParallelStrategy),
        SQUARE,
    ),
    (
        "model_parallel",
        fs.pipeline("pp", microbatches=2) + fs.fsdp("dp"),
        "the plan runs pipeline parallel",
        fs.Mesh(pp=2, dp=2),
    ),
]


@pytest.mark.parametrize(
    ("target", "policy", "expected", "mesh"), [(*row, None)[:4] for row in OPTIONS], ids=range(len(OPTIONS))
)
def test_every_plan_option_is_carried_or_refused_by_name(target, policy, expected, mesh):
    the_plan = plan(policy, mesh)
    if isinstance(expected, str):
        with pytest.raises(fs.ShardingError, match=re.escape(expected)):
            to_lightning(the_plan, MODEL, target=target)
    elif target == "deepspeed":
        assert expected(deepspeed_config(the_plan))
    else:
        assert expected(to_lightning(the_plan, MODEL, target=target))


@pytest.mark.parametrize(
    ("option", "message"),
    [
        # before: "takes no storage_options or filter", without what to do instead
        (
            {"storage_options": {}},
            "takes no storage_options: it writes through torch's distributed checkpoint",
        ),
        (
            {"filter": {"model": lambda k, v: True}},
            "takes no filter: the module and its optimizers are saved whole",
        ),
    ],
    ids=["storage_options", "filter"],
)
def test_fabric_save_checkpoint_refuses_an_option_it_does_not_take_with_the_fix(tmp_path, option, message):
    from functional_shard.adapters.lightning import FabricShardStrategy

    strategy = FabricShardStrategy(fs.fsdp("dp"), mesh=fs.Mesh(dp=1))
    with pytest.raises(fs.ShardingError, match=re.escape(message) + ".*; drop "):
        strategy.save_checkpoint(tmp_path / "ckpt", {}, **option)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("dtype", "flag", "cast", "agreeing"),
    [
        (torch.bfloat16, "32-true", "float32", ["bf16-mixed", "bf16-true"]),
        (torch.bfloat16, "16-mixed", "float16", ["bf16-mixed", "bf16-true"]),
        (torch.float16, "bf16-mixed", "bfloat16", ["16-mixed", "16-true"]),
        (torch.float32, "bf16-true", "bfloat16", ["32-true"]),
    ],
)
def test_deepspeed_refuses_a_trainer_precision_other_than_the_plans_at_setup(dtype, flag, cast, agreeing):
    """The plan's config pins DeepSpeed's dtype; Lightning's precision plugin would cast the
    inputs to another, which DeepSpeed meets deep inside the model. Refused on each rank before
    it joins (DeepSpeed runs only on CUDA: a precision that agrees reaches Lightning's refusal)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is in the dev extra; CI installs it")
    import lightning as L  # noqa: N812 (the name Lightning documents)

    def set_up(precision):
        strategy = to_lightning(plan(fs.zero(2) + fs.mixed_precision(dtype)), target="deepspeed")
        L.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision=precision, logger=False)
        return strategy

    planned = str(dtype).removeprefix("torch.")
    wrong = (
        f"to_lightning(target='deepspeed'): the plan trains in {planned} (mixed_precision in its policy, "
        f"pinned in the DeepSpeed config) and precision={flag!r} casts the inputs to {cast}; use precision="
        + " or ".join(repr(f) for f in agreeing)
        + ", or drop mixed_precision from the plan"
    )
    with pytest.raises(fs.ShardingError, match=re.escape(wrong)):
        set_up(flag).setup_environment()
    for precision in agreeing:
        with pytest.raises(RuntimeError, match="only supported on CUDA GPUs"):
            set_up(precision).setup_environment()


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 2, 2))  # 4 experts' weights, one 3-D tensor


@pytest.mark.parametrize(
    ("policy", "mesh", "feature"),
    [
        (
            fs.fsdp("dp") + fs.tp([("experts.w", "moe_tp_experts")], "tp"),
            fs.Mesh(dp=2, tp=2),
            "tensor parallel inside experts modules over ('tp',) (experts; no expert axis)",
        ),
        (fs.fsdp("dp") + fs.ep("dp"), fs.Mesh(dp=2), "expert parallel over 'dp'"),
    ],
)
@pytest.mark.parametrize("target", [None, "fsdp", "deepspeed", "model_parallel"])
def test_experts_are_refused_naming_how_the_plan_splits_them(policy, mesh, feature, target):
    """Split by tp alone, the experts have no expert axis: not 'expert parallel'."""
    model = torch.nn.ModuleDict({"experts": _Experts(), "router": torch.nn.Linear(2, 4)})
    model.router.top_k = 2  # what a router says, as the plan's experts config reads it
    wrong = f"to_lightning: the plan runs {feature}, which none of Lightning's own strategies runs"
    with pytest.raises(fs.ShardingError, match=re.escape(wrong)):
        to_lightning(fs.shard(model, mesh, policy), target=target)
