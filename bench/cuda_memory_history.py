"""The CUDA caching allocator's every allocation and free in one training step, for a reserved-memory model.

For a few rows of `bench/cuda_step_kernels.py` (same models and plans), after two warm-up
steps, records one step's allocator history (``torch.cuda.memory._record_memory_history``,
no stack traces) and writes, gzipped JSON per row: the events (action, size, address,
stream), the segments at the end of the step, and ``max_memory_allocated`` and
``max_memory_reserved`` of that step. A model of reserved memory can then replay the events
on the CPU and be held to the measured reserved peak.

Run: python bench/cuda_memory_history.py --out bench/data/h200 [--rows NAME ...]
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import pathlib
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from cuda_step_kernels import HELD_OUT_ROWS, ROWS, build, step  # the same rows and step

import functional_shard as fs

WANTED = ("llama-1b 4k full", "llama-1b 16k none", "llama-1b 32k full", "qwen2-1.5b b2 4k none")


def history(row, device: torch.device) -> dict:
    model, block = build(row, dry=False)
    policy = fs.fsdp("dp") + fs.mixed_precision()
    if row.checkpointing:
        policy = policy + fs.checkpointing(block, policy=row.checkpointing)
    plan = fs.shard(model, fs.Mesh(dp=1), policy)
    fs.apply(plan, model, plan.mesh.device_mesh("cuda"))
    fs.materialize(plan, model, "cuda", seed=0)
    adamw = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-4)
    vocab = model.get_output_embeddings().weight.shape[0] if row.family != "zoo" else model.config.vocab_size
    generator = torch.Generator(device=device).manual_seed(0)
    for _ in range(2):
        step(
            model,
            adamw,
            torch.randint(0, vocab, (row.batch, row.seq + 1), generator=generator, device=device),
            row.family,
        )
    batch = torch.randint(0, vocab, (row.batch, row.seq + 1), generator=generator, device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=1_000_000
    )
    step(model, adamw, batch, row.family)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [
        [e["action"], e["size"], e["addr"], e["stream"]] for trace in snapshot["device_traces"] for e in trace
    ]
    segments = [
        {
            "size": s["total_size"],
            "address": s["address"],
            "pool": s.get("segment_type", ""),
            "blocks": [[b["size"], b["state"]] for b in s["blocks"]],
        }
        for s in snapshot["segments"]
    ]
    result = {
        "row": row.name,
        "allocated_peak": torch.cuda.max_memory_allocated(),
        "reserved_peak": torch.cuda.max_memory_reserved(),
        "events": events,
        "segments": segments,
    }
    del model, adamw
    gc.collect()  # the model's reference cycles: else the next row counts it (seen: +9.2 GiB)
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/data/h200"))
    parser.add_argument("--rows", nargs="*", default=list(WANTED))
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda")
    try:
        for row in [r for r in ROWS + HELD_OUT_ROWS if r.name in arguments.rows]:
            found = history(row, device)
            name = "memory-" + row.name.replace(" ", "_").replace(".", "") + ".json.gz"
            with gzip.open(arguments.out / name, "wt") as file:
                json.dump(found, file)
            print(
                f"{row.name}: {len(found['events'])} events, {len(found['segments'])} segments, "
                f"allocated {found['allocated_peak'] / 2**30:.2f} GiB, "
                f"reserved {found['reserved_peak'] / 2**30:.2f} GiB",
                flush=True,
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
