"""Real Trainer.fit runs (accelerator="cpu", 4 processes) against one process."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest
import torch

import functional_shard as fs

from .. import dist_cases, lightning_cases, load_hf_cases

NAMED = [
    ("fs_ddp", 4),
    ("fs_zero1", 4),
    ("fs_zero2", 4),
    ("fs_zero3", 4),
    ("fs_fsdp", 4),
    ("fs_hsdp", 4),
    ("fs_fsdp_tp", 2),
]
# the default suite trains one registered strategy per engine family (ZeRO-1's optimizer,
# FSDP2 with tensor parallel); the whole list runs under -m slow
_DEFAULT_NAMED = {"fs_zero1", "fs_fsdp_tp"}
NAMED_CASES = [
    pytest.param(name, dp, marks=() if name in _DEFAULT_NAMED else pytest.mark.slow, id=f"{name}-{dp}")
    for name, dp in NAMED
]


@pytest.fixture(scope="module")
def world(world4):
    return world4


def assert_matches_one_process(result, data_parallel):
    losses, params = lightning_cases.reference(dist_cases.EVEN, data_parallel)
    assert result["losses"] == pytest.approx(losses, abs=1e-5)
    for name, value in params.items():
        torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("name", "data_parallel"), NAMED_CASES)
def test_registered_strategies_train_as_one_process(world, name, data_parallel):
    result = world.run(lightning_cases.fit_named, name, dist_cases.EVEN, data_parallel)[0]
    assert_matches_one_process(result, data_parallel)


def test_a_hand_composed_2d_plan_trains_as_one_process(world):
    module = lightning_cases.LanguageModel(dist_cases.EVEN)
    plan = fs.shard(
        module, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp", sequence_parallel=True)
    )
    result = world.run(lightning_cases.fit_with, plan, None, dist_cases.EVEN, 2)[0]
    assert_matches_one_process(result, 2)


def test_zero1_steps_a_zero_redundancy_optimizer(world):
    kinds = world.run(lightning_cases.optimizer_kinds, "fs_zero1", dist_cases.EVEN, 4)
    assert {kind for per_rank in kinds for kind in per_rank} == {"ZeroRedundancyOptimizer"}


def test_plan_mesh_must_match_the_devices(world):
    plan = fs.shard(lightning_cases.LanguageModel(dist_cases.EVEN), fs.Mesh(dp=2), fs.fsdp())
    with pytest.raises(fs.MeshError, match="has 2 devices but the world size is 4"):
        world.refusal(lightning_cases.fit_with, plan, None, dist_cases.EVEN, 2)


def test_an_optimizer_built_before_sharding_is_refused(worlds):
    with pytest.raises(fs.ShardingError, match="built before sharding replaced them"):
        worlds(2).refusal(lightning_cases.fit_early_optimizer, dist_cases.EVEN)


def test_registered_names_resolve():
    import lightning as L  # noqa: N812 (the name Lightning documents)

    import functional_shard.adapters.lightning  # noqa: F401 (importing it registers the names)

    trainer = L.Trainer(strategy="fs_fsdp_tp", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy).__name__ == "ShardStrategy"
    assert trainer.strategy._mesh == fs.Mesh(dp=-1, tp=2)


@pytest.mark.parametrize("name", ["fs_fsdp", pytest.param("fs_ddp", marks=pytest.mark.slow)])
def test_gradient_accumulation_reduces_once_per_step(world, name):
    """2 micro-batches per step: the same training as one process on both together, and
    gradients reduced once per optimizer step (Lightning's own Trainer path for
    ModelParallelStrategy reduces on each micro-batch, twice these bytes).

    Parameters to 1e-4: accumulating sums two half-batch gradients where the reference
    takes one, and AdamW's division by sqrt(v) magnifies that reordering on near-zero
    gradients (observed: 3.4e-5 at most, on a weight of 0.069)."""
    result = world.run(lightning_cases.fit_accumulating, name, dist_cases.EVEN, 4, 2)
    losses, params = lightning_cases.reference(dist_cases.EVEN, 4, accumulate=2)
    assert result[0]["losses"] == pytest.approx(losses, abs=1e-5)
    for key, value in params.items():
        torch.testing.assert_close(result[0]["params"][key], value, atol=1e-4, rtol=1e-4)
    plan = fs.shard(
        lightning_cases.LanguageModel(dist_cases.EVEN),
        fs.Mesh(dp=4),
        fs.fsdp() if name == "fs_fsdp" else fs.replicate(),
    )
    per_step = sum(
        sum(b.values()) for k, b in plan.cost().comm_bytes.items() if k in ("reduce_scatter", "all_reduce")
    )
    # gradients reduced once per optimizer step; Lightning adds a few scalar all-reduces of
    # its own (its stopping decisions: 24 bytes over this fit)
    assert per_step * dist_cases.STEPS <= result[0]["reduced_bytes"] <= per_step * dist_cases.STEPS + 64


@pytest.mark.parametrize(
    ("name", "data_parallel"), [pytest.param("fs_fsdp", 4, marks=pytest.mark.slow), ("fs_fsdp_tp", 2)]
)
def test_gradient_clipping_clips_the_global_norm(world, name, data_parallel):
    """gradient_clip_val=0.5 (well below these gradients' norm): as one process clipping."""
    result = world.run(lightning_cases.fit_clipped, name, dist_cases.EVEN, data_parallel, 0.5)[0]
    losses, params = lightning_cases.reference(dist_cases.EVEN, data_parallel, clip=0.5)
    assert result["losses"] == pytest.approx(losses, abs=1e-5)
    for key, value in params.items():
        torch.testing.assert_close(result["params"][key], value, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "clipping", [lightning_cases.trainer_clip_by_value, lightning_cases.fabric_clip_by_value]
)
def test_clipping_by_value_clamps_each_entry_under_tensor_parallel(world, clipping):
    """gradient_clip_algorithm="value" and fabric.clip_gradients(clip_val=...) under TP, whose
    plain norm weights beside DTensor projections made torch's one foreach clamp raise: every
    gradient entry clamped into [-clip, clip], as one process clamping the whole gradient."""
    result = world.run(clipping, "tp", dist_cases.EVEN, 1e-2)[0]
    clipped = 0
    for before, after in zip(result["before"], result["after"], strict=True):
        assert torch.equal(after, before.clamp(-1e-2, 1e-2))
        clipped += int((before.abs() > 1e-2).sum())
    assert clipped > 0


@pytest.mark.parametrize(
    ("name", "full"),
    [
        pytest.param("fs_fsdp", False, marks=pytest.mark.slow),
        pytest.param("fs_fsdp_tp", False, marks=pytest.mark.slow),
        ("fs_fsdp_tp", True),  # a full file of a 2-D plan
        ("fs_zero1", False),  # ZeRO-1's owned state, in folders
        pytest.param("fs_zero1", True, marks=pytest.mark.slow),
    ],
)
def test_trainer_checkpoints_resume_exactly(world, tmp_path, name, full):
    """Two epochs straight, against one epoch, a checkpoint (a folder, or with
    save_distributed_checkpoint=False one file), and a resumed second epoch: the same losses
    in epoch two and the same final parameters."""
    straight = world.run(lightning_cases.fit_epochs, name, dist_cases.EVEN, 2, None, None)[0]
    path = tmp_path / "epoch1.ckpt"
    world.run(lightning_cases.fit_epochs, name, dist_cases.EVEN, 1, None, str(path), full)
    assert path.is_file() == full
    resumed = world.run(lightning_cases.fit_epochs, name, dist_cases.EVEN, 2, str(path), None, full)[0]
    second_epoch = straight["losses"][len(straight["losses"]) // 2 :]
    assert resumed["losses"] == pytest.approx(second_epoch, abs=1e-5)  # a float32 step at 25 is 1.9e-6
    for key, value in straight["params"].items():
        torch.testing.assert_close(resumed["params"][key], value, atol=1e-5, rtol=1e-4)


def assert_same_training_state(got, expected):
    assert got["params"].keys() == expected["params"].keys()
    for key, value in expected["params"].items():
        torch.testing.assert_close(got["params"][key], value, atol=0, rtol=0, msg=key)
    assert got["optimizer"].keys() == expected["optimizer"].keys()
    for key, state in expected["optimizer"].items():
        for field, value in state.items():
            torch.testing.assert_close(got["optimizer"][key][field], value, atol=0, rtol=0, msg=key)


@pytest.mark.slow  # the default suite moves checkpoints between plans in tests/dist/test_checkpoint.py
def test_trainer_checkpoints_move_between_plans(world, worlds, tmp_path):
    """A Trainer checkpoint saved under FSDP x4 resumes under FSDP x2 . TP x2 and ZeRO-1
    x4 (a folder), and under Lightning's own single-device strategy (one file): the same
    parameters and optimizer state, exactly."""
    folder, file = str(tmp_path / "fsdp"), str(tmp_path / "fsdp.ckpt")
    saved = world.run(lightning_cases.fit_epochs, "fs_fsdp", dist_cases.EVEN, 1, None, folder)[0]
    for name in ("fs_fsdp_tp", "fs_zero1"):
        # max_epochs=1 is reached already: the fit loads and stops
        loaded = world.run(lightning_cases.fit_epochs, name, dist_cases.EVEN, 1, folder, None)[0]
        assert_same_training_state(loaded, saved)
    world.run(lightning_cases.fit_epochs, "fs_fsdp", dist_cases.EVEN, 1, folder, file, True)
    loaded = worlds(1).run(lightning_cases.fit_epochs, "auto", dist_cases.EVEN, 1, file, None)[0]
    assert_same_training_state(loaded, saved)


@pytest.mark.parametrize("name", ["zero3", "fsdp_tp"])
def test_fabric_loop_trains_as_one_process(world, name):
    result = world.run(lightning_cases.fabric_loop, name, dist_cases.EVEN)[0]
    losses, params = dist_cases.reference(dist_cases.EVEN, result["data_parallel"], lightning_cases.ADAM_EPS)
    assert result["losses"] == pytest.approx(losses, abs=1e-5)
    for key, value in params.items():
        torch.testing.assert_close(result["params"][key], value, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("name", "full"),
    [
        pytest.param("zero3", False, marks=pytest.mark.slow),
        ("fsdp_tp", False),
        pytest.param("zero1", True, marks=pytest.mark.slow),
    ],
)
def test_fabric_save_and_load_resume_exactly(world, tmp_path, name, full):
    """fabric.save after 2 steps, fabric.load in a new Fabric, 3 more steps: the losses of
    an uninterrupted run (ZeRO-1: a plain AdamW rebound to ZeroRedundancyOptimizer)."""
    path = str(tmp_path / ("ckpt.pt" if full else "ckpt"))
    uninterrupted = world.run(lightning_cases.fabric_loop, name, dist_cases.EVEN)[0]
    world.run(lightning_cases.fabric_loop, name, dist_cases.EVEN, False, 2, None, path, full)
    resumed = world.run(lightning_cases.fabric_loop, name, dist_cases.EVEN, False, 3, path, None, full)[0]
    assert resumed["start"] == 2
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][2:], abs=1e-5)
    if name == "zero1":
        assert resumed["optimizer"] == "ZeroRedundancyOptimizer"


