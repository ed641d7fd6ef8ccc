"""One cp rank's share of torch's ring attention, timed on one GPU, beside one whole call.

torch's ring attention (``context_parallel``, through our ``engine="ring"``) is run for
one rank of a cp group of 2, 4 and 8 on a fake process group (torch's ``FakeStore``
backend, whose collectives do nothing): what is left is the work that rank's GPU does,
its attention kernels on its chunk pairs, the float32 merges of their outputs and the
accumulation of the key and value gradients, without the communication. Beside it: one
causal SDPA call over a rank's whole 32k tokens (cp 1), cp times over, and the seconds
`fs.estimate` counts for the same attention (the full score matrix at the profile's
``compute_efficiency``).

The shapes are Llama 3 8B's attention (32 query heads, the 8 key/value heads repeated to
32 as torchtitan does, head dimension 128) in bf16, 32k tokens a rank: torchtitan's
published long-context rows, 32k to 256k tokens on cp 1 to 8. Each figure is one layer's
forward and backward, the median of three after a warm-up, for flash attention and for
cuDNN's. On one H200 with torch 2.11 this takes about 100 s (docs/long-context.md,
"torch's ring on one GPU"). Without a GPU it says so and runs nothing.

Run: python bench/cuda_ring_compute.py
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import functional_shard as fs
from functional_shard.costing.time.flops import attention_backward, attention_forward

HEADS, KV_HEADS, HEAD_DIM, LOCAL = 32, 8, 128, 32768
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def seconds(step: Callable[[], None], repeats: int = 3) -> float:
    """Median wall seconds of ``step`` between two synchronisations, after one warm-up."""
    step()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tensors(seq: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = ((1, HEADS, seq, HEAD_DIM), (1, kv_heads, seq, HEAD_DIM), (1, kv_heads, seq, HEAD_DIM))
    return tuple(
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
        for shape in shapes
    )


def one_call(seq: int, backend: str) -> float:
    """Seconds of one causal SDPA call's forward and backward over ``seq`` tokens."""
    query, key, value = tensors(seq, HEADS)
    grad = torch.randn_like(query)

    def step() -> None:
        with sdpa_kernel([BACKENDS[backend]]):
            F.scaled_dot_product_attention(query, key, value, is_causal=True).backward(grad)

    return seconds(step)


def ring_rank(cp: int, rank: int, backend: str) -> float:
    """Seconds of cp rank ``rank``'s forward and backward under torch's ring, with no communication."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from functional_shard.runtime.engines.context.ring import ring_attention, ring_dispatch

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    try:
        mesh = init_device_mesh("cuda", (cp,), mesh_dim_names=("cp",))
        query, key, value = tensors(LOCAL, KV_HEADS)
        grad = torch.randn_like(query)

        def step() -> None:
            with ring_dispatch(load_balance=True), sdpa_kernel([BACKENDS[backend]]):
                out = ring_attention(
                    query, key, value, mesh, causal=True, scale=None, dropout_p=0.0, load_balance=True
                )
                out.backward(grad)

        return seconds(step)
    finally:
        dist.destroy_process_group()


def estimated(cp: int, profile: fs.Hardware) -> float:
    """The seconds `fs.estimate` counts for one rank's attention forward and backward in one layer."""
    query = (1, HEADS, LOCAL, HEAD_DIM)
    whole = (1, HEADS, LOCAL * cp, HEAD_DIM)
    flops = attention_forward(query, whole, whole) + attention_backward(query, whole, whole)
    return flops / profile.achievable_flops("bfloat16")


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/cuda_ring_compute.py times CUDA kernels: this machine has no GPU")
        return 0
    name = torch.cuda.get_device_name()
    profile = fs.hardware("h200" if "H200" in name else "h100")
    print(f"{name}, torch {torch.__version__}, profile {profile.name!r}; one layer, forward and backward")
    print(
        "\n| kernels | tokens | cp | rank | ring, one rank | cp x one 32k call | ratio "
        "| the estimate's | estimate / ring |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for backend in BACKENDS:
        local = one_call(LOCAL, backend)
        for cp in (1, 2, 4, 8):
            ranks = (0,) if cp == 1 else (0, cp - 1)
            for rank in ranks:
                ring = local if cp == 1 else ring_rank(cp, rank, backend)
                est = estimated(cp, profile)
                print(
                    f"| {backend} | {LOCAL * cp // 1024}k | {cp} | {rank} | {ring * 1e3:.0f} ms "
                    f"| {cp * local * 1e3:.0f} ms | {ring / (cp * local):.2f} | {est * 1e3:.0f} ms "
                    f"| {est / ring:.2f} |",
                    flush=True,
                )
        whole = one_call(LOCAL * 8, backend)
        print(
            f"| {backend}, one call over 256k | 256k | - | - | {whole * 1e3:.0f} ms (all 8 ranks' work) "
            f"| {64 * local * 1e3:.0f} ms | {whole / (64 * local):.2f} | | |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
