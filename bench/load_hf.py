"""Memory and time of loading a Hugging Face folder: `fs.checkpoint.load_hf` beside ``from_pretrained``.

A Llama of about 2.4 GB (fp32, built from a config, written once by ``save_pretrained``
and kept in a folder between runs) is loaded on 1, 2 and 4 gloo ranks under ``fsdp(dp)``
and ``fsdp(dp) + tp(hf, tp)`` (tp 2), two ways:

- ``load_hf``: the model built on the meta device, ``fs.shard``, ``fs.apply``, then
  ``fs.checkpoint.load_hf(folder, model)`` (each rank reads its shards' elements);
- ``from_pretrained``: ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` on
  every rank, then ``fs.shard`` and ``fs.apply`` (the way docs/huggingface.md showed).

Memory: each (ranks, plan, way) runs in fresh processes, so that no rank reuses memory an
earlier run freed, after the folder's file was read once (a warm page cache for both
ways). Each rank first loads a tiny Llama the same way (the code it runs paged in, lazy
imports done), then takes its baseline (after ``gc`` and ``malloc_trim``) and measures its
resident memory above it while building and loading the big one.

Time: then, in the processes of the second way, the two ways alternate for ``--rounds``
rounds (3 by default), so that drift (other jobs on a shared machine) hits both alike. A
round's time is the slowest rank's, from a barrier to the model filled; the table shows the
median round, and the ratio is the median of the rounds' ratios.

Resident memory is Linux's, from ``/proc/self/status``: the total peak is ``VmHWM`` (reset
through ``/proc/self/clear_refs`` just before, so it is exact), and its two parts are
sampled every 5 ms by a thread: ``RssAnon`` (private memory: tensors, allocator, Python)
and ``RssFile`` (pages of mapped files, here the memory-mapped safetensors file: page cache
shared by every rank and reclaimable, but resident in this process while mapped).

The bound each rank is held to: the bytes its model holds after loading (its shards'
storages, FSDP2's padding included, and buffers) plus the folder's largest tensor, plus
10%. ``peak/bound`` is the worst rank's; the goal is at most 1 for ``load_hf``, and
``load_hf``'s time at most ``from_pretrained``'s on 4 ranks.

Run: python bench/load_hf.py [--folder /tmp/fs_bench_llama_2g] [--ranks 1 2 4] [--rounds 3] [--markdown]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import functional_shard as fs
from functional_shard.runtime.checkpoint.hf.slices import open_folder

# 2.41 GB in fp32: four ranks each holding the whole model (from_pretrained) fit in 24 GiB
CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 10,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
# the same architecture, tiny: each rank loads it once first (see measure)
WARM_UP = {**CONFIG, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
FOLDER = "/tmp/fs_bench_llama_2g"
PLANS = ("fsdp(dp)", "fsdp(dp) + tp(hf, tp)")
WAYS = ("load_hf", "from_pretrained")
SAMPLE_SECONDS = 0.005
MB = 10**6


def write_folder(folder: pathlib.Path, config: dict[str, Any]) -> pathlib.Path:
    """The model's folder, written once: kept while its config.json is this config's."""
    config_file = folder / "config.json"
    if config_file.exists() and (folder / "model.safetensors").exists():
        saved = json.loads(config_file.read_text())
        if all(saved.get(key) == value for key, value in config.items()):
            return folder
    import transformers

    print(f"writing {folder} (once; kept for later runs) ...", flush=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    del model
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def largest_tensor_bytes(folder: pathlib.Path) -> int:
    sources = open_folder(folder, trust=False).sources.values()  # the headers only
    return max(math.prod(source.shape) * source.dtype.itemsize for source in sources if source.dtype)


def warm_page_cache(folder: pathlib.Path) -> None:
    # both ways then read the file from memory: the first run does not pay the disk alone
    for file in folder.glob("*.safetensors"):
        with file.open("rb") as handle:
            while handle.read(64 << 20):
                pass


def status() -> dict[str, int]:
    """This process's VmRSS, VmHWM, RssAnon and RssFile, in bytes."""
    found = {}
    with open("/proc/self/status") as lines:
        for line in lines:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                found[key] = int(value.split()[0]) * 1024
    return found


