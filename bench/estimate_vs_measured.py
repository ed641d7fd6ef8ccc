"""Predicted against measured: `fs.estimate` beside a real run of the demo's plans on 4 gloo ranks.

For each plan (the demo's default, ``fsdp(dp) + tp(llama, tp)`` on ``dp=2, tp=2``, and a few
the demo accepts), every rank trains the demo's tiny Llama for a few AdamW steps, then
measures in one more step:

- resident bytes: parameters, gradients and optimizer state held in storages
  (`fs.resident_bytes`);
- activation bytes: storages the forward leaves alive for backward
  (`fs.measure.kept_activation_bytes`, parameters and the output excluded);
- step time: the median of the timed steps, each between two barriers (the slowest rank).

The estimate is taken with the measured ``"local"`` profile (4 processes). On a CPU the
measured "peak" is resident bytes plus kept activations: the parts a CPU run can count
exactly. The estimate's other parts (FSDP units in flight, logits and loss workspace) are
printed but not compared. Ratios are estimate / measurement.

Run: python bench/estimate_vs_measured.py [timed steps]
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import functional_shard as fs
from functional_shard.runtime.measure import kept_activation_bytes
from functional_shard.zoo import CONFIGS, Llama, LlamaConfig

WORLD = 4
MICRO_BATCH, SEQ = 2, 16  # the demo's micro-batch and sequence
CONFIG = CONFIGS["tiny"]
PLANS = {
    "demo: fsdp(dp) + tp(llama, tp)": ("dp=2,tp=2", "fsdp(dp) + tp(llama, tp)"),
    "ddp(dp)": ("dp=4", "ddp(dp)"),
    "fsdp(dp)": ("dp=4", "fsdp(dp)"),
    "fsdp(dp) + checkpointing(Block)": ("dp=4", "fsdp(dp) + checkpointing(Block)"),
    "fsdp(dp) + sp(llama, tp)": ("dp=2,tp=2", "fsdp(dp) + sp(llama, tp)"),
}


def _loss(model: torch.nn.Module, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def measure(plan: fs.Plan, config: LlamaConfig, steps: int) -> dict[str, Any]:
    """On a LocalWorld rank: step times, resident bytes and kept activation bytes."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    meta = plan.config.data_parallel not in ("ddp", "zero1")
    torch.manual_seed(0)
    with torch.device("meta") if meta else nullcontext():
        model = Llama(config)
    fs.apply(plan, model)
    if meta:
        fs.materialize(plan, model, seed=0)
    adamw = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 2):  # two warm-up steps: lazy optimizer state, DDP's buckets
        tokens = torch.randint(0, config.vocab_size, (MICRO_BATCH, SEQ + 1), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        adamw.zero_grad()
        _loss(model, model(tokens[:, :-1]), tokens).backward()
        adamw.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    tokens = torch.randint(0, config.vocab_size, (MICRO_BATCH, SEQ + 1), generator=generator)
    adamw.zero_grad()
    activations, logits = kept_activation_bytes(model, tokens[:, :-1])
    _loss(model, logits, tokens).backward()
    adamw.step()
    return {
        "step": statistics.median(times[2:]),
        "resident": fs.resident_bytes(model, adamw),
        "activations": activations,
    }


def main(steps: int = 5) -> None:
    local = fs.hardware("local", processes=WORLD)
    print(
        f"local profile ({WORLD} processes): fp32 matmul {local.flops['float32'] / 1e9:.1f} GFLOP/s per "
        f"process, gloo {local.intra_node_bandwidth / 1e6:.0f} MB/s, latency "
        f"{local.collective_latency * 1e3:.2f} ms"
    )
    with torch.device("meta"):
        shapes = Llama(CONFIG)
    header = (
        f"{'plan':<34} {'rank':>4} {'resident est/meas':>21} {'ratio':>6} {'activations est/meas':>21} "
        f"{'ratio':>6} {'peak est/meas':>21} {'ratio':>6}"
    )
    timing = []
    with fs.LocalWorld(WORLD) as world:
        for name, (mesh_text, policy_text) in PLANS.items():
            mesh = fs.Mesh(**{k: int(v) for k, v in (kv.split("=") for kv in mesh_text.split(","))})
            plan = fs.shard(shapes, mesh, fs.parse_policy(policy_text, shapes))
            results = world.run(measure, plan, CONFIG, steps)
            print(f"\n{name}  on {mesh!r}")
            print(header)
            for rank, got in enumerate(results):
                est = fs.estimate(shapes, plan, batch=MICRO_BATCH, seq=SEQ, hardware=local, rank=rank)
                resident_est = est.memory["params"] + est.cost.grads_bytes + est.memory["optimizer"]
                resident = sum(got["resident"].values())
                peak_est = resident_est + est.activation_bytes
                peak = resident + got["activations"]
                print(
                    f"{'':<34} {rank:>4} {resident_est:>10,}/{resident:<10,} {resident_est / resident:>6.3f} "
                    f"{est.activation_bytes:>10,}/{got['activations']:<10,} "
                    f"{est.activation_bytes / got['activations']:>6.3f} "
                    f"{peak_est:>10,}/{peak:<10,} {peak_est / peak:>6.3f}"
                )
            est = fs.estimate(shapes, plan, batch=MICRO_BATCH, seq=SEQ, hardware=local)
            print(
                f"{'':<34} not measured on a CPU: gathered {est.memory['gathered']:,} B, "
                f"loss workspace {est.memory['loss_workspace']:,} B; estimated peak {est.peak_bytes:,} B"
            )
            timing.append((name, est.step_seconds, max(r["step"] for r in results)))
    print(f"\n{'step time':<34} {'estimated':>12} {'measured':>12} {'ratio':>7}")
    for name, predicted, measured in timing:
        print(f"{name:<34} {predicted * 1e3:>9.2f} ms {measured * 1e3:>9.2f} ms {predicted / measured:>7.2f}")
    by_estimate = [n for n, _, _ in sorted(timing, key=lambda t: t[1])]
    by_measurement = [n for n, _, _ in sorted(timing, key=lambda t: t[2])]
    print(f"\nranking by estimate:    {by_estimate}")
    print(f"ranking by measurement: {by_measurement}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
