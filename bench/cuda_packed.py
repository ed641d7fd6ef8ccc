"""Packed documents on a GPU: the flex path's parity, and padded against packed tokens/s.

Prepared for a session that lends a GPU (docs/packed-documents.md, "Not done yet"); writes
``packed.json`` beside the other H200 data and prints two tables:

- **parity**: the zoo's tiny Llama in float32 on CUDA, where `document_attention_mask` gives
  flex attention's block mask (compiled): a packed batch's summed loss and every gradient
  against each document run alone (causal SDPA), over drawn documents;
- **tokens/s**: the zoo's llama-1b under FSDP2 (bf16 compute, one rank) on a skewed mix of
  documents (many chat-sized, a few long), three ways: padded (batches of documents, each
  padded to its batch's longest), packed on the device's kernel (flex attention on CUDA) and
  packed on SDPA's boolean mask. Each way: measured seconds over all its batches after a
  warm-up, useful (not padding) tokens/s, the allocated peak, and `fs.estimate`'s step
  (``hardware="h200"``, ``documents=`` for the packed rows) summed over the same batches.

Run: python bench/cuda_packed.py --out bench/data/h200 [--dry]
``--dry`` runs tiny sizes on the CPU (gloo), where both packed ways take SDPA's mask.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import pathlib
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

from cuda_step_kernels import join_one_rank_group

import functional_shard as fs
from functional_shard.core.document_masks import document_mask
from functional_shard.core.packing import IGNORE_INDEX
from functional_shard.frontends import model_zoo
from functional_shard.zoo import CONFIGS, Llama

GIB = 2**30


def skewed_documents(count: int, seq: int, seed: int) -> list[list[int]]:
    """``count`` documents: nine in ten chat-sized (log-normal, median ``seq / 27``: 300 tokens at 8k),
    one in ten long (a quarter of ``seq`` to all of it)."""
    draw = random.Random(seed)
    lengths = [
        int(min(seq, max(4, draw.lognormvariate(math.log(seq / 27), 0.8))))
        if draw.random() < 0.9
        else draw.randint(seq // 4, seq)
        for _ in range(count)
    ]
    return [[draw.randrange(1, 256) for _ in range(n)] for n in lengths]


@contextlib.contextmanager
def boolean_masks() -> Iterator[None]:
    """Within it, the zoo Llama takes SDPA's boolean document mask on every device."""
    chosen = model_zoo.document_attention_mask
    model_zoo.document_attention_mask = document_mask
    try:
        yield
    finally:
        model_zoo.document_attention_mask = chosen


def parity(device: torch.device, draws: int) -> list[dict[str, Any]]:
    """Packed against alone on the tiny Llama, float32: the largest differences of loss and gradients."""
    torch.manual_seed(0)
    model = Llama(CONFIGS["tiny"]).to(device)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    parameters = list(model.parameters())
    rows = []
    for draw in range(draws):
        docs = skewed_documents(12, 256, seed=draw)
        batch = fs.pack(docs, 256)
        inputs = fs.packed_inputs(model, batch)
        logits = model(**inputs)
        packed = F.cross_entropy(logits.flatten(0, 1), batch.labels.to(device).flatten(), reduction="sum")
        packed_grads = torch.autograd.grad(packed, parameters)
        alone = torch.zeros((), device=device)
        for doc in docs:
            tokens = torch.tensor([doc], device=device)
            out = model(tokens, positions=torch.arange(len(doc), device=device)[None])
            alone = alone + F.cross_entropy(out[0, :-1], tokens[0, 1:], reduction="sum")
        alone_grads = torch.autograd.grad(alone, parameters)
        rows.append(
            {
                "documents": [len(doc) for doc in docs],
                "loss": packed.item(),
                "loss_difference": abs(packed.item() - alone.item()),
                "largest_gradient_difference": max(
                    (a - b).abs().max().item() for a, b in zip(packed_grads, alone_grads, strict=True)
                ),
            }
        )
    return rows


