"""`fs.Kernels` beside the public runs that measured compile, Float8 and async TP on H100s.

Each row is `fs.estimate` with the run's own settings, eager and with the kernels the run
used, printed beside the published tokens/s per GPU, with our figure over theirs and our
speedup beside theirs:

* torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (Dec 2024), Table 1: Llama 3.1
  8B, FSDP on 8 GPUs, local batch 2 x 8,192 tokens, selective checkpointing: eager 5,762,
  compiled 6,667, compiled + Float8 8,532. (Its eager and compiled rows are where
  ``compile_speedup`` comes from: that row checks the arithmetic, not the model; the Float8
  row is a check.)
* torchtitan Table 3: the same on 128 GPUs (16 nodes; FSDP across them): eager 5,605, compiled
  6,514, compiled + Float8 8,380; 67.0, 62.0 and 61.8 GiB. Beside Table 1 it shows what FSDP
  across nodes costs: 2.7% of tokens/s.
* torchao ``docs/source/workflows/training.md``, "e2e training benchmarks", NVIDIA H100:
  Llama 3 8B, FSDP on 8 GPUs, batch 1 x 8,192, per-op selective checkpointing, compiled:
  bf16 6,150, tensorwise Float8 with Float8 all-gathers 7,689.5 (1.25x).
* torchtitan Table 4: Llama 3.1 70B, FSDP 32 x TP 8 on 256 GPUs, local batch 16 x 8,192,
  full checkpointing, compiled + Float8: 829, and with async TP 876.
* torchtitan ``benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md`` (June 2025, torchtitan
  e7c0cae): Llama 3.1 8B on 4 and 8 nodes of 8 H200s (400 Gb/s a GPU between nodes), FSDP
  over all of them, local batch 2 x 8,192, compiled + Float8 with Float8 all-gathers: 10,938
  and 10,753, 47.96 and 46.97 GiB. The same GPU as the ``h200`` profile's measured rates.
  That torchtitan compiled the loss too (``build_cross_entropy_loss``): ``compiled_loss``.

* torchtitan ``docs/performance.md`` (April 2024, torchtitan 157a12c56): FSDP2 on 64 A100s
  (80 GB), eager bf16, local batch 1 (Llama 3, 8,192 tokens) or 2 (Llama 2, 4,096 tokens), with
  each run's checkpointing: Llama 3 8B selective layer 2,904 and selective op 2,973, Llama 3 70B
  full 331; Llama 2 13B none 2,162, selective layer 1,914, selective op 1,904; Llama 2 70B
  selective op (batch 1) 355, full 353. The ``a100`` profile's kernel rates are the H200's
  measured fractions of peak applied to the A100's datasheet: nothing here was fitted to them.
  "Selective layer" is torchtitan's ``selective_ac_option = "2"``: every second block
  checkpointed whole.

* KempnerForge ``benchmarks/mfu_scaling/mfu_scaling_2026-04-05.md`` (Kempner Institute, April
  2026): Llama 3 8B's shapes (dim 4,096, 32 layers, 8 key/value heads, ffn 14,336, 128,256
  tokens) on one H200 alone and FSDP over 2 and 4 H200s of one node (NVLink), compiled, full
  checkpointing, fused AdamW, 2 micro-batches of 4 x 4,096 tokens a step: 10,471, 18,728 and
  38,983 tokens/s (3.13, 3.50 and 3.36 s a step). Counted as two micro-batch steps and one
  optimizer step. Only time is compared: their one-GPU run held 80.7 GB, less than fp32 AdamW's
  states of 8B parameters (128 GB), so its optimizer kept them otherwise (0.2 s of a 3.1 s step here).

* NVIDIA Megatron-Bridge ``docs/performance-summary.md``, NeMo container 25.11 (tag v0.2.0), DGX-H100
  (H100 SXM 80 GB at 700 W), FP8 with current scaling (Transformer Engine), 8,192 tokens, micro-batch 1:
  Llama 3 8B on 8 GPUs, global batch 128 (16 micro-batches a step), the first 5 of 32 blocks
  checkpointed whole (``recompute_num_layers=5``): 14,451; Llama 3 70B on 64, TP 4 x PP 8 with 5
  virtual stages a rank, data parallel 2, global batch 128 (64 micro-batches), tensor-parallel
  communication overlapped: 1,602; Llama 3.1 405B on 1,024, TP 8 x PP 8 x CP 2 with 8 virtual stages,
  data parallel 8, global batch 512: 292. A tuned stack of another maker on the parts the ``h100``
  profile describes: Transformer Engine's fused FP8 linears counted as compiled Float8 linears,
  its overlapped tensor-parallel communication as async TP. The table's FSDP column says 8 for the
  8B run (the recipe's default is DDP with a distributed optimizer, ZeRO-1 here: 0.95 of the figure
  where FSDP gives 1.02). Only time is compared: our peaks are torch's engines' (its pipeline keeps
  a receive buffer per micro-batch; eager activations), not Megatron's.

The 8B rows ran torchtitan's per-op selective checkpointing (``llama3_8b.toml``: selective,
``op``), counted as it runs: ``fs.checkpointing(Block, policy="torchtitan")``.

Run: python bench/published_kernels.py
"""

