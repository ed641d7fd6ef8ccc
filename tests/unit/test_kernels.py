"""fs.Kernels: compile, Float8 linears and async TP in the estimate's step time.

Float8's saving is torchao's roofline per linear (three GEMMs in float8 instead of bf16,
less the casts); compile runs the work other than attention faster; async TP hides the
tensor-parallel collectives under that work. Each is checked against its own statement,
and the estimate against the parts it adds up.
"""

from __future__ import annotations

import functools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.costing.time.kernels import (
    Clock,
    _gemm_seconds,
    check_kernels,
    float8_gathered,
    float8_linears,
    float8_saved,
    float8_weights,
)
from functional_shard.planning.tp import rules
from functional_shard.zoo import Block, Llama, LlamaConfig

H100 = fs.hardware("h100")
ALL = fs.Kernels(compile=True, float8=True, async_tp=True)
ALL_FOUR = fs.Kernels(compile=True, float8=True, async_tp=True, float8_all_gather=True)


@functools.cache
def _model():
    # linears large enough for float8 to pay (vocab 1,024: the head is told apart by it)
    return Llama(LlamaConfig(1024, 2048, 8192, 4, 16, 4)).to("meta")


@functools.cache
def _plan(kind: str) -> fs.Plan:
    model = _model()
    bf16 = fs.mixed_precision()
    if kind == "fsdp":
        return fs.shard(model, fs.Mesh(dp=8), fs.fsdp("dp") + bf16 + fs.checkpointing(Block))
    if kind == "tp_sp":
        tp = fs.tp(rules.llama, "tp", sequence_parallel=True)
        return fs.shard(model, fs.Mesh(dp=2, tp=4), fs.fsdp("dp") + tp + bf16)
    assert kind == "pp"
    pipe = fs.pipeline("pp", microbatches=4)
    return fs.shard(model, fs.Mesh(pp=2, dp=2), pipe + fs.fsdp("dp") + bf16 + fs.checkpointing(Block))


@functools.cache
def _tp_only() -> fs.Plan:
    return fs.shard(_model(), fs.Mesh(tp=4), fs.tp(rules.llama, "tp") + fs.mixed_precision())


def _estimate(kind: str, kernels: fs.Kernels | None = None, hardware: fs.Hardware = H100) -> fs.Estimate:
    batch = 4 if kind == "pp" else 1
    return fs.estimate(_model(), _plan(kind), batch=batch, seq=4096, hardware=hardware, kernels=kernels)


def test_kernels_refuse_what_they_cannot_count():
    with pytest.raises(fs.ShardingError, match=r"float8=True.*without compile"):
        fs.Kernels(float8=True)
    with pytest.raises(fs.ShardingError, match=r"async_tp=True.*without compile"):
        fs.Kernels(async_tp=True)
    with pytest.raises(fs.ShardingError, match=r"float8_all_gather=True.*without float8"):
        fs.Kernels(compile=True, float8_all_gather=True)
    with pytest.raises(fs.ShardingError, match="True or False"):
        fs.Kernels(compile=1)  # type: ignore[arg-type]
    model = _model()
    with pytest.raises(fs.ShardingError, match=r"an fs.Kernels"):
        fs.estimate(model, _plan("fsdp"), batch=1, seq=128, kernels="compile")  # type: ignore[arg-type]
    a100 = fs.hardware("a100").replace(compile_speedup=1.2)
    with pytest.raises(fs.ShardingError, match=r"'a100' has no flops\['float8_e4m3fn'\], gemm_efficiency"):
        fs.estimate(model, _plan("fsdp"), batch=1, seq=128, hardware=a100, kernels=ALL)
    no_compile = H100.replace(compile_speedup=None)
    with pytest.raises(fs.ShardingError, match=r"no compile_speedup.*hw.replace"):
        fs.estimate(model, _plan("fsdp"), batch=1, seq=128, hardware=no_compile, kernels=ALL)
    fp32 = fs.shard(model, fs.Mesh(dp=8), fs.fsdp("dp"))
    with pytest.raises(fs.ShardingError, match=r"computes in float32.*mixed_precision"):
        fs.estimate(model, fp32, batch=1, seq=128, kernels=fs.Kernels(compile=True, float8=True))
    gathers = fs.Kernels(compile=True, float8=True, float8_all_gather=True)
    tp_only = fs.shard(model, fs.Mesh(tp=4), fs.tp(rules.llama, "tp") + fs.mixed_precision())
    with pytest.raises(fs.ShardingError, match=r"gathers no parameters.*fs.fsdp"):
        fs.estimate(model, tp_only, batch=1, seq=128, kernels=gathers)
    with pytest.raises(fs.ShardingError, match="sequence_parallel=True"):
        fs.estimate(model, _plan("fsdp"), batch=1, seq=128, kernels=ALL)


