"""Padded or packed: useful tokens per second of the same documents, predicted and measured, on a CPU.

A seeded skewed sample, as fine-tuning on chat data sees it: many short documents (chat turns of
8 to 64 tokens) and a few long ones (192 to 512), in a drawn order. Each way of laying them out
trains the zoo's Llama (a small config, float32) on every document once, ``ROWS`` rows a step:

- **padded to seq**: each document alone in a row of ``SEQ`` tokens, padding after it;
- **padded to the longest**: each document alone in a row, each step's rows padded to its longest
  document (a padding collator's dynamic padding);
- **packed**: `fs.pack` lays the documents end to end in rows of ``SEQ`` tokens, attention kept
  inside each document (the zoo Llama's block-diagonal boolean mask).

Every path runs the rotary embedding at each document's own positions and sums the token losses
over the documents' targets (-100 elsewhere), so each computes the same loss and gradients
(tests/unit/test_packed_vs_padded.py). Useful tokens are the documents' own; padding is not.

Predicted: `fs.estimate` of each step on the measured ``"local"`` profile (one process), given
the step's inputs (packed: with ``documents=`` the `PackedBatch`, so attention is counted per
document). Measured: the median of a few timed passes over every step (forward, backward, AdamW).
Ratios are estimate / measurement; "over padded" is packed's useful tokens/s over each padded way's.

Run: python bench/packed_vs_padded.py [timed passes]
"""

from __future__ import annotations

import os
import pathlib
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import functional_shard as fs
from functional_shard.core.packing import IGNORE_INDEX
from functional_shard.zoo import Llama, LlamaConfig

SEQ = 512
ROWS = 8  # rows a step
CONFIG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4)
SHORT, LONG = 28, 4  # documents of each kind
SEED = 0


def skewed_documents(seed: int = SEED) -> list[list[int]]:
    """``SHORT`` chat-like documents of 8 to 64 tokens and ``LONG`` of 192 to ``SEQ``, in a drawn order."""
    draw = random.Random(seed)
    lengths = [draw.randint(8, 64) for _ in range(SHORT)] + [draw.randint(192, SEQ) for _ in range(LONG)]
    draw.shuffle(lengths)
    return [[draw.randrange(1, CONFIG.vocab_size) for _ in range(n)] for n in lengths]


@dataclass(frozen=True)
class Step:
    """One step: the model's keyword arguments, the targets (-100 where none), the documents' tokens."""

    inputs: dict[str, torch.Tensor]
    labels: torch.Tensor
    useful: int
    documents: fs.PackedBatch | None = None  # packed: what the estimate counts attention for

    @property
    def shape(self) -> tuple[int, int]:
        rows, length = self.labels.shape
        return int(rows), int(length)


def padded_rows(documents: Sequence[Sequence[int]], length: int) -> Step:
    """Each document alone in a row of ``length`` tokens: positions 0, 1, ... along the row, causal over it.

    The padding after a document attends to it, but no target of the document sees the padding, and
    the padding's targets are -100: each document's loss and gradients are those of it alone.
    """
    tokens = torch.zeros(len(documents), length, dtype=torch.long)
    labels = torch.full((len(documents), length), IGNORE_INDEX, dtype=torch.long)
    for row, document in enumerate(documents):
        ids = torch.tensor(document, dtype=torch.long)
        tokens[row, : len(ids)] = ids
        labels[row, : len(ids) - 1] = ids[1:]
    positions = torch.arange(length).expand(len(documents), length)
    return Step({"tokens": tokens, "positions": positions}, labels, sum(map(len, documents)))


def packed_rows(batch: fs.PackedBatch) -> Step:
    """``batch``'s rows, each document attending only to itself."""
    inputs = {"tokens": batch.tokens, "positions": batch.positions, "document_ids": batch.document_ids}
    useful = sum(offsets[-1] for offsets in batch.offsets)
    return Step(inputs, batch.labels, useful, documents=batch)


