"""fs.estimate under a pipeline: per-stage memory by hand, the step from torch's lists, the search."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest

import functional_shard as fs
from functional_shard.costing.estimate.estimate import compare_schedules
from functional_shard.costing.estimate.pipeline_estimate import with_schedule
from functional_shard.costing.trace.activations import regroup, trace_activations
from functional_shard.planning.pipeline.schedules import simulate
from functional_shard.zoo import Llama, LlamaConfig, llama

from ..pipeline_cases import H100_ON_CPU

BATCH, SEQ, M = 8, 16, 4


@functools.cache
def _model():
    return llama("tiny")


@functools.cache
def _plan(schedule="1f1b", per_rank=1, pp=2):
    policy = fs.pipeline("pp", microbatches=M, schedule=schedule, stages_per_rank=per_rank)
    return fs.shard(_model(), fs.Mesh(pp=pp), policy)


@functools.cache
def _estimate(schedule="1f1b", per_rank=1, pp=2):
    return fs.estimate(_model(), _plan(schedule, per_rank, pp), batch=BATCH, seq=SEQ, hardware="h100")


def _param_bytes(modules):
    return sum(
        p.numel() * 4
        for name, p in _model().named_parameters()
        if any(name.startswith(f"{m}.") for m in modules)
    )


def _tensors(modules):
    return sum(1 for name, _ in _model().named_parameters() if any(name.startswith(f"{m}.") for m in modules))


def test_stage_memory_by_hand():
    est = _estimate()
    pipe = est.pipeline
    stage0, stage1 = pipe.stages
    assert stage0.modules == ("embed_tokens", "layers.0")
    assert stage1.modules == ("layers.1", "norm", "lm_head")
    # 1F1B on 2 ranks: stage 0 holds two micro-batches, stage 1 one
    assert (stage0.in_flight, stage1.in_flight) == (2, 1)
    micro = BATCH // M
    logits = micro * SEQ * 256
    by_rank = []
    for stage, flight in ((stage0, 2), (stage1, 1)):
        params = _param_bytes(stage.modules)
        adam = 2 * params + 4 * _tensors(stage.modules)
        # the last stage: one micro-batch's loss backward makes two fp32 gradients (more
        # than its forward's fp32 copy); the logits and the log-softmax it keeps for
        # backward are in its activations, per micro-batch
        loss = 2 * 4 * logits if stage.stage == 1 else 0
        # torch's receive buffers, one hidden state (fp32) per micro-batch: stage 0 for
        # its output's gradients, stage 1 for its inputs
        buffers = M * micro * SEQ * 64 * 4
        assert stage.buffer_bytes == buffers
        by_rank.append(3 * params + adam - params + stage.activation_bytes * flight + loss + buffers)
    assert pipe.rank_peak_bytes == tuple(by_rank)
    assert est.peak_bytes == max(by_rank)
    worst = by_rank.index(max(by_rank))
    assert est.memory["params"] == _param_bytes(pipe.stages[worst].modules)
    assert est.memory["activations"] == pipe.stages[worst].activation_bytes * pipe.stages[worst].in_flight


def test_stage_activations_add_up_to_the_whole_models():
    model, plan = _model(), _plan()
    micro = BATCH // M
    whole = trace_activations(model, plan, batch=micro, seq=SEQ)
    staged = trace_activations(model, plan, batch=micro, seq=SEQ, stages=plan.config.pipeline.stages)
    shared = staged.stage_shared_bytes
    assert sum(staged.stage_activation_bytes) - shared == whole.activation_bytes
    assert sum(staged.stage_forward_flops) - staged.stage_shared_flops == whole.forward_flops
    assert sum(staged.stage_backward_flops) == whole.backward_flops
    moved = sum(staged.stage_memory_bound_bytes) - staged.stage_shared_memory_bytes
    assert moved == whole.memory_bound_bytes > 0
    # the activation stage 0 sends: one micro-batch's hidden states
    assert staged.stage_output_bytes[0] == micro * SEQ * 64 * 4
    # per unit, regrouped into the plan's two stages: the same numbers
    units = trace_activations(
        model,
        plan,
        batch=micro,
        seq=SEQ,
        stages=(("embed_tokens",), ("layers.0",), ("layers.1",), ("norm", "lm_head")),
    )
    merged = regroup(units, [[0, 1], [2, 3]])
    assert merged.stage_activation_bytes == staged.stage_activation_bytes
    assert merged.stage_forward_flops == staged.stage_forward_flops
    assert merged.stage_memory_bound_bytes == staged.stage_memory_bound_bytes


def test_step_is_the_schedules_makespan():
    est = _estimate()
    pipe = est.pipeline
    rate = est.hardware.achievable_flops(est.dtype)
    stages = pipe.stages
    send = (
        stages[0].send_bytes / est.hardware.bandwidth(_plan().mesh, ("pp",)) + est.hardware.collective_latency
    )
    line = simulate(
        "1f1b",
        2,
        M,
        forward=[s.forward_seconds for s in stages],
        backward=[s.backward_seconds for s in stages],
        p2p=[send],
    )
    assert est.compute_seconds == pytest.approx(line.makespan)
    assert pipe.bubble == pytest.approx(line.bubble)
    assert est.flops * rate > 0
    for rank, stage in enumerate(stages):
        assert line.busy[rank] == pytest.approx(M * (stage.forward_seconds + stage.backward_seconds))
    # tokens per device: the pipeline's ranks share the batch
    assert est.tokens_per_second == pytest.approx(BATCH * SEQ / 2 / est.step_seconds)
    assert "pipeline 1f1b: 2 ranks, 2 stages, 4 micro-batches of 2" in est.explain()
    assert est.to_dict()["pipeline"]["stages"][0]["in_flight"] == 2


def test_schedules_compared():
    found = compare_schedules(_model(), _plan(), batch=BATCH, seq=SEQ, hardware="h100")
    assert sorted(found) == ["1f1b", "gpipe"]
    # GPipe keeps every micro-batch in flight; the same compute either way
    assert found["gpipe"].pipeline.stages[0].in_flight == M
    assert found["gpipe"].peak_bytes > found["1f1b"].peak_bytes
    assert found["gpipe"].pipeline.stage_activation_bytes == found["1f1b"].pipeline.stage_activation_bytes
    interleaved = compare_schedules(_model(), _plan("interleaved1f1b", 2), batch=BATCH, seq=SEQ)
    assert set(interleaved) == {"interleaved1f1b", "looped_bfs", "interleaved_zb"}
    v_shaped = compare_schedules(_model(), _plan("zbv", 2), batch=BATCH, seq=SEQ)
    assert set(v_shaped) == {"zbv", "dualpipev"}
    with pytest.raises(fs.ShardingError, match=r"places stages on other ranks"):
        compare_schedules(_model(), _plan("zbv", 2), batch=BATCH, seq=SEQ, schedules=["looped_bfs"])


def test_one_schedule_name_for_schedules_is_refused_not_read_letter_by_letter():
    # was: "schedule='1': one of 'gpipe', '1f1b', ..."
    with pytest.raises(
        fs.ShardingError, match=re.escape("schedules='1f1b': a list of schedule names (['1f1b'] for one)")
    ):
        compare_schedules(_model(), _plan(), batch=BATCH, seq=SEQ, schedules="1f1b")


def test_schedules_compared_with_kept_outputs_and_kernels_as_estimate_gives_them():
    model = Llama(LlamaConfig(1024, 1024, 4096, 4, 8, 4)).to("meta")
    policy = fs.pipeline("pp", microbatches=M, schedule="interleaved1f1b", stages_per_rank=2)
    plan = fs.shard(model, fs.Mesh(pp=2, dp=2), policy + fs.fsdp("dp") + fs.mixed_precision())
    kernels = fs.Kernels(compile=True, float8=True, float8_all_gather=True)
    options = dict(batch=BATCH, seq=1024, hardware="h100", keep_outputs=True, kernels=kernels)
    found = compare_schedules(model, plan, **options)
    for schedule, compared in found.items():
        alone = fs.estimate(model, with_schedule(plan, schedule), **options)
        assert (compared.peak_bytes, compared.step_seconds) == (alone.peak_bytes, alone.step_seconds)
        assert compared.kernels == kernels
        assert compared.pipeline.kept_output_bytes > 0


@pytest.mark.parametrize("microbatches", [4, 32])
def test_kept_outputs_by_hand(microbatches):
    """torch's default step keeps the last stage's logits to the end, then concatenates them."""
    policy = fs.pipeline("pp", microbatches=microbatches)
    plan = fs.shard(_model(), fs.Mesh(pp=2), policy)
    batch = 2 * microbatches

    def estimate(keep):
        return fs.estimate(_model(), plan, batch=batch, seq=SEQ, hardware="h100", rank=1, keep_outputs=keep)

    freed, kept = estimate(False), estimate(True)
    logits = 2 * SEQ * 256 * 4
    assert (freed.pipeline.kept_output_bytes, kept.pipeline.kept_output_bytes) == (0, logits)
    last = kept.pipeline.stages[-1]
    assert last.activation_bytes == freed.pipeline.stages[-1].activation_bytes - logits
    # 1F1B's last stage: its one micro-batch in flight, and every earlier one's logits
    during = dict(freed.memory) | {"activations": freed.memory["activations"] + (microbatches - 1) * logits}
    # at the end: the states, the receive buffers, the kept logits and their concatenation
    static = {
        part: freed.memory[part] for part in ("params", "grads", "optimizer", "buffers", "pipeline_buffers")
    }
    ending = sum(static.values()) + 2 * microbatches * logits
    assert kept.peak_bytes == max(sum(during.values()), ending)
    at_end = ending > sum(during.values())
    assert (microbatches, at_end) in ((4, False), (32, True))
    ending_label = "the step's end (its kept outputs concatenated)"
    assert kept.peak_at == (ending_label if at_end else "the start of backward")
    assert f"(at {kept.peak_at})" in kept.explain().splitlines()[1]
    assert "keeps each micro-batch's output" in kept.explain()


def test_kept_outputs_need_a_pipeline():
    plan = fs.shard(_model(), fs.Mesh(dp=2), fs.fsdp("dp"))
    message = "estimate(keep_outputs=True): only a pipeline's last stage keeps its outputs"
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.estimate(_model(), plan, batch=2, seq=SEQ, keep_outputs=True)


def test_the_worst_pp_rank_is_chosen_with_the_rings_workspace():
    """Under torch's ring each pp rank's peak has its attention backward's buffers, less the
    loss workspace they follow (the last stage's), before the worst rank is chosen."""
    policy = fs.pipeline("pp", microbatches=M) + fs.fsdp("cp") + fs.cp("cp", engine="ring")
    plan = fs.shard(_model(), fs.Mesh(pp=2, cp=2), policy)
    worst = fs.estimate(_model(), plan, batch=BATCH, seq=64, hardware="h100")
    ranks = [fs.estimate(_model(), plan, batch=BATCH, seq=64, hardware="h100", rank=r) for r in (0, 2)]
    assert worst.pipeline.rank_peak_bytes == tuple(each.peak_bytes for each in ranks)
    assert worst.peak_bytes == max(worst.pipeline.rank_peak_bytes)
    first, last = (each.memory for each in ranks)
    assert first["ring_workspace"] - last["ring_workspace"] == last["loss_workspace"] > 0


def test_batch_the_microbatches_do_not_divide():
    message = "estimate(batch=6): pipeline(microbatches=4) cuts each step's batch into 4 equal micro-batches"
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.estimate(_model(), _plan(), batch=6, seq=SEQ)


def test_each_parameter_counted_on_one_pp_rank():
    from functional_shard.costing.estimate.pipeline_estimate import stage_costs

    plan = _plan("interleaved1f1b", 2)
    costs = stage_costs(plan, "adamw", BATCH * SEQ)
    whole = sum(p.numel() * 4 for p in _model().parameters())
    assert sum(c.params_bytes for c in costs) == whole


@pytest.mark.slow
def test_405b_on_512_h100s_gets_fsdp_tp_pp():
    # Llama 3.1 405B's shape, 8M tokens a step (the Llama 3 paper's 405B batch after its
    # first stage): nothing fits 80 GB without pp; the search finds a pp x FSDP x TP plan
    import time

    model = llama("llama-3-405b")
    start = time.process_time()
    report = fs.search_plans(model, devices=512, memory_budget="80GB", batch=1024, seq=8192)
    took = time.process_time() - start
    best = report.best_candidate
    assert best is not None
    assert best.pipeline is not None
    assert best.mesh["pp"] > 1
    assert best.mesh["dp"] > 1
    assert best.tensor_parallel > 1
    assert not any(c.fits for c in report.candidates if c.pipeline is None)
    # torchtitan's FSDP 8 x TP 8 x PP 8 does not fit at this batch, for torch's receive
    # buffers alone: 128 sequences per data-parallel rank keep their boundary activations
    # (bf16, a tensor-parallel rank's sequence share) each way on every stage boundary
    titan = [c for c in report.candidates if repr(c.mesh) == "Mesh(pp=8, dp=8, tp=8)"]
    assert titan
    assert not any(c.fits for c in titan)
    closest = min(titan, key=lambda c: c.peak_bytes)
    boundary = 128 * 8192 * 16384 * 2 // 8
    buffers = closest.estimate.memory["pipeline_buffers"]
    assert buffers % boundary == 0
    assert buffers >= 2 * boundary
    assert closest.peak_bytes - buffers < fs.parse_bytes("80GB") < closest.peak_bytes
    assert took < 60


def test_stage_activations_against_a_real_forward():
    # each stage run for real, as torch's PipelineStage runs it: stage 0 from the tokens,
    # stage 1 from a received activation; kept bytes measured by fs.kept_activation_bytes.
    # A stage also holds its output for its backward (the pipeline keeps it until then).
    import torch
    from torch import nn

    model = llama("tiny", device="cpu")
    plan = _plan("1f1b", 1, 2)
    est = fs.estimate(_model(), plan, batch=BATCH, seq=SEQ, hardware=H100_ON_CPU)  # these runs' kernels
    micro = BATCH // M
    tokens = torch.zeros(micro, SEQ, dtype=torch.long)
    first = nn.Sequential(model.embed_tokens, model.layers[0])
    kept0, hidden = fs.kept_activation_bytes(first, tokens)
    last = nn.Sequential(model.layers[1], model.norm, model.lm_head)
    kept1, _ = fs.kept_activation_bytes(last, hidden.detach().requires_grad_())
    stage0, stage1 = est.pipeline.stages
    assert stage0.activation_bytes == kept0 + hidden.nbytes
    # the trace's stage 1 also counts the token ids every stage's forward is handed; and
    # what the loss keeps: the logits and their fp32 log-softmax. The activation it
    # received, which its first op saves, is one of torch's receive buffers (one per
    # micro-batch, as stage 0's buffers for the gradients it receives)
    logits = micro * SEQ * 256 * 4
    assert stage1.activation_bytes == kept1 - hidden.nbytes + tokens.nbytes + 2 * logits
    assert stage0.send_bytes == hidden.nbytes
    assert stage0.buffer_bytes == stage1.buffer_bytes == M * hidden.nbytes


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_weight_gradients_by_hand(dtype):
    # what zero-bubble schedules defer to W: each Linear's dW = dY^T X, 2 x tokens x its
    # weight's elements, under mixed precision too (the bf16 cast of a weight is a weight)
    import torch

    policy = fs.pipeline("pp", microbatches=M)
    if dtype:
        policy = policy + fs.mixed_precision(dtype)
    plan = fs.shard(_model(), fs.Mesh(pp=2), policy)
    trace = trace_activations(_model(), plan, batch=2, seq=SEQ, stages=plan.config.pipeline.stages)
    linear = sum(m.weight.numel() for m in _model().modules() if isinstance(m, torch.nn.Linear))
    assert trace.backward_weight_flops == 2 * 2 * SEQ * linear
    assert sum(trace.stage_backward_weight_flops) == trace.backward_weight_flops


def test_the_searchs_shortcuts_for_pipelines_change_no_estimate(monkeypatch):
    # the search traces each unit of work once per (tp, checkpointing, micro-batch), the
    # checkpointed ones forward-only with the backward of the plan without checkpointing:
    # every pipeline candidate is what the same search gives tracing each with its backward
    from functional_shard.costing.time.hardware import hardware
    from functional_shard.search import candidates
    from functional_shard.search.search import Search, SearchInputs
    from functional_shard.search.traces import TraceCache
    from functional_shard.zoo import Llama, LlamaConfig

    model = Llama(LlamaConfig(num_layers=4)).to("meta")
    facts = candidates.model_facts(model)
    hw = hardware("h100")
    space = candidates.Space.of(facts, devices=4, batch=8, hardware=hw)
    points = [
        point
        for point in candidates.pipeline_points(space, len(facts.units))
        if point.mesh["pp"] == 2 and (point.tp > 1) == (point.pipeline[0] == "1f1b")
    ]
    assert {(p.pipeline[0], p.tp) for p in points} == {("1f1b", 2), ("interleaved1f1b", 1)}
    inputs = SearchInputs(facts=facts, hardware=hw, optimizer="adamw", batch=8, seq=16, budget=0)

    def search() -> list:
        return Search(inputs).run(points)  # a new search: traces afresh

    fast = search()
    assert {c.checkpointing for c in fast} == {"none", "selective", "full"}  # nothing fits 0 bytes
    monkeypatch.setattr(
        TraceCache,
        "_checkpointed",
        lambda self, plan, key, plain, trace: trace(
            self.model, plan, batch=key.micro_batch, seq=self.seq, stages=self.units, cuda=self.cuda
        ),
    )
    slow = search()
    assert [(c.peak_bytes, c.step_seconds, c.estimate) for c in fast] == [
        (c.peak_bytes, c.step_seconds, c.estimate) for c in slow
    ]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_rank_peaks_in_the_optimizer_step_where_it_holds_more(optimizer):
    """Two tokens a micro-batch: each rank's states and foreach AdamW's step temporaries outweigh backward."""
    est = fs.estimate(_model(), _plan(), batch=M, seq=2, hardware="h100", optimizer=optimizer)
    for stage, rank_peak in zip(est.pipeline.stages, est.pipeline.rank_peak_bytes, strict=True):
        params = _param_bytes(stage.modules)
        state = 2 * params + 4 * _tensors(stage.modules) if optimizer == "adamw" else 0
        # parameters, gradients, the state, and half the state: `_foreach_sqrt` of every exp_avg_sq
        at_step = 2 * params + state + state // 2
        assert (rank_peak == at_step) == (optimizer == "adamw")
    assert ("optimizer_step" in est.memory) == (optimizer == "adamw")
    assert est.peak_at.startswith("the optimizer step") == (optimizer == "adamw")


def test_a_bf16_pipelines_stages_are_timed_by_kernel_kind_as_a_step_without_one():
    """Each rank's parts by kind, over the pp ranks, are the same model's step without a pipeline;
    with the schedule's wait they sum to the makespan (not flops at ``compute_efficiency``)."""
    from functional_shard.costing.time.kernel_time import IDLE_PART, KINDS

    bf16 = fs.mixed_precision()
    piped = fs.shard(_model(), fs.Mesh(pp=2), fs.pipeline("pp", microbatches=M) + bf16)
    flat = fs.shard(_model(), fs.Mesh(dp=1), fs.fsdp("dp") + bf16)
    whole = fs.estimate(_model(), flat, batch=BATCH, seq=SEQ, hardware="h100")
    ranks = [fs.estimate(_model(), piped, batch=BATCH, seq=SEQ, hardware="h100", rank=r) for r in (0, 1)]
    for est in ranks:
        assert set(est.compute_parts) == {*KINDS, IDLE_PART}
        assert sum(est.compute_parts.values()) == pytest.approx(est.compute_seconds)
        assert est.compute_parts[IDLE_PART] > 0  # 1F1B's bubble
    for kind in ("matmul", "attention"):
        together = sum(est.compute_parts[kind] for est in ranks)
        assert together == pytest.approx(whole.compute_parts[kind], rel=0.02)


def test_a_stage_of_an_embedding_alone_is_timed_by_the_bytes_it_moves():
    """A stage that runs no flops (``split=[["embed_tokens"], ...]``) still gathers its rows, scatters
    their gradients and, under FSDP, copies its unit: its rank's memory-bound work is not zero (nor
    moved to the other stages as a share of their flops), and its copies are not dropped."""
    split = [["embed_tokens"], ["layers.0", "layers.1", "norm", "lm_head"]]
    piped = fs.pipeline("pp", microbatches=M, split=split) + fs.mixed_precision()
    firsts = []
    for policy, mesh in ((piped, fs.Mesh(pp=2)), (piped + fs.fsdp("dp"), fs.Mesh(pp=2, dp=2))):
        plan = fs.shard(_model(), mesh, policy)
        first = fs.estimate(_model(), plan, batch=M, seq=SEQ, hardware="h100", rank=0)
        stage = first.pipeline.stages[0]
        assert stage.forward_seconds > 0
        assert stage.backward_seconds > 0
        assert first.compute_parts["matmul"] == 0 < first.compute_parts["memory-bound"]
        assert sum(first.compute_parts.values()) == pytest.approx(first.compute_seconds)
        firsts.append(first)
    plain, sharded = firsts
    assert sharded.compute_parts["memory-bound"] > plain.compute_parts["memory-bound"]  # FSDP's copies


def test_a_pipelines_sends_are_timed_by_its_schedule_alone():
    """The sends between stages are in the schedule's makespan: not exposed again beside it (without
    overlap), nor taken for FSDP's gathers (an exposed "first all-gather" of a plan with no FSDP)."""
    no_overlap = dataclasses.replace(fs.hardware("h100"), overlap_communication=False)
    for hardware in ("h100", no_overlap):
        est = fs.estimate(_model(), _plan(), batch=BATCH, seq=SEQ, hardware=hardware)
        assert any(name.startswith("send_recv over pp") for name in est.comm_seconds)
        assert set(est.exposed_seconds) == {"optimizer step"}
        assert est.step_seconds == pytest.approx(est.compute_seconds + est.exposed_seconds["optimizer step"])


def test_frozen_parameters_keep_no_whole_gradients_across_micro_batches():
    """A frozen parameter (LoRA's base weights) has no gradient for torch's stage to keep whole
    until the last micro-batch: each stage keeps its trained parameters' alone."""
    model = llama("tiny")
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith("layers."))
    plan = fs.shard(model, fs.Mesh(pp=2, dp=2), fs.pipeline("pp", microbatches=M) + fs.fsdp("dp"))
    est = fs.estimate(model, plan, batch=BATCH, seq=SEQ, hardware="h100")
    for stage in est.pipeline.stages:
        trained = [module for module in stage.modules if not module.startswith("layers.")]
        assert stage.whole_grad_bytes == _param_bytes(trained) > 0