from __future__ import annotations

import pathlib
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import functional_shard as fs
from functional_shard.planning.tp import rules
from functional_shard.zoo import Block, Llama, LlamaConfig, llama

COMPILE = fs.Kernels(compile=True)
FLOAT8 = fs.Kernels(compile=True, float8=True)
FLOAT8_GATHERS = fs.Kernels(compile=True, float8=True, float8_all_gather=True)
ASYNC_TP = fs.Kernels(compile=True, float8=True, async_tp=True)
# torchtitan compiles the loss with the model from April 2025 (build_cross_entropy_loss)
TRAINY = fs.Kernels(compile=True, float8=True, float8_all_gather=True, compiled_loss=True)


# torchtitan's Llama 2 ModelArgs: its ffn rounds 8/3 of the width (times ffn_dim_multiplier 1.3
# for 70B) up to multiple_of (256; 4,096 for 70B); a 32,000-token vocabulary
LLAMA2_13B = LlamaConfig(32000, 5120, 13824, 40, 40, 40)
LLAMA2_70B = LlamaConfig(32000, 8192, 28672, 80, 64, 8)


class Row(NamedTuple):
    source: str
    kernels_label: str
    kernels: fs.Kernels | None
    model_and_plan: tuple[object, object]
    batch: int
    seq: int
    tokens_per_second: float | None  # published, per GPU
    gib: float | None = None  # published memory: torch's max reserved
    hardware: str = "h100"
    micro_batches: int = 1  # gradient accumulation: micro-batches per optimizer step


def estimate(row: Row) -> fs.Estimate:
    """`fs.estimate` of ``row`` with the settings its run used."""
    model, plan = row.model_and_plan
    return fs.estimate(model, plan, batch=row.batch, seq=row.seq, hardware=row.hardware, kernels=row.kernels)


def tokens_per_second(row: Row, est: fs.Estimate) -> float:
    """Per GPU (`Estimate.tokens_per_second`); with accumulation, each micro-batch's step and the
    optimizer's once (FSDP reduces each micro-batch's gradients)."""
    optimizer = est.exposed_seconds.get("optimizer step", 0.0)
    step = row.micro_batches * est.step_seconds - (row.micro_batches - 1) * optimizer
    return est.tokens_per_second * est.step_seconds * row.micro_batches / step


def rows() -> list[Row]:
    """Each published row, with the settings its run used."""
    return [*hopper_rows(), *one_node_h200_rows(), *a100_rows(), *megatron_rows()]