def padded_batches(docs: list[list[int]], per_batch: int, multiple: int) -> list[dict[str, torch.Tensor]]:
    """Documents in order, ``per_batch`` a batch, padded to the batch's longest rounded up to ``multiple``."""
    batches = []
    for start in range(0, len(docs), per_batch):
        group = docs[start : start + per_batch]
        length = -(-max(map(len, group)) // multiple) * multiple
        tokens = torch.zeros(len(group), length, dtype=torch.long)
        labels = torch.full((len(group), length), IGNORE_INDEX)
        for row, doc in enumerate(group):
            tokens[row, : len(doc)] = torch.tensor(doc)
            labels[row, : len(doc) - 1] = torch.tensor(doc[1:])
        batches.append({"tokens": tokens, "labels": labels})
    return batches


def packed_batches(docs: list[list[int]], seq: int, rows: int) -> list[fs.PackedBatch]:
    packed = fs.pack(docs, seq)
    return [packed[start : start + rows] for start in range(0, len(packed), rows)]


def _tokens(batch: Any) -> torch.Tensor:
    return batch.tokens if isinstance(batch, fs.PackedBatch) else batch["tokens"]


def train(
    model: torch.nn.Module, adamw: torch.optim.Optimizer, batches: list[Any], device: torch.device
) -> dict[str, Any]:
    """Seconds over all ``batches`` after one warm-up batch (not counted), and the allocated peak."""

    def run(batch: Any) -> None:
        adamw.zero_grad()
        if isinstance(batch, fs.PackedBatch):
            logits, labels = model(**fs.packed_inputs(model, batch)), batch.labels
        else:
            logits, labels = model(batch["tokens"].to(device)), batch["labels"]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.to(device).flatten())
        del logits
        loss.backward()
        adamw.step()

    run(batches[0])
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for batch in batches:
        run(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {
        "seconds": time.perf_counter() - began,
        "allocated_peak": torch.cuda.max_memory_allocated() if device.type == "cuda" else 0,
    }


def predicted_seconds(model: torch.nn.Module, plan: fs.Plan, batches: list[Any], hardware: str) -> float:
    """`fs.estimate`'s step summed over ``batches`` (one estimate a distinct shape)."""
    steps: dict[Any, float] = {}
    total = 0.0
    for batch in batches:
        packed = isinstance(batch, fs.PackedBatch)
        rows, seq = _tokens(batch).shape
        key = (rows, seq, batch.offsets if packed else None)
        if key not in steps:
            documents = batch if packed else None
            found = fs.estimate(model, plan, batch=rows, seq=seq, hardware=hardware, documents=documents)
            steps[key] = found.step_seconds
        total += steps[key]
    return total


def tokens_per_second(device: torch.device, dry: bool) -> list[dict[str, Any]]:
    seq = 256 if dry else 8192
    docs = skewed_documents(24 if dry else 160, seq, seed=1)
    useful = sum(len(doc) - 1 for doc in docs)
    config = CONFIGS["tiny" if dry else "llama-1b"]
    with torch.device("meta"):
        blueprint, model = Llama(config), Llama(config)  # the estimate reads a model not yet applied
    plan = fs.shard(blueprint, fs.Mesh(dp=1), fs.fsdp("dp") + fs.mixed_precision())
    fs.apply(plan, model, plan.mesh.device_mesh(device.type))
    fs.materialize(plan, model, device.type, seed=0)
    adamw = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-5)
    ways = [
        ("padded, 8 documents a batch", padded_batches(docs, 8, 64), contextlib.nullcontext),
        ("packed, the device's kernel", packed_batches(docs, seq, 1), contextlib.nullcontext),
        ("packed, SDPA's boolean mask", packed_batches(docs, seq, 1), boolean_masks),
    ]
    results = []
    for name, batches, kernel in ways:
        with kernel():
            measured = train(model, adamw, batches, device)
            predicted = predicted_seconds(blueprint, plan, batches, "h200")
        results.append(
            {
                "way": name,
                "batches": len(batches),
                "tokens": sum(_tokens(batch).numel() for batch in batches),
                "useful_tokens": useful,
                **measured,
                "predicted_seconds": predicted,
            }
        )
        gc.collect()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/data/h200"))
    parser.add_argument("--dry", action="store_true", help="tiny sizes on the CPU, to try the script out")
    arguments = parser.parse_args()
    device = torch.device("cpu" if arguments.dry else "cuda")
    environment = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    environment["torch"] = torch.__version__
    print(environment, flush=True)
    found: dict[str, Any] = {"environment": environment}
    found["parity"] = parity(device, draws=2 if arguments.dry else 8)
    print("| documents | packed loss | loss difference | largest gradient difference |")
    print("|---|---:|---:|---:|")
    for row in found["parity"]:
        print(
            f"| {len(row['documents'])} ({sum(row['documents'])} tokens) | {row['loss']:.4f} "
            f"| {row['loss_difference']:.2e} | {row['largest_gradient_difference']:.2e} |"
        )
    join_one_rank_group(device, port=29534)
    try:
        found["ways"] = tokens_per_second(device, arguments.dry)
    finally:
        dist.destroy_process_group()
    print(
        "| way | batches | tokens (useful) | measured s | useful tokens/s | predicted s | est./meas. "
        "| peak GiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for way in found["ways"]:
        print(
            f"| {way['way']} | {way['batches']} | {way['tokens']} ({way['useful_tokens']}) "
            f"| {way['seconds']:.2f} | {way['useful_tokens'] / way['seconds']:.0f} "
            f"| {way['predicted_seconds']:.2f} | {way['predicted_seconds'] / way['seconds']:.2f} "
            f"| {way['allocated_peak'] / GIB:.2f} |"
        )
    arguments.out.mkdir(parents=True, exist_ok=True)
    target = arguments.out / ("packed-dry.json" if arguments.dry else "packed.json")
    target.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
