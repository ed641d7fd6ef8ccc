"""`fs.Kernels` beside the public runs that measured compile, Float8 and async TP on H100s.

Each row is `fs.estimate` with the run's own settings, eager and with the kernels the run
used, printed beside the published tokens/s per GPU, with our figure over theirs and our
speedup beside theirs:

* torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (Dec 2024), Table 1: Llama 3.1
  8B, FSDP on 8 GPUs, local batch 2 x 8,192 tokens, selective checkpointing: eager 5,762,
  compiled 6,667, compiled + Float8 8,532. (Its eager and compiled rows are where
  ``compile_speedup`` comes from: that row checks the arithmetic, not the model; the Float8
  row is a check.)
* torchao ``docs/source/workflows/training.md``, "e2e training benchmarks", NVIDIA H100:
  Llama 3 8B, FSDP on 8 GPUs, batch 1 x 8,192, per-op selective checkpointing, compiled:
  bf16 6,150, tensorwise Float8 with Float8 all-gathers 7,689.5 (1.25x).
* torchtitan Table 4: Llama 3.1 70B, FSDP 32 x TP 8 on 256 GPUs, local batch 16 x 8,192,
  full checkpointing, compiled + Float8: 829, and with async TP 876.

Run: python bench/published_kernels.py
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import functional_shard as fs
from functional_shard.planning.tp import rules
from functional_shard.zoo import Block, llama

COMPILE = fs.Kernels(compile=True)
FLOAT8 = fs.Kernels(compile=True, float8=True)
FLOAT8_GATHERS = fs.Kernels(compile=True, float8=True, float8_all_gather=True)
ASYNC_TP = fs.Kernels(compile=True, float8=True, async_tp=True)


def rows() -> list[tuple[str, str, object, object, int, int, float | None]]:
    """(source, kernels label, model, plan, batch, seq, published tokens/s) per row."""
    m8, m70 = llama("llama-3-8b"), llama("llama-70b")
    bf16 = fs.mixed_precision()
    fsdp8 = fs.shard(m8, fs.Mesh(dp=8), fs.fsdp("dp") + bf16 + fs.checkpointing(Block, policy="selective"))
    tp = fs.tp(rules.llama, "tp", sequence_parallel=True, loss_parallel=True)
    two_d = fs.shard(m70, fs.Mesh(dp=32, tp=8), fs.fsdp("dp") + tp + bf16 + fs.checkpointing(Block))
    return [
        ("torchtitan T1 8B", "eager", None, (m8, fsdp8), 2, 8192, 5762),
        ("torchtitan T1 8B", "compile", COMPILE, (m8, fsdp8), 2, 8192, 6667),
        ("torchtitan T1 8B", "compile + Float8", FLOAT8, (m8, fsdp8), 2, 8192, 8532),
        ("torchao README 8B", "compile", COMPILE, (m8, fsdp8), 1, 8192, 6150),
        ("torchao README 8B", "+ Float8, Float8 all-gathers", FLOAT8_GATHERS, (m8, fsdp8), 1, 8192, 7689.5),
        ("torchtitan T4 70B", "eager", None, (m70, two_d), 16, 8192, None),
        ("torchtitan T4 70B", "compile + Float8", FLOAT8, (m70, two_d), 16, 8192, 829),
        ("torchtitan T4 70B", "+ async TP", ASYNC_TP, (m70, two_d), 16, 8192, 876),
    ]


def main() -> None:
    print("| run | kernels | our tokens/s per GPU | published | ratio | our speedup | published |")
    print("|---|---|---:|---:|---:|---:|---:|")
    previous: dict[str, tuple[float, float | None]] = {}
    for source, label, kernels, (model, plan), batch, seq, published in rows():
        est = fs.estimate(model, plan, batch=batch, seq=seq, hardware="h100", kernels=kernels)
        ours = est.tokens_per_second
        ratio = f"{ours / published:.3f}" if published else "-"
        speedup = theirs = "-"
        if source in previous:
            before, before_published = previous[source]
            speedup = f"{ours / before:.3f}"
            theirs = f"{published / before_published:.3f}" if published and before_published else "-"
        previous[source] = (ours, published)
        print(f"| {source} | {label} | {ours:,.0f} | {published or '-'} | {ratio} | {speedup} | {theirs} |")


if __name__ == "__main__":
    main()
