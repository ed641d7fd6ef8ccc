"""HSDP under a pipeline on 8 gloo ranks: pp=2 × replicate=2 × shard=2 trains like one process.

Each stage's parameters are sharded over ``dp`` and replicated over ``replicate`` (FSDP2's
2-D mesh, ``fully_shard(mesh=(replicate, shard))``); the four data-parallel ranks of each
stage see different rows, so the parameters match one process only if the gradients are
reduced across both axes after the schedule's last micro-batch. Three AdamW steps, the
same tolerances as tests/dist/test_pipeline_run.py; also each rank's parameter bytes and
point-to-point bytes against ``plan.cost()``.
"""

from __future__ import annotations

import pytest

from .. import pipeline_cases as pc
from .test_pipeline_run import activation_bytes, assert_costs_as_predicted, assert_trains_as_one_process


@pytest.fixture(scope="module")
def world8(worlds):
    return worlds(8)


@pytest.mark.slow
def test_hsdp_under_a_pipeline_trains_as_one_process(world8):
    spec = pc.case({"pp": 2, "replicate": 2, "dp": 2}, "1f1b", data="hsdp")
    results = world8.run(pc.train, spec, True)
    assert results[0]["data_parallel"] == 4
    assert_trains_as_one_process(results, spec)
    assert_costs_as_predicted(results, spec)
    # each pp rank's parameters: its stage's, halved by the shard axis, whole across replicas
    by_stage = {}
    for rank, result in enumerate(results):
        by_stage.setdefault(rank // 4, set()).add(result["param_bytes"])
    assert all(len(sizes) == 1 for sizes in by_stage.values())
    for result in results:
        assert result["sent"] == result["received"] == activation_bytes(spec)