@pytest.mark.parametrize("full", [False, True])
def test_fabric_strict_load_refuses_a_state_key_the_checkpoint_lacks(world, tmp_path, full):
    """fabric.load of a state naming "epoch", which the checkpoint lacks, kept the state's own
    value unsaid; as Fabric's strict load, it is refused before anything loads (strict=False loads)."""
    path = str(tmp_path / ("ckpt.pt" if full else "ckpt"))
    result = world.run(lightning_cases.fabric_load_asking_for_more, "zero3", dist_cases.EVEN, path, full)[0]
    assert "holds no 'epoch' of the state asked for, and nothing was loaded" in result["refusal"]
    assert result["untouched"] == 0
    assert result["loose"] == (3, 7)


@pytest.mark.parametrize("precision", [pytest.param("16-mixed-cpu", marks=pytest.mark.slow), "16-mixed"])
def test_fabric_float16_with_a_scaler_that_agrees_over_ranks(world, precision):
    """Fabric's float16 AMP plugin: the strategy swaps its GradScaler for fs.grad_scaler and
    training follows one float32 process within float16's rounding. The "16-mixed" flag,
    which Fabric refuses to its own ModelParallelStrategy, is accepted (on the CPU Fabric
    runs it as bf16-mixed, without a scaler)."""
    loop = lightning_cases.fabric_loop
    result = world.run(
        loop, "fsdp_tp", dist_cases.EVEN, False, dist_cases.STEPS, None, None, False, precision
    )[0]
    assert result["scaler"] == ("_LocalShardsGradScaler" if precision == "16-mixed-cpu" else "NoneType")
    in_float32 = dist_cases.reference(dist_cases.EVEN, 2, lightning_cases.ADAM_EPS)[0]
    assert result["losses"] == pytest.approx(in_float32, abs=5e-2)
    assert _differs_somewhere(result["losses"], in_float32)


