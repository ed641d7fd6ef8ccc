"""The three rates a step's time is counted in, measured on the device at hand.

Matmuls are bound by the tensor cores, fused attention by its own kernels' lower rate, and
everything else (norms, elementwise ops, the optimizer's step) by memory bandwidth.
`measure_rates` times each with the shapes of a transformer's step, so a device's profile can
carry them (`fs.Hardware.matmul_flops`, ``attention_flops``, ``memory_bandwidth``).

Examples:
    >>> rates = fs.measure_rates("cpu", size=128, seqs=(128,), repeats=2, elements=2**16, host_ops=20)
    >>> sorted(rates.as_dict())[:4]
    ['attention', 'attention_flops', 'attention_kernels', 'bandwidth']
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from functional_shard.core.validate import device as checked_device
from functional_shard.core.validate import entry_point, instance_of, one_of, positive_int, refuse

__all__ = ["MeasuredRates", "attention_kernel_flops", "kernel_kind", "measure_rates"]

# a profiler's CUDA events that are annotations (engine and optimizer ranges), not kernels
_ANNOTATIONS = ("FSDP::", "Optimizer.", "ProfilerStep")


def kernel_kind(name: str) -> str | None:
    """The kind of a kernel a profiler named: ``"matmul"``, ``"attention"`` or ``"memory-bound"``.

    ``None`` for an annotation listed beside the kernels (its time overlaps theirs).

    Examples:
        >>> kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"), kernel_kind("FSDP::pre_forward")
        ('matmul', None)
    """
    lower = name.lower()
    if name.startswith(_ANNOTATIONS):
        return None
    if any(word in lower for word in ("sdpa", "flash", "fmha", "attention")):
        return "attention"
    if any(word in lower for word in ("nvjet", "gemm", "sm90_xmma", "cutlass", "wgmma")):
        return "matmul"
    return "memory-bound"


def attention_kernel_flops(
    batch: int, heads: int, seq: int, head_dim: int, *, causal: bool
) -> tuple[float, float]:
    """Flops a fused attention kernel runs forward and backward (not the model-flops count).

    Forward: two products (scores, weighted values), 2 flops a multiply-add each. Backward:
    five (the scores recomputed, then the value, probability, query and key gradients).
    With a causal mask a fused kernel skips the blocks above the diagonal: ``(s + 1) / 2s``
    of the pairs.

    Examples:
        >>> attention_kernel_flops(1, 1, 4, 8, causal=False)
        (512.0, 1280.0)
    """
    pairs = seq * seq * ((seq + 1) / (2 * seq) if causal else 1.0)
    forward = 4.0 * batch * heads * pairs * head_dim
    return forward, 2.5 * forward


@dataclass(frozen=True)
class MeasuredRates:
    """Rates measured on one device, and what each was measured on.

    Attributes:
        device: the device's name (``torch.cuda.get_device_name`` or ``"cpu"``).
        matmul_flops: FLOP/s of the matmuls, flops-weighted over ``matmuls``.
        attention_flops: FLOP/s of fused causal attention, forward and backward (`attention_kernel_flops`).
        memory_bandwidth: bytes/s read and written by memory-bound ops, over ``bandwidth``.
        matmuls / attention / bandwidth: each case's name and its seconds and rate.
        host: the host's seconds per op, where it and not the device bounds a step.
    """

    device: str
    dtype: str
    matmul_flops: float
    attention_flops: float
    memory_bandwidth: float
    matmuls: dict[str, dict[str, float]] = field(default_factory=dict)
    attention: dict[str, dict[str, float]] = field(default_factory=dict)
    bandwidth: dict[str, dict[str, float]] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    """Seconds the host spends per op: ``"eager"`` (launching a small op), ``"selective
    checkpointing"`` (what its dispatch mode adds to each op of a checkpointed forward)."""
    attention_kernels: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """The attention cases again under each SDPA backend asked for, alone (or why it could not run)."""

    def as_dict(self) -> dict[str, Any]:
        """The rates and cases as plain data (JSON-ready)."""
        return asdict(self)


def _seconds(work: Callable[[], Any], device: torch.device, repeats: int, back_to_back: int = 8) -> float:
    """The median seconds of ``work`` over ``repeats`` timings after two warm-ups.

    On a GPU each timing runs ``work`` ``back_to_back`` times between two events, as a
    step runs its kernels: one launch alone between events counts its launch gap too.
    """
    for _ in range(2):
        work()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(back_to_back):
                work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / back_to_back)
        else:
            began = time.perf_counter()
            work()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _rate(cases: dict[str, dict[str, float]], work_key: str) -> float:
    """The rate of all ``cases`` together: their work over their seconds."""
    return sum(c[work_key] for c in cases.values()) / sum(c["seconds"] for c in cases.values())


