"""The step-time model held to what one H200 ran: profiled steps committed as data.

bench/cuda_step_kernels.py measured each row on an H200 (torch 2.11, cuDNN 9.19): the
median step, and one profiled step's kernels. `fs.estimate(hardware="h200")`, whose
kernel rates came from the same script's microbenchmarks (bench/data/h200/rates.json), not
from these steps, must give each row's step and each kind of kernel's time within 10%.

bench/data/h200/steps-heldout.json holds rows measured after the model was written (other
batches, lengths and families): they are held to the same bounds.

A row whose GPU idles for more than a tenth of its step is bound by the host (Python
dispatch; selective checkpointing's dispatch mode at short sequences): the estimate counts
the device's work, so such rows are held to the kernels' busy time instead.

The reserved peak (``max_memory_reserved``) is held to each row within 10%: the fast model
(``reserved="streams"``) on all but three rows, which it misses under; the traced one
(``reserved="traced"``) on every row. The caching-allocator simulator behind both is held to
torch itself: bench/cuda_memory_history.py
recorded every allocation and free of one step (bench/data/h200/memory-*.json.gz), and the
simulator, replaying them from the segments the warm-up steps left, must put every block
where torch put it and end with the segments torch ended with.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib

import pytest
import torch

import functional_shard as fs
from functional_shard.core.units import format_bytes
from functional_shard.costing.estimate.caching_allocator import blocks_of, from_the_start, replay
from functional_shard.costing.estimate.reserved import MODEL as RESERVED_STREAMS
from functional_shard.costing.estimate.reserved import SIMULATED, simulated_peaks
from functional_shard.runtime.measure_rates import kernel_kind
from functional_shard.zoo import CONFIGS, Block, Llama

DATA = pathlib.Path(__file__).parents[2] / "bench" / "data" / "h200"
ROWS = {row["row"]["name"]: row for row in json.loads((DATA / "steps.json").read_text())["rows"]}
# measured later, on rows the model was not first checked on (two reruns of the above left out)
HELD_OUT = {
    row["row"]["name"]: row
    for row in json.loads((DATA / "steps-heldout.json").read_text())["rows"]
    if row["row"]["name"] not in ROWS
}


def measured_kinds(row: dict) -> dict[str, float]:
    """Seconds of the profiled step's kernels by kind; the optimizer's apart."""
    kinds = {"matmul": 0.0, "attention": 0.0, "memory-bound": 0.0, "optimizer": 0.0}
    for kernel in row["kernels"]:
        kind = kernel_kind(kernel["name"])
        if kind is not None:
            kind = "optimizer" if "multi_tensor_apply" in kernel["name"] else kind
            kinds[kind] += kernel["us"] / 1e6
    return kinds


def model_of(row: dict) -> torch.nn.Module:
    with torch.device("meta"):
        if row["row"]["family"] == "zoo":  # llama-1b, or the sizes the row names
            sizes = dict(row["row"].get("config") or {})
            return Llama(dataclasses.replace(CONFIGS[sizes.pop("like", "llama-1b")], **sizes))
        transformers = pytest.importorskip("transformers")
        config = getattr(transformers, row["row"]["family"])(**row["row"]["config"])
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def plan_of(row: dict) -> tuple[torch.nn.Module, fs.Plan]:
    model = model_of(row)
    block = Block if row["row"]["family"] == "zoo" else type(model.model.layers[0])
    policy = fs.fsdp("dp") + fs.mixed_precision()
    if row["row"]["checkpointing"]:
        policy = policy + fs.checkpointing(block, policy=row["row"]["checkpointing"])
    return model, fs.shard(model, fs.Mesh(dp=1), policy)


def estimate_of(row: dict, **options: object) -> fs.Estimate:
    model, plan = plan_of(row)
    if row["row"].get("compiled"):  # its blocks torch.compile'd (bench/cuda_step_kernels.py COMPILE_ROWS)
        options = {"kernels": fs.Kernels(compile=True), **options}
    return fs.estimate(
        model, plan, batch=row["row"]["batch"], seq=row["row"]["seq"], hardware="h200", **options
    )


def check(name: str) -> None:
    row = ROWS.get(name) or HELD_OUT[name]
    found = estimate_of(row)
    kinds = measured_kinds(row)
    busy = sum(kinds.values())
    measured = row["step_seconds"] if busy >= 0.9 * row["step_seconds"] else busy
    assert found.step_seconds == pytest.approx(measured, rel=0.10), (name, found.compute_parts, kinds)
    if row["row"]["family"] == "zoo":  # kind by kind where the model is ours
        # 15%: rates.json's GEMMs on random operands run 8-10% below the same shapes inside a
        # training step (measured twice: one GEMM per event pair, and 8 back to back)
        assert found.compute_parts["matmul"] == pytest.approx(kinds["matmul"], rel=0.15)
        if row["row"]["seq"] >= 8192:  # shorter sequences fill the GPU less: a lower rate
            assert found.compute_parts["attention"] == pytest.approx(kinds["attention"], rel=0.15)
        memory = found.compute_parts["memory-bound"] + found.exposed_seconds["optimizer step"]
        assert memory == pytest.approx(kinds["memory-bound"] + kinds["optimizer"], rel=0.15)


def check_peak(name: str) -> fs.Estimate:
    row = ROWS[name]
    found = estimate_of(row)
    assert found.peak_bytes == pytest.approx(row["allocated_peak"], rel=0.05), (found.peak_at, found.memory)
    return found


def test_llama_1b_at_16k_with_full_checkpointing() -> None:
    check("llama-1b 16k full")


def test_the_step_parts_are_shown() -> None:
    found = estimate_of(ROWS["llama-1b 8k none"])
    assert set(found.compute_parts) == {"matmul", "attention", "memory-bound"}
    assert found.compute_seconds == pytest.approx(sum(found.compute_parts.values()))
    text = found.explain()
    assert "by kernel kind" in text
    assert "memory-bound" in text
    assert "MFU" in text


def test_the_estimate_orders_plans_as_the_gpu_did() -> None:
    """Where two plans' measured steps differ by more than 10%, the estimate orders them alike."""
    names = [n for n in ROWS if n.startswith("llama-1b 16k")]
    estimated = {n: estimate_of(ROWS[n]).step_seconds for n in names}
    for a in names:
        for b in names:
            if ROWS[a]["step_seconds"] > 1.1 * ROWS[b]["step_seconds"]:
                assert estimated[a] > estimated[b], (a, b)