def megatron_rows() -> list[Row]:
    """Megatron-Bridge's DGX-H100 rows (NeMo 25.11): 8B FSDP, 70B TP + PP, 405B TP + PP + CP, in FP8."""
    m8, m70, m405 = llama("llama-3-8b"), llama("llama-70b"), llama("llama-3-405b")
    bf16 = fs.mixed_precision()
    tp = fs.tp(rules.llama, "tp", sequence_parallel=True)
    # Megatron's recompute_method "block": the first blocks of each stage re-run whole
    first_five = fs.checkpointing(*(f"layers.{i}" for i in range(5)))
    fsdp8 = fs.shard(m8, fs.Mesh(dp=8), fs.fsdp("dp") + bf16 + first_five)

    def interleaved(virtual: int) -> fs.Policy:
        return fs.pipeline("pp", microbatches=64, schedule="interleaved1f1b", stages_per_rank=virtual)

    pp70 = fs.shard(m70, fs.Mesh(pp=8, dp=2, tp=4), fs.fsdp("dp") + tp + interleaved(5) + bf16)
    pp405 = fs.shard(
        m405,
        fs.Mesh(pp=8, dp=8, cp=2, tp=8),
        fs.fsdp(("dp", "cp")) + fs.cp("cp") + tp + interleaved(8) + bf16,
    )
    source = "Megatron-Bridge DGX-H100"
    return [
        Row(f"{source} 8B, FSDP 8", "FP8", FLOAT8, (m8, fsdp8), 1, 8192, 14451, micro_batches=16),
        Row(f"{source} 70B, TP 4 x PP 8", "FP8, TP overlap", ASYNC_TP, (m70, pp70), 64, 8192, 1602),
        Row(f"{source} 405B, TP 8 x PP 8 x CP 2", "FP8, TP overlap", ASYNC_TP, (m405, pp405), 64, 8192, 292),
    ]


def one_node_h200_rows() -> list[Row]:
    """KempnerForge's April 2026 report (benchmarks/mfu_scaling/mfu_scaling_2026-04-05.md): Llama 3 8B's
    shapes on 1, 2 and 4 H200s of one node, compiled, full checkpointing, 2 micro-batches of 4 x 4,096."""
    model = llama("llama-3-8b")
    policy = fs.fsdp("dp") + fs.mixed_precision() + fs.checkpointing(Block)
    source = "KempnerForge H200 8B, one node"
    return [
        Row(
            source,
            f"{n} GPU{'s' if n > 1 else ''}",
            COMPILE,
            (model, fs.shard(model, fs.Mesh(dp=n), policy)),
            4,
            4096,
            published,
            None,
            "h200",
            micro_batches=2,
        )
        for n, published in ((1, 10471), (2, 18728 / 2), (4, 38983 / 4))
    ]


def a100_rows() -> list[Row]:
    """torchtitan's April 2024 rows: FSDP2 on 64 A100s, eager bf16, each with its checkpointing."""
    with torch.device("meta"):
        l2_13b, l2_70b = Llama(LLAMA2_13B), Llama(LLAMA2_70B)
    l3_8b, l3_70b = llama("llama-3-8b"), llama("llama-70b")

    def on_64(model: torch.nn.Module, checkpointing: str | None) -> tuple[object, object]:
        policy = fs.fsdp("dp") + fs.mixed_precision()
        if checkpointing == "layer":  # every second block whole, as ac_freq 2 picks them
            policy = policy + fs.checkpointing(*(f"layers.{i}" for i in range(1, len(model.layers), 2)))
        elif checkpointing is not None:
            policy = policy + fs.checkpointing(Block, policy=checkpointing)
        return model, fs.shard(model, fs.Mesh(dp=64), policy)

    source = "torchtitan A100"
    return [
        Row(f"{source} L3 8B", "selective layer", None, on_64(l3_8b, "layer"), 1, 8192, 2904, None, "a100"),
        Row(f"{source} L3 8B", "selective op", None, on_64(l3_8b, "torchtitan"), 1, 8192, 2973, None, "a100"),
        Row(f"{source} L3 70B", "full", None, on_64(l3_70b, "full"), 1, 8192, 331, None, "a100"),
        Row(f"{source} L2 13B", "none", None, on_64(l2_13b, None), 2, 4096, 2162, None, "a100"),
        Row(f"{source} L2 13B", "selective layer", None, on_64(l2_13b, "layer"), 2, 4096, 1914, None, "a100"),
        Row(
            f"{source} L2 13B", "selective op", None, on_64(l2_13b, "torchtitan"), 2, 4096, 1904, None, "a100"
        ),
        Row(
            f"{source} L2 70B", "selective op", None, on_64(l2_70b, "torchtitan"), 1, 4096, 355, None, "a100"
        ),
        Row(f"{source} L2 70B b2", "full", None, on_64(l2_70b, "full"), 2, 4096, 353, None, "a100"),
    ]


