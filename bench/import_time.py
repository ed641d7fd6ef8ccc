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

``--against PATH`` times another checkout of the repository (e.g. one from before a
change) in the same rounds: each statement runs in a fresh interpreter whose working
directory and ``PYTHONPATH`` are that checkout, taking turns with this one, so both see the
same load; the columns stand side by side, with this checkout's best over the other's.

Run: python bench/import_time.py [--rounds 5] [--against /path/to/other/checkout]
(exit status 1 when this checkout misses a target)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
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


def seconds(statement: str, root: pathlib.Path) -> float:
    """``statement``'s time in a fresh interpreter that imports the package from ``root``."""
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    # the working directory comes first on sys.path (-c), PYTHONPATH next: both name the
    # checkout, so neither an editable install nor the other checkout can answer the import
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env
    )
    return float(result.stdout.split()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=5, help="fresh interpreters per statement (best counts)"
    )
    parser.add_argument("--against", type=pathlib.Path, help="another checkout, timed alongside")
    args = parser.parse_args()
    roots = {"this checkout": ROOT}
    if args.against:
        roots[str(args.against)] = args.against.resolve()
    times = {(name, root): [] for name in STATEMENTS for root in roots}
    for _ in range(args.rounds):  # interleaved: drift in the machine's load hits every cell alike
        for name, statement in STATEMENTS.items():
            for root, path in roots.items():
                times[name, root].append(seconds(statement, path))
    print(f"best (median) of {args.rounds} fresh interpreters each, statements and checkouts taking turns")
    header = "".join(f" | {root[-32:]:>32}" for root in roots)
    other = f" | {'this/other':>10}" if args.against else ""
    print(f"{'statement':<36}{header}{other}  target")
    missed = []
    for name in STATEMENTS:
        cells, bests = [], {}
        for root in roots:
            values = times[name, root]
            bests[root] = min(values)
            ratio = bests[root] / min(times["import torch", root])
            cells.append(
                f"{bests[root] * 1e3:.1f} ms ({statistics.median(values) * 1e3:.1f}) {ratio:>5.2f}x torch"
            )
        row = "".join(f" | {cell:>32}" for cell in cells)
        if args.against:
            mine, theirs = bests["this checkout"], bests[str(args.against)]
            row += f" | {mine / theirs:>9.2f}x"
        ratio = bests["this checkout"] / min(times["import torch", "this checkout"])
        target = ""
        if name in TARGETED:
            target = f"<= {TARGET}x " + ("ok" if ratio <= TARGET else "MISSED")
            if ratio > TARGET:
                missed.append(name)
        print(f"{name:<36}{row}  {target}".rstrip())
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
