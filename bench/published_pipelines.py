"""Llama 3.1 405B under pipelines: `fs.estimate` beside torchtitan's published H100 runs.

torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, torch 1963fc8,
Dec 2024; H100 96 GB HBM2e at 500 W) publishes:

* Table 5: FSDP 8 × TP 8 × PP 8 on 512 GPUs, local batch 32, 8,192 tokens, full activation
  checkpointing, 1F1B (100 tokens/s per GPU, 82.5 GiB) and interleaved 1F1B (128, 72.7 GiB);
* Table 6: TP 8 × PP 8 with FSDP × CP over the other 8, local batch 8, 1F1B, 32k to 256k
  tokens.

Their settings as torchtitan ran them: micro-batches = the pp degree (its default when
``pipeline_parallel_microbatches`` is unset), its generated stage cut (first and last
stages one layer short), FSDP ``reshard_after_forward=False`` under pp, sequence and loss
parallel, bf16 parameters with fp32 reductions; torch.compile, Float8 linears with Float8
FSDP all-gathers (``enable_fsdp_float8_all_gather`` in their 405B config) and async TP,
which ``fs.Kernels(compile=True, float8=True, async_tp=True, float8_all_gather=True)``
counts. The tables print our peak eager (outputs freed, then kept) and with their kernels
(the Float8 all-gathers hold the linears' gathered weights in one byte an element), the
ratios of the kept ones, and our tokens/s eager and with their kernels. The memory they
publish is the peak memory torch *reserved* (``reserved_bytes.all.peak``, the most over every GPU),
which includes the caching allocator's cached blocks; ours is what is allocated.

One engine behaviour of theirs we model as an option: torch's ``schedule.step()`` of that
time (2.6 to 2.9 always; 2.10 on unless ``return_outputs=False``, which torchtitan passes
since October 2025) keeps the last stage's output, the logits, of every micro-batch to the
step's end to return them concatenated, where our runtime frees each at its backward.
``fs.estimate(..., keep_outputs=True)`` counts that (measured on gloo ranks in
tests/dist/test_pipeline_memory.py); the tables print both, and the ratio of the kept one.
Both count torch's receive buffers, one per micro-batch for each stage's input and for its
output's gradient, kept from step to step (2 GiB on a middle rank here; torch 2.6 made
them as 2.13 does).

Part 3 prints, per pp rank, what each schedule holds: our estimate's parts (``recompute``:
what a checkpointed block's recompute adds where the rank's peak falls in a backward), and
the layer-micro-batches of activations torch's own action lists keep at the peak. Under
interleaving every rank but the last two holds at least as many as under 1F1B; 1F1B's
activations peak inside a backward, beside its whole gradients and a block's recompute,
interleaving's before its stages' first backwards. With the outputs freed that puts 1F1B
5 GiB above interleaving, as published (10 GiB); with them kept, interleaving's last rank
is the highest.

Run: python bench/published_pipelines.py
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

from torch import nn

import functional_shard as fs
from functional_shard.planning.pipeline.schedules import held_peak_parts
from functional_shard.planning.tp import rules
from functional_shard.zoo import Block, llama

GIB = 2**30
PARTS = "receive buffers | loss | recompute | layer-mbs |"
COLUMNS = (
    "our peak, outputs freed | kept | kept, their kernels | published | ratio (kept) | ratio (their kernels) "
    "| our tokens/s eager "
    "| with their kernels | published | ratio |"
)
KERNELS = fs.Kernels(compile=True, float8=True, async_tp=True, float8_all_gather=True)
# schedule -> (stages per rank, tokens/s per GPU, GiB)
TABLE5 = {"1f1b": (1, 100, 82.5), "interleaved1f1b": (2, 128, 72.7)}
# tokens -> (cp, tokens/s per GPU, GiB)
TABLE6 = {32768: (1, 76, 75.3), 65536: (2, 47, 75.9), 131072: (4, 31, 77.1), 262144: (8, 16, 84.9)}


def policy(schedule: str, per_rank: int, *, cp: int = 1) -> fs.Policy:
    data = fs.fsdp(("dp", "cp")) + fs.cp("cp") if cp > 1 else fs.fsdp("dp")
    return (
        data
        + fs.tp(rules.llama, "tp", sequence_parallel=True, loss_parallel=True)
        + fs.pipeline("pp", microbatches=8, schedule=schedule, stages_per_rank=per_rank)
        + fs.mixed_precision()
        + fs.checkpointing(Block)
    )


def row(model: nn.Module, plan: fs.Plan, batch: int, seq: int, gib: float, tps: float) -> str:
    """Our peak with the outputs freed and kept, the published one, and the tokens/s."""
    freed, kept, fast = (
        fs.estimate(model, plan, batch=batch, seq=seq, hardware="h100", keep_outputs=keep, kernels=kernels)
        for keep, kernels in ((False, None), (True, None), (True, KERNELS))
    )
    peak = fast.peak_bytes / GIB
    return (
        f"{freed.peak_bytes / GIB:.1f} GiB | {kept.peak_bytes / GIB:.1f} GiB | {peak:.1f} GiB | {gib} GiB "
        f"| {kept.peak_bytes / GIB / gib:.3f} | {peak / gib:.3f} "
        f"| {kept.tokens_per_second:.0f} | {fast.tokens_per_second:.0f} | {tps} "
        f"| {fast.tokens_per_second / tps:.2f} |"
    )


def main() -> None:
    model = llama("llama-3-405b")
    mesh = fs.Mesh(pp=8, dp=8, tp=8)
    print("Table 5: FSDP 8 x TP 8 x PP 8, local batch 32, 8 micro-batches, 8,192 tokens, full ckpt")
    print(f"| schedule | {COLUMNS}")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    plans = {}
    for schedule, (per_rank, tps, gib) in TABLE5.items():
        plan = plans[schedule] = fs.shard(model, mesh, policy(schedule, per_rank))
        print(f"| {schedule} | " + row(model, plan, 32, 8192, gib, tps))
    print("\nTable 6: TP 8 x PP 8, FSDP x CP over 8, local batch 8, 1F1B, full ckpt")
    print(f"| tokens | cp | {COLUMNS}")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seq, (cp, tps, gib) in TABLE6.items():
        cp_mesh = fs.Mesh(pp=8, dp=8 // cp, cp=cp, tp=8)
        plan = fs.shard(model, cp_mesh, policy("1f1b", 1, cp=cp))
        print(f"| {seq // 1024}k | {cp} | " + row(model, plan, 8, seq, gib, tps))
    print(
        "\nPer pp rank (Table 5's plans, outputs kept, eager): our parts in GiB, and layer-micro-batches held"
    )
    print(f"| schedule | pp rank | peak | gathered | accumulated grads | activations | {PARTS}")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for schedule, plan in plans.items():
        pipeline = plan.config.pipeline
        layers = [sum(name.startswith("layers.") for name in stage) for stage in pipeline.stages]
        held = [
            part.activations for part in held_peak_parts(schedule, 8, 8, pipeline.stages_per_rank, layers)
        ]
        for coordinate in range(8):
            est = fs.estimate(
                model, plan, batch=32, seq=8192, hardware="h100", rank=coordinate * 64, keep_outputs=True
            )
            part = {key: value / GIB for key, value in est.memory.items()}
            print(
                f"| {schedule} | {coordinate} | {est.peak_bytes / GIB:.1f} | {part['gathered']:.1f} "
                f"| {part['accumulated_grads']:.1f} | {part['activations']:.1f} "
                f"| {part['pipeline_buffers']:.1f} "
                f"| {part['loss_workspace']:.1f} | {part.get('recompute', 0.0):.1f} "
                f"| {held[coordinate]:.0f} |"
            )


if __name__ == "__main__":
    main()
