"""Parity on real gloo process groups: any plan trains as one process does.

Each case trains a tied tiny Llama for 5 AdamW steps (lr 1e-2, fp32) under a plan and
compares the losses and the full parameters with one process training on the whole
global batch. Tolerances: 1e-5 absolute on losses (about 28) and 1e-5 absolute plus
1e-4 relative on parameters, the float32 reordering noise of sharded reductions
(measured differences are 2e-6 and 2e-6 at most).
"""

from __future__ import annotations

import pytest
import torch

import functional_shard as fs

from .. import dist_cases

FAMILIES = ("ddp", "zero1", "zero2", "zero3", "hsdp", "tp", "tp_sp", "fsdp_tp")
CASES = [
    *[(4, name, "EVEN") for name in FAMILIES],
    *[(3, name, "UNEVEN") for name in ("ddp", "zero1", "zero2", "zero3")],
    *[(3, name, "UNEVEN_TP") for name in ("tp", "tp_sp")],
    *[(2, name, "EVEN") for name in ("fsdp_checkpointing", "fsdp_offload")],
]
# every family again on 2 ranks: the default suite has each on 4 (and the uneven ones on 3)
TWO_RANK_CASES = [
    pytest.param(2, name, "EVEN", marks=pytest.mark.slow, id=f"2-{name}-EVEN") for name in FAMILIES
]
# The default suite trains these plans on 4 ranks in test_zero_dim.py's
# test_a_zero_dim_parameter_trains_as_one_process_and_sends_what_the_cost_model_says: the same
# meshes and policies (its "fsdp" is zero3's FSDP2 plan but for its name), the same tied model
# plus a 0-d parameter, steps and tolerances, with this module's training, memory and traffic
# checks in one run; here they run under -m slow. DDP on 3 uneven ranks is ZeRO-1's run without
# its optimizer sharding (both wrap the model alike), which the default suite keeps.
IN_TEST_ZERO_DIM = {(4, name, "EVEN") for name in ("ddp", "zero1", "zero3", "hsdp", "fsdp_tp")}
COVERED = IN_TEST_ZERO_DIM | {(3, "ddp", "UNEVEN")}


def cases(listed):
    """``listed`` as parameters, those another default test covers marked slow."""
    return [
        pytest.param(*case, id="-".join(map(str, case)), marks=pytest.mark.slow if case in COVERED else ())
        for case in listed
    ]


@pytest.mark.parametrize(("world_size", "strategy", "config"), [*cases(CASES), *TWO_RANK_CASES])
def test_training_matches_one_process(worlds, world_size, strategy, config):
    config = getattr(dist_cases, config)
    result = worlds(world_size).run(dist_cases.train, strategy, config)[0]
    losses, params = dist_cases.reference(config, result["data_parallel"])
    assert result["losses"] == pytest.approx(losses, abs=1e-5)
    assert result["params"].keys() == params.keys()
    for name, value in params.items():
        torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=1e-4, msg=name)


MEMORY_CASES = [
    (4, name, "EVEN") for name in ("ddp", "zero1", "zero2", "zero3", "hsdp", "tp", "tp_sp", "fsdp_tp")
] + [
    (3, "zero1", "UNEVEN"),
    (3, "zero3", "UNEVEN"),
    (3, "tp", "UNEVEN_TP"),
]


@pytest.mark.parametrize(("world_size", "strategy", "config"), cases(MEMORY_CASES))
def test_measured_memory_equals_the_cost_model(worlds, world_size, strategy, config):
    """Every rank's bytes of params, grads and optimizer state equal plan.cost(rank=r), exactly."""
    results = worlds(world_size).run(dist_cases.measure_memory, strategy, getattr(dist_cases, config))
    for rank, result in enumerate(results):
        assert result["measured"] == result["predicted"], f"rank {rank}"


COMM_CASES = [
    (4, name, "EVEN")
    for name in ("ddp", "zero1", "zero2", "zero3", "hsdp", "tp", "tp_sp", "fsdp_tp", "fsdp_tp_sp")
] + [
    (3, "zero3", "UNEVEN"),
    (3, "tp", "UNEVEN_TP"),
    (3, "tp_sp", "UNEVEN_TP"),
    (2, "fsdp_bf16", "EVEN"),
    (2, "fsdp_bf16_no_reduce_dtype", "EVEN"),
]


@pytest.mark.parametrize(("world_size", "strategy", "config"), cases(COMM_CASES))
def test_measured_traffic_equals_the_cost_model(worlds, world_size, strategy, config):
    """Bytes each rank sends in a steady-state step, per collective kind and mesh axis, counted
    from the c10d ops torch issued, equal plan.cost(tokens=...) (what NCCL would send)."""
    results = worlds(world_size).run(dist_cases.measure_comm, strategy, getattr(dist_cases, config))
    for rank, result in enumerate(results):
        assert result["measured"].keys() == result["predicted"].keys(), f"rank {rank}"
        for kind, by_axis in result["predicted"].items():
            assert result["measured"][kind] == pytest.approx(by_axis), f"rank {rank}: {kind}"


def test_mixed_precision_matches_a_reference_with_the_same_casts(worlds):
    """bf16 compute, fp32 reduction: equal to one process that runs bf16 copies per
    micro-batch and averages their gradients in fp32 (observed: bitwise equal)."""
    grads = worlds(2).run(dist_cases.mixed_precision_grads, dist_cases.EVEN)[0]
    expected = dist_cases.emulated_mixed_precision_grads(dist_cases.EVEN, 2)
    for name, value in expected.items():
        assert grads[name].dtype == torch.float32
        torch.testing.assert_close(grads[name], value, atol=1e-6, rtol=1e-5, msg=name)