@given(
    m=st.integers(1, 1 << 16),
    k=st.integers(1, 1 << 15),
    n=st.integers(1, 1 << 15),
    recompute=st.floats(0.0, 1.0),
)
def test_float8_saving_is_torchaos_roofline_of_the_linear(m, k, n, recompute):
    # torchao's per-linear total: three GEMMs in bf16 against float8, and the tensorwise
    # casts of the input (6 bytes an element), the weight (8) and the output's gradient (6)
    saved = float8_saved([(0, k, n)], m, recompute, H100)[0]

    def gemms(float8: bool) -> float:
        return sum(_gemm_seconds(*shape, H100, float8=float8) for shape in ((m, k, n), (m, n, k), (k, m, n)))

    assert H100.memory_efficiency is not None
    casts = (6 * m * k + 8 * k * n + 6 * m * n) / (H100.memory_bandwidth * H100.memory_efficiency)
    once = saved["forward"] + saved["backward"] + saved["weight"]
    assert once == pytest.approx(gemms(False) - gemms(True) - casts, rel=1e-9, abs=1e-15)
    assert saved["recompute"] == pytest.approx(recompute * saved["forward"], rel=1e-9, abs=1e-15)
    assert saved["weight"] >= 0  # no cast before the weight's gradient: only the GEMM's gain


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 8192), st.integers(1, 8192)), max_size=6))
def test_float8_saving_adds_up_per_stage(linears):
    together = float8_saved(linears, 4096, 1.0, H100, stages=3)
    for stage in range(3):
        alone = [
            float8_saved([linear], 4096, 1.0, H100, stages=3)[stage]
            for linear in linears
            if linear[0] == stage
        ]
        for phase, seconds in together[stage].items():
            assert seconds == pytest.approx(sum(a[phase] for a in alone), rel=1e-9, abs=1e-15)


def test_float8_linears_leave_out_the_head_and_take_local_shapes():
    model = _model()
    found = float8_linears(model, _plan("tp_sp"))
    # 7 projections a block, the head (1,024 outputs, the vocabulary) left out
    assert len(found) == 7 * 4
    # column-wise q splits its outputs over tp=4, row-wise o its inputs
    assert found[0] == (0, 2048, 512)
    assert (0, 512, 2048) in found
    stages = {stage for stage, _, _ in float8_linears(model, _plan("pp"))}
    assert stages == {0, 1}


def test_float8_leaves_out_the_head_even_where_the_vocabulary_is_the_width():
    # a hidden width equal to the vocabulary: only the head is left out, by what it is
    model = Llama(LlamaConfig(1024, 1024, 4096, 2, 8, 4)).to("meta")
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp"))
    assert len(float8_weights(model, plan)) == 7 * 2
    assert "lm_head.weight" not in float8_weights(model, plan)


def test_compile_speeds_up_all_but_attention():
    eager = _estimate("fsdp")
    same = _estimate("fsdp", fs.Kernels(compile=True), H100.replace(compile_speedup=1.0))
    assert same.compute_seconds == pytest.approx(eager.compute_seconds)
    twice = _estimate("fsdp", fs.Kernels(compile=True), H100.replace(compile_speedup=2.0))
    # attention (a quarter of the work here, or so) is not sped up
    assert eager.compute_seconds / 2 < twice.compute_seconds < eager.compute_seconds


def test_float8_subtracts_its_saving_from_compiled_compute():
    compiled = _estimate("fsdp", fs.Kernels(compile=True))
    float8 = _estimate("fsdp", fs.Kernels(compile=True, float8=True))
    saving = compiled.compute_seconds - float8.compute_seconds
    linears = float8_linears(_model(), _plan("fsdp"))
    # full checkpointing re-runs every block's linears but its last (down) projection
    bounds = [sum(float8_saved(linears, 4096, share, H100)[0].values()) for share in (0.5, 1.0)]
    assert bounds[0] < saving <= bounds[1]
    # the parts by kind say so too, and still sum to the compute
    assert float8.compute_parts["float8"] == pytest.approx(-saving)
    assert sum(float8.compute_parts.values()) == pytest.approx(float8.compute_seconds)
    assert float8.explain().count("Float8 linears") == 1
    # a saving prints negative, and the line says which sign saves
    (line,) = [line for line in float8.explain().splitlines() if line.lstrip().startswith("float8 ")]
    assert line.split()[1].startswith("-")
    assert line.endswith("(float8 GEMMs and their casts less bf16 GEMMs: negative where they save)")
    assert float8.to_dict()["kernels"] == {
        "compile": True,
        "float8": True,
        "async_tp": False,
        "float8_all_gather": False,
        "compiled_loss": False,
    }