@pytest.mark.parametrize("name", ["ddp", pytest.param("zero3", marks=pytest.mark.slow)])
def test_fabric_no_backward_sync_holds_the_reduction_under_every_engine(world, name):
    """fabric.no_backward_sync: nothing reduced inside, under replicate (DDP, ZeRO-1) as under
    FSDP2 (Lightning's own switch finds FSDP2 modules only); the next backward reduces the sum."""
    result = world.run(lightning_cases.fabric_no_backward_sync, name, dist_cases.EVEN)[0]
    assert result["reduced_inside"] == 0
    assert result["difference"] < 1e-5


def test_fabric_refuses_an_optimizer_built_before_sharding(world):
    with pytest.raises(fs.ShardingError, match="built before sharding replaced them"):
        world.refusal(lightning_cases.fabric_loop, "zero3", dist_cases.EVEN, True)


@pytest.mark.parametrize("optimizer_first", [False, True], ids=["setup", "optimizer-first"])
def test_fabric_setup_of_a_model_and_its_optimizer_is_refused_with_fabrics_fix(world, optimizer_first):
    """fabric.setup(model, optimizer), or setup_optimizers before setup_module (before: it stepped
    the replaced parameters and trained nothing, unsaid)."""
    fix = "model = fabric.setup_module(model); optimizer = fabric.setup_optimizers(torch.optim.AdamW("
    with pytest.raises(fs.ShardingError, match=re.escape(fix)):
        world.refusal(lightning_cases.fabric_setup_together, "zero3", dist_cases.EVEN, optimizer_first)


