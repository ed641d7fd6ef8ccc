"""How long does a save stall training? Synchronous and asynchronous saves side by side.

A 34M-parameter Llama under FSDP on 2 local gloo ranks trains steps of one micro-batch and
saves a sharded checkpoint every third step (params and AdamW state: ~400 MB). The stall is
the time between the end of a step and the moment the save call returns: a synchronous
save writes everything first; an asynchronous one (``asynchronous=True``, torch's
``async_save``) copies this rank's shards to host memory and returns, and the next save
waits for it. Printed: the median step, each stall, and their ratio, measured in one run.

Run: python bench/async_save.py
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

import functional_shard as fs
from functional_shard.zoo import Llama, LlamaConfig

CONFIG = LlamaConfig(8192, 512, 1408, num_layers=8, num_heads=8, num_kv_heads=8)
SAVES = 3  # per mode
EVERY = 3  # steps between saves


def run_rank(folder: str) -> dict[str, list[float]] | None:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    plan = fs.shard(model, fs.Mesh(dp=dist.get_world_size()), fs.fsdp("dp"))
    fs.apply(plan, model)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-4)
    tokens = torch.randint(0, CONFIG.vocab_size, (1, 257))

    def step() -> None:
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()

    timings: dict[str, list[float]] = {"step": [], "synchronous": [], "asynchronous": []}
    step()  # warm-up: lazy state, first collectives
    pending = None
    for mode in ("synchronous", "asynchronous"):
        for save in range(SAVES):
            for _ in range(EVERY):
                start = time.perf_counter()
                step()
                timings["step"].append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            result = fs.checkpoint.save(
                f"{folder}/{mode}-{save}", model, optimizer, asynchronous=mode == "asynchronous"
            )
            timings[mode].append(time.perf_counter() - start)
            pending = result if mode == "asynchronous" else None
    if pending is not None:
        pending.wait()
    return timings if dist.get_rank() == 0 else None


def main() -> None:
    with tempfile.TemporaryDirectory() as folder, fs.LocalWorld(2) as world:
        timings = world.run(run_rank, folder)[0]
    step = statistics.median(timings["step"])
    sync, background = (statistics.median(timings[mode]) for mode in ("synchronous", "asynchronous"))
    print(f"34M-parameter Llama, FSDP on 2 gloo ranks, a sharded save every {EVERY} steps:")
    print(f"  training step (median)           {step * 1000:8.1f} ms")
    print(f"  stall of a synchronous save      {sync * 1000:8.1f} ms")
    print(
        f"  stall of an asynchronous save    {background * 1000:8.1f} ms (copy to host; the next save waits)"
    )
    print(f"  ratio synchronous / asynchronous {sync / background:8.1f}x")


if __name__ == "__main__":
    main()