META_CASES = [(4, name, "EVEN") for name in ("zero2", "zero3", "hsdp", "tp", "tp_sp", "fsdp_tp")] + [
    (3, "zero3", "UNEVEN"),
    (3, "tp", "UNEVEN_TP"),
]


@pytest.mark.parametrize(
    ("world_size", "strategy", "config"), META_CASES, ids=[f"{n}-{s}-{c}" for n, s, c in META_CASES]
)
def test_meta_init_equals_init_then_shard(worlds, world_size, strategy, config):
    """Built on meta, applied, materialized shard by shard with seed 0: the same full
    parameters as one process initialising the model with seed 0 (exactly)."""
    config = getattr(dist_cases, config)
    params = worlds(world_size).run(dist_cases.meta_init, strategy, config)[0]
    torch.manual_seed(0)
    expected = dist_cases.Llama(config).state_dict()
    assert params.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(params[name], value), name


GPUS = torch.cuda.device_count()
# NCCL runs one rank per GPU: two ranks where there are two GPUs; on one GPU, the plans
# whose mesh fits one rank run as a 1-rank world (NCCL, DTensor and FSDP2 on CUDA, no peers)
NCCL_RANKS = min(GPUS, 2)
NCCL_STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "tp", "tp_sp"]
NCCL_STRATEGIES += ["hsdp", "fsdp_tp"] if NCCL_RANKS == 2 else []


@pytest.mark.skipif(GPUS == 0, reason="NCCL parity needs a GPU; none here, so the cases ran on gloo.")
@pytest.mark.parametrize("strategy", NCCL_STRATEGIES)
def test_training_matches_one_process_on_nccl(strategy):
    # a world of its own: NCCL, one GPU per rank (the shared worlds are gloo)
    with fs.LocalWorld(NCCL_RANKS, backend="nccl") as world:
        result = world.run(dist_cases.train, strategy, dist_cases.EVEN)[0]
    losses, params = dist_cases.reference(dist_cases.EVEN, result["data_parallel"])
    assert result["losses"] == pytest.approx(losses, abs=1e-4)
    for name, value in params.items():
        torch.testing.assert_close(result["params"][name], value, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.skipif(GPUS == 0, reason="bf16 on CUDA needs a GPU")
def test_bf16_mixed_precision_on_cuda_matches_its_emulation():
    """FSDP2's bf16 compute with fp32 reduction on CUDA (NCCL): the gradients one process gets
    from bf16 copies of the parameters, as on gloo."""
    # a world of its own: NCCL, one GPU per rank (the shared worlds are gloo)
    with fs.LocalWorld(NCCL_RANKS, backend="nccl") as world:
        grads = world.run(dist_cases.mixed_precision_grads, dist_cases.EVEN)[0]
    expected = dist_cases.emulated_mixed_precision_grads(dist_cases.EVEN, NCCL_RANKS)
    for name, value in expected.items():
        assert grads[name].dtype == torch.float32
        # CUDA's bf16 kernels round in another order than the CPU's emulation: a few bf16
        # ulps per element (2**-8 relative), so the whole tensor is compared by its norm
        error = (grads[name] - value).norm() / value.norm()
        assert error < 2e-2, f"{name}: relative error {error:.2e}"


# (pure TP at 8 would split 4 attention heads 8 ways: the model cannot)
WIDE = [(8, name, "EVEN") for name in ("zero3", "hsdp", "fsdp_tp", "hsdp_tp")]


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "strategy", "config"), WIDE, ids=[f"{n}-{s}-{c}" for n, s, c in WIDE])
def test_wide_worlds_train_as_one_process(worlds, world_size, strategy, config):
    """8 ranks on 2 cores: run before resolving (-m slow), not in the default suite."""
    test_training_matches_one_process(worlds, world_size, strategy, config)
    test_measured_memory_equals_the_cost_model(worlds, world_size, strategy, config)


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp_tp"])
def test_float16_overflow_on_one_rank_skips_the_step_on_every_rank(worlds, strategy):
    """An inf in one rank's own gradient shard: fs.grad_scaler skips the step everywhere and
    halves the scale everywhere (torch's GradScaler would step on the other ranks)."""
    results = worlds(4).run(dist_cases.train_float16, strategy, dist_cases.EVEN, 1)
    assert [r["moved"] for r in results] == [False] * 4
    assert [r["scale"] for r in results] == [2.0**15] * 4


@pytest.mark.parametrize("strategy", ["zero3", "fsdp_tp"])
def test_float16_with_loss_scaling_trains_as_one_process_in_float32(worlds, strategy):
    """float16 autocast on the CPU, no overflow: within float16's rounding (measured 2.6e-3
    at most on losses near 30) of one float32 process."""
    result = worlds(4).run(dist_cases.train_float16, strategy, dist_cases.EVEN)[0]
    data_parallel = 2 if strategy == "fsdp_tp" else 4
    assert result["moved"]
    assert result["scale"] == 2.0**16
    reference = dist_cases.reference(dist_cases.EVEN, data_parallel)[0]
    assert result["losses"] == pytest.approx(reference, abs=1e-2)