def test_the_peak_of_llama_1b_at_32k_with_selective_checkpointing() -> None:
    check_peak("llama-1b 32k selective")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ROWS if not n.startswith("phi3")])
def test_every_measured_row(name: str) -> None:
    check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HELD_OUT))
def test_every_held_out_row(name: str) -> None:
    check(name)
    assert estimate_of(HELD_OUT[name]).peak_bytes == pytest.approx(HELD_OUT[name]["allocated_peak"], rel=0.05)


def test_the_peak_of_llama_1b_at_4k_with_full_checkpointing_falls_in_the_optimizer_step() -> None:
    """Its short logits hold less than AdamW's step: every gradient and a temporary per parameter."""
    assert check_peak("llama-1b 4k full").peak_at.startswith("the optimizer step")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ROWS))
def test_every_measured_peak(name: str) -> None:
    check_peak(name)


def fastest_measured(seq: int, budget: int) -> str:
    """The checkpointing of the fastest llama-1b row at ``seq`` tokens whose measured reserved peak fits.

    Reserved, as `fs.auto` checks its budget: the caching allocator's segments, not only the tensors.
    """
    fitting = [
        row
        for name, row in ROWS.items()
        if name.startswith(f"llama-1b {seq // 1024}k ") and row["reserved_peak"] <= budget
    ]
    return min(fitting, key=lambda row: row["step_seconds"])["row"]["checkpointing"] or "none"


@pytest.mark.parametrize(
    ("seq", "budget"),
    [
        (32768, 100 * 2**30),  # selective fits by its allocated peak, not its reserved one
        pytest.param(16384, 60 * 2**30, marks=pytest.mark.slow),
        pytest.param(32768, 80 * 2**30, marks=pytest.mark.slow),
        pytest.param(32768, 115 * 2**30, marks=pytest.mark.slow),
    ],
)
def test_auto_picks_what_was_fastest_among_what_fit(seq: int, budget: int) -> None:
    """On one H200 with a budget, fs.auto's checkpointing is that of the fastest measured row that fit."""
    with torch.device("meta"):
        model = Llama(CONFIGS["llama-1b"])
    report = fs.search_plans(model, devices=1, memory_budget=budget, batch=1, seq=seq, hardware="h200")
    assert report.best_candidate.checkpointing == fastest_measured(seq, budget)


