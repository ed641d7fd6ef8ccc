"""The estimate against published H100, H200 and A100 rows, at their settings (slow).

bench/published_kernels.py, bench/published_pipelines.py and bench/long_context.py print these
tables; here they are held to the issue's bar: tokens/s within 20% of the published figures
counted with the kernels the runs used (`fs.Kernels`), and memory within 20% counted eager with
the outputs kept. Megatron-Bridge's DGX-H100 runs (8B FSDP, 70B and 405B pipelines, 8 to 1,024
GPUs) hold, and so do torchtitan's FSDP2 rows on 64 A100s (1.08-1.15): a multi-GPU step runs at
the kernel rates measured on one GPU. torchtitan's December 2024 H100 rows do not: ours are
1.6-2.1 times theirs, the 8B FSDP rows at 8k and the long-context ones (counted with torch's
ring's causal pairs and the FlashAttention-2 kernels their runs called,
bench/long_context.py's TORCHTITAN_H100) and the 405B pipelines alike, since each stage is timed
by kernel kind as a step without a pipeline is. docs/long-context.md, "Against published runs",
says what is known of why and what measurement would settle it. Left out, and said so in
docs/pipelines.md: the 405B memory with their Float8 all-gathers counted (0.76-0.90 of the
reserved peaks they publish).
"""

from __future__ import annotations

import pathlib
import sys

import pytest

import functional_shard as fs
from functional_shard.zoo import llama

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))

import long_context
import published_kernels
import published_pipelines

GIB = 2**30
pytestmark = pytest.mark.slow


def _within(ours: float, published: float) -> bool:
    return 0.8 <= ours / published <= 1.2