def steps_of(documents: list[list[int]]) -> dict[str, list[Step]]:
    """The three layouts of ``documents``, ``ROWS`` rows a step."""
    chunks = [documents[start : start + ROWS] for start in range(0, len(documents), ROWS)]
    packed = fs.pack(documents, seq_len=SEQ)
    return {
        "padded to seq": [padded_rows(chunk, SEQ) for chunk in chunks],
        "padded to the longest": [padded_rows(chunk, max(map(len, chunk))) for chunk in chunks],
        "packed (fs.pack)": [
            packed_rows(packed[list(range(start, min(start + ROWS, len(packed))))])
            for start in range(0, len(packed), ROWS)
        ],
    }


def summed_loss(model: torch.nn.Module, step: Step) -> torch.Tensor:
    """The sum of the token losses over the documents' targets."""
    logits = model(**step.inputs)
    return F.cross_entropy(logits.flatten(0, 1), step.labels.flatten(), reduction="sum")


def measure(steps: list[Step], passes: int) -> float:
    """Seconds of a pass over ``steps`` (forward, backward, AdamW): median of ``passes`` after a warm-up."""
    torch.manual_seed(0)
    model = Llama(CONFIG)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for _ in range(passes + 1):
        start = time.perf_counter()
        for step in steps:
            adamw.zero_grad()
            summed_loss(model, step).backward()
            adamw.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def predict(steps: list[Step], hardware: fs.Hardware) -> float:
    """Seconds of one pass over ``steps``, as `fs.estimate` counts each step."""
    with torch.device("meta"):
        shapes = Llama(CONFIG)
    plan = fs.shard(shapes, fs.Mesh(dp=1), fs.replicate())
    total = 0.0
    for step in steps:
        rows, length = step.shape
        found = fs.estimate(
            shapes,
            plan,
            batch=rows,
            seq=length,
            hardware=hardware,
            inputs=step.inputs,
            documents=step.documents,
        )
        total += found.step_seconds
    return total


def main(passes: int = 3) -> None:
    documents = skewed_documents()
    lengths = sorted(map(len, documents))
    useful = sum(lengths)
    local = fs.hardware("local", processes=1)
    print(
        f"{len(documents)} documents (seed {SEED}): {SHORT} of 8-64 tokens, {LONG} of 192-{SEQ}; "
        f"median {lengths[len(lengths) // 2]}, longest {lengths[-1]}, {useful:,} tokens in all"
    )
    load, cores = os.getloadavg()[0], os.cpu_count()
    print(
        f"zoo Llama: hidden {CONFIG.hidden_size}, {CONFIG.num_layers} layers, float32, {ROWS} rows a step; "
        f"local profile: fp32 matmul {local.flops['float32'] / 1e9:.1f} GFLOP/s, {passes} timed passes; "
        f"load average {load:.1f} on {cores} cores at the start"
    )
    print(
        f"\n{'layout':<22} {'steps':>5} {'tokens':>7} {'useful':>7} "
        f"{'useful tok/s est':>16} {'measured':>9} {'ratio':>6}"
    )
    found = {}
    for name, steps in steps_of(documents).items():
        tokens = sum(rows * length for rows, length in (step.shape for step in steps))
        assert sum(step.useful for step in steps) == useful
        predicted, measured = predict(steps, local), measure(steps, passes)
        found[name] = (useful / predicted, useful / measured)
        print(
            f"{name:<22} {len(steps):>5} {tokens:>7,} {useful / tokens:>7.1%} "
            f"{useful / predicted:>16,.0f} {useful / measured:>9,.0f} {measured / predicted:>6.2f}"
        )
    packed = found["packed (fs.pack)"]
    for name in ("padded to seq", "padded to the longest"):
        print(
            f"packed over {name}: {packed[0] / found[name][0]:.2f}x estimated, "
            f"{packed[1] / found[name][1]:.2f}x measured"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