# rows whose reserved peak the fast model (reserved="streams") misses by more than 10%, and
# why (docs/will-it-fit.md); reserved="traced" holds them too
RESERVED_MISSED = {
    # the default stream's own fragmentation: the first steps cut
    # checkpointed activations and an AdamW state from the loss's freed 2 GiB blocks, so a
    # later step's loss needs two more segments
    "llama-1b 4k full",
    # the default stream's own fragmentation, which the model does not count: AdamW's first
    # step() cuts its states from the loss's freed fp32 logits blocks (8 and 16 GiB at 32k),
    # so the next step's loss needs one more 16 GiB segment
    "llama-1b 32k none",
    "llama-1b 32k selective",
}


def check_reserved(row: dict) -> None:
    found = estimate_of(row).reserved_peak_bytes
    assert found == pytest.approx(row["reserved_peak"], rel=0.10), found / row["reserved_peak"]


def test_the_reserved_peak_of_llama_1b_at_16k() -> None:
    check_reserved(ROWS["llama-1b 16k none"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in [*ROWS, *HELD_OUT] if n not in RESERVED_MISSED])
def test_every_reserved_peak(name: str) -> None:
    check_reserved(ROWS.get(name) or HELD_OUT[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RESERVED_MISSED))
def test_the_missed_reserved_peaks_are_under(name: str) -> None:
    """What the model leaves out (fragmentation) only adds: a missed row is under, not over."""
    assert estimate_of(ROWS[name]).reserved_peak_bytes < ROWS[name]["reserved_peak"]


def check_replay(name: str) -> None:
    history = json.loads(gzip.decompress((DATA / f"memory-{name}.json.gz").read_bytes()))
    found = replay(history)
    assert found.misplaced == 0, (found.misplaced, found.allocations)
    recorded = sorted(
        (s["address"], s["size"], [(size, state.startswith("active")) for size, state in s["blocks"]])
        for s in history["segments"]
    )
    assert blocks_of(found.allocator.segments) == recorded
    assert found.allocator.peak_allocated == history["allocated_peak"]
    assert found.allocator.peak_reserved == history["reserved_peak"]


def test_the_simulator_replays_a_recorded_step_as_torch_ran_it() -> None:
    check_replay("llama-1b_8k_full")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [p.name.removeprefix("memory-").removesuffix(".json.gz") for p in sorted(DATA.glob("memory-*"))]
)
def test_the_simulator_replays_every_recorded_step(name: str) -> None:
    check_replay(name)


def check_from_the_start(name: str) -> None:
    """The recorded step's order, run from an empty cache with the warm-up's order, reserves what the row did.

    Held to steps.json's row (a run of its own): two histories were recorded in a process
    that still cached the previous row's blocks (segments no stream of the step touches:
    9.3 GiB free beside llama-1b 32k full, 5.1 GiB beside qwen2), which the rows' own runs
    did not hold.
    """
    history = json.loads(gzip.decompress((DATA / f"memory-{name}.json.gz").read_bytes()))
    measured = ROWS[history["row"]]["reserved_peak"]
    assert from_the_start(history).peak_reserved == pytest.approx(measured, rel=0.01)


def test_the_step_order_and_torchs_rules_give_the_reserved_peak() -> None:
    check_from_the_start("llama-1b_4k_full")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [p.name.removeprefix("memory-").removesuffix(".json.gz") for p in sorted(DATA.glob("memory-*"))]
)
def test_every_recorded_order_gives_its_reserved_peak(name: str) -> None:
    check_from_the_start(name)


def check_simulated(name: str) -> None:
    """Three steps of the step's traced allocations through the simulator: both peaks, as torch ran them.

    Within 2% (seen: 0.995-1.007 reserved, 0.997-0.999 allocated on every row).
    """
    row = ROWS.get(name) or HELD_OUT[name]
    model, plan = plan_of(row)
    allocated, reserved = simulated_peaks(model, plan, batch=row["row"]["batch"], seq=row["row"]["seq"])
    assert reserved == pytest.approx(row["reserved_peak"], rel=0.02), reserved / row["reserved_peak"]
    assert allocated == pytest.approx(row["allocated_peak"], rel=0.02), allocated / row["allocated_peak"]


def check_traced_reserved(name: str, rel: float = 0.10) -> fs.Estimate:
    """``fs.estimate(reserved="traced")``: the reserved peak within 10% of the row's (issue #41's bound)."""
    row = ROWS.get(name) or HELD_OUT[name]
    found = estimate_of(row, reserved="traced")
    assert found.reserved_peak_bytes == pytest.approx(row["reserved_peak"], rel=rel), (
        found.reserved_peak_bytes / row["reserved_peak"]
    )
    return found


