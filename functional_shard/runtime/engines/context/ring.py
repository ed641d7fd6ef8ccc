"""torch's own ring attention behind the cp axis (``fs.cp(engine="ring")``, and ``"auto"`` on CUDA). Effects.

While torch's CP dispatcher is on, it maps the CUDA SDPA kernels to ring versions for DTensors
sharded on the sequence dim (``Shard(2)`` of ``[batch, heads, seq, dim]``), as torchtitan's
``_ContextParallel`` style does. So this engine wraps this rank's q, k, v as DTensors on the
cp mesh, calls SDPA and takes the local output back; the dispatcher stays on through the backward.

Our cut of the sequence is torch's (with load balancing, rank ``i`` holds chunks ``i`` and
``2·cp − 1 − i`` of ``2·cp``), and the dispatcher is told which (``enable_load_balance``).
Only CUDA has ring kernels, so a ring is refused elsewhere before anything runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from functional_shard.core.errors import ShardingError
from functional_shard.core.sequence import engine_that_runs
from functional_shard.costing.trace.context_attention import repeat_kv_heads

__all__ = ["RING_DEVICES", "check_ring_device", "ring_attention", "ring_dispatch", "runs_ring"]

_SDPA = torch.nn.functional.scaled_dot_product_attention

RING_DEVICES = frozenset({"cuda"})
"""Devices torch has ring kernels for (its CP dispatcher maps CUDA's SDPA kernels only)."""


def runs_ring(engine: str, device_type: str) -> bool:
    """Whether cp attention runs as torch's ring on ``device_type`` (pure).

    Examples:
        >>> runs_ring("auto", "cuda"), runs_ring("auto", "cpu"), runs_ring("all_gather", "cuda")
        (True, False, False)
    """
    return engine_that_runs(engine, cuda=device_type in RING_DEVICES) == "ring"


def check_ring_device(engine: str, device_type: str, axis: str) -> None:
    """Refuse a ring on a device torch has no ring kernels for.

    Raises:
        ShardingError: ``engine="ring"`` on a mesh that is not on CUDA.
    """
    if engine == "ring" and device_type not in RING_DEVICES:
        raise ShardingError(
            f"cp({axis!r}, engine='ring'): torch's ring attention has CUDA kernels only, and this mesh "
            f"is on {device_type}; use engine='all_gather' (any backend) or 'auto' (the ring on CUDA)"
        )


def _ring_module() -> object:
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


@contextlib.contextmanager
def ring_dispatch(*, load_balance: bool) -> Iterator[None]:
    """Turn torch's CP dispatcher on for a whole step (the ring's backward runs through it too).

    ``load_balance`` tells torch's ring which chunks each rank holds (head-tail pairs, or
    one chunk each); the previous setting comes back after.
    """
    attention = _ring_module()
    options = attention._cp_options  # type: ignore[attr-defined]
    before = options.enable_load_balance
    options.enable_load_balance = load_balance
    attention._enable_context_parallel_dispatcher()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        attention._disable_context_parallel_dispatcher()  # type: ignore[attr-defined]
        options.enable_load_balance = before


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mesh: DeviceMesh,
    *,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    load_balance: bool,
) -> torch.Tensor:
    """SDPA of this rank's chunks (``[batch, heads, local_seq, dim]``) over the sequence, by torch's ring.

    Runs inside `ring_dispatch`. Grouped-query keys and values are repeated to the query
    heads first, as torchtitan does: the ring's kernels are not known to take fewer.

    Raises:
        ShardingError: non-causal attention with load balancing (torch's ring balances
            causal attention only).
    """
    if not causal and load_balance:
        raise ShardingError(
            "context parallel (torch's ring): a non-causal attention call under load balancing, which the "
            "ring cannot split; plan fs.cp(..., load_balance=False), or engine='all_gather'"
        )
    key, value = repeat_kv_heads(query, key, value)
    placement = [Shard(2)]
    q, k, v = (DTensor.from_local(t, mesh, placement, run_check=False) for t in (query, key, value))
    out = _SDPA(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
    return out.to_local() if isinstance(out, DTensor) else out
