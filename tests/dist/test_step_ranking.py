"""The estimate ranks plans as real runs do: five plans on 4 gloo ranks, with the measured
"local" hardware profile, measured step-time medians against estimated step times."""

from __future__ import annotations

import statistics

import pytest
import torch

import functional_shard as fs
from functional_shard.planning.tp import rules
from functional_shard.zoo import Block, Llama, LlamaConfig
from tests.estimate_helpers import measure_steps

# big enough that compute and communication, not Python overhead, dominate a step
CONFIG = LlamaConfig(
    vocab_size=512, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4
)
GLOBAL_BATCH, SEQ = 8, 64
ROUNDS, STEPS = 3, 4  # each round times every plan (after one warm-up step) in turn

# plans that differ for real reasons: replicated vs sharded state (more collectives),
# recomputation (more compute), tensor parallelism's activation collectives, and
# recomputation under tensor parallelism (more compute and its forward collectives again)
PLANS = {
    "ddp": (fs.Mesh(dp=4), fs.replicate("dp")),
    "fsdp": (fs.Mesh(dp=4), fs.fsdp("dp")),
    "fsdp + full checkpointing": (fs.Mesh(dp=4), fs.fsdp("dp") + fs.checkpointing(Block)),
    "tp=4": (fs.Mesh(tp=4), fs.tp(rules.llama, "tp")),
    "tp=4 + full checkpointing": (fs.Mesh(tp=4), fs.tp(rules.llama, "tp") + fs.checkpointing(Block)),
}


@pytest.mark.slow
def test_estimated_step_times_rank_plans_as_measured(world4):
    local = fs.hardware("local", processes=4)
    with torch.device("meta"):
        model = Llama(CONFIG)
    plans = {name: fs.shard(model, mesh, policy) for name, (mesh, policy) in PLANS.items()}
    micro = {name: GLOBAL_BATCH // plan.data_parallel_rank(0)[1] for name, plan in plans.items()}
    estimated = {
        name: fs.estimate(model, plan, batch=micro[name], seq=SEQ, hardware=local).step_seconds
        for name, plan in plans.items()
    }
    times: dict[str, list[float]] = {name: [] for name in PLANS}
    # rounds interleave the plans, so a neighbour's load on this shared machine falls on all
    for _ in range(ROUNDS):
        for name, plan in plans.items():
            steps = world4.run(measure_steps, plan, CONFIG, micro[name], SEQ, STEPS + 1)[0]
            times[name] += steps[1:]  # after the warm-up step (lazy optimizer state)
    measured = {name: statistics.median(t) for name, t in times.items()}
    by_estimate = sorted(PLANS, key=estimated.__getitem__)
    by_measurement = sorted(PLANS, key=measured.__getitem__)
    table = "\n".join(
        f"{n:<28} est {estimated[n] * 1e3:8.1f} ms  measured {measured[n] * 1e3:8.1f} ms" for n in PLANS
    )
    print(table)  # visible with -s: how far apart the plans are, estimated and measured
    assert by_estimate == by_measurement, table