def test_float8_under_a_pipeline_saves_per_stage_as_its_linears_do():
    compiled = _estimate("pp", fs.Kernels(compile=True))
    float8 = _estimate("pp", fs.Kernels(compile=True, float8=True))
    assert compiled.pipeline is not None
    assert float8.pipeline is not None
    linears = float8_linears(_model(), _plan("pp"))
    # a micro-batch is one sequence: each stage's forward saves what its own linears save
    saved = float8_saved(linears, 4096, 1.0, H100, stages=2)
    for before, after, mine in zip(compiled.pipeline.stages, float8.pipeline.stages, saved, strict=True):
        assert before.forward_seconds - after.forward_seconds == pytest.approx(mine["forward"])
        assert after.backward_seconds < before.backward_seconds
    assert float8.step_seconds < compiled.step_seconds


def test_async_tp_hides_the_forwards_tensor_parallel_under_its_matmuls():
    compiled = _estimate("tp_sp", fs.Kernels(compile=True, float8=True))
    overlapped = _estimate("tp_sp", ALL)
    # the forward's half of the collectives hides; backward's and recompute's do not
    tp = compiled.exposed_seconds["tensor parallel"]
    assert overlapped.exposed_seconds["tensor parallel"] == pytest.approx(tp / 2)
    assert overlapped.step_seconds == pytest.approx(compiled.step_seconds - tp / 2)
    # with links far slower than the matmuls, only as much as the forward's work hides
    slow = H100.replace(intra_node_bandwidth=H100.intra_node_bandwidth / 1e4)
    slow_tp = _estimate("tp_sp", fs.Kernels(compile=True, float8=True), slow).exposed_seconds[
        "tensor parallel"
    ]
    hidden = slow_tp - _estimate("tp_sp", ALL, slow).exposed_seconds["tensor parallel"]
    assert 0 < hidden < slow_tp / 100


@pytest.mark.parametrize("kind", ["fsdp", "pp"])
def test_float8_all_gathers_halve_the_gathered_weights_of_the_linears(kind):
    float8 = fs.Kernels(compile=True, float8=True)
    gathers = fs.Kernels(compile=True, float8=True, float8_all_gather=True)
    before, after = (_estimate(kind, kernels) for kernels in (float8, gathers))
    saved = float8_gathered(_model(), _plan(kind), "bfloat16")
    # every block's unit saves alike: a byte of its linears' weights an element
    assert len(set(saved.values())) == 1
    assert "" not in saved  # the root holds the embedding and the head: not converted
    # flat FSDP holds two blocks at once (the running one and the prefetched one); under a
    # pipeline the rank's stage keeps its two blocks gathered across micro-batches
    assert before.memory["gathered"] - after.memory["gathered"] == 2 * next(iter(saved.values()))
    assert {k: v for k, v in before.memory.items() if k != "gathered"} == {
        k: v for k, v in after.memory.items() if k != "gathered"
    }
    # and they travel so: a byte an element of the rank's converted weights, per gather
    # (flat FSDP gathers each block twice a step, forward and backward; the pipeline's
    # kept units once), over the dp ranks' (n-1)/n; the gradients' scatters unchanged
    plan = _plan(kind)
    held = {w for w in float8_weights(_model(), plan) if plan.unit_of(w) in _units_held(after)}
    elements = sum(math.prod(plan.tensors[w].shape) for w in held)
    times = 2 if kind == "fsdp" else 1
    sent = before.cost.comm_bytes["all_gather"]["dp"] - after.cost.comm_bytes["all_gather"]["dp"]
    n = plan.mesh["dp"]
    assert sent == pytest.approx(elements * times * (n - 1) / n)
    assert before.cost.comm_bytes["reduce_scatter"] == after.cost.comm_bytes["reduce_scatter"]


def _units_held(estimate: fs.Estimate) -> set[str]:
    """The FSDP units of the estimate's rank: every block flat, its stage's under a pipeline."""
    if estimate.pipeline is None:
        return {f"layers.{i}" for i in range(4)}
    mine = [s for s in estimate.pipeline.stages if s.rank == 0]
    return {m for s in mine for m in s.modules}


def test_clock_counts_attention_at_the_rate_and_the_rest_faster():
    clock = Clock(rate=10.0, speedup=4.0)
    assert clock.seconds(50.0, attention=10.0) == pytest.approx(1.0 + 1.0)
    assert clock.seconds(50.0, attention=10.0, saved=0.5) == pytest.approx(1.5)


