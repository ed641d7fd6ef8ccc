"""How long does `import functional_shard` take, against `import torch` alone?

Each statement runs in a fresh interpreter (nothing cached in sys.modules), timed inside it
from just before the import to just after, so interpreter start-up is left out of both
sides. The statements take turns, round after round, so a machine that slows down
mid-run slows every row alike; the best of the rounds counts. Rows, side by side:

1. ``import torch``: the baseline.
2. ``import functional_shard``: the façade alone (lazy, PEP 562). Target: <= 1.3x row 1.
3. ``import functional_shard``, then ``fs.Mesh``, ``fs.shard``, ``fs.Plan`` touched:
   the pure core loaded, as any user's first line of planning does. Target: <= 1.3x row 1.
4. Row 3 plus a plan made and costed (``fs.shard(nn.Linear) .cost()``), for reference.

Run: python bench/import_time.py [--rounds 5]   (exit status 1 when a target is missed)
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]
TARGET = 1.3
STATEMENTS = {
    "import torch": "import torch",
    "import functional_shard": "import functional_shard",
    "... + fs.Mesh, fs.shard, fs.Plan": "import functional_shard as fs; fs.Mesh; fs.shard; fs.Plan",
    "... + shard(nn.Linear).cost()": (
        "import functional_shard as fs, torch; "
        "fs.shard(torch.nn.Linear(8, 8), fs.Mesh(dp=2), fs.fsdp()).cost()"
    ),
}
TARGETED = ("import functional_shard", "... + fs.Mesh, fs.shard, fs.Plan")


def seconds(statement: str) -> float:
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return float(result.stdout.split()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=5, help="fresh interpreters per statement (best counts)"
    )
    rounds = parser.parse_args().rounds
    times: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    for _ in range(rounds):
        for name, statement in STATEMENTS.items():
            times[name].append(seconds(statement))
    best = {name: min(values) for name, values in times.items()}
    baseline = best["import torch"]
    print(f"best of {rounds} fresh interpreters each, statements taking turns")
    print(f"{'statement':<36} {'seconds':>8} {'x torch':>8}  target")
    missed = []
    for name, value in best.items():
        ratio = value / baseline
        target = f"<= {TARGET}x" if name in TARGETED else ""
        ok = "" if not target else ("ok" if ratio <= TARGET else "MISSED")
        if ok == "MISSED":
            missed.append(name)
        print(f"{name:<36} {value:>8.3f} {ratio:>7.2f}x  {target} {ok}".rstrip())
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