class Sampler(threading.Thread):
    """The highest RssAnon and RssFile seen, read every 5 ms (torch's copies release the GIL)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            now = status()
            for key in self.peak:
                self.peak[key] = max(self.peak[key], now[key])
            time.sleep(SAMPLE_SECONDS)

    def finish(self) -> dict[str, int]:
        self.stop.set()
        self.join()
        now = status()  # the last moment too
        return {key: max(value, now[key]) for key, value in self.peak.items()}


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes of the storages behind the model's parameters and buffers, each once."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def policy_of(plan: str, world: int) -> tuple[fs.Mesh, fs.Policy]:
    if plan == "fsdp(dp)":
        return fs.Mesh(dp=world), fs.fsdp("dp")
    return fs.Mesh(dp=world // 2, tp=2), fs.fsdp("dp") + fs.tp("hf", "tp")


def build(folder: str, plan: str, way: str) -> torch.nn.Module:
    """The model of ``folder``, parallelized by ``plan`` and filled, one way."""
    import transformers

    mesh, policy = policy_of(plan, dist.get_world_size())
    if way == "load_hf":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(folder)
            )
        fs.apply(fs.shard(model, mesh, policy), model)
        fs.checkpoint.load_hf(folder, model)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        fs.apply(fs.shard(model, mesh, policy), model)
    return model


def measure(folder: str, warm_up: str, plan: str, way: str) -> dict[str, Any]:
    """On a rank: build and fill the model one way; memory above the start, and seconds."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # the same way once on a tiny model first: the code it runs (torch's, transformers') is
    # paged in and its lazy imports done before the baseline, so RssFile grows by the
    # folder's pages alone
    warm_up_model = build(warm_up, plan, way)
    del warm_up_model
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier imports freed goes back first
    start = status()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM starts again from the current resident size
    sampler = Sampler()
    sampler.start()
    dist.barrier()
    began = time.perf_counter()
    model = build(folder, plan, way)
    seconds = time.perf_counter() - began
    peak = sampler.finish()
    hwm = status()["VmHWM"]
    return {
        "seconds": seconds,
        "total": hwm - start["VmRSS"],
        "sampled_total": peak["VmRSS"] - start["VmRSS"],
        "anon": peak["RssAnon"] - start["RssAnon"],
        "file": peak["RssFile"] - start["RssFile"],
        "held": held_bytes(model),
    }


def timed(folder: str, plan: str, way: str) -> float:
    """On a rank: seconds to build and fill the model one way (no memory sampled)."""
    dist.barrier()
    began = time.perf_counter()
    model = build(folder, plan, way)
    seconds = time.perf_counter() - began
    del model
    gc.collect()
    return seconds


@dataclasses.dataclass(frozen=True)
class Row:
    """One (ranks, plan, way): the worst rank's numbers; seconds, the median round's."""

    ranks: int
    plan: str
    way: str
    seconds: float
    total: int
    anon: int
    file: int
    held: int
    total_ratio: float
    anon_ratio: float
    sampled_share: float  # the sampled total peak over VmHWM's: how near the sampler came


def memory_row(results: list[dict[str, Any]], ranks: int, plan: str, way: str, largest: int) -> Row:
    bounds = [1.1 * (r["held"] + largest) for r in results]
    return Row(
        ranks,
        plan,
        way,
        max(r["seconds"] for r in results),
        max(r["total"] for r in results),
        max(r["anon"] for r in results),
        max(r["file"] for r in results),
        max(r["held"] for r in results),
        max(r["total"] / b for r, b in zip(results, bounds, strict=True)),
        max(r["anon"] / b for r, b in zip(results, bounds, strict=True)),
        min(r["sampled_total"] / max(r["total"], 1) for r in results),
    )


def run_pair(
    folder: pathlib.Path, warm_up: pathlib.Path, ranks: int, plan: str, largest: int, rounds: int
) -> tuple[list[Row], list[float]]:
    """Both ways under one plan: memory each in fresh processes, then ``rounds`` A/B timings.

    Returns the rows (seconds: the median round's) and each round's time ratio
    load_hf / from_pretrained. The timing rounds run in the last way's processes, each way
    warmed up first, alternating so that drift (other jobs on the machine) hits both alike.
    """
    rows = []
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for way in WAYS:
        with fs.LocalWorld(ranks) as world:
            rows.append(
                memory_row(
                    world.run(measure, str(folder), str(warm_up), plan, way), ranks, plan, way, largest
                )
            )
            if way != WAYS[-1]:
                continue
            for other in WAYS[:-1]:
                world.run(timed, str(warm_up), plan, other)
            for _ in range(rounds):
                for timed_way in WAYS:
                    times[timed_way].append(max(world.run(timed, str(folder), plan, timed_way)))
    if not rounds:
        return rows, [rows[0].seconds / rows[1].seconds]
    rows = [dataclasses.replace(row, seconds=statistics.median(times[row.way])) for row in rows]
    return rows, [a / b for a, b in zip(times[WAYS[0]], times[WAYS[1]], strict=True)]


