"""Does running a plan cost anything? Step time of apply(plan) against the same layout
written by hand with torch's APIs, on 4 gloo ranks, interleaved A/B, medians and ratios.

Strategies: DDP, ZeRO-1, ZeRO-2, FSDP, TP, FSDP×TP (target: ratio <= 1.02 everywhere), and
the FSDP plan against torch's FSDP1 (FullyShardedDataParallel, device_id="cpu"). The ratio
is the median of per-round ratios (each round times both, back to back); the spread shows
how much 4 ranks on a small machine move between rounds.
Run: python bench/step_overhead.py [rounds]
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import functional_shard as fs
from functional_shard.zoo import Block, Llama, LlamaConfig
from tests import dist_cases
from tests.reference import llama_tp_plan

WORLD = 4
STEPS = 4  # timed steps per round, after one warm-up
CONFIG = LlamaConfig(512, 128, 352, num_layers=4, num_heads=4, num_kv_heads=4)
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "tp", "fsdp_tp")


def by_plan(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mesh, policy = dist_cases.strategy(name, WORLD)
    torch.manual_seed(0)
    model = Llama(CONFIG)
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    return model, fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-3)


def by_hand(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed._composable import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = Llama(CONFIG)
    if name in ("ddp", "zero1"):
        replicate(model)
        if name == "zero1":
            return model, ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
            )
    elif name in ("zero2", "zero3"):
        for block in model.layers:
            fully_shard(block, reshard_after_forward=name == "zero3")
        fully_shard(model, reshard_after_forward=None if name == "zero3" else False)
    elif name == "tp":
        parallelize_module(model, init_device_mesh("cpu", (WORLD,)), llama_tp_plan(model))
    elif name == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], llama_tp_plan(model))
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif name == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({Block})
        )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step_times(name: str, variant: str) -> list[float]:
    """Seconds per step on this rank, for one round of STEPS steps."""
    # FSDP2 warns on each forward that the logits are a view; nothing writes into them
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    model, optimizer = (by_plan if variant == "plan" else by_hand)(name)
    data_parallel = 1 if name == "tp" else (2 if name == "fsdp_tp" else WORLD)
    tokens = dist_cases.batches(CONFIG, data_parallel)[0][:2]
    times = []
    for step in range(STEPS + 1):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        dist_cases.loss_of(model, tokens).backward()
        optimizer.step()
        dist.barrier()
        if step:
            times.append(time.perf_counter() - start)
    return times


def main(rounds: int = 5) -> None:
    pairs = [(name, name) for name in STRATEGIES] + [("zero3", "fsdp1")]
    with fs.LocalWorld(WORLD) as world:
        print(f"{CONFIG}, {WORLD} gloo ranks, {rounds} interleaved rounds of {STEPS} steps, medians (ms):")
        print(f"{'strategy':<16} {'apply(plan)':>12} {'by hand':>10} {'ratio':>7}  per-round ratios")
        for plan_name, hand_name in pairs:
            plan_times: list[float] = []
            hand_times: list[float] = []
            ratios = []
            for _ in range(rounds):  # A/B interleaved so drift hits both alike
                a_round = world.run(step_times, plan_name, "plan")[0]
                b_round = world.run(step_times, hand_name, "hand")[0]
                ratios.append(statistics.median(a_round) / statistics.median(b_round))
                plan_times += a_round
                hand_times += b_round
            a, b = statistics.median(plan_times), statistics.median(hand_times)
            label = plan_name if plan_name == hand_name else f"{plan_name} vs {hand_name}"
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
            print(f"{label:<16} {a * 1000:12.1f} {b * 1000:10.1f} {statistics.median(ratios):7.3f}  {spread}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
