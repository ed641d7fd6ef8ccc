"""The estimate ranks pipeline schedules as real runs do: pp=4 on 4 gloo ranks, with the
measured "local" hardware profile, measured step-time medians against estimated ones.

The schedules differ in their bubble (1F1B with 1, 4 and 8 micro-batches, interleaved 1F1B
with 8 over two stages per rank), which the estimate takes from torch's own action lists
run on a clock; the measured steps run torch's schedules through `fs.forward_backward`.
"""

from __future__ import annotations

import statistics

import pytest
import torch

import functional_shard as fs
from functional_shard.estimate import compare_schedules
from functional_shard.zoo import Llama, LlamaConfig
from tests.estimate_helpers import measure_pipeline_steps

# big enough that each stage's compute, not Python overhead, dominates a micro-batch
CONFIG = LlamaConfig(
    vocab_size=512, hidden_size=256, intermediate_size=688, num_layers=8, num_heads=8, num_kv_heads=4
)
BATCH, SEQ = 8, 64
ROUNDS, STEPS = 3, 3

# (schedule, micro-batches, stages per rank)
SCHEDULES = {
    "1f1b, 1 micro-batch": ("1f1b", 1, 1),
    "1f1b, 4 micro-batches": ("1f1b", 4, 1),
    "1f1b, 8 micro-batches": ("1f1b", 8, 1),
    "interleaved1f1b, 8 micro-batches": ("interleaved1f1b", 8, 2),
}


@pytest.mark.slow
def test_estimated_step_times_rank_schedules_as_measured():
    local = fs.hardware("local", processes=4)
    with torch.device("meta"):
        model = Llama(CONFIG)
    plans = {
        name: fs.shard(model, fs.Mesh(pp=4), fs.pipeline("pp", microbatches=m, schedule=s, stages_per_rank=v))
        for name, (s, m, v) in SCHEDULES.items()
    }
    estimated = {
        name: compare_schedules(
            model, plan, batch=BATCH, seq=SEQ, schedules=[plan.config.pipeline_schedule], hardware=local
        )[plan.config.pipeline_schedule].step_seconds
        for name, plan in plans.items()
    }
    times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    with fs.LocalWorld(4) as world:
        for _ in range(ROUNDS):  # rounds interleave the schedules: a neighbour's load falls on all
            for name, plan in plans.items():
                steps = world.run(measure_pipeline_steps, plan, CONFIG, BATCH, SEQ, STEPS + 1)[0]
                times[name] += steps[1:]  # after the warm-up step
    measured = {name: statistics.median(t) for name, t in times.items()}
    table = "\n".join(
        f"{n:<34} est {estimated[n] * 1e3:8.1f} ms  measured {measured[n] * 1e3:8.1f} ms" for n in SCHEDULES
    )
    print(table)
    assert sorted(SCHEDULES, key=estimated.__getitem__) == sorted(SCHEDULES, key=measured.__getitem__), table
