"""fs.auto / fs.search_plans: the fastest plan that fits, found by an exhaustive search."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import re
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import functional_shard as fs
from functional_shard.core.quiet import captured
from functional_shard.costing.trace import activations
from functional_shard.costing.trace import counting as trace_counting
from functional_shard.planning.tp import rules
from functional_shard.search.candidates import FAMILIES, Space, _divisors, head_counts, points, repeated_block
from functional_shard.search.report import Candidate
from functional_shard.zoo import CONFIGS, MLP, Block, Llama, LlamaConfig, llama

_TRACES: dict = {}


def _trace_key(plan, batch, seq):
    """What an activation trace depends on: not the data-parallel family (checked below)."""
    config = plan.config
    return (
        config.tp_size(plan.mesh),
        config.tp is not None and config.tp.sequence_parallel,
        config.checkpointed,
        config.checkpoint_policy,
        config.param_dtype,
        batch,
        seq,
    )


@pytest.fixture(autouse=True)
def _tracer(monkeypatch):
    # the enumeration below estimates ~40 plans; reuse one trace per key, as auto does
    module = importlib.import_module("functional_shard.costing.estimate.estimate")
    trace = module._trace

    def remembered(model, plan, *, batch, seq, rank=None, inputs=None, **options):
        if model is not _MODEL or rank is not None or inputs is not None or options:
            return trace(model, plan, batch=batch, seq=seq, rank=rank, inputs=inputs, **options)
        key = _trace_key(plan, batch, seq)
        if key not in _TRACES:
            _TRACES[key] = trace(model, plan, batch=batch, seq=seq, rank=rank, inputs=inputs)
        return _TRACES[key]

    monkeypatch.setattr(module, "_trace", remembered)


_MODEL = llama("tiny")  # 4 query heads, 2 key/value heads: tp is 1 or 2


def _space(devices, batch):
    """The search space written out by hand, through the public API only."""
    how = ["none", "full"]
    if "policy" in inspect.signature(fs.checkpointing).parameters:
        how.append("selective")
    bf16 = fs.mixed_precision()
    for tp in (1, 2):
        dp = devices // tp
        if batch % dp:
            continue
        extra = {"tp": tp} if tp > 1 else {}
        families = [
            (fs.Mesh(dp=dp, **extra), fs.replicate("dp")),
            (fs.Mesh(dp=dp, **extra), fs.zero(1, "dp")),
            (fs.Mesh(dp=dp, **extra), fs.zero(2, "dp")),
            (fs.Mesh(dp=dp, **extra), fs.fsdp("dp")),
        ]
        families += [
            (fs.Mesh(replicate=dp // s, shard=s, **extra), fs.hsdp("replicate", "shard"))
            for s in range(2, dp)
            if dp % s == 0
        ]
        for mesh, data in families:
            for sp in (False, True) if tp > 1 else (False,):
                policy = data + bf16
                if tp > 1:
                    policy = data + fs.tp(rules.llama, "tp", sequence_parallel=sp) + bf16
                for h in how:
                    p = policy
                    if h == "full":
                        p = policy + fs.checkpointing(Block)
                    elif h == "selective":
                        p = policy + fs.checkpointing(Block, policy="selective")
                    yield mesh, p


@functools.cache
def _real_model():
    """_MODEL's twin on the CPU: fs.check_runnable refuses DDP on any meta-device model."""
    return llama("tiny", device="cpu")