def _differs_somewhere(losses, reference):
    return any(abs(a - b) > 1e-5 for a, b in zip(losses, reference, strict=True))


@pytest.mark.parametrize(
    ("name", "data_parallel"), [pytest.param("fs_fsdp", 4, marks=pytest.mark.slow), ("fs_fsdp_tp", 2)]
)
def test_bf16_mixed_trains_as_one_process_in_bf16(world, name, data_parallel):
    """Trainer(precision="bf16-mixed"): bfloat16 autocast, as one process under the same
    autocast to within bfloat16's rounding (measured 1.5e-2 at most on losses near 30;
    bfloat16's relative step is 7.8e-3)."""
    result = world.run(lightning_cases.fit_in_precision, name, dist_cases.EVEN, data_parallel, "bf16-mixed")
    losses = result[0]["losses"]
    in_bf16 = lightning_cases.reference(dist_cases.EVEN, data_parallel, autocast=torch.bfloat16)[0]
    assert losses == pytest.approx(in_bf16, abs=5e-2)
    assert _differs_somewhere(losses, lightning_cases.reference(dist_cases.EVEN, data_parallel)[0])


def test_16_mixed_scales_the_loss_with_a_scaler_that_agrees_over_ranks(world):
    """Lightning's float16 AMP plugin (on the CPU: its flag would fall back to bf16-mixed):
    the strategy swaps torch's per-rank GradScaler for fs.grad_scaler; training follows one
    float32 process to within float16's rounding (measured 1.6e-3)."""
    result = world.run(lightning_cases.fit_in_precision, "fs_fsdp_tp", dist_cases.EVEN, 2, "16-mixed-cpu")[0]
    assert result["scaler"] == "_LocalShardsGradScaler"
    in_float32 = lightning_cases.reference(dist_cases.EVEN, 2)[0]
    assert result["losses"] == pytest.approx(in_float32, abs=1e-2)
    assert _differs_somewhere(result["losses"], in_float32)


def test_the_16_mixed_flag_is_accepted(world):
    """Lightning's own ModelParallelStrategy refuses precision="16-mixed"; ours takes it (on
    the CPU Lightning then runs bf16-mixed, the same training as that flag)."""
    flagged = world.run(lightning_cases.fit_in_precision, "fs_fsdp", dist_cases.EVEN, 4, "16-mixed")[0]
    bf16 = world.run(lightning_cases.fit_in_precision, "fs_fsdp", dist_cases.EVEN, 4, "bf16-mixed")[0]
    assert flagged["losses"] == bf16["losses"]


def test_a_plan_in_bf16_under_a_float16_flag_is_refused(world):
    # autocast to float16 over FSDP2's bf16 copies: some ops refuse the mix deep inside torch
    policy = fs.fsdp("dp") + fs.mixed_precision(torch.bfloat16)
    message = (
        "ShardStrategy: the plan computes in bfloat16 (mixed_precision in its policy) and "
        "precision='16-mixed' in float16"
    )
    with pytest.raises(fs.ShardingError, match=re.escape(message)) as refused:
        world.refusal(lightning_cases.fit_with, policy, fs.Mesh(dp=4), dist_cases.EVEN, 4, True)
    assert "use precision='bf16-mixed' or '32-true'" in str(refused.value)


