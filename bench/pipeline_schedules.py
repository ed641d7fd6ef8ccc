"""Pipeline schedules from torch's own lists, and the search that chooses a pipeline.

Part 1, schedules: for each schedule torch has, each rank's action list (torch's schedule
classes, no process group), the micro-batches each stage holds in flight and the bubble
with equal per-stage times (F = 1, B = 2; zero-bubble schedules I = W = 1), beside the
textbook (p - 1)/(m + p - 1) for GPipe and 1F1B and (p - 1)/(v m + p - 1) for interleaving.

Part 2, the search: ``fs.search_plans`` for a Llama-3.1-405B-shaped model on 512 H100s, a
step of 1,024 sequences of 8,192 tokens (8M tokens, the Llama 3 paper's 405B batch after
its first stage), 80 GB: nothing fits without pipeline parallelism, and the search picks
among pp x FSDP x TP plans (torchtitan's published run: FSDP 8 x TP 8 x PP 8). Timed in a
fresh interpreter, CPU seconds of the process (the machine is shared) with wall beside.

Run: python bench/pipeline_schedules.py [--skip-search]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).parents[1]
SEARCH = r"""
import json, time
import functional_shard as fs
from functional_shard.zoo import llama
model = llama("llama-3-405b")
cpu, wall = time.process_time(), time.perf_counter()
report = fs.search_plans(model, devices=512, memory_budget="80GB", batch=1024, seq=8192, hardware="h100")
took = (time.process_time() - cpu, time.perf_counter() - wall)
best = report.best_candidate
titan = sorted((c for c in report.candidates if repr(c.mesh) == "Mesh(pp=8, dp=8, tp=8)" and c.fits),
               key=lambda c: c.step_seconds)
print(json.dumps({"cpu": took[0], "wall": took[1], "candidates": len(report.candidates),
                  "pipelines": sum(c.pipeline is not None for c in report.candidates),
                  "fit_without_pp": sum(c.fits for c in report.candidates if c.pipeline is None),
                  "chosen": f"{best.mesh!r} {best.policy_text}", "step": best.step_seconds,
                  "peak": best.peak_bytes, "bubble": best.estimate.pipeline.bubble,
                  "titan": titan and [titan[0].policy_text, titan[0].step_seconds, titan[0].peak_bytes]}))
"""


def schedules() -> None:
    from functional_shard.planning.pipeline.schedules import in_flight, simulate
    from functional_shard.planning.pipeline.stages import SCHEDULES, SINGLE_STAGE

    head = f"{'schedule':<16} {'pp':>3} {'m':>3} {'bubble':>7} {'textbook':>8} {'lists ms':>8}"
    print(head + "  in flight per stage")
    for pp, m in ((4, 8), (4, 16), (8, 32)):
        for name in SCHEDULES:
            v = 1 if name in SINGLE_STAGE else 2
            start = time.perf_counter()
            line = simulate(name, pp, m, v, forward=1.0 / v, backward=2.0 / v)
            took = (time.perf_counter() - start) * 1e3
            book = (pp - 1) / (v * m + pp - 1)
            flight = in_flight(name, pp, m, v)
            print(f"{name:<16} {pp:>3} {m:>3} {line.bubble:>7.2%} {book:>8.2%} {took:>8.1f}  {flight}")


def search() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SEARCH], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        print(out.stderr[-2000:])
        raise SystemExit(out.returncode)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        "\nfs.search_plans(llama('llama-3-405b'), devices=512, batch=1024, seq=8192, memory_budget='80GB', "
        "hardware='h100'), fresh interpreter:"
    )
    print(
        f"  {result['candidates']} candidates ({result['pipelines']} pipelines), "
        f"{result['fit_without_pp']} fit without pp; {result['cpu']:.1f} CPU s ({result['wall']:.1f} s wall)"
    )
    print(
        f"  chosen: {result['chosen']}\n    step {result['step']:.1f} s, "
        f"peak {result['peak'] / 2**30:.1f} GiB, bubble {result['bubble']:.1%}"
    )
    if result["titan"]:
        text, step, peak = result["titan"]
        print(f"  FSDP 8 x TP 8 x PP 8: {text}\n    step {step:.1f} s, peak {peak / 2**30:.1f} GiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-search", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    schedules()
    if not args.skip_search:
        search()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
