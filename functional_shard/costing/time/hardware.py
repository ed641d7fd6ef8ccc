"""Accelerators as data: peak rates from vendor datasheets, achievable fractions from public runs.

The named profiles are tables of profiles.toml, each figure beside its source.

The efficiency factors turn datasheet peaks into what real training reaches, from published runs
(docs/will-it-fit.md). Minor mesh axes fill a node first: an axis is inside a node when its size times
the more-minor axes' is at most ``devices_per_node`` (or name them in ``intra_node_axes``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the backport, on Python 3.10
    import tomli as tomllib

import functional_shard as fs
from functional_shard.core.errors import ShardingError
from functional_shard.core.mesh import Mesh
from functional_shard.core.validate import entry_point, positive_int, positive_number, refuse

__all__ = ["PROFILES", "Hardware", "KernelRates", "hardware", "process_limit"]


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

    def __post_init__(self) -> None:
        # a profile written by hand (fs.Hardware(...), replace) is refused where it is made, not in a step
        positive_int(self.devices_per_node, "Hardware.devices_per_node")
        for dtype, rate in self.flops.items():
            positive_number(rate, f"Hardware.flops[{dtype!r}]", meaning="dense FLOP/s")
        for name in _REQUIRED:
            _positive_or_unbounded(getattr(self, name), name)
        for name in _OPTIONAL:
            if getattr(self, name) is not None:
                _positive_or_unbounded(getattr(self, name), name)

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


_REQUIRED = (
    "memory_bytes",
    "memory_bandwidth",
    "intra_node_bandwidth",
    "inter_node_bandwidth",
    "host_bandwidth",
    "compute_efficiency",
    "intra_node_efficiency",
    "inter_node_efficiency",
)
_OPTIONAL = ("compile_speedup", "gemm_efficiency", "memory_efficiency")  # None: the profile has no figure


def _positive_or_unbounded(value: Any, name: str) -> None:
    """A rate or size above 0; infinite where nothing bounds it (a measured link that never waited)."""
    if value != math.inf:
        positive_number(value, f"Hardware.{name}")


def _profiles() -> dict[str, Hardware]:
    """The named profiles, read from profiles.toml (datasheet figures, each beside its source)."""
    tables = tomllib.loads(resources.files(__package__).joinpath("profiles.toml").read_text(encoding="utf-8"))
    profiles: dict[str, Hardware] = {}
    for name, table in tables.items():
        fields = dict(table)
        like = fields.pop("like", None)
        # never inherited: a profile built on another states its own kernel rates and source, or has none
        rates = fields.pop("kernel_rates", None)
        fields["kernel_rates"] = None if rates is None else KernelRates(**rates)
        fields.setdefault("source", "")
        base = profiles[like] if like is not None else None
        profiles[name] = (
            Hardware(name=name, **fields) if base is None else dataclasses.replace(base, name=name, **fields)
        )
    return profiles


PROFILES: dict[str, Hardware] = _profiles()


def process_limit() -> int:
    """How many local gloo processes this machine runs: four per usable CPU core, at least eight.

    Past that, gloo ranks crawl for minutes before a collective times out. ``"local"`` hardware
    and the demo start one process per device of a plan, and start no more than this.

    Examples:
        >>> process_limit() >= 8
        True
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(8, 4 * (cores or 1))


@entry_point
def hardware(name: str | Hardware | None = None, *, processes: int = 4) -> Hardware:
    """A named hardware profile (``None`` means ``"h100"``), or ``name`` itself if already one.

    ``"local"`` is measured once per process and ``processes`` count (matmul rate and gloo all-reduce).

    Args:
        name: ``"h100"``, ``"h200"``, ``"a100"``, ``"b200"``, ``"local"`` (in any case) or a `Hardware`.
        processes: for ``"local"``: how many processes share this machine.

    Returns:
        The `Hardware`.

    Raises:
        ShardingError: an unknown name, or ``"local"`` with more processes than this machine runs.

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
    if isinstance(key, str):  # as datasheets and nvidia-smi write them: "H100" is "h100"
        key = key.lower()
    if key == "local":
        positive_int(processes, "processes", meaning="the processes sharing this machine")
        if processes > (limit := process_limit()):
            # each process is a device of the plan: a 1024-device plan would start 1024 here
            refuse(
                "processes",
                str(processes),
                f"at most {limit} on this machine (four per usable core, at least eight)",
                meaning="'local' measures this machine with one process per device; for a larger plan "
                "name a profile (h100, ...) or pass an fs.Hardware",
            )
        return _local(processes)
    if not isinstance(key, str) or key not in PROFILES:
        raise ShardingError(
            f"unknown hardware {name!r}; choose one of {sorted([*PROFILES, 'local'])} or pass an fs.Hardware"
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
