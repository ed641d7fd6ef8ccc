"""Llama-3-8B on 8 H100s from 8k to 256k tokens: peak memory and tokens/s per plan.

Every row is `fs.estimate` on the zoo's ``llama-3-8b`` (meta device, SDPA attention) with the
``"h100"`` profile (80 GB), bf16 mixed precision and AdamW: one sequence per data-parallel
rank (global batch = dp sequences; the ranks of a cp group share one). It prints the
markdown tables docs/will-it-fit.md and docs/long-context.md show: every plan at every
length, then the context-parallel rows beside torchtitan's published ones (Llama 3.1 8B on
8 H100s, FSDP + CP, full activation checkpointing, local batch 1, torch.compile and Float8
linears: ``fs.Kernels(compile=True, float8=True)``), with our figure over theirs. Those rows
are counted on `TORCHTITAN_H100`: the ``"h100"`` profile with attention at the rate of the
kernels their runs called (FlashAttention-2, not the cuDNN kernels the profile's rate is of).

Run: python bench/long_context.py
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import functional_shard as fs
from functional_shard.planning.tp import rules
from functional_shard.zoo import Block, llama

SEQS = (8192, 32768, 131072, 262144)
# torchtitan's published Llama 3.1 8B long-context rows (docs/long-context.md cites them):
# tokens -> (cp, tokens/s per GPU, peak GiB)
TORCHTITAN = {32768: (1, 3890, 83.9), 65536: (2, 2540, 84.2), 131072: (4, 1071, 84.0), 262144: (8, 548, 84.5)}
BUDGET = 80 * 10**9
KERNELS = fs.Kernels(compile=True, float8=True)  # torchtitan's runs: compiled, Float8 linears
# Their runs (benchmarks/llama3_h100_202412_torchtitan.md: torch 1963fc8, Dec 2024) called torch's
# flash kernels, FlashAttention-2: under cp torchtitan's train context allowed only the flash and
# memory-efficient backends ("TODO (xilunwu): support cuDNN backend", until torchtitan#1000, Mar
# 2025), and without cp SDPA picked flash on H100, cuDNN being last since pytorch#138522 (Oct 2024)
# until torch preferred it again on sm90 with a cuDNN newer than 9.15 (torch 2.11's).
# FlashAttention-2 on an H100 SXM5, forward + backward, causal, head dim 128, 16k tokens: 328 TFLOP/s
# (flash-attention's assets/flash2_h100_fwd_bwd_benchmark.png, panel d, July 2023), its flops counted
# as `KernelRates.attention` counts them (half the matrix, backward 2.5 forwards:
# benchmarks/benchmark_flash_attention.py). The profile's 437 is cuDNN 9.19's, measured on an H200.
FLASH_ATTENTION_2_H100 = 328e12
_H100 = fs.hardware("h100")
assert _H100.kernel_rates is not None
TORCHTITAN_H100 = _H100.replace(
    name="h100, FlashAttention-2",
    kernel_rates=dataclasses.replace(
        _H100.kernel_rates,
        attention=FLASH_ATTENTION_2_H100,
        source="h100's, attention at FlashAttention-2's published H100 SXM5 rate (causal, head dim 128)",
    ),
)
GIB = 2**30


def plans() -> list[tuple[str, fs.Mesh, fs.Policy]]:
    bf16 = fs.mixed_precision()
    return [
        ("fsdp", fs.Mesh(dp=8), fs.fsdp("dp") + bf16),
        (
            "fsdp + selective ckpt",
            fs.Mesh(dp=8),
            fs.fsdp("dp") + bf16 + fs.checkpointing(Block, policy="selective"),
        ),
        ("fsdp + full ckpt", fs.Mesh(dp=8), fs.fsdp("dp") + bf16 + fs.checkpointing(Block)),
        (
            "fsdp 4 + tp 2 + full ckpt",
            fs.Mesh(dp=4, tp=2),
            fs.fsdp("dp") + fs.tp(rules.llama, "tp") + bf16 + fs.checkpointing(Block),
        ),
        (
            "fsdp 2 + tp/sp 4 + full ckpt",
            fs.Mesh(dp=2, tp=4),
            fs.fsdp("dp") + fs.tp(rules.llama, "tp", sequence_parallel=True) + bf16 + fs.checkpointing(Block),
        ),
        (
            "tp/sp 8 + full ckpt",
            fs.Mesh(dp=1, tp=8),
            fs.fsdp("dp") + fs.tp(rules.llama, "tp", sequence_parallel=True) + bf16 + fs.checkpointing(Block),
        ),
        *(context(cp) for cp in (2, 4, 8)),
        (
            "fsdp 4 · cp 2 + tp/sp 2, loss parallel + full ckpt",
            fs.Mesh(dp=2, cp=2, tp=2),
            fs.fsdp(("dp", "cp"))
            + fs.cp("cp")
            + fs.tp(rules.llama, "tp", sequence_parallel=True, loss_parallel=True)
            + bf16
            + fs.checkpointing(Block),
        ),
    ]


def context(cp: int) -> tuple[str, fs.Mesh, fs.Policy]:
    """FSDP over dp and cp together, cp cutting each sequence, as torchtitan runs it."""
    policy = fs.fsdp(("dp", "cp")) + fs.cp("cp") + fs.mixed_precision() + fs.checkpointing(Block)
    return f"fsdp {8 // cp} · cp {cp} + full ckpt", fs.Mesh(dp=8 // cp, cp=cp), policy


def main() -> None:
    model = llama("llama-3-8b")
    start = time.perf_counter()
    print(
        "| tokens | plan | peak | activations | loss workspace | fits 80 GB | step | tokens/s per GPU | MFU |"
    )
    print("|---:|---|---:|---:|---:|:---:|---:|---:|---:|")
    for seq in SEQS:
        for name, mesh, policy in plans():
            plan = fs.shard(model, mesh, policy)
            est = fs.estimate(model, plan, batch=1, seq=seq, hardware="h100")
            print(
                f"| {seq // 1024}k | {name} | {est.peak_bytes / GIB:.1f} GiB "
                f"| {est.memory['activations'] / GIB:.1f} GiB | {est.memory['loss_workspace'] / GIB:.1f} GiB "
                f"| {'yes' if est.peak_bytes <= BUDGET else 'no'} | {est.step_seconds * 1e3:,.0f} ms "
                f"| {est.tokens_per_second:,.0f} | {est.mfu:.1%} |"
            )
    print()
    print(
        "| tokens | plan | our peak | torchtitan's | ratio | our tokens/s per GPU eager "
        "| with their kernels | torchtitan's | ratio |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for seq, (cp, published_tps, published_gib) in TORCHTITAN.items():
        name, mesh, policy = context(cp) if cp > 1 else plans()[2]
        plan = fs.shard(model, mesh, policy)
        est, fast = (
            fs.estimate(model, plan, batch=1, seq=seq, hardware=TORCHTITAN_H100, kernels=kernels)
            for kernels in (None, KERNELS)
        )
        peak, tps = est.peak_bytes / GIB, fast.tokens_per_second
        print(
            f"| {seq // 1024}k | {name} | {peak:.1f} GiB | {published_gib} GiB | {peak / published_gib:.2f} "
            f"| {est.tokens_per_second:,.0f} | {tps:,.0f} | {published_tps:,} | {tps / published_tps:.2f} |"
        )
    print(f"\n({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