@given(
    kernels=st.sampled_from(
        [
            fs.Kernels(compile=True),
            fs.Kernels(compile=True, float8=True),
            fs.Kernels(compile=True, float8=True, async_tp=True),
            fs.Kernels(compile=True, float8=True, float8_all_gather=True),
            ALL_FOUR,
        ]
    ),
    kind=st.sampled_from(["fsdp", "tp_sp", "tp_only", "pp"]),
)
def test_for_plan_keeps_what_the_plan_has_and_estimate_takes_it(kernels, kind):
    plan = _plan(kind) if kind != "tp_only" else _tp_only()
    fitted = kernels.for_plan(plan)
    assert fitted.compile == kernels.compile
    assert fitted.float8 == kernels.float8
    sequence_parallel = plan.config.tp is not None and plan.config.tp.sequence_parallel
    assert fitted.async_tp == (kernels.async_tp and sequence_parallel)
    sharded = plan.config.fsdp is not None and bool(plan.config.fsdp.shard_axes)
    assert fitted.float8_all_gather == (kernels.float8_all_gather and sharded)
    check_kernels(fitted, plan, H100, "bfloat16")  # what the search counts, estimate accepts


def test_search_counts_the_kernels_as_estimate_does():
    model = _model()
    eager, fast = (
        fs.search_plans(model, devices=8, memory_budget="80GB", batch=8, seq=2048, kernels=k)
        for k in (None, ALL_FOUR)
    )
    assert eager.kernels is None
    assert fast.kernels == ALL_FOUR
    assert "with torch.compile, Float8 linears, async TP, Float8 all-gathers" in str(fast).splitlines()[0]
    before = {(c.mesh, c.policy_text): c for c in eager.candidates if c.estimate is not None}
    estimated = [c for c in fast.candidates if c.estimate is not None]
    assert any(c.sequence_parallel for c in estimated)
    assert any(not c.sequence_parallel for c in estimated)
    for c in estimated:
        assert c.estimate is not None
        assert c.estimate.kernels.async_tp == c.sequence_parallel, c.policy_text
        assert c.step_seconds is not None
        assert c.step_seconds < before[c.mesh, c.policy_text].step_seconds
    best = fast.best
    assert best is not None
    assert fast.best_candidate is not None
    local = 8 // best.data_parallel_rank(0)[1]
    again = fs.estimate(model, best, batch=local, seq=2048, kernels=ALL_FOUR.for_plan(best))
    assert again.step_seconds == pytest.approx(fast.best_candidate.step_seconds, rel=1e-9)
    assert again.reserved_peak_bytes == fast.best_candidate.peak_bytes  # what the search holds to the budget


def test_search_refuses_kernels_the_hardware_cannot_count():
    with pytest.raises(fs.ShardingError, match=r"auto\(kernels=...compile=True\): hardware 'a100'"):
        fs.auto(_model(), devices=8, memory_budget="80GB", batch=8, seq=128, hardware="a100", kernels=ALL)
    with pytest.raises(fs.ShardingError, match=r"auto\(kernels='compile'\): an fs.Kernels"):
        fs.search_plans(_model(), devices=8, memory_budget="80GB", batch=8, seq=128, kernels="compile")  # type: ignore[arg-type]


def test_a_compiled_loss_holds_the_logits_and_their_gradient_alone():
    """Inductor's cross-entropy keeps a float32 per row, not per logit, and reads the logits three
    times (tests/dist/test_loss_workspace.py measures what it holds)."""
    eager = _estimate("fsdp", fs.Kernels(compile=True))
    compiled = _estimate("fsdp", fs.Kernels(compile=True, compiled_loss=True))
    logits = 4096 * _model().config.vocab_size  # one sequence's, in bf16
    assert eager.memory["loss_workspace"] == 12 * logits
    assert compiled.memory["loss_workspace"] == 2 * 2 * logits
    assert compiled.peak_bytes <= eager.peak_bytes  # (here the optimizer step holds the peak)
    saved = (36 - 8) * logits / H100.kernel_rates.bandwidth / H100.compile_speedup
    assert eager.compute_parts["memory-bound"] - compiled.compute_parts["memory-bound"] == pytest.approx(
        saved
    )
    assert "compiled loss" in compiled.explain()


@pytest.mark.parametrize("kind", ["pp", "loss_parallel"])
def test_a_compiled_loss_is_refused_where_it_was_not_measured(kind):
    plan = (
        _plan("pp")
        if kind == "pp"
        else fs.shard(
            _model(), fs.Mesh(tp=4), fs.tp(rules.llama, "tp", loss_parallel=True) + fs.mixed_precision()
        )
    )
    with pytest.raises(fs.ShardingError, match=r"compiled_loss=True.*leave compiled_loss out"):
        fs.estimate(_model(), plan, batch=4, seq=64, kernels=fs.Kernels(compiled_loss=True))
    # the search's view of such a candidate counts the loss eager instead
    assert not fs.Kernels(compiled_loss=True).for_plan(plan).compiled_loss
