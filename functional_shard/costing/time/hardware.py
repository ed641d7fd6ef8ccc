"""Accelerators as data: peak rates from vendor datasheets, achievable fractions from public runs.

The efficiency factors turn datasheet peaks into what real training reaches, from published runs
(docs/will-it-fit.md). Minor mesh axes fill a node first: an axis is inside a node when its size times
the more-minor axes' is at most ``devices_per_node`` (or name them in ``intra_node_axes``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import functional_shard as fs
from functional_shard.core.errors import ShardingError
from functional_shard.core.mesh import Mesh
from functional_shard.core.validate import entry_point, positive_int

__all__ = ["PROFILES", "Hardware", "KernelRates", "hardware"]


@dataclass(frozen=True)
class KernelRates:
    """What one device reaches in each kind of kernel, in bf16 (`functional_shard.costing.time.kernel_time`).

    Examples:
        >>> fs.hardware("h200").kernel_rates.attention / 1e12
        437.0
    """

    matmul: float
    """FLOP/s of the matmuls of a training step."""
    attention: float
    """FLOP/s of fused attention, forward and backward, counted as the kernels run them."""
    bandwidth: float
    """Bytes/s memory-bound ops read and write."""
    source: str = ""


@dataclass(frozen=True)
class Hardware:
    """One kind of device and the links between devices (all rates per device).

    Examples:
        >>> h = fs.hardware("h100")
        >>> h.flops["bfloat16"] / 1e12, h.devices_per_node
        (989.0, 8)
        >>> h.link_of(fs.Mesh(dp=16, tp=8), ("tp",)), h.link_of(fs.Mesh(dp=16, tp=8), ("dp",))
        ('intra', 'inter')
    """

    name: str
    flops: Mapping[str, float]
    """Dense peak FLOP/s per dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``)."""
    memory_bytes: int
    memory_bandwidth: float
    """Bytes/s of device memory."""
    devices_per_node: int
    intra_node_bandwidth: float
    """Bytes/s one device sends inside a node (one direction)."""
    inter_node_bandwidth: float
    """Bytes/s one device's NIC sends to other nodes (one direction): a collective's ranks in one node
    drive their NICs together (`bandwidth`)."""
    host_bandwidth: float = float("inf")
    """Bytes/s between host and device memory (one direction), for offloading."""
    overlap_communication: bool = True
    """Whether collectives run beside compute (GPUs yes; gloo on a CPU no: they share the cores)."""
    collective_latency: float = 0.0
    """Seconds each collective costs beyond its bytes (0: bandwidth-bound sizes)."""
    cuda: bool = True
    """Whether the devices are CUDA GPUs, where `fs.cp`'s ``"auto"`` engine runs torch's ring."""
    skips_masked_attention: bool = True
    """Whether causal attention skips the masked half, so cp ranks' work follows their chunks."""
    tensor_parallel_latency: float | None = None
    """Seconds each tensor-parallel collective costs, DTensor's dispatch included; ``None``: as others."""
    compute_efficiency: float = 1.0
    """Fraction of the peak FLOP/s training reaches on the flops the estimate counts (recompute included)."""
    intra_node_efficiency: float = 1.0
    inter_node_efficiency: float = 1.0
    compile_speedup: float | None = None
    """How much faster ``torch.compile`` runs the work other than attention; ``None``: compile is refused."""
    gemm_efficiency: float | None = None
    """Fraction of the peak a large GEMM reaches, for Float8's roofline (torchao's
    ``pct_achievable_gemm_tops``); ``None``: ``fs.Kernels(float8=True)`` is refused."""
    memory_efficiency: float | None = None
    """Fraction of ``memory_bandwidth`` elementwise kernels reach (torchao's ``pct_achievable_mem_bw``)."""
    intra_node_axes: frozenset[str] | None = None
    """Mesh axes inside a node; ``None``: the minor axes that fit in ``devices_per_node``."""
    kernel_rates: KernelRates | None = None
    """Rates by kind of kernel, to time a bf16 step kind by kind; ``None``: all at ``compute_efficiency``."""
    source: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Measurement details (the ``"local"`` profile) or notes."""

    def achievable_flops(self, dtype: str) -> float:
        """FLOP/s training reaches in ``dtype``: the datasheet peak times ``compute_efficiency``.

        Raises:
            ShardingError: the profile has no rate for ``dtype``.

        Examples:
            >>> round(fs.hardware("a100").achievable_flops("bfloat16") / 1e12, 1)
            162.2
        """
        return self.peak_flops(dtype) * self.compute_efficiency

    def peak_flops(self, dtype: str) -> float:
        """The datasheet's dense FLOP/s in ``dtype``.

        Raises:
            ShardingError: the profile has no rate for ``dtype``.

        Examples:
            >>> fs.hardware("h100").peak_flops("float32") / 1e12
            67.0
        """
        if dtype not in self.flops:
            raise ShardingError(
                f"hardware {self.name!r} has no FLOP/s for dtype {dtype!r} (it has {sorted(self.flops)}); "
                "compute in one of those (e.g. fs.mixed_precision()) or give the profile a rate with "
                "dataclasses.replace(hw, flops={...})"
            )
        return self.flops[dtype]

    def intra_axes(self, mesh: Mesh) -> frozenset[str]:
        """The mesh axes whose collectives stay inside a node.

        Examples:
            >>> sorted(fs.hardware("h100").intra_axes(fs.Mesh(node=4, dp=2, tp=4)))
            ['dp', 'tp']
        """
        if self.intra_node_axes is not None:
            return frozenset(a for a in mesh.axis_names if a in self.intra_node_axes)
        inside, span = set(), 1
        for axis in reversed(mesh.axis_names):
            span *= mesh[axis]
            if span > self.devices_per_node:
                break
            inside.add(axis)
        return frozenset(inside)

    def link_of(self, mesh: Mesh, axes: Iterable[str]) -> str:
        """``"intra"`` if every axis lies inside a node, else ``"inter"``."""
        inside = self.intra_axes(mesh)
        return "intra" if all(a in inside for a in axes) else "inter"

    def bandwidth(self, mesh: Mesh, axes: Iterable[str], *, point_to_point: bool = False) -> float:
        """Achievable bytes/s one device sends in a collective over ``axes``.

        Across nodes, NCCL runs one ring per NIC: a group with ``k`` ranks in each node (`ranks_per_node`)
        sends through ``k`` NICs at once, each rank's bytes at ``k`` times one NIC's rate, up to the
        node's own links (nccl-tests' bus bandwidth across nodes of 8 GPUs with a 400 Gb/s NIC each is
        that of 8 NICs, docs/will-it-fit.md, "Links"). ``point_to_point`` (all-to-alls, a pipeline's
        sends): each rank's bytes go to its own peers, through its own NIC.

        Examples:
            >>> h = fs.hardware("h100")
            >>> h.bandwidth(fs.Mesh(dp=2, tp=8), ["tp"]) == h.intra_node_bandwidth * h.intra_node_efficiency
            True
            >>> [h.bandwidth(mesh, ["dp"]) / 1e9 for mesh in (fs.Mesh(dp=16, tp=8), fs.Mesh(dp=32, tp=4))]
            [40.0, 80.0]
            >>> h.bandwidth(fs.Mesh(dp=32, tp=4), ["dp"], point_to_point=True) / 1e9
            40.0
        """
        intra = self.intra_node_bandwidth * self.intra_node_efficiency
        if self.link_of(mesh, axes) == "intra":
            return intra
        nics = 1 if point_to_point else self.ranks_per_node(mesh, axes)
        return min(intra, nics * self.inter_node_bandwidth * self.inter_node_efficiency)

    def ranks_per_node(self, mesh: Mesh, axes: Iterable[str]) -> int:
        """How many ranks of one collective group over ``axes`` share a node (consecutive ranks fill a node).

        Examples:
            >>> h = fs.hardware("h100")
            >>> h.ranks_per_node(fs.Mesh(dp=32), ["dp"]), h.ranks_per_node(fs.Mesh(dp=16, tp=8), ["dp"])
            (8, 1)
            >>> h.ranks_per_node(fs.Mesh(dp=4, cp=2, tp=4), ["dp", "cp"])
            2
        """
        group = set(axes)
        if self.intra_node_axes is not None:
            return math.prod(mesh[a] for a in mesh.axis_names if a in group and a in self.intra_node_axes)
        ranks, stride = 1, 1
        for axis in reversed(mesh.axis_names):
            if axis in group:
                ranks *= max(1, min(mesh[axis], self.devices_per_node // stride))
            stride *= mesh[axis]
        return ranks

    def replace(self, **changes: Any) -> Hardware:
        """A copy with some fields changed (``intra_node_axes`` may be any iterable of names).

        Examples:
            >>> fs.hardware("h100").replace(intra_node_axes=["dp"]).intra_node_axes
            frozenset({'dp'})
        """
        if changes.get("intra_node_axes") is not None:
            changes["intra_node_axes"] = frozenset(changes["intra_node_axes"])
        return dataclasses.replace(self, **changes)


_GB = 10**9
_TFLOPS = 10**12

# Datasheet figures (dense, i.e. without 2:4 sparsity); bandwidths per GPU and direction:
# NVLink totals are bidirectional, halved here; one 400 Gb/s NIC per GPU is 50 GB/s.
# Efficiencies: compute from published BF16 runs, converted to our flop convention (full
# attention matrix, recomputation counted); links from nccl-tests bus bandwidth reported
# for the same systems (docs/will-it-fit.md gives each source's arithmetic).
# h100 and a100 are written out in full, each number beside its source; the machines built from
# an H100 (h200, b200) are derived from it and name only what differs.
PROFILES: dict[str, Hardware] = {
    "h100": Hardware(
        name="h100",
        host_bandwidth=64 * _GB,
        flops={
            "bfloat16": 989 * _TFLOPS,
            "float16": 989 * _TFLOPS,
            "float32": 67 * _TFLOPS,
            "float8_e4m3fn": 1979 * _TFLOPS,
        },
        memory_bytes=80 * _GB,
        memory_bandwidth=3.35e12,
        devices_per_node=8,
        intra_node_bandwidth=450 * _GB,
        inter_node_bandwidth=50 * _GB,
        compute_efficiency=0.40,
        intra_node_efficiency=0.80,
        inter_node_efficiency=0.80,
        compile_speedup=1.21,
        gemm_efficiency=0.78,
        memory_efficiency=0.92,
        source=(
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5); efficiency: Llama 3 paper (40-43% of 989 "
            "TFLOP/s at 8k tokens, SXM 700 W) and torchtitan's Llama 3.1 8B FSDP run (36.7% of 989 with "
            "its recomputation, on 96 GB HBM2e parts at 500 W), as docs/will-it-fit.md converts them; "
            "compile speedup: torchtitan's eager and compiled 8B runs, attention set aside; Float8 "
            "roofline fractions: torchao's roofline_utils (docs/will-it-fit.md, Kernels)"
        ),
    ),
    "a100": Hardware(
        name="a100",
        host_bandwidth=32 * _GB,
        flops={"bfloat16": 312 * _TFLOPS, "float16": 312 * _TFLOPS, "float32": 19.5 * _TFLOPS},
        memory_bytes=80 * _GB,
        memory_bandwidth=2.039e12,
        devices_per_node=8,
        intra_node_bandwidth=300 * _GB,
        inter_node_bandwidth=25 * _GB,
        compute_efficiency=0.52,
        intra_node_efficiency=0.80,
        inter_node_efficiency=0.80,
        source=(
            "NVIDIA A100 datasheet (SXM4 80GB); efficiency: Megatron-LM 2021 (52% of peak, counting "
            "full recomputation and attention's full matrix, as we do)"
        ),
    ),
}
# A DGX B200 node is built as a DGX H100 (8 GPUs, a 400 Gb/s NIC each, PCIe 5 to the host) around
# Blackwell GPUs: their rates, memory and NVLink 5 differ. No public BF16 MFU exists for it, so the
# efficiencies and the compile speedup stay the H100's (derived before the H100 gets kernel rates:
# the B200 has none).
PROFILES["b200"] = dataclasses.replace(
    PROFILES["h100"],
    name="b200",
    flops={"bfloat16": 2250 * _TFLOPS, "float16": 2250 * _TFLOPS, "float8_e4m3fn": 4500 * _TFLOPS},
    memory_bytes=180 * _GB,
    memory_bandwidth=7.7e12,
    intra_node_bandwidth=900 * _GB,
    source=(
        "NVIDIA DGX B200 datasheet; efficiency and compile speedup assumed as h100 (no public "
        "BF16 MFU found); Float8 roofline fractions as torchao assumes them (copied from H100)"
    ),
)
# The H200 is an H100 die with more and faster HBM: only memory differs.
PROFILES["h200"] = dataclasses.replace(
    PROFILES["h100"],
    name="h200",
    memory_bytes=141 * _GB,
    memory_bandwidth=4.8e12,
    # measured: bench/cuda_step_kernels.py on one H200 (torch 2.11, cuDNN 9.19), bench/data/h200/rates.json
    kernel_rates=KernelRates(
        matmul=734 * _TFLOPS,
        attention=437 * _TFLOPS,
        bandwidth=3.16e12,
        source="fs.measure_rates on one H200 SXM (bench/data/h200/rates.json)",
    ),
    source="NVIDIA H200 Tensor Core GPU datasheet (SXM); efficiency as h100 (same compute die)",
)
# H100 and A100 are not measured: their rates are the H200's measured fractions of the peak
# (0.742 matmul, 0.442 attention; bandwidth 0.658) of their own datasheets (the H100 shares the
# H200's die). bench/cuda_step_kernels.py measures them.
PROFILES["h100"] = dataclasses.replace(
    PROFILES["h100"],
    kernel_rates=KernelRates(
        matmul=734 * _TFLOPS,
        attention=437 * _TFLOPS,
        bandwidth=0.658 * 3.35e12,
        source="the H200's measured rates (same compute die); bandwidth at the H200's measured fraction",
    ),
)
PROFILES["a100"] = dataclasses.replace(
    PROFILES["a100"],
    kernel_rates=KernelRates(
        matmul=0.742 * 312 * _TFLOPS,
        attention=0.442 * 312 * _TFLOPS,
        bandwidth=0.658 * 2.039e12,
        source="the H200's measured fractions of peak and of bandwidth, applied to the A100's datasheet",
    ),
)


@entry_point
def hardware(name: str | Hardware | None = None, *, processes: int = 4) -> Hardware:
    """A named hardware profile (``None`` means ``"h100"``), or ``name`` itself if already one.

    ``"local"`` is measured once per process and ``processes`` count (matmul rate and gloo all-reduce).

    Args:
        name: ``"h100"``, ``"h200"``, ``"a100"``, ``"b200"``, ``"local"`` or a `Hardware`.
        processes: for ``"local"``: how many processes share this machine.

    Returns:
        The `Hardware`.

    Raises:
        ShardingError: an unknown name.

    Examples:
        >>> fs.hardware("h200").memory_bytes // 10**9
        141
        >>> fs.hardware("tpu9")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: unknown hardware 'tpu9'; choose one of ['a100', 'b200', ...
    """
    if isinstance(name, Hardware):
        return name
    key = "h100" if name is None else name
    if key == "local":
        positive_int(processes, "processes", meaning="the processes sharing this machine")
        return _local(processes)
    if not isinstance(key, str) or key not in PROFILES:
        raise ShardingError(
            f"unknown hardware {key!r}; choose one of {sorted([*PROFILES, 'local'])} or pass an fs.Hardware"
        )
    return PROFILES[key]


@functools.cache  # measured once per process and count, as hardware("local") promises
def _local(processes: int) -> Hardware:
    """This machine, measured on ``processes`` gloo ranks running at once."""
    # only the runtime starts gloo processes: reached through the façade (docs/architecture.md)
    rates = fs.measure.local_rates(processes)
    return Hardware(
        name="local",
        flops=rates["flops"],
        memory_bytes=rates["memory_bytes"],
        memory_bandwidth=rates["memory_bandwidth"],
        devices_per_node=processes,
        intra_node_bandwidth=rates["bandwidth"],
        inter_node_bandwidth=rates["bandwidth"],
        overlap_communication=False,
        cuda=False,
        skips_masked_attention=False,
        collective_latency=rates["collective_latency"],
        tensor_parallel_latency=rates["tensor_parallel_latency"],
        source=f"measured on this machine with {processes} gloo processes running together",
        extra={"processes": processes, "per_rank": rates["per_rank"]},
    )