def test_a_float32_plan_under_a_low_precision_flag_names_the_one_flag_that_agrees():
    # Lightning has no mixed flag for float32: only '32-true' is offered
    from types import SimpleNamespace

    from functional_shard.adapters.lightning._common import _refuse_two_precisions

    plan = fs.shard(
        dist_cases.Llama(dist_cases.EVEN), fs.Mesh(dp=2), fs.fsdp() + fs.mixed_precision(torch.float32)
    )
    with pytest.raises(fs.ShardingError, match=re.escape("or use precision='32-true'")):
        _refuse_two_precisions(plan, SimpleNamespace(precision="bf16-mixed"), "ShardStrategy")
    _refuse_two_precisions(plan, SimpleNamespace(precision="32-true"), "ShardStrategy")


def test_a_strict_rule_set_that_misses_parameters_is_refused_by_name(world):
    no_norms = fs.Rules(list(fs.rules.llama)[:-1], strict=True, name="no-norms")
    policy = fs.fsdp("dp") + fs.tp(no_norms, "tp")
    with pytest.raises(fs.PlanError, match=r"model\.norm\.weight.*no rule of the strict rule set 'no-norms'"):
        world.refusal(lightning_cases.fit_with, policy, fs.Mesh(dp=2, tp=2), dist_cases.EVEN, 2)


def test_a_plan_that_misses_parameters_of_the_module_is_refused_by_name(world):
    one_layer = dataclasses.replace(dist_cases.EVEN, num_layers=1)
    plan = fs.shard(lightning_cases.LanguageModel(one_layer), fs.Mesh(dp=4), fs.fsdp())
    missing = r"model\.layers\.1\.mlp\.down_proj\.weight: a parameter of the module but not in the plan"
    with pytest.raises(fs.PlanError, match=missing):
        world.refusal(lightning_cases.fit_with, plan, None, dist_cases.EVEN, 4)


def test_weight_averaging_of_sharded_parameters_is_refused_at_setup(world):
    """StochasticWeightAveraging copies the module before the plan shards it: its first update
    raised torch's 'mixed torch.Tensor and DTensor'; now a ShardingError names the callback."""
    averaging = "the callback StochasticWeightAveraging averages a copy of the whole module made before"
    with pytest.raises(fs.ShardingError, match=re.escape(averaging)):
        world.refusal(lightning_cases.fit_averaging_weights, "zero3", dist_cases.EVEN)


def test_model_checkpoint_keeps_sharded_folders_and_resumes_from_them(world, tmp_path):
    """ModelCheckpoint(every_n_train_steps=2, save_top_k=1): sharded checkpoints are
    folders, the older ones removed, none left half-written; a fit resumes from the last."""
    folder = str(tmp_path / "ckpts")
    first = world.run(lightning_cases.fit_with_model_checkpoint, "fs_fsdp", dist_cases.EVEN, folder, None)[0]
    assert first["held"] == ["epoch=0-step=4.ckpt"]
    assert (tmp_path / "ckpts" / "epoch=0-step=4.ckpt").is_dir()
    resumed = world.run(
        lightning_cases.fit_with_model_checkpoint, "fs_fsdp", dist_cases.EVEN, folder, first["best"]
    )[0]
    assert resumed["step"] == dist_cases.STEPS + 1


def test_a_fitted_module_fits_again_under_a_new_trainer_of_the_same_strategy(world):
    """A second Trainer of the same registered name runs the plan the module has (before: "this
    module is already parallelized"); another policy is refused, naming the fix."""
    losses = world.run(lightning_cases.fit_again_with_a_new_trainer, "fs_fsdp", "fs_fsdp", dist_cases.EVEN)[0]
    assert len(losses) == 2
    assert losses[1] < losses[0]  # the second step trained on from the first
    other = "ShardStrategy: the module runs another plan already (an earlier strategy applied it)"
    with pytest.raises(fs.ShardingError, match=re.escape(other)):
        world.refusal(lightning_cases.fit_again_with_a_new_trainer, "fs_fsdp", "fs_ddp", dist_cases.EVEN)


@pytest.mark.parametrize("strategy", ["ShardStrategy", "FabricShardStrategy"])
def test_a_module_parallelized_elsewhere_runs_under_an_equal_plan_or_policy(one_rank, strategy):
    """A module fs.apply (or a strategy given a plan) parallelized: a strategy of a policy plans
    it again, to the plan it runs (its classes read as its code wrote them, not FSDP2's
    FSDPBlock); a plan made from it runs as well; another policy is still refused."""
    from functional_shard.adapters import lightning as adapter
    from functional_shard.zoo import Llama

    made, mesh = getattr(adapter, strategy), fs.Mesh(dp=1)
    model = Llama(dist_cases.EVEN)
    fs.apply(fs.shard(model, mesh, fs.fsdp("dp")), model)
    assert made(fs.fsdp("dp"), mesh=mesh)._runs_it_already(model)
    assert made(fs.shard(model, mesh, fs.fsdp("dp")))._runs_it_already(model)
    other = f"{strategy}: the module runs another plan already (an earlier strategy applied it)"
    with pytest.raises(fs.ShardingError, match=re.escape(other)):
        made(fs.replicate("dp"), mesh=mesh)._runs_it_already(model)