def _405b_rows():
    model = llama("llama-3-405b")
    rows = [
        (fs.Mesh(pp=8, dp=8, tp=8), published_pipelines.policy(schedule, per_rank), 32, 8192, tps, gib)
        for schedule, (per_rank, tps, gib) in published_pipelines.TABLE5.items()
    ] + [
        (
            fs.Mesh(pp=8, dp=8 // cp, cp=cp, tp=8),
            published_pipelines.policy("1f1b", 1, cp=cp),
            8,
            seq,
            tps,
            gib,
        )
        for seq, (cp, tps, gib) in published_pipelines.TABLE6.items()
    ]
    for mesh, policy, batch, seq, tps, gib in rows:
        plan = fs.shard(model, mesh, policy)
        yield model, plan, batch, seq, tps, gib, f"{mesh}, {seq} tokens"


def test_405b_pipeline_rows_memory_is_within_20_percent():
    for model, plan, batch, seq, _, gib, where in _405b_rows():
        eager = fs.estimate(model, plan, batch=batch, seq=seq, hardware="h100", keep_outputs=True)
        assert _within(eager.peak_bytes / GIB, gib), (where, eager.peak_bytes / GIB)


# issue #41 point 4, open: with each stage timed by kernel kind, as a step without a pipeline is, ours
# are 1.72-2.07 times theirs, as torchtitan's 8B rows on the same parts are; Megatron-Bridge's pipelines
# on DGX-H100s hold (test_megatron_h100_rows_are_within_20_percent); docs/pipelines.md says more
@pytest.mark.xfail(
    strict=True,
    reason="torchtitan's Dec 2024 H100 runs (500 W parts) take 1.6-2.1x the step by kernel kind, 8B and 405B",
)
def test_405b_pipeline_rows_are_within_20_percent_with_their_kernels():
    kernels = published_pipelines.KERNELS
    for model, plan, batch, seq, tps, _, where in _405b_rows():
        fast = fs.estimate(
            model, plan, batch=batch, seq=seq, hardware="h100", keep_outputs=True, kernels=kernels
        )
        assert _within(fast.tokens_per_second, tps), (where, fast.tokens_per_second)


def test_megatron_h100_rows_are_within_20_percent():
    """Megatron-Bridge's DGX-H100 runs (NeMo 25.11, 700 W parts, FP8): 8B FSDP on 8 GPUs, 70B TP 4 x PP 8
    on 64 and 405B TP 8 x PP 8 x CP 2 on 1,024, each counted with the recipe's settings: 1.02, 1.07, 0.86.
    The kernel rates are the H200's, measured; nothing here was fitted to these rows. Transformer
    Engine's fusions count as compile's speedup (docs/will-it-fit.md, "Kernels": 0.84, 0.87, 0.73 without)."""
    for row in published_kernels.megatron_rows():
        ours = published_kernels.tokens_per_second(row, published_kernels.estimate(row))
        assert row.tokens_per_second is not None
        assert _within(ours, row.tokens_per_second), (row.source, ours)


# issue #41 point 4, open: ours are 1.30-1.75 times theirs, as at 8k tokens (docs/long-context.md,
# "Against published runs"); strict, so the run that makes these rows hold says so
@pytest.mark.xfail(
    strict=True,
    reason="the 8B's multi-GPU FSDP steps run 1.6-1.8x the one-GPU kernels' sum, on 700 W H200s too",
)
def test_8b_long_context_rows_are_within_20_percent_with_their_kernels():
    model = llama("llama-3-8b")
    for seq, (cp, tps, gib) in long_context.TORCHTITAN.items():
        name, mesh, policy = long_context.context(cp) if cp > 1 else long_context.plans()[2]
        plan = fs.shard(model, mesh, policy)
        est = fs.estimate(
            model, plan, batch=1, seq=seq, hardware=long_context.TORCHTITAN_H100, kernels=long_context.KERNELS
        )
        where = f"{name}, {seq} tokens: {est.peak_bytes / GIB:.1f} GiB, {est.tokens_per_second:.0f} tokens/s"
        assert _within(est.peak_bytes / GIB, gib), where
        assert _within(est.tokens_per_second, tps), where


def test_published_memory_is_within_20_percent_and_the_8b_rows_within_10():
    """torchtitan's 8B and 70B rows (H100) and Trainy's 8B rows (H200): the reserved peak against the
    published ``max_reserved``, each counted with the run's checkpointing policy and kernels."""
    for row in published_kernels.rows():
        if row.gib is None:
            continue
        ratio = published_kernels.estimate(row).reserved_peak_bytes / GIB / row.gib
        assert abs(ratio - 1) <= (0.10 if "8B" in row.source else 0.20), (
            row.source,
            row.kernels_label,
            ratio,
        )


def test_torchtitan_a100_rows_are_within_20_percent_and_ordered_as_measured():
    """torchtitan's April 2024 FSDP2 runs on 64 A100s (8B to 70B, each checkpointing it ran): tokens/s
    within 20% (ours 1.08-1.15 of theirs), and where two runs of one model differ by more than 10%,
    ours order them the same way. The A100's rates are the H200's fractions of peak, not these rows'."""
    rows = published_kernels.a100_rows()
    ours = []
    for row in rows:
        ours.append(published_kernels.estimate(row).tokens_per_second)
        assert row.tokens_per_second is not None
        assert _within(ours[-1], row.tokens_per_second), (row.source, row.kernels_label, ours[-1])
    for a, mine in zip(rows, ours, strict=True):
        for b, other in zip(rows, ours, strict=True):
            if a.source == b.source and a.tokens_per_second > 1.1 * b.tokens_per_second:  # type: ignore[operator]
                assert mine > other, (a.source, a.kernels_label, b.kernels_label)


def test_the_bench_counts_tokens_per_gpu_as_the_estimate_does_and_accumulation_steps_the_optimizer_once():
    """A tensor-parallel group shares its tokens (the 70B row once read 10x its published figure)."""
    model = llama("tiny")
    plan = fs.shard(model, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"))
    row = published_kernels.Row("r", "k", None, (model, plan), 2, 64, None)
    est = fs.estimate(model, plan, batch=2, seq=64, hardware="h100")
    assert published_kernels.tokens_per_second(row, est) == pytest.approx(est.tokens_per_second)
    optimizer = est.exposed_seconds["optimizer step"]
    assert optimizer > 0
    twice = published_kernels.tokens_per_second(row._replace(micro_batches=2), est)
    assert twice == pytest.approx(2 * 2 * 64 / 2 / (2 * est.step_seconds - optimizer))
