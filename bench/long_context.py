"""Llama-3-8B on 8 H100s at 8k, 32k and 128k tokens: peak memory and tokens/s per plan.

Every row is `fs.estimate` on the zoo's ``llama-3-8b`` (meta device, SDPA attention) with the
``"h100"`` profile (80 GB), bf16 mixed precision and AdamW: one sequence per data-parallel
rank (global batch = dp sequences). It prints the markdown table docs/will-it-fit.md shows.

Run: python bench/long_context.py
"""

from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import functional_shard as fs
from functional_shard.planning import rules
from functional_shard.zoo import Block, llama

SEQS = (8192, 32768, 131072)
BUDGET = 80 * 10**9
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
    ]


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
    print(f"\n({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
