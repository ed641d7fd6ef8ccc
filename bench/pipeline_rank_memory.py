"""One pp rank of torchtitan's 405B run on one GPU: allocated memory beside what torch reserves.

torchtitan published 82.5 GiB for 1F1B and 72.7 GiB for interleaved 1F1B (FSDP 8 x TP 8 x
PP 8, local batch 32, 8 micro-batches), the peak torch *reserved* over all GPUs. This runs
one pp rank of that layout on a single GPU, in the order torch's action lists give it, so
that the caching allocator sees that rank's allocations:

* its stages' blocks at tensor-parallel-local shapes (tp 8: 16 query heads, 1 key/value
  head, 6,656 feed-forward rows), sequence parallel as torchtitan runs it (a block keeps
  its input as its sequence share; the all-gather and the reduce-scatter are stood in for
  by local copies of the same sizes), each block fully checkpointed;
* the stages' parameters in bf16, kept gathered for the step, and their gradients
  folded into whole fp32 sums from each stage's first backward, each bf16 gradient freed
  as it is folded in (FSDP2's under pp, which does it per block), plus the sharded
  optimizer state as one block;
* torch's receive buffers (one per micro-batch for each stage's input and its output's
  gradient), the last stage's logits and fp32 loss, and (``--keep-outputs``) every
  micro-batch's logits kept to the step's end, as the torch of that run did.

Each schedule runs in a fresh process, so the allocator starts empty, with and without
``expandable_segments`` (torchtitan's run set it). It prints, per schedule,
``max_memory_allocated`` and ``max_memory_reserved`` of the measured (second) step. No
compile, Float8 or async TP: what they add is not here. On a machine without a GPU it runs
a tiny shape on the CPU (``--tiny``) and prints no memory.

On one H200 with torch 2.11 the estimate came out at 0.90-1.00 of the allocated peak on
every rank measured (docs/pipelines.md, "Measured on one GPU"): about 6 minutes for the
six runs of ``--keep-outputs --rank 1 7 0``.

Run: python bench/pipeline_rank_memory.py [--rank 1 7] [--schedule 1f1b] [--keep-outputs] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

from functional_shard.zoo import CONFIGS

ROOT = pathlib.Path(__file__).parents[1]
GIB = 2**30
HEADER = (
    "| schedule | pp rank | expandable segments | our estimate | allocated | reserved "
    "| reserved - allocated |"
)


_405B = CONFIGS["llama-3-405b"]


@dataclass(frozen=True)
class Shape:
    """The model (the zoo's 405B by default), its tensor-parallel size and one micro-batch."""

    dim: int = _405B.hidden_size
    hidden: int = _405B.intermediate_size
    heads: int = _405B.num_heads
    kv_heads: int = _405B.num_kv_heads
    vocab: int = _405B.vocab_size
    layers: int = _405B.num_layers
    tp: int = 8
    microbatch: int = 4
    seq: int = 8192
    pp: int = 8
    microbatches: int = 8
    state_bytes: int = 12 * GIB  # FSDP's sharded fp32 parameters, gradients and AdamW moments


TINY = Shape(
    dim=64, hidden=128, heads=8, kv_heads=2, vocab=96, layers=16, microbatch=2, seq=32, state_bytes=0
)


class LocalBlock(nn.Module):
    """A Llama block as one tensor-parallel rank runs it under sequence parallel."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.tp, head = shape.tp, shape.dim // shape.heads
        self.head, self.kv = head, max(1, shape.kv_heads // shape.tp)
        self.norm1, self.norm2 = nn.RMSNorm(shape.dim), nn.RMSNorm(shape.dim)
        self.wq = nn.Linear(shape.dim, shape.dim // shape.tp, bias=False)
        self.wk = nn.Linear(shape.dim, self.kv * head, bias=False)
        self.wv = nn.Linear(shape.dim, self.kv * head, bias=False)
        self.wo = nn.Linear(shape.dim // shape.tp, shape.dim, bias=False)
        self.w1 = nn.Linear(shape.dim, shape.hidden // shape.tp, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.hidden // shape.tp, bias=False)
        self.w2 = nn.Linear(shape.hidden // shape.tp, shape.dim, bias=False)

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, self.tp, 1)  # the sequence all-gather's output

    def _scattered(self, y: torch.Tensor) -> torch.Tensor:
        b, s, d = y.shape
        return y.view(b, self.tp, s // self.tp, d).sum(1)  # the reduce-scatter's output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._gathered(self.norm1(x))
        b, s, _ = h.shape
        q = self.wq(h).view(b, s, -1, self.head).transpose(1, 2)
        k = self.wk(h).view(b, s, -1, self.head).transpose(1, 2)
        v = self.wv(h).view(b, s, -1, self.head).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self._scattered(self.wo(out.transpose(1, 2).reshape(b, s, -1)))
        h = self._gathered(self.norm2(x))
        return x + self._scattered(self.w2(F.silu(self.w1(h)) * self.w3(h)))


class Stage(nn.Module):
    """One pipeline stage: its blocks, each checkpointed, and the embedding or the head at the ends."""

    def __init__(self, shape: Shape, layers: int, first: bool, last: bool) -> None:
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab // shape.tp, shape.dim) if first else None
        self.blocks = nn.ModuleList([LocalBlock(shape) for _ in range(layers)])
        self.norm = nn.RMSNorm(shape.dim) if last else None
        self.head = nn.Linear(shape.dim, shape.vocab // shape.tp, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:  # rowwise embedding: this rank's rows, then its sequence share
            whole = self.embed(x.clamp(max=self.embed.num_embeddings - 1))
            # the reduce-scatter's output is a tensor of its own: a slice would keep the whole
            # sequence's output alive in every micro-batch's checkpoint
            x = whole[:, : x.shape[1] // self.shape.tp].clone()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x).repeat(1, self.shape.tp, 1))  # loss parallel: vocab-split logits
        return x


def cuts(shape: Shape, stages: int) -> list[int]:
    """Blocks per stage as torchtitan's generated split gives them (the two ends a block short)."""
    base, extra = divmod(shape.layers, stages)
    counts = [base] + [base + 1 if i < extra else base for i in range(stages - 2)]
    return [*counts, shape.layers - sum(counts)]


def run(schedule: str, rank: int, shape: Shape, keep_outputs: bool, device: str) -> dict[str, Any]:
    """Two steps of ``rank``'s actions; the second measured: peak allocated and reserved bytes."""
    from functional_shard.planning.pipeline.schedules import schedule_actions
    from functional_shard.planning.pipeline.stages import rank_stages

    per_rank = 1 if schedule == "1f1b" else 2
    n = shape.pp * per_rank
    layers = cuts(shape, n)
    mine = list(rank_stages(rank, shape.pp, per_rank, schedule))
    torch.manual_seed(0)
    # built where they run, in bf16: a 405B rank's 6.4B parameters made in fp32 on the host
    # first would take minutes and leave fp32-sized blocks in the allocator's cache
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            stages = {s: Stage(shape, layers[s], s == 0, s == n - 1) for s in mine}
    finally:
        torch.set_default_dtype(default)
    state = torch.empty(shape.state_bytes, dtype=torch.uint8, device=device)
    m, micro = shape.microbatches, shape.microbatch

    def buffers() -> list[torch.Tensor]:
        # torch's receive buffers: one per micro-batch, kept from step to step
        shape_ = (micro, shape.seq // shape.tp, shape.dim)
        return [torch.randn(shape_, device=device, dtype=torch.bfloat16) for _ in range(m)]

    inputs = {s: buffers() for s in mine if s}
    grads = {s: buffers() for s in mine if s < n - 1}
    tokens = torch.randint(0, shape.vocab, (micro, shape.seq), device=device)
    actions = [action for step in schedule_actions(schedule, shape.pp, m, per_rank)[rank] for action in step]
    # FSDP2 under pp: each gradient made whole in fp32 at its first micro-batch and summed into
    # after, the bf16 gradient freed as soon as it is folded in (FSDP2 does it per block, in
    # its post-backward; per parameter here, within one block's bf16 gradients of it), and the
    # sums reduce-scattered (freed) once the step's backwards are done
    accumulated: dict[nn.Parameter, torch.Tensor] = {}

    def fold_in(p: torch.Tensor) -> None:
        assert p.grad is not None
        if p in accumulated:
            accumulated[p] += p.grad
        else:
            accumulated[p] = p.grad.float()
        p.grad = None

    for stage in stages.values():
        for p in stage.parameters():
            p.register_post_accumulate_grad_hook(fold_in)
    result: dict[str, Any] = {}
    for measured in (False, True):
        if measured and device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        kept: list[torch.Tensor] = []
        accumulated.clear()
        for action in actions:
            s, mb = action.stage, action.microbatch
            if action.kind == "F":
                x = tokens if s == 0 else inputs[s][mb].requires_grad_()
                out = stages[s](x)
                if s == n - 1:
                    logits = out.float().flatten(0, 1)
                    out = F.cross_entropy(logits, tokens.flatten() % logits.shape[-1])
                    if keep_outputs:
                        kept.append(logits.detach().to(torch.bfloat16))
                cache[(s, mb)] = (x, out)
            elif action.kind == "B":
                x, out = cache.pop((s, mb))
                out.backward(None if s == n - 1 else grads[s][mb])
                if s:
                    x.grad = None  # sent to the stage before
        if keep_outputs and kept:
            kept.append(torch.cat(kept))  # torch concatenates the kept outputs at the end
        if measured and device == "cuda":
            torch.cuda.synchronize()
            result = {
                "allocated": torch.cuda.max_memory_allocated(),
                "reserved": torch.cuda.max_memory_reserved(),
            }
    del state
    return result


def estimated(schedule: str, rank: int, keep_outputs: bool) -> int:
    """`fs.estimate`'s peak for that pp rank of the published plan (bench/published_pipelines.py)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from published_pipelines import policy

    import functional_shard as fs
    from functional_shard.zoo import llama

    model = llama("llama-3-405b")
    plan = fs.shard(model, fs.Mesh(pp=8, dp=8, tp=8), policy(schedule, 1 if schedule == "1f1b" else 2))
    found = fs.estimate(
        model, plan, batch=32, seq=8192, hardware="h100", rank=rank * 64, keep_outputs=keep_outputs
    )
    return found.peak_bytes


def child(arguments: dict[str, Any]) -> None:
    shape = Shape(**arguments["shape"])
    found = run(
        arguments["schedule"], arguments["rank"], shape, arguments["keep_outputs"], arguments["device"]
    )
    print(json.dumps(found))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, nargs="*", default=[1, 7])
    parser.add_argument("--keep-outputs", action="store_true")
    parser.add_argument(
        "--expandable", choices=("on", "off", "both"), default="on", help="as torchtitan ran: on"
    )
    parser.add_argument("--schedule", nargs="*", default=["1f1b", "interleaved1f1b"])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (the CPU's default)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = TINY if args.tiny or device == "cpu" else Shape()
    print(f"one pp rank on {device}: {shape}")
    print(HEADER)
    print("|---|---:|---|---:|---:|---:|---:|")
    for schedule in args.schedule:
        for rank in args.rank:
            choices = {"on": (True,), "off": (False,), "both": (False, True)}[args.expandable]
            for expandable in choices if device == "cuda" else (False,):
                paths = (str(ROOT), os.environ.get("PYTHONPATH"))  # the caller's too: where torch's deps are
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
                if expandable:
                    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
                payload = {"schedule": schedule, "rank": rank, "shape": asdict(shape)}
                payload |= {"keep_outputs": args.keep_outputs, "device": device}
                out = subprocess.run(
                    [sys.executable, __file__, "--child", json.dumps(payload)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if out.returncode:
                    print(out.stderr[-2000:])
                    return out.returncode
                found = json.loads(out.stdout.strip().splitlines()[-1])
                ours = (
                    "" if shape == TINY else f"{estimated(schedule, rank, args.keep_outputs) / GIB:.1f} GiB"
                )
                if not found:
                    print(f"| {schedule} | {rank} | {expandable} | {ours} | (no allocator on the CPU) | | |")
                    continue
                alloc, reserved = found["allocated"] / GIB, found["reserved"] / GIB
                print(
                    f"| {schedule} | {rank} | {expandable} | {ours} | {alloc:.1f} GiB | {reserved:.1f} GiB "
                    f"| {reserved - alloc:.1f} GiB |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