def hopper_rows() -> list[Row]:
    """The H100 and H200 rows: torchtitan's December 2024 tables, torchao's README, Trainy's runs."""
    m8, m70 = llama("llama-3-8b"), llama("llama-70b")
    bf16 = fs.mixed_precision()
    titan_sac = fs.checkpointing(Block, policy="torchtitan")
    fsdp8 = fs.shard(m8, fs.Mesh(dp=8), fs.fsdp("dp") + bf16 + titan_sac)
    fsdp32, fsdp64, fsdp128 = (
        fs.shard(m8, fs.Mesh(dp=n), fs.fsdp("dp") + bf16 + titan_sac) for n in (32, 64, 128)
    )
    tp = fs.tp(rules.llama, "tp", sequence_parallel=True, loss_parallel=True)
    two_d = fs.shard(m70, fs.Mesh(dp=32, tp=8), fs.fsdp("dp") + tp + bf16 + fs.checkpointing(Block))
    return [
        Row("torchtitan T1 8B", "eager", None, (m8, fsdp8), 2, 8192, 5762, 82.4),
        Row("torchtitan T1 8B", "compile", COMPILE, (m8, fsdp8), 2, 8192, 6667, 77.0),
        Row("torchtitan T1 8B", "compile + Float8", FLOAT8, (m8, fsdp8), 2, 8192, 8532, 76.8),
        Row("torchtitan T3 8B, 128 GPUs", "eager", None, (m8, fsdp128), 2, 8192, 5605, 67.0),
        Row("torchtitan T3 8B, 128 GPUs", "compile", COMPILE, (m8, fsdp128), 2, 8192, 6514, 62.0),
        Row("torchtitan T3 8B, 128 GPUs", "compile + Float8", FLOAT8, (m8, fsdp128), 2, 8192, 8380, 61.8),
        Row("torchao README 8B", "compile", COMPILE, (m8, fsdp8), 1, 8192, 6150),
        Row(
            "torchao README 8B", "+ Float8, Float8 all-gathers", FLOAT8_GATHERS, (m8, fsdp8), 1, 8192, 7689.5
        ),
        Row("torchtitan T4 70B", "eager", None, (m70, two_d), 16, 8192, None),
        Row("torchtitan T4 70B", "compile + Float8", FLOAT8, (m70, two_d), 16, 8192, 829, 71.9),
        Row("torchtitan T4 70B", "+ async TP", ASYNC_TP, (m70, two_d), 16, 8192, 876, 67.6),
        Row(
            "Trainy H200 8B, 32 GPUs",
            "compile + Float8 all-gathers, loss",
            TRAINY,
            (m8, fsdp32),
            2,
            8192,
            10938,
            47.96,
            "h200",
        ),
        Row(
            "Trainy H200 8B, 64 GPUs",
            "compile + Float8 all-gathers, loss",
            TRAINY,
            (m8, fsdp64),
            2,
            8192,
            10753,
            46.97,
            "h200",
        ),
    ]


def main() -> None:
    print(
        "| run | kernels | our tokens/s per GPU | published | ratio | our speedup | published "
        "| our reserved GiB | published | ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    previous: dict[str, tuple[float, float | None]] = {}
    for row in rows():
        est = estimate(row)
        ours, published = tokens_per_second(row, est), row.tokens_per_second
        ratio = f"{ours / published:.3f}" if published else "-"
        speedup = theirs = "-"
        if row.source in previous:
            before, before_published = previous[row.source]
            speedup = f"{ours / before:.3f}"
            theirs = f"{published / before_published:.3f}" if published and before_published else "-"
        previous[row.source] = (ours, published)
        reserved = est.reserved_peak_bytes / 2**30
        memory = (
            f"{reserved:.1f} | {row.gib} | {reserved / row.gib:.3f}" if row.gib else f"{reserved:.1f} | - | -"
        )
        print(
            f"| {row.source} | {row.kernels_label} | {ours:,.0f} | {published or '-'} | {ratio} | {speedup} "
            f"| {theirs} | {memory} |"
        )


if __name__ == "__main__":
    main()