COLUMNS = (
    "ranks",
    "plan",
    "way",
    "time s",
    "peak RSS MB",
    "anon MB",
    "file MB",
    "shards MB",
    "bound MB",
    "RSS/bound",
    "anon/bound",
)


def cells(row: Row, largest: int) -> list[str]:
    return [
        str(row.ranks),
        row.plan,
        row.way,
        f"{row.seconds:.1f}",
        f"{row.total / MB:.0f}",
        f"{row.anon / MB:.0f}",
        f"{row.file / MB:.0f}",
        f"{row.held / MB:.0f}",
        f"{1.1 * (row.held + largest) / MB:.0f}",
        f"{row.total_ratio:.2f}",
        f"{row.anon_ratio:.2f}",
    ]


def show(rows: list[Row], largest: int, markdown: bool) -> None:
    body = [cells(row, largest) for row in rows]
    if markdown:
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "|".join("---" for _ in COLUMNS) + "|")
        for line in body:
            print("| " + " | ".join(line) + " |")
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(line[i]) for line in body)) for i, c in enumerate(COLUMNS)]
        print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths, strict=True)))
        for line in body:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
        return
    table = Table(*COLUMNS)
    for line in body:
        table.add_row(*line)
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=FOLDER, help="where the model's folder is kept between runs")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    parser.add_argument("--rounds", type=int, default=3, help="A/B timing rounds after the memory runs")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = parser.parse_args()
    folder = write_folder(pathlib.Path(args.folder), CONFIG)
    warm_up = write_folder(folder.with_name(folder.name + "_warm_up"), WARM_UP)
    size = sum(file.stat().st_size for file in folder.glob("*.safetensors"))
    largest = largest_tensor_bytes(folder)
    warm_page_cache(folder)
    print(
        f"Llama {CONFIG}: {size / MB:.0f} MB of safetensors (fp32), largest tensor {largest / MB:.0f} MB; "
        f"gloo CPU processes on {os.cpu_count()} cores, {_memory_gib():.0f} GiB"
    )
    rows: list[Row] = []
    ratios: dict[tuple[int, str], list[float]] = {}
    for ranks in args.ranks:
        for plan in args.plans:
            if "tp" in plan and ranks % 2:
                continue
            pair, ratios[(ranks, plan)] = run_pair(folder, warm_up, ranks, plan, largest, args.rounds)
            rows += pair
            print(f"  {ranks} ranks, {plan}: done", flush=True)
    print(
        "peak RSS: VmHWM above the rank's resident size at the start (exact); anon, file: its RssAnon "
        "and RssFile parts, each at its own sampled peak (5 ms); shards: bytes the rank's model holds "
        "after loading; bound: 1.1 x (shards + largest tensor); each the worst rank's. time: the "
        f"slowest rank's, median of {args.rounds} alternating rounds."
    )
    show(rows, largest, args.markdown)
    worst = max(row.total_ratio for row in rows if row.way == "load_hf")
    print(f"load_hf: peak RSS / bound at most {worst:.2f} on every rank (goal <= 1)")
    worst_sampled = min(row.sampled_share for row in rows)
    print(f"the 5 ms sampler saw at least {worst_sampled:.0%} of VmHWM's peak on every rank")
    by_key = {(row.ranks, row.plan, row.way): row for row in rows}
    for (ranks, plan), found in ratios.items():
        peak = by_key[(ranks, plan, "load_hf")].total / by_key[(ranks, plan, "from_pretrained")].total
        print(
            f"{ranks} ranks, {plan}: load_hf / from_pretrained: time {statistics.median(found):.2f} "
            f"(rounds {min(found):.2f}-{max(found):.2f}), peak RSS {peak:.2f}"
        )


def _memory_gib() -> float:
    with open("/proc/meminfo") as lines:
        return int(next(lines).split()[1]) / 2**20


if __name__ == "__main__":
    main()
