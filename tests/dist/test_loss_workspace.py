"""The estimate's loss workspace against what a real step's cross-entropy holds, measured.

A bf16 model trains a step through `fs.forward_backward` under a live-storage meter
(`loss_memory_cases.LiveStorages`) that labels the loss's own tensors: the logits, what
the loss makes in its forward, and what its backward makes until the logits' gradient
exists. Their peak is the backward's (the saved fp32 log-softmax and two fp32 gradients,
the logits freed), which ``Estimate.memory["loss_workspace"]`` must equal. Tolerance: the
loss also makes a few index and mask tensors per token (targets' masks, ``arange`` under
loss parallel) and scalars, at most ``TOKEN_BYTES`` per token and ``SCALAR_BYTES`` in all,
against 12 or 16 bytes per logit (3,072 or 4,096 per token for the tiny model's 256 words).

Under a pipeline the last stage's loss is measured the same way, with torch's schedule
on gloo ranks: the logits and log-softmax of each micro-batch in flight (which the
estimate counts with the stage's activations) plus the workspace.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import functional_shard as fs
from functional_shard.costing.estimate.loss_memory import loss_workspace, pipeline_loss_workspace
from functional_shard.planning.pipeline.schedules import in_flight
from functional_shard.zoo import llama

from .. import loss_memory_cases as lm
from .. import pipeline_cases as pc

TOKEN_BYTES = 64
SCALAR_BYTES = 512
BATCH, SEQ = 2, 64


def _step(policy: fs.Policy, tracker: Any = None) -> tuple[fs.Estimate, lm.LiveStorages, int]:
    """Estimate, then train one step of the tiny model in bf16 under ``policy`` on a mesh of one,
    metered (and under torch's ``MemTracker`` ``tracker`` when given); the logits' elements."""
    torch.manual_seed(0)
    model = llama("tiny", device="cpu").to(torch.bfloat16)
    axis = "tp" if policy.tensor_parallel else "dp"
    plan = fs.shard(model, fs.Mesh(**{axis: 1}), policy)
    estimate = fs.estimate(model, plan, batch=BATCH, seq=SEQ)
    fs.apply(plan, model)
    meter = lm.LiveStorages()
    step = fs.forward_backward(plan, model, lm.metered(meter))
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    for parameter in model.parameters():
        meter.note(parameter, "model")
    meter.note(inputs, "data")
    meter.note(targets, "data")
    if tracker is not None:
        tracker.track_external(model, inputs, targets)
    with tracker if tracker is not None else contextlib.nullcontext(), meter:
        step(inputs, targets)
    return estimate, meter, BATCH * SEQ * model.config.vocab_size


def test_the_meter_sees_frees_and_views():
    meter = lm.LiveStorages()
    with meter:
        kept = torch.ones(1000)
        view = torch.ones(500)[:10]  # a view keeps its whole storage
        gone = torch.ones(250)
        assert meter.total == 4 * (1000 + 500 + 250)
        del gone
        assert meter.total == 4 * (1000 + 500)
        twice = kept.view(10, 100)  # no new storage
    assert meter.total == 4 * (1000 + 500)
    assert meter.total_peak == 4 * 1750
    del kept
    assert meter.total == 4 * 1500  # the view still holds it
    del twice
    assert meter.total == 4 * 500
    del view
    assert meter.total == 0


def test_the_meter_agrees_with_torchs_memory_tracker(one_rank):
    # the whole step, parameters, gradients, activations and loss: to the byte
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    _, meter, _ = _step(fs.replicate(), tracker)
    assert meter.total_peak == tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize(
    ("policy", "per_logit"),
    [(fs.replicate(), 12), (fs.tp(fs.rules.llama, "tp", loss_parallel=True), 16)],
    ids=["plain", "loss_parallel"],
)
def test_the_loss_holds_what_the_estimate_says(one_rank, policy, per_logit):
    # bf16 logits: the forward holds 2 + 4 + 4 (+ 4 under loss parallel) bytes per logit,
    # the backward 12 (16): the backward's peak is the workspace (the old formula's 10 was
    # the forward's)
    estimate, meter, logits = _step(policy)
    measured = meter.peak["loss"]
    assert estimate.memory["loss_workspace"] == per_logit * logits
    assert 0 <= measured - estimate.memory["loss_workspace"] <= TOKEN_BYTES * BATCH * SEQ + SCALAR_BYTES


PIPELINES = [
    (pc.case({"pp": 2, "dp": 2}, "1f1b", data="fsdp"), False),
    (pc.case({"pp": 2, "tp": 2}, "1f1b", tp=True), True),
    pytest.param(pc.case({"pp": 2, "dp": 2}, "gpipe", data="fsdp"), False, marks=pytest.mark.slow),
    pytest.param(pc.case({"pp": 2, "tp": 2}, "gpipe", tp=True), True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    ("spec", "loss_parallel"),
    PIPELINES,
    ids=["1f1b-fsdp", "1f1b-loss_parallel", "gpipe-fsdp", "gpipe-loss_parallel"],
)
def test_pipeline_last_stage_loss_holds_what_the_estimate_says(world4, spec, loss_parallel):
    # pp=2: the last stage holds, per micro-batch in flight (1F1B: one, GPipe: all four),
    # its bf16 logits and fp32 log-softmax (the stage's activations) and, in one
    # micro-batch's backward, two fp32 gradients (the workspace; torch's loss_parallel():
    # three fp32 tensors); the old workspace (the forward's fp32 copy) was half or a third
    flight = in_flight(spec["schedule"], 2, spec["microbatches"])[-1]
    for result in world4.run(lm.last_stage_loss_peak, spec, loss_parallel):
        if result["pp_rank"] == 0:
            assert result["measured"] == result["loss_workspace"] == 0
            continue
        numel = result["numel"]
        expected = pipeline_loss_workspace(numel, loss_parallel)
        assert result["loss_workspace"] == expected == (12 if loss_parallel else 8) * numel
        kept = flight * (2 + 4) * numel
        extra = result["measured"] - (kept + expected)
        assert 0 <= extra <= TOKEN_BYTES * result["tokens"] * flight + SCALAR_BYTES


def test_workspace_is_the_larger_of_forward_and_backward():
    for numel in (1, 1000):
        for itemsize in (2, 4):
            assert loss_workspace(itemsize * numel, numel, False) == 12 * numel
            assert loss_workspace(itemsize * numel, numel, True) == 16 * numel
        # fp64 logits: the forward's (8 + 4 + 4) is the larger
        assert loss_workspace(8 * numel, numel, False) == 16 * numel


_COMPILED_LOSS = """
import os, resource, sys, torch, torch.nn.functional as F
torch.set_num_threads(1)
rows, vocab = int(sys.argv[1]), int(sys.argv[2])
loss = torch.compile(lambda x, y: F.cross_entropy(x.float(), y))
targets = torch.randint(0, vocab, (rows,))
logits = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
loss(logits, targets).backward()  # compiled at this shape
logits.grad = None
resident = int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
loss(logits, targets).backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - resident)
"""


@pytest.mark.slow
def test_a_compiled_loss_holds_its_gradient_beside_the_logits():
    """Measured in a fresh process: the high-water mark of its resident memory beyond what it held
    before a compiled cross-entropy's forward and backward (Inductor writes the gradient, in the
    logits' dtype, and a float32 or two per row). fs.Kernels(compiled_loss=True) counts that."""
    import subprocess
    import sys

    rows, vocab = 4096, 32000  # 262 MB of bf16 logits: far above the allocator's and the page size's noise
    run = subprocess.run(
        [sys.executable, "-c", _COMPILED_LOSS, str(rows), str(vocab)],
        capture_output=True,
        text=True,
        check=True,
    )
    beyond = int(run.stdout.split()[-1])
    logits = 2 * rows * vocab
    assert beyond == pytest.approx(
        loss_workspace(logits, rows * vocab, False, compiled=True) - logits, rel=0.05
    )