def test_a_2d_plan_through_lightnings_own_model_parallel_strategy(world):
    """to_lightning(2D plan) -> ModelParallelStrategy(2, 2); the module's configure_model
    applies the plan: the same training as one process."""
    result = world.run(lightning_cases.fit_under_lightnings_model_parallel, dist_cases.EVEN)[0]
    assert result["strategy"] == "ModelParallelStrategy"
    assert_matches_one_process(result, 2)


@pytest.mark.parametrize("name", ["fs_fsdp_tp", "fs_zero1"])
def test_the_strategy_reduces_gathers_and_broadcasts_over_every_rank(world, name):
    results = world.run(lightning_cases.strategy_collectives, name, dist_cases.EVEN)
    for result in results:
        assert result["mean"] == pytest.approx(1.5)
        assert result["sum"] == 6.0
        assert result["gathered"] == [0.0, 1.0, 2.0, 3.0]
        assert result["broadcast"] == "from 2.0"
        assert result["decision"] is True
        if name == "fs_zero1":  # whole weights on every rank
            assert result["a_weight"] == (4, dist_cases.EVEN.vocab_size, dist_cases.EVEN.hidden_size)
        else:  # a DTensor: torch's collective raised NotImplementedError
            assert "all_gather of a DTensor (shape (128, 32)" in result["a_weight"]
            assert "tensor.full_tensor() for the whole tensor" in result["a_weight"]


@pytest.mark.parametrize("name", ["fsdp_tp", pytest.param("ddp", marks=pytest.mark.slow)])
def test_fabric_gathers_and_reduces_each_ranks_own_tensor_and_refuses_a_dtensor(world, name):
    results = world.run(lightning_cases.fabric_collectives_of_a_weight, name, dist_cases.EVEN)
    whole = (dist_cases.EVEN.vocab_size, dist_cases.EVEN.hidden_size)
    for result in results:
        if name == "ddp":
            assert result == {"gathered": (4, *whole), "reduced": whole}
        else:
            assert "fabric.all_gather of a DTensor (shape (128, 32)" in result["gathered"]
            assert "fabric.all_reduce of a DTensor (shape (128, 32)" in result["reduced"]