def _matmuls(
    size: int, device: torch.device, dtype: torch.dtype, repeats: int
) -> dict[str, dict[str, float]]:
    """A layer's products at ``size`` tokens: forward, input gradient, weight gradient."""
    hidden, ffn = max(size // 4, 64), max(size, 64)
    cases: dict[str, dict[str, float]] = {}
    for name, (m, k, n) in {
        "projection": (size, hidden, hidden),
        "up": (size, hidden, ffn),
        "down": (size, ffn, hidden),
    }.items():
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        grad = torch.randn(m, n, device=device, dtype=dtype)
        for kind, work in {
            "forward": lambda a=a, b=b: a @ b,
            "input grad": lambda grad=grad, b=b: grad @ b.t(),
            "weight grad": lambda a=a, grad=grad: a.t() @ grad,
        }.items():
            seconds = _seconds(work, device, repeats)
            flops = 2.0 * m * k * n
            cases[f"{name} {kind} {m}x{k}x{n}"] = {
                "flops": flops,
                "seconds": seconds,
                "rate": flops / seconds,
            }
    return cases


def _attention(
    seqs: Sequence[int],
    heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    *,
    backend: str = "",
) -> dict[str, dict[str, float]]:
    """Causal SDPA forward and backward at each length in ``seqs``: torch's default kernel, or ``backend``'s.

    ``backend``: a name of torch's ``SDPBackend`` (``"FLASH_ATTENTION"``, ``"EFFICIENT_ATTENTION"``,
    ``"CUDNN_ATTENTION"``), the only kernel SDPA may pick.
    """
    if backend:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return _attention(seqs, heads, head_dim, device, dtype, repeats)
    cases: dict[str, dict[str, float]] = {}
    for seq in seqs:
        q, k, v = (
            torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype)
        forward, backward = attention_kernel_flops(1, heads, seq, head_dim, causal=True)

        def run_forward(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> torch.Tensor:
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def run_both(
            q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, grad: torch.Tensor = grad
        ) -> None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)

        fwd = _seconds(run_forward, device, repeats)
        both = _seconds(run_both, device, repeats)
        cases[f"causal forward s={seq}"] = {"flops": forward, "seconds": fwd, "rate": forward / fwd}
        cases[f"causal forward+backward s={seq}"] = {
            "flops": forward + backward,
            "seconds": both,
            "rate": (forward + backward) / both,
        }
    return cases


def _bandwidth(
    elements: int, device: torch.device, dtype: torch.dtype, repeats: int
) -> dict[str, dict[str, float]]:
    """Bytes moved per second by a copy, an add, a cast up and a fused norm over ``elements``."""
    x = torch.randn(elements, device=device, dtype=dtype)
    y = torch.randn(elements, device=device, dtype=dtype)
    out = torch.empty_like(x)
    up = torch.empty(elements, device=device, dtype=torch.float32)
    rows = x.view(-1, 2048) if elements % 2048 == 0 else x.view(1, -1)
    weight = torch.ones(rows.shape[-1], device=device, dtype=dtype)
    size = x.element_size() * elements
    cases: dict[str, dict[str, float]] = {}
    for name, (work, moved) in {
        "copy": (lambda: out.copy_(x), 2 * size),
        "add": (lambda: torch.add(x, y, out=out), 3 * size),
        "cast to float32": (lambda: up.copy_(x), size + 4 * elements),
        "rms_norm": (lambda: F.rms_norm(rows, (rows.shape[-1],), weight, 1e-5), 2 * size),
    }.items():
        seconds = _seconds(work, device, repeats)
        cases[name] = {"bytes": float(moved), "seconds": seconds, "rate": moved / seconds}
    return cases


def _host(device: torch.device, ops: int = 2000) -> dict[str, float]:
    """The host's seconds per small op: eager, and what selective checkpointing's mode adds."""
    from torch.utils.checkpoint import checkpoint

    from functional_shard.costing.trace.checkpointing import selective_context

    start = torch.ones(256, device=device, requires_grad=True)

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(ops):
            x = x * 1.0
        return x

    def checkpointed() -> torch.Tensor:
        out: torch.Tensor = checkpoint(chain, start, use_reentrant=False, context_fn=selective_context)
        return out

    seconds = {}
    for name, work in {"eager": lambda: chain(start), "checkpointed": checkpointed}.items():
        began = time.perf_counter()
        for _ in range(3):
            work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds[name] = (time.perf_counter() - began) / 3 / ops
    return {"eager": seconds["eager"], "selective checkpointing": seconds["checkpointed"] - seconds["eager"]}


@entry_point
def measure_rates(
    device: str | torch.device = "cuda",
    *,
    dtype: torch.dtype = torch.bfloat16,
    size: int = 8192,
    seqs: Sequence[int] = (4096, 16384),
    heads: int = 32,
    head_dim: int = 64,
    elements: int = 2**29,
    repeats: int = 10,
    host_ops: int = 2000,
    backends: Sequence[str] = (),
) -> MeasuredRates:
    """Measure the matmul rate, the fused attention rate and the memory bandwidth of ``device``.

    Args:
        device: where to measure (a CUDA GPU; ``"cpu"`` works, for trying it out).
        dtype: the compute dtype.
        size: tokens of the matmuls (a layer of hidden ``size / 4`` and feed-forward ``size``).
        seqs: sequence lengths of the causal attention cases.
        heads: the attention cases' heads.
        head_dim: their head width.
        elements: elements of the memory-bound cases (large enough to leave the caches).
        repeats: timed runs per case (the median counts).
        host_ops: small ops in a row for the host's seconds per op.
        backends: SDPA backends to measure the attention cases again with, each alone
            (``"FLASH_ATTENTION"``, ``"EFFICIENT_ATTENTION"``, ``"CUDNN_ATTENTION"``).

    Raises:
        ShardingError: ``device`` is no device this machine has; a count is not a positive
            int, ``seqs`` not a non-empty sequence of them; ``dtype`` is not a torch dtype; a
            backend is not one of ``SDPBackend``'s kernels.

    Examples:
        >>> rates = fs.measure_rates("cpu", size=128, seqs=(128,), repeats=2, elements=2**16, host_ops=20)
        >>> rates.matmul_flops > 0
        True
    """
    _check_measure_arguments(
        dtype,
        seqs,
        backends,
        size=size,
        heads=heads,
        head_dim=head_dim,
        elements=elements,
        repeats=repeats,
        host_ops=host_ops,
    )
    meaning = (
        '"cuda", "cuda:1" or "cpu"' if torch.cuda.is_available() else 'no CUDA GPU here; "cpu" tries it out'
    )
    where = checked_device(device, "device", meaning=meaning)
    name = torch.cuda.get_device_name(where) if where.type == "cuda" else where.type
    matmuls = _matmuls(size, where, dtype, repeats)
    attention = _attention(seqs, heads, head_dim, where, dtype, repeats)
    bandwidth = _bandwidth(elements, where, dtype, repeats)
    both = {k: v for k, v in attention.items() if "backward" in k}
    kernels: dict[str, dict[str, dict[str, Any]]] = {}
    for backend in backends:
        try:
            kernels[backend] = _attention(seqs, heads, head_dim, where, dtype, repeats, backend=backend)
        except RuntimeError as unavailable:  # no kernel of that backend for these inputs or this device
            kernels[backend] = {"unavailable": {"reason": str(unavailable).splitlines()[0]}}
    return MeasuredRates(
        device=name,
        dtype=str(dtype).removeprefix("torch."),
        matmul_flops=_rate(matmuls, "flops"),
        attention_flops=_rate(both, "flops"),
        memory_bandwidth=_rate(bandwidth, "bytes"),
        matmuls=matmuls,
        attention=attention,
        bandwidth=bandwidth,
        host=_host(where, host_ops),
        attention_kernels=kernels,
    )


def _check_measure_arguments(dtype: Any, seqs: Any, backends: Any, **counts: Any) -> None:
    """Refuse what `measure_rates` would fail on deep inside torch, or turn into a rate of 0."""
    from torch.nn.attention import SDPBackend

    for name, count in counts.items():
        positive_int(count, name)
    instance_of(dtype, torch.dtype, "dtype", meaning="a torch dtype, such as torch.bfloat16")
    if isinstance(seqs, str) or not isinstance(seqs, Sequence) or not seqs:
        refuse(
            "seqs",
            repr(seqs),
            "a non-empty sequence of positive ints",
            meaning="the attention cases' lengths",
        )
    for seq in seqs:
        positive_int(seq, "seqs", meaning="each an attention case's sequence length")
    kernels = tuple(name for name in SDPBackend.__members__ if name not in ("ERROR", "OVERRIDEABLE"))
    if isinstance(backends, str) or not isinstance(backends, Sequence):
        refuse(
            "backends", repr(backends), f"a sequence of names from {kernels}", meaning="each measured alone"
        )
    for backend in backends:
        one_of(backend, kernels, "backends", meaning="torch's SDPBackend names, each measured alone")