@functools.cache
def _estimated_space(devices, batch, seq):
    """(reserved peak, step) of every plan in the space that plans and traces."""
    out = []
    for mesh, policy in _space(devices, batch):
        try:
            plan = fs.shard(_MODEL, mesh, policy)
            fs.check_runnable(plan, _real_model())  # what auto may return is what apply runs
        except fs.ShardingError:  # e.g. ZeRO-1 with tensor parallelism, DDP with bf16
            continue
        try:
            est = fs.estimate(_MODEL, plan, batch=batch // (devices // plan.mesh.shape.get("tp", 1)), seq=seq)
        except fs.ShardingError:  # the tracer cannot run this one; auto reports it as rejected
            continue
        out.append((est.reserved_peak_bytes, est.step_seconds))
    return tuple(out)


@functools.cache
def _searched(budget):
    """fs.search_plans of _MODEL on 4 devices, batch 8, seq 16: tests that read the same search
    share it (a search is seconds; test_search_is_deterministic holds a second one to the first)."""
    return fs.search_plans(_MODEL, devices=4, memory_budget=budget, batch=8, seq=16)


def _fastest_fitting(devices, batch, seq, budget):
    return min((step for peak, step in _estimated_space(devices, batch, seq) if peak <= budget), default=None)


def test_auto_is_optimal_in_its_space():
    report = _searched(10**9)
    expected = _fastest_fitting(4, 8, 16, 10**9)
    assert report.best_candidate.step_seconds == pytest.approx(expected, rel=1e-9)
    assert sum(c.step_seconds is not None for c in report.candidates) == len(_estimated_space(4, 8, 16))
    # every candidate, not just the best, is what fs.estimate says of the same plan
    searched = sorted((c.peak_bytes, c.step_seconds) for c in report.candidates if c.step_seconds is not None)
    enumerated = sorted(_estimated_space(4, 8, 16))
    assert [peak for peak, _ in searched] == [peak for peak, _ in enumerated]
    assert [step for _, step in searched] == pytest.approx([step for _, step in enumerated], rel=1e-9)
    est = fs.estimate(_MODEL, report.best, batch=8 // (4 // report.best.mesh.shape.get("tp", 1)), seq=16)
    assert est.step_seconds == pytest.approx(report.best_candidate.step_seconds, rel=1e-9)
    _assert_apply_runs_what_fits(report)


def _assert_apply_runs_what_fits(report):
    # before: ddp(dp) + bf16, zero(1, dp) + bf16 and ddp(dp) + sp(llama, tp) + bf16 fit and could be
    # chosen (with a 2 MiB budget, ddp + sp was), and fs.apply refused each
    for c in report.candidates:
        if c.fits:
            plan = fs.shard(_MODEL, c.mesh, fs.parse_policy(c.policy_text, _MODEL))
            fs.check_runnable(plan, _real_model())
    refused = {c.policy_text: c.rejected for c in report.candidates if c.family == "ddp"}
    assert refused == {
        "ddp(dp) + bf16": "apply() cannot run it: mixed precision with ddp: apply() casts through FSDP2; "
        "use fs.fsdp(...)",
        **{
            f"ddp(dp) + {tp}(llama, tp) + bf16": "apply() cannot run it: ddp with tensor parallel: torch's "
            "DDP does not run over DTensor shards; use fs.fsdp(...) (or fs.zero(2)) for the data-parallel "
            "axis; mixed precision with ddp: …"
            for tp in ("tp", "sp")
        },
    }


def test_tensor_parallel_over_every_device_is_fsdp2s_on_one_data_parallel_rank():
    # before: DDP's, which apply() runs neither beside tensor parallel nor in bf16
    space = Space(devices=2, batch=2, hardware=fs.hardware("h100"), heads=(4, 2))
    expected = {(1, family) for family in FAMILIES if family != "hsdp"} | {(2, "fsdp")}  # (dp 2: no hsdp)
    assert {(p.tp, p.family) for p in points(space)} == expected


def test_traces_do_not_depend_on_the_data_parallel_family():
    """What lets auto (and the enumeration above) trace once per key."""
    from functional_shard.costing.trace.activations import trace_activations

    tp = fs.tp(rules.llama, "tp", sequence_parallel=True) + fs.mixed_precision()
    plans = [
        fs.shard(_MODEL, fs.Mesh(dp=2, tp=2), fs.replicate("dp") + tp),
        fs.shard(_MODEL, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + tp),
        fs.shard(_MODEL, fs.Mesh(replicate=1, shard=2, tp=2), fs.hsdp("replicate", "shard") + tp),
    ]
    traces = {dataclasses.replace(trace_activations(_MODEL, plan, batch=2, seq=16), rank=0) for plan in plans}
    assert len(traces) == 1


def test_a_tight_budget_picks_a_smaller_plan():
    loose = _searched(10**9)
    peaks = sorted(c.peak_bytes for c in loose.candidates if c.peak_bytes is not None)
    budget = peaks[len(peaks) // 4]
    tight = fs.search_plans(_MODEL, devices=4, memory_budget=budget, batch=8, seq=16)
    assert tight.best_candidate.peak_bytes <= budget
    assert tight.best_candidate.step_seconds == pytest.approx(_fastest_fitting(4, 8, 16, budget), rel=1e-9)
    rejected = [c for c in tight.candidates if not c.fits and c.peak_bytes is not None]
    assert rejected
    assert all(re.fullmatch(r"needs .* more", c.rejected) for c in rejected)


def test_search_is_deterministic():
    a = _searched("1GiB")
    b = fs.search_plans(_MODEL, devices=4, memory_budget="1GiB", batch=8, seq=16)
    assert a.best == b.best
    assert [(c.mesh, c.policy_text, c.step_seconds) for c in a.candidates] == [
        (c.mesh, c.policy_text, c.step_seconds) for c in b.candidates
    ]


@pytest.mark.slow  # two searches an example; test_auto_is_optimal_in_its_space holds the search by default
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(200_000, 3_000_000), st.integers(0, 2_000_000))
def test_a_larger_budget_never_gives_a_slower_plan(budget, more):
    try:
        small = fs.search_plans(_MODEL, devices=4, memory_budget=budget, batch=8, seq=16)
    except fs.PlanError:
        return
    if small.best_candidate is None or small.best_candidate.offload:
        return  # the offload fallback is outside the property (docs/will-it-fit.md)
    large = fs.search_plans(_MODEL, devices=4, memory_budget=budget + more, batch=8, seq=16)
    if small.best_candidate.pipeline is not None and large.best_candidate.pipeline is None:
        # pipelines are searched only when no flat plan fits (docs/will-it-fit.md): the larger
        # budget's flat plan may be slower than the pipeline the smaller one forced, by design
        assert not any(c.fits for c in small.candidates if c.pipeline is None)
        return
    assert large.best_candidate.step_seconds <= small.best_candidate.step_seconds


def test_offload_only_when_nothing_else_fits():
    report = _searched("1GiB")
    assert not any(c.offload for c in report.candidates)
    squeezed = report
    # pipelines come before offload, and a pipeline checkpoints more only when it must:
    # squeeze below every candidate without offload until none is left
    for _ in range(4):
        smallest = min(
            c.peak_bytes for c in squeezed.candidates if c.peak_bytes is not None and not c.offload
        )
        squeezed = fs.search_plans(_MODEL, devices=4, memory_budget=smallest - 1, batch=8, seq=16)
        if any(c.offload for c in squeezed.candidates):
            break
    offloaded = [c for c in squeezed.candidates if c.offload]
    assert offloaded
    if squeezed.best_candidate is not None:
        assert squeezed.best_candidate.offload


def test_nothing_fits_names_the_closest_candidate():
    with pytest.raises(
        fs.PlanError, match=r"nothing fits 1\.00 KiB per device on 4 h100; the closest is Mesh\("
    ):
        fs.auto(_MODEL, devices=4, memory_budget=1024, batch=8, seq=16)


@pytest.mark.parametrize(
    ("devices", "batch", "message"),
    [
        (0, 8, "auto(devices=0): a positive int"),
        (-2, 8, "auto(devices=-2): a positive int"),
        # (4 devices and a batch of 3 run as pp=2 x tp=2; 5 devices have no such mesh)
        (5, 3, "auto(devices=5, batch=3): no data-parallel size divides the batch"),
        # a typo's count, whose meshes would take hours to lay out
        (10**20, 8, "auto(devices=100,000,000,000,000,000,000): at most 16,777,216 (2**24)"),
    ],
)
def test_devices_that_cannot_form_a_mesh(devices, batch, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.auto(_MODEL, devices=devices, memory_budget="80GiB", batch=batch, seq=16)


def test_auto_takes_search_plans_arguments_and_refuses_in_its_own_name():
    searched = inspect.signature(fs.search_plans)
    assert inspect.signature(fs.auto).parameters == searched.parameters
    assert inspect.signature(fs.auto).return_annotation == "Plan"
    with pytest.raises(TypeError, match=re.escape("auto() missing a required argument: 'seq'")):
        fs.auto(_MODEL, devices=4, memory_budget="80GiB", batch=8)
    with pytest.raises(TypeError, match=re.escape("auto() got an unexpected keyword argument 'hardwar'")):
        fs.auto(_MODEL, devices=4, memory_budget="80GiB", batch=8, seq=16, hardwar="h100")


def test_bad_budget_is_a_sharding_error():
    with pytest.raises(fs.ShardingError, match=re.escape("memory size '80 parsecs'")):
        fs.auto(_MODEL, devices=4, memory_budget="80 parsecs", batch=8, seq=16)


def test_report_lists_candidates_readably():
    report = _searched("1GiB")
    text = report.table(top=5)
    assert text.splitlines()[0].split()[:4] == ["mesh", "policy", "peak", "step"]
    assert "chosen" in text
    assert len(text.splitlines()) == 7
    assert "candidates on h100" in str(report)
    assert len(report.table(top=None).splitlines()) == len(report.candidates) + 2
    for top in (0, -1, 2.0):  # was: -1 silently dropped the last row, 0 listed none
        with pytest.raises(fs.ShardingError, match=re.escape(f"table(top)={top!r}: a positive int")):
            report.table(top=top)


def test_heads_and_blocks_are_read_from_the_model():
    assert head_counts(llama("llama-70b")) == (64, 8)
    assert repeated_block(_MODEL) is Block
    assert head_counts(MLP(CONFIGS["tiny"])) is None


def test_tp_stays_in_a_node_and_divides_the_heads():
    h100 = fs.hardware("h100")
    sizes = {p.tp for p in points(Space(devices=32, batch=32, hardware=h100, heads=(32, 32)))}
    assert sizes == {1, 2, 4, 8}  # 16 and 32 would leave a node of 8
    assert {p.tp for p in points(Space(devices=32, batch=32, hardware=h100, heads=(32, 2)))} == {1, 2}
    # dp = 4 divides the batch
    assert {p.tp for p in points(Space(devices=32, batch=4, hardware=h100, heads=(32, 32)))} == {8}


@pytest.mark.slow
def test_llama_70b_on_1024_devices_takes_seconds():
    # CPU seconds of this process: the wall clock on a shared machine measures the neighbours
    model = llama("llama-70b")
    start = time.process_time()
    report = fs.search_plans(model, devices=1024, memory_budget="80GiB", batch=1024, seq=8192)
    first = time.process_time() - start
    assert report.best.mesh.size == 1024
    assert all(c.rejected is None or not c.rejected.startswith("cannot trace") for c in report.candidates)
    # about 3.5 s (bench/auto_speed.py), up to 10 on the loaded 2-core machine
    assert first < 20, f"{first:.1f} s"
    start = time.process_time()  # another budget: traced again (a search's traces are its own)
    fs.search_plans(model, devices=1024, memory_budget="40GiB", batch=1024, seq=8192)
    assert time.process_time() - start < 20  # 7.6 s measured on the 2-core machine at 2837ca2 too


class Mismatch(nn.Module):
    """A forward that fails inside a fake kernel: torch logs the traceback before raising."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.mm(self.embed(ids).flatten(0, 1), self.proj.weight[:4])


def test_a_candidate_that_cannot_be_traced_prints_nothing_and_keeps_its_reason(capfd):
    torch_logger = logging.getLogger("torch")
    handlers, propagate = torch_logger.handlers[:], torch_logger.propagate
    model = Mismatch()
    report = fs.search_plans(model, devices=2, memory_budget="1GiB", batch=2, seq=4)
    assert report.best is None
    assert report.candidates
    for candidate in report.candidates:
        assert candidate.rejected.startswith(("cannot trace: ", "cannot plan: ", "apply() cannot run it: "))
    assert any("a and b must have same reduction dim" in c.rejected for c in report.candidates)
    with pytest.raises(fs.PlanError, match="no candidate could be planned"):
        fs.auto(model, devices=2, memory_budget="1GiB", batch=2, seq=4)
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp"))
    with pytest.raises(fs.ShardingError, match="Mismatch's forward failed"):
        fs.estimate(model, plan, batch=2, seq=4)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    # torch's logging is put back as it was
    assert torch_logger.handlers == handlers
    assert torch_logger.propagate == propagate
    with pytest.raises(RuntimeError), captured() as held, FakeTensorMode():
        torch.mm(torch.empty(8, 8), torch.empty(4, 8))
    assert any("failed while attempting to run meta for aten.mm" in line for line in held)


def test_a_search_traces_each_key_once_keeps_a_failure_as_its_error_and_owns_its_traces():
    from functional_shard.search.traces import TraceCache, TraceKey

    model = Mismatch()
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate("dp"))
    traces = TraceCache(model, seq=4)
    failed = traces.trace(plan, TraceKey(1, False, "none", 2))
    assert isinstance(failed, fs.ShardingError)
    assert traces.trace(plan, TraceKey(1, False, "none", 2)) is failed  # not traced again
    assert "a and b must have same reduction dim" in str(failed)
    # every search traces for itself: nothing is left behind for the next one
    calls = []
    module = importlib.import_module("functional_shard.costing.estimate.estimate")
    trace = module._trace

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return trace(*args, **kwargs)

    deep = Llama(LlamaConfig(num_layers=3)).to("meta")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "_trace", counted)
        fs.search_plans(deep, devices=2, memory_budget="1GiB", batch=2, seq=8)
        once = len(calls)
        fs.search_plans(deep, devices=2, memory_budget="2GiB", batch=2, seq=8)
    assert once > 0
    assert len(calls) == 2 * once


def _moe(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **common
        )
    else:
        config = transformers.Qwen3MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            **common,
        )
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_a_mixture_of_experts_model_gets_tp_inside_its_experts_and_ep_plans(kind):
    model = _moe(kind)
    assert rules.for_model(model).match("model.layers.0.mlp.experts.gate_up_proj").target == "packed_colwise"
    report = fs.search_plans(model, devices=4, memory_budget="1GiB", batch=4, seq=16)
    assert report.no_tensor_parallel is None
    assert {c.tensor_parallel for c in report.candidates} == {1, 2}  # tp(hf) splits inside the experts
    assert not any(c.sequence_parallel for c in report.candidates)  # which apply runs without sp
    # ep sizes dividing the 4 experts, borrowed from the 4 data-parallel ranks
    assert [c.expert_parallel for c in report.expert_parallel_candidates] == [2, 4]
    assert all(c.fits for c in report.expert_parallel_candidates)
    # (ZeRO-1 beside tp is refused by the planner for any model: its optimizer state is whole; DDP
    # beside tp or bf16, by apply)
    assert all(
        c.fits or c.rejected.startswith(("cannot plan", "apply() cannot run it")) for c in report.candidates
    )
    plan = fs.auto(model, devices=4, memory_budget="1GiB", batch=4, seq=16)
    assert plan == report.best


_DEEP = Llama(LlamaConfig(num_layers=4)).to("meta")  # 4 layers: traced as 2, extrapolated


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp=st.sampled_from([1, 2]),
    sp=st.booleans(),
    how=st.sampled_from(["none", "full", "selective", "torchtitan"]),
    micro=st.integers(1, 3),
    seq=st.sampled_from([8, 12, 16]),
    rank=st.integers(0, 1),
)
def test_the_shortcuts_of_a_search_trace_give_what_tracing_every_layer_gives(tp, sp, how, micro, seq, rank):
    """The fast path (2 layers run; the others share fake parameters and get no hooks; torch's
    device query answered at the top mode) against the slow one: every layer traced, each with
    its own parameters, every query handed down to the fake-tensor mode."""
    policy = fs.replicate("dp") + fs.mixed_precision()
    if tp > 1:
        policy = fs.replicate("dp") + fs.tp(rules.llama, "tp", sequence_parallel=sp) + fs.mixed_precision()
    if how != "none":
        policy = policy + fs.checkpointing(Block, policy=how)
    plan = fs.shard(_DEEP, fs.Mesh(dp=2, tp=tp) if tp > 1 else fs.Mesh(dp=2), policy)
    fast = activations.trace_activations(_DEEP, plan, batch=micro, seq=seq, rank=rank)
    with pytest.MonkeyPatch.context() as slow:
        slow.setattr(activations, "repeated_layers", lambda *args: [])
        slow.setattr(trace_counting, "_DEVICE", object())
        whole = activations.trace_activations(_DEEP, plan, batch=micro, seq=seq, rank=rank)
    assert fast == whole


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp=st.sampled_from([1, 2]),
    sp=st.booleans(),
    how=st.sampled_from(["full", "selective", "torchtitan"]),
    micro=st.integers(1, 3),
    seq=st.sampled_from([8, 12, 16]),
    dtype=st.sampled_from([None, "bfloat16"]),
)
def test_a_forward_only_trace_with_the_plain_backward_is_the_whole_trace(tp, sp, how, micro, seq, dtype):
    """The search traces a checkpointed candidate forward-only and takes the backward's flops
    from the same plan without checkpointing: equal to the checkpointed trace with its own
    backward. Full checkpointing re-runs each block up to the last op that saved a tensor
    (torch stops recomputing there), which the forward notes; selective re-runs no op with
    flops, and torchtitan's policy the matmuls it does not keep."""
    policy = fs.replicate("dp")
    if tp > 1:
        policy = policy + fs.tp(rules.llama, "tp", sequence_parallel=sp)
    if dtype:
        policy = policy + fs.mixed_precision(dtype)
    mesh = fs.Mesh(dp=2, tp=tp) if tp > 1 else fs.Mesh(dp=2)
    plain = fs.shard(_DEEP, mesh, policy)
    checkpointed = fs.shard(_DEEP, mesh, policy + fs.checkpointing(Block, policy=how))
    whole = activations.trace_activations(_DEEP, checkpointed, batch=micro, seq=seq)
    forward = activations.trace_activations(_DEEP, checkpointed, batch=micro, seq=seq, backward=False)
    without = activations.trace_activations(_DEEP, plain, batch=micro, seq=seq)
    assert forward.backward_flops == 0
    assert forward.forward_flops == without.forward_flops == whole.forward_flops
    assert whole.backward_flops == without.backward_flops
    assert forward.activation_bytes == whole.activation_bytes
    assert forward.recompute_flops == whole.recompute_flops
    assert (whole.recompute_flops > 0) == (how != "selective")
    backward = {
        "backward_flops": without.backward_flops,
        "backward_weight_flops": without.backward_weight_flops,
        "attention_backward_flops": without.attention_backward_flops,
        "attention_kernel_backward_flops": without.attention_kernel_backward_flops,
        "memory_bound_backward_bytes": without.memory_bound_backward_bytes,
    }
    assert dataclasses.replace(forward, **backward) == whole


class _TrailingConstant(nn.Module):
    """A block whose last matmul multiplies constants: it saves nothing for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("table", torch.ones(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.proj(x)) + (self.table @ self.table).sum()


class _Trailing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_TrailingConstant() for _ in range(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x


def test_full_recompute_stops_at_the_last_saved_tensor():
    # torch's checkpoint stops recomputing once every saved tensor is back (silu's input):
    # the constants' matmul after it is not re-run, and the forward-only trace knows it.
    # Per block: the projection, 2 x 8 tokens x 8 x 8, and the constants', 2 x 8 x 8 x 8
    model = _Trailing().to("meta")
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate("dp") + fs.checkpointing(_TrailingConstant))
    whole = activations.trace_activations(model, plan, batch=2, seq=4)
    forward = activations.trace_activations(model, plan, batch=2, seq=4, backward=False)
    assert forward.recompute_flops == whole.recompute_flops == 3 * 1024
    assert forward.forward_flops == whole.forward_flops == 3 * (1024 + 1024)


def test_the_search_traces_checkpointed_candidates_forward_only():
    # the backward is run only where it cannot be taken from the plan without checkpointing
    calls = []
    module = importlib.import_module("functional_shard.costing.estimate.estimate")
    trace = module._trace

    def recorded(model, plan, *, batch, seq, rank=None, inputs=None, **options):
        calls.append((plan.config.checkpoint_policy if plan.config.checkpointed else "none", options))
        return trace(model, plan, batch=batch, seq=seq, rank=rank, inputs=inputs, **options)

    model = Llama(LlamaConfig(num_layers=3)).to("meta")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "_trace", recorded)
        fs.search_plans(model, devices=2, memory_budget="1GiB", batch=2, seq=8)
    assert sorted({(how, tuple(options.items())) for how, options in calls}) == [
        ("full", (("cuda", True), ("backward", False))),  # h100: torch's CUDA kernels
        ("none", (("cuda", True),)),
        ("selective", (("cuda", True), ("backward", False))),
    ]


@given(st.integers(1, 5000))
def test_the_divisors_of_a_device_count_are_every_divisor_in_order(devices):
    assert _divisors(devices) == [d for d in range(1, devices + 1) if devices % d == 0]


def test_steps_a_rounding_error_apart_tie_and_the_smaller_peak_wins():
    # the estimate sums a step's parts in another order for each plan: two checkpointing
    # policies whose step is set by the same exposed communication (Mixtral-8x7B on 64 H100s,
    # ep 2: 8.993087945997056 s selective, ...058 full) differ in the last bits only
    step = 8.993087945997058
    shared = {
        "mesh": fs.Mesh(dp=32, ep=2),
        "family": "fsdp",
        "tensor_parallel": 1,
        "sequence_parallel": False,
    }
    full = Candidate(
        **shared, checkpointing="full", offload=False, policy_text="b", peak_bytes=136, step_seconds=step
    )
    selective = dataclasses.replace(
        full, checkpointing="selective", policy_text="a", peak_bytes=160, step_seconds=step - 2e-15
    )
    assert min([selective, full], key=Candidate.key) is full
    faster = dataclasses.replace(selective, step_seconds=step * (1 - 1e-9))
    assert min([faster, full], key=Candidate.key) is faster


class _Unnamed(nn.Module):
    """A residual stack whose parameter names no named rule set fits: tp by its structure's rules."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(2)
        )
        self.head = nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_candidates_over_rules_text_cannot_name_still_show_their_whole_policy():
    model = _Unnamed()
    assert rules.for_model(model).name == "structure"
    report = fs.search_plans(model, devices=2, memory_budget="1GiB", batch=2, seq=16)
    split = [c for c in report.candidates if c.tensor_parallel > 1]
    assert split
    # was "ddp('dp') + tp(structure, 'tp')" for each: bf16, sp and checkpointing left out
    assert all(
        c.policy_text.startswith(
            ("fsdp(dp) + tp(structure, tp) + bf16", "fsdp(dp) + sp(structure, tp) + bf16")
        )
        for c in split
    )
    shown = [(c.mesh, c.policy_text) for c in report.candidates]
    assert len(set(shown)) == len(shown)


@pytest.mark.parametrize("model", [torch.nn.Sequential(), torch.nn.ReLU()], ids=["empty", "no-parameters"])
def test_a_model_with_no_parameters_is_refused_by_name(model):
    # before: a plan (every candidate alike), where auto(None) was refused
    with pytest.raises(
        fs.ShardingError, match=re.escape(f"auto(model={type(model).__name__}): a model with")
    ):
        fs.auto(model, devices=4, memory_budget="1GiB", batch=2, seq=16)


def test_local_hardware_is_measured_on_as_many_processes_as_devices(local_measured_on):
    # before: on 4 processes, whatever devices was
    fs.auto(llama("tiny"), devices=2, memory_budget="1GiB", batch=2, seq=16, hardware="local")
    assert local_measured_on == [2]