def test_the_traced_reserved_peak_holds_where_the_streams_model_misses() -> None:
    found = check_traced_reserved("llama-1b 32k none", rel=0.02)  # RESERVED_MISSED; seen: 1.005
    assert f"reserved peak {format_bytes(found.reserved_peak_bytes)}: {SIMULATED}" in found.explain()
    assert set(found.reserved) == {"default stream", "reduce-scatter stream"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [*ROWS, *HELD_OUT])
def test_every_traced_reserved_peak(name: str) -> None:
    check_traced_reserved(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*ROWS, *HELD_OUT])
def test_every_simulated_step(name: str) -> None:
    check_simulated(name)


def test_the_simulated_step_refuses_what_was_not_measured() -> None:
    from functional_shard.zoo import llama

    model = llama("tiny")
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp") + fs.mixed_precision())
    with pytest.raises(fs.PlanError, match="more than one rank"):
        simulated_peaks(model, plan, batch=1, seq=16)
    with pytest.raises(fs.PlanError, match=r'reserved="traced": .*more than one rank.*reserved="streams"'):
        fs.estimate(model, plan, batch=1, seq=16, reserved="traced")
    one_rank = fs.shard(
        model, fs.Mesh(dp=1), fs.fsdp("dp", reshard_after_forward=False) + fs.mixed_precision()
    )
    with pytest.raises(fs.PlanError, match="zero2, not FSDP"):
        fs.estimate(model, one_rank, batch=1, seq=16, reserved="traced")
    one_rank = fs.shard(model, fs.Mesh(dp=1), fs.fsdp("dp") + fs.mixed_precision())
    with pytest.raises(fs.ShardingError, match="without documents"):
        fs.estimate(model, one_rank, batch=1, seq=16, reserved="traced", documents=[8, 8])
    with pytest.raises(fs.ShardingError, match="eager kernels"):
        fs.estimate(model, one_rank, batch=1, seq=16, reserved="traced", kernels=fs.Kernels(compile=True))
    with pytest.raises(fs.ShardingError, match='"streams" or "traced"'):
        fs.estimate(model, one_rank, batch=1, seq=16, reserved="simulated")  # type: ignore[arg-type]


def test_the_simulated_step_refuses_a_model_that_gives_no_logits_and_the_search_keeps_the_fast_model() -> (
    None
):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    plan = fs.shard(model, fs.Mesh(dp=1), fs.fsdp("dp") + fs.mixed_precision())
    with pytest.raises(fs.PlanError, match=r"Sequential returned shape \(2, 16\)"):
        fs.estimate(model, plan, batch=2, seq=16, reserved="traced")
    report = fs.search_plans(model, devices=1, memory_budget="1GiB", batch=2, seq=16)
    assert [c.estimate.reserved_model for c in report.candidates] == [RESERVED_STREAMS]


def test_a_search_on_one_device_traces_the_reserved_peak_of_what_fits() -> None:
    from functional_shard.zoo import llama

    report = fs.search_plans(llama("tiny"), devices=1, memory_budget="1GiB", batch=2, seq=16)
    assert {c.policy_text.split(" ")[0] for c in report.candidates} == {"fsdp(dp)"}
    assert {c.estimate.reserved_model for c in report.candidates} == {SIMULATED}
    assert "\n3 reserved peaks traced through the caching allocator where the fast model fit\n" in str(report)
    tight = fs.search_plans(
        llama("tiny"), devices=1, memory_budget=report.best_candidate.peak_bytes - 1, batch=2, seq=16
    )
    assert tight.best_candidate is None or tight.best_candidate.peak_bytes < report.best_candidate.peak_bytes


def test_a_compiled_row_is_estimated_with_compiles_kernels() -> None:
    """bench/cuda_step_kernels.py's COMPILE_ROWS compile each block: their estimate counts compile."""
    row = {"row": {"family": "zoo", "config": {"like": "tiny"}, "checkpointing": None, "batch": 1, "seq": 64}}
    eager = estimate_of(row)
    compiled = estimate_of({"row": {**row["row"], "compiled": True}})
    assert (eager.kernels.compile, compiled.kernels.compile) == (False, True)
    assert compiled.compute_seconds < eager.compute_seconds
