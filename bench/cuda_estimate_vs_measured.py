"""Predicted against measured on one GPU: `fs.estimate` beside real CUDA steps of Llama 3.2 1B.

Each row trains the zoo's ``llama-1b`` (1.24B parameters, 128k vocabulary) on one GPU under a
plan on a 1-rank NCCL mesh (FSDP2 with bf16 compute and fp32 reduction, AdamW), one sequence
per step, and measures in the last step:

- peak: ``torch.cuda.max_memory_allocated`` over the whole step (forward, loss, backward,
  optimizer), the figure `fs.estimate`'s ``peak_bytes`` predicts; ``max_memory_reserved``
  (what torchtitan's published "max_reserved" reports) is printed beside it;
- step: the median of the timed steps after two warm-ups, each between two synchronisations.

The estimate uses the datasheet profile of the GPU it finds (``"h100"`` or ``"h200"``) and
is taken before anything runs. Ratios are estimate / measurement.

With ``--vocab N`` the model's vocabulary is N instead (and the rows are the checkpointed
ones up to 64k tokens): a small head's loss workspace is smaller than a checkpointed block's
recompute, so the backward's recompute, not the loss, sets the peak.

Run: python bench/cuda_estimate_vs_measured.py [--steps 3] [--vocab N]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import pathlib
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import functional_shard as fs
from functional_shard.zoo import CONFIGS, Block, Llama

GIB = 2**30
# (name, tokens per sequence, policy beside fsdp + bf16)
ROWS = [
    ("fsdp", 8192, None),
    ("fsdp", 16384, None),
    ("fsdp + selective ckpt", 16384, "selective"),
    ("fsdp + full ckpt", 16384, "full"),
    ("fsdp + full ckpt", 32768, "full"),
]
# a small vocabulary: the checkpointed rows, where a block's recompute sets the peak
SMALL_VOCAB_ROWS = [
    ("fsdp", 16384, None),
    ("fsdp + full ckpt", 16384, "full"),
    ("fsdp + full ckpt", 32768, "full"),
    ("fsdp + full ckpt", 65536, "full"),
]


def llama_1b(vocab: int | None) -> Llama:
    """The zoo's Llama 3.2 1B on the meta device, with ``vocab`` tokens if given."""
    config = (
        CONFIGS["llama-1b"] if vocab is None else dataclasses.replace(CONFIGS["llama-1b"], vocab_size=vocab)
    )
    with torch.device("meta"):
        return Llama(config)


def policy(checkpointing: str | None) -> fs.Policy:
    base = fs.fsdp("dp") + fs.mixed_precision()
    if checkpointing is None:
        return base
    return base + fs.checkpointing(Block, policy=checkpointing)


def measure(plan: fs.Plan, seq: int, steps: int, vocab: int | None) -> dict[str, float]:
    """Train on this GPU under ``plan``; peak bytes of the last step and the median step time."""
    model = llama_1b(vocab)
    fs.apply(plan, model, plan.mesh.device_mesh("cuda"))
    fs.materialize(plan, model, "cuda", seed=0)
    adamw = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-4)
    generator = torch.Generator(device="cuda").manual_seed(0)
    vocab = model.config.vocab_size
    times = []
    for step in range(steps + 2):  # two warm-ups: lazy optimizer state, cuBLAS and flash autotuning
        tokens = torch.randint(0, vocab, (1, seq + 1), generator=generator, device="cuda")
        if step == steps + 1:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        adamw.zero_grad()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1)).backward()
        del logits
        adamw.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result = {
        "allocated": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.max_memory_reserved(),
        "step": statistics.median(times[2:]),
    }
    del model, adamw
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(steps: int = 3, vocab: int | None = None) -> None:
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    name = torch.cuda.get_device_name()
    profile = "h200" if "H200" in name else "h100"
    print(f"{name}, torch {torch.__version__}, profile {profile!r}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    shapes = llama_1b(vocab)
    print(f"vocabulary {shapes.config.vocab_size:,}")
    print(
        "| plan | tokens | est. peak | measured peak (allocated) | ratio | max reserved "
        "| est. step | measured step | ratio | measured tokens/s | MFU (6N) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    params = sum(p.numel() for p in shapes.parameters())
    peak_flops = fs.hardware(profile).flops["bfloat16"]
    try:
        for title, seq, checkpointing in ROWS if vocab is None else SMALL_VOCAB_ROWS:
            plan = fs.shard(shapes, fs.Mesh(dp=1), policy(checkpointing))
            est = fs.estimate(shapes, plan, batch=1, seq=seq, hardware=profile)
            try:
                got = measure(plan, seq, steps, vocab)
            except torch.OutOfMemoryError:
                gc.collect()
                torch.cuda.empty_cache()
                print(
                    f"| {title} | {seq // 1024}k | {est.peak_bytes / GIB:.1f} GiB | out of memory |{' |' * 7}"
                )
                continue
            mfu = 6 * params * seq / got["step"] / peak_flops
            peak = got["allocated"]
            print(
                f"| {title} | {seq // 1024}k | {est.peak_bytes / GIB:.1f} GiB | {peak / GIB:.1f} GiB "
                f"| {est.peak_bytes / peak:.2f} | {got['reserved'] / GIB:.1f} GiB "
                f"| {est.step_seconds * 1e3:.0f} ms | {got['step'] * 1e3:.0f} ms "
                f"| {est.step_seconds / got['step']:.2f} | {seq / got['step']:,.0f} | {mfu:.1%} |",
                flush=True,
            )
            parts = {k: f"{v / GIB:.2f}" for k, v in est.memory.items()}
            print(f"    estimate's parts (GiB): {parts}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after two warm-ups")
    parser.add_argument("--vocab", type=int, help="a vocabulary size instead of the model's 128k")
    arguments = parser.parse_args()
    main(arguments.steps, arguments.vocab)