# weights=: a Hugging Face folder (save_pretrained of a tiny Llama) the run starts from
FSDP = (fs.fsdp("dp"), fs.Mesh(dp=4))
FSDP_TP = (fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"), fs.Mesh(dp=2, tp=2))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return load_hf_cases.write_folder(tmp_path_factory.mktemp("hf") / "llama", "llama")


@pytest.fixture(scope="module")
def pretrained(hf_folder: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    state, logits, _ = load_hf_cases.reference(hf_folder, "llama")
    return state, logits


def assert_loaded(result, state, logits=None):
    assert result["state"], "nothing gathered"
    assert set(result["state"]) <= set(state)
    for name, value in result["state"].items():
        assert torch.equal(value, state[name]), f"{name} differs by {(value - state[name]).abs().max()}"
    if logits is not None:
        torch.testing.assert_close(result["logits"], logits, atol=1e-6, rtol=1e-6)
    assert all(0 < loss < 10 for loss in result["losses"])  # then a step trains


@pytest.mark.parametrize(
    ("meta", "plan"),
    [pytest.param(True, FSDP, id="meta-fsdp"), pytest.param(False, FSDP_TP, id="cpu-fsdp_tp")],
)
def test_the_trainer_starts_from_a_hugging_face_folder(world, hf_folder, pretrained, meta, plan):
    """ShardStrategy(policy, weights=folder): configure_model builds the model (on the meta
    device: no memory, no random init; or seeded, then overwritten); the strategy applies the
    plan and fills each shard from the folder: from_pretrained's weights bit for bit, its
    logits to 1e-6."""
    result = world.run(lightning_cases.fit_from_folder, str(hf_folder), "llama", meta, *plan)[0]
    assert_loaded(result, *pretrained)


def test_fabric_starts_from_a_hugging_face_folder(world, hf_folder, pretrained):
    """FabricShardStrategy(policy, weights=folder): fabric.setup_module of a meta-device model."""
    result = world.run(lightning_cases.fabric_from_folder, str(hf_folder), "llama", True, *FSDP_TP)[0]
    assert_loaded(result, *pretrained)


def test_weights_mapping_fills_a_zoo_model_from_a_hugging_face_folder(world, tmp_path):
    """weights_mapping=fs.checkpoint.zoo_llama: the zoo's tied Llama from a folder that
    leaves the tied head out (as save_pretrained writes it)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    config = dist_cases.EVEN
    torch.manual_seed(3)
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        tie_word_embeddings=True,
    )
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path)
    mapping = fs.checkpoint.zoo_llama
    result = world.run(lightning_cases.fit_from_folder, str(tmp_path), "zoo", False, *FSDP, mapping)[0]
    saved = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in saved
    expected = {name: saved[f"model.{name}"] for name in result["state"] if name != "lm_head.weight"}
    assert_loaded(result, {**expected, "lm_head.weight": saved["model.embed_tokens.weight"]})


@pytest.mark.parametrize("strategy", ["ShardStrategy", "FabricShardStrategy"])
def test_a_mesh_or_timeout_the_strategy_would_ignore_or_fail_on_is_refused_when_it_is_made(strategy):
    from datetime import timedelta

    import functional_shard.adapters.lightning as adapter

    made = getattr(adapter, strategy)
    plan = fs.shard(torch.nn.Linear(4, 4), fs.Mesh(dp=4), fs.fsdp())
    wrong = "mesh=Mesh(dp=8): not the plan's own mesh, Mesh(dp=4) (drop mesh="
    with pytest.raises(fs.ShardingError, match=re.escape(wrong)):
        made(plan, mesh=fs.Mesh(dp=8))
    made(plan, mesh=fs.Mesh(dp=4))  # its own mesh: nothing to ignore
    with pytest.raises(fs.ShardingError, match=re.escape("mesh=dict: a Mesh (as fs.Mesh(dp=-1))")):
        made(fs.fsdp(), mesh={"dp": 4})
    wrong = "timeout=int: a timedelta (as Lightning's strategies take it: timeout=timedelta(seconds=60))"
    with pytest.raises(fs.ShardingError, match=re.escape(wrong)):
        made(fs.fsdp(), timeout=60)
    wrong = "timeout=str: a timedelta (as Lightning's strategies take it: timeout=timedelta(seconds=...))"
    with pytest.raises(fs.ShardingError, match=re.escape(wrong)):
        made(fs.fsdp(), timeout="60")
    made(fs.fsdp(), timeout=timedelta(seconds=60))


_PLAN_FOR_4 = "the plan Mesh(dp=4) has 4 devices but the world size is"
_FIXED_2 = "fixed axes hold 2 devices, which does not divide the world size 3 (devices=3)"
# (devices, num_nodes, the refusal) for a plan on Mesh(dp=4), under the Trainer and Fabric alike
_PLAN_WORLDS = [
    (2, 1, f"{_PLAN_FOR_4} 2 (devices=2); make the plan for 2 ranks, or set devices=4"),
    (8, 1, f"{_PLAN_FOR_4} 8 (devices=8); make the plan for 8 ranks, or set devices=4"),
    (4, 2, f"{_PLAN_FOR_4} 8 (devices=4 x num_nodes=2); make the plan for 8 ranks, or set devices=2"),
]


@pytest.mark.parametrize(
    ("kind", "strategy", "devices", "num_nodes", "message"),
    [
        *[
            pytest.param(kind, "plan", devices, nodes, message, id=f"{kind}-plan-{devices}x{nodes}")
            for kind in ("Trainer", "Fabric")
            for devices, nodes, message in _PLAN_WORLDS
        ],
        pytest.param(
            "Trainer",
            "fs_fsdp_tp",
            3,
            1,
            f"Mesh(dp=-1, tp=2)'s {_FIXED_2}; set devices to a multiple of 2",
            id="Trainer-fs_fsdp_tp",
        ),
        pytest.param("Trainer", "fs_hsdp", 3, 1, f"Mesh(node=2, gpu=-1)'s {_FIXED_2}", id="Trainer-fs_hsdp"),
    ],
)
def test_a_world_the_mesh_does_not_fit_is_refused_when_the_trainer_is_made(
    kind, strategy, devices, num_nodes, message
):
    """Refused before Lightning starts or joins a process: with num_nodes, joining a world of
    the wrong size would wait for ranks that never come."""
    import lightning as L  # noqa: N812 (the name Lightning documents)

    from functional_shard.adapters.lightning import FabricShardStrategy, ShardStrategy

    if kind == "Trainer":
        made, who = functools.partial(L.Trainer, logger=False), ShardStrategy
    else:
        made, who = L.Fabric, FabricShardStrategy
    plan = fs.shard(torch.nn.Linear(4, 4), fs.Mesh(dp=4), fs.fsdp())

    def fresh():  # a strategy takes one Trainer's accelerator
        return who(plan) if strategy == "plan" else strategy

    with pytest.raises(fs.MeshError, match=re.escape(f"{who.__name__}: {message}")):
        made(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=fresh())
    made(accelerator="cpu", devices=2, num_nodes=2, strategy=fresh())  # 4 ranks fit each mesh


@pytest.mark.parametrize("strategy", ["ShardStrategy", "FabricShardStrategy"])
def test_weights_that_are_not_a_folder_are_refused_when_the_strategy_is_made(hf_folder, strategy):
    import functional_shard.adapters.lightning as adapter

    made = getattr(adapter, strategy)
    file = hf_folder / "model.safetensors"
    wrong = f"{strategy}(weights={str(file)!r}): a file, not a folder; pass the folder that holds it"
    with pytest.raises(fs.ShardingError, match=re.escape(wrong)):
        made(fs.fsdp("dp"), weights=file)
    missing = str(hf_folder / "nowhere")
    wrong = f"{strategy}(weights={missing!r}): no such folder; pass a Hugging Face model's folder"
    with pytest.raises(fs.ShardingError, match=re.escape(wrong)):
        made(fs.fsdp("dp"), weights=missing)
    for shown, weights in (("3", 3), ("''", "")):
        with pytest.raises(
            fs.ShardingError, match=re.escape(f"weights={shown}: a path (a str or os.PathLike)")
        ):
            made(fs.fsdp("dp"), weights=weights)
    wrong = f"{strategy}: weights_mapping= and trust_weights= say how to read weights=, which is not given"
    with pytest.raises(fs.ShardingError, match=re.escape(wrong)):
        made(fs.fsdp("dp"), weights_mapping=fs.checkpoint.zoo_llama)


# packed rows (fs.pack): one long document among short ones in each row, the ranks' targets
# uneven; the default suite runs the Trainer under cp, whose rows the strategy cuts by work
PACKED = [
    pytest.param({"dp": 2, "cp": 2}, "fsdp(dp, cp) + cp(cp)", id="dp2xcp2"),
    pytest.param({"dp": 4}, "fsdp(dp)", marks=pytest.mark.slow, id="fsdp4"),
]
# a pipeline hands each stage its micro-batch's positions and document ids (the zoo Llama untied:
# a pipeline keeps no tie between stages)
PACKED_PIPELINE = ({"pp": 2, "dp": 2}, "pipeline(pp, microbatches=2) + fsdp(dp)", "zoo_untied")


def assert_packed_matches_one_process(results, expected):
    # each rank saw its data-parallel slice's mean loss over its targets (under cp, its group's)
    for result in results:
        seen = [step[result["index"]] for step in expected["slice_losses"]]
        assert result["losses"] == pytest.approx(seen, abs=1e-5)
    # each parameter from the first rank that holds it (under a pipeline, its stage's ranks)
    held = {name: value for result in reversed(results) for name, value in (result["params"] or {}).items()}
    assert held.keys() == expected["params"].keys()
    for name, value in expected["params"].items():
        torch.testing.assert_close(held[name], value, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("mesh", "policy"), PACKED)
def test_the_trainer_fits_packed_rows_as_one_process(world, mesh, policy):
    """A DataLoader of a PackedBatch (collate_fn=fs.collate_packed): training_loss passes the
    rows' positions and document ids; the same training as one process on the same slices."""
    results = world.run(lightning_cases.fit_packed, mesh, policy)
    expected = lightning_cases.packed_reference(mesh.get("dp", 1), shuffled=True)
    assert_packed_matches_one_process(results, expected)


@pytest.mark.slow
def test_the_trainer_fits_packed_rows_under_a_pipeline_as_one_process(world):
    mesh, policy, kind = PACKED_PIPELINE
    results = world.run(lightning_cases.fit_packed, mesh, policy, kind)
    expected = lightning_cases.packed_reference(mesh["dp"], shuffled=True, kind=kind)
    assert_packed_matches_one_process(results, expected)


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "policy"), [p.values for p in PACKED], ids=[p.id for p in PACKED])
def test_fabric_trains_packed_rows_as_one_process(world, mesh, policy):
    results = world.run(lightning_cases.fabric_packed, mesh, policy)
    expected = lightning_cases.packed_reference(mesh.get("dp", 1), shuffled=False)
    assert_packed_matches_one_process(results, expected)
