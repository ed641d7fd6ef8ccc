"""Plan a Llama-7B-shaped model for 32 devices, on the meta device: nothing is allocated.

Prints the plan (every parameter: four specs, local shape, bytes per device), what it
costs per device and per step, and how it differs from plain FSDP on the same devices.
Run: python examples/plan_llama.py [model] [dp] [tp]
"""

import sys
import time

import torch

import functional_shard as fs
from functional_shard.zoo import Block, llama


def main(name: str = "llama-7b", dp: int = 8, tp: int = 4) -> None:
    model = llama(name)  # meta device: real shapes, no storage
    mesh = fs.Mesh(dp=dp, tp=tp)
    policy = (
        fs.fsdp("dp")
        + fs.tp(fs.rules.llama, "tp", sequence_parallel=True)
        + fs.mixed_precision(torch.bfloat16, torch.float32)
        + fs.checkpointing(Block)
    )
    start = time.perf_counter()
    plan = fs.shard(model, mesh, policy)
    cost = plan.cost("adamw", tokens=4 * 4096)
    elapsed = time.perf_counter() - start
    print(plan.explain())
    print()
    print(cost)
    print(f"\nplanned and costed in {elapsed * 1000:.0f} ms")

    flat = fs.shard(
        model, fs.Mesh(dp=dp * tp), fs.fsdp("dp") + fs.mixed_precision(torch.bfloat16, torch.float32)
    )
    flat_cost = flat.cost("adamw")
    print(f"\nagainst FSDP alone on {dp * tp} devices:")
    gib = 2**30
    print(f"  memory per device  {flat_cost.total_bytes / gib:7.2f} GiB -> {cost.total_bytes / gib:7.2f} GiB")
    changed = {c.path for c in plan.diff(flat) if c.path != "<plan>"}
    print(f"  {len(changed)} of {len(plan.params)} parameters change layout")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "llama-7b", *(int(a) for a in args[1:3]))
