"""Measure what a running plan costs, to hold beside `Plan.cost`'s prediction.

An edge module like `apply`: it observes the collectives torch issues and the tensors a
rank holds, and issues no collective of its own. Bytes follow the cost model's ring
conventions, from the full (gathered) size S of each collective: all-gather and
reduce-scatter send (n-1)/n·S per rank, all-reduce 2(n-1)/n·S, broadcast and reduce
(n-1)/n·S; an all-to-all sends what it hands the other ranks (its input less this rank's own
split), and so do a gather (each rank but the root its input, the root nothing) and a scatter
(the root every piece but its own, the others nothing); a send (``send_recv``, as a
pipeline's stages issue) all its bytes, on the axes where the two ranks differ. Coalesced
collectives count per tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from functional_shard.core.mesh import Mesh
from functional_shard.core.validate import instance_of

from .launch import LocalWorld

__all__ = [
    "CollectiveLog",
    "kept_activation_bytes",
    "local_rates",
    "probe_local_rates",
    "resident_bytes",
    "saved_tensor_bytes",
]

# DTensor and FSDP2 issue these functional collectives; they name their group last
_FUNCTIONAL = {
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::all_reduce": "all_reduce",
    "_c10d_functional::broadcast": "broadcast",
}


def _functional_kind(name: str) -> str:
    # the in-place (``all_reduce_``), ``_out`` and coalesced forms send as the plain one does
    return name.removesuffix("_").removesuffix("_out").removesuffix("_coalesced")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CollectiveLog(TorchDispatchMode):
    """Every collective torch issues while active, and the bytes this rank sent.

    ``sent`` sums them per kind and mesh axes, in ``Cost.comm_bytes``'s shape; ``ops``
    lists each one (kind, axes, full bytes).

    Examples:
        >>> # with fs.CollectiveLog(plan.mesh) as log:
        >>> #     train_step()
        >>> # log.sent == {"reduce_scatter": {"dp": 1.5e6}, "all_gather": {"dp": 3.0e6}}
    """

    def __init__(self, mesh: Mesh) -> None:
        super().__init__()
        self.mesh = instance_of(
            mesh, Mesh, "mesh", meaning="the plan's mesh, plan.mesh, whose axes the bytes go by"
        )
        self.sent: dict[str, dict[str, float]] = {}
        self.ops: list[tuple[str, str, int]] = []

    def _axes(self, group: Any) -> str:
        coords = [self.mesh.coords(rank) for rank in dist.get_process_group_ranks(group)]
        return ",".join(a for a in self.mesh.axis_names if len({c[a] for c in coords}) > 1)

    def _count(self, kind: str, axes: str, full_bytes: int, sent: float) -> None:
        self.ops.append((kind, axes, full_bytes))
        by_axes = self.sent.setdefault(kind, {})
        by_axes[axes] = by_axes.get(axes, 0.0) + float(sent)

    def _record(self, kind: str, group: Any, full_bytes: int) -> None:
        n = group.size()
        factor = 2 if kind == "all_reduce" else 1
        self._count(kind, self._axes(group), full_bytes, factor * (n - 1) / n * full_bytes)

    def _record_send(self, group: Any, peer: int, nbytes: int) -> None:
        # point to point (a pipeline stage's activations and gradients): all of it, counted by
        # the sender on the axes where the two ranks' coordinates differ, as Plan.cost does
        ends = (self.mesh.coords(dist.get_rank()), self.mesh.coords(dist.get_global_rank(group, peer)))
        axes = ",".join(a for a in self.mesh.axis_names if ends[0][a] != ends[1][a])
        self._count("send_recv", axes, nbytes, nbytes)

    def _record_all_to_all(self, group: Any, tensor: torch.Tensor, input_splits: list[int]) -> None:
        # an all-to-all sends each rank its own rows (splits along dim 0; none: equal parts)
        # and keeps this rank's part: sent is everything but that part
        n, me = group.size(), dist.get_rank(group)
        total = _nbytes(tensor)
        if input_splits:
            row = total // tensor.shape[0] if tensor.shape[0] else 0
            sent = (sum(input_splits) - input_splits[me]) * row
        else:
            sent = total * (n - 1) // n
        self._count("all_to_all", self._axes(group), total, sent)

    def _record_direct(self, kind: str, group: Any, full_bytes: int, handed: list[int]) -> None:
        # gather, scatter and all_to_all's list form go straight from rank to rank: this rank
        # holds ``handed`` bytes for each rank in group order and sends all but its own
        me = dist.get_rank(group)
        sent = sum(nbytes for rank, nbytes in enumerate(handed) if rank != me)
        self._count(kind, self._axes(group), full_bytes, sent)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        # modes run before tensor subclasses: handing a DTensor op back lets DTensor turn
        # it into local ops and the collectives it needs (a Partial gradient's all-reduce
        # inside an optimizer step, say), which then come through here to be counted
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = func.name()
        if name in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_"):
            kind = "all_gather" if "allgather" in name else "reduce_scatter"
            full = args[0] if kind == "all_gather" else args[1]
            self._record(kind, dist.ProcessGroup.unbox(args[2]), _nbytes(full))
        elif name in ("c10d::allreduce_", "c10d::allreduce_coalesced_"):
            self._record("all_reduce", dist.ProcessGroup.unbox(args[1]), sum(map(_nbytes, args[0])))
        elif name == "c10d::allgather_":  # all_gather into a list: one full output per input
            group = dist.ProcessGroup.unbox(args[2])
            self._record("all_gather", group, sum(map(_nbytes, args[1])) * group.size())
        elif name in ("c10d::allgather_into_tensor_coalesced_", "c10d::reduce_scatter_tensor_coalesced_"):
            kind = "all_gather" if "allgather" in name else "reduce_scatter"
            group = dist.ProcessGroup.unbox(args[2])
            for full in args[0] if kind == "all_gather" else args[1]:
                self._record(kind, group, _nbytes(full))
        elif name == "c10d::send":
            self._record_send(dist.ProcessGroup.unbox(args[1]), args[2], sum(map(_nbytes, args[0])))
        elif name in ("c10d::broadcast_", "c10d::reduce_"):
            kind = "broadcast" if name == "c10d::broadcast_" else "reduce"
            self._record(kind, dist.ProcessGroup.unbox(args[1]), sum(map(_nbytes, args[0])))
        elif name == "c10d::reduce_scatter_":  # from a list: one full input per output
            group = dist.ProcessGroup.unbox(args[2])
            self._record("reduce_scatter", group, sum(map(_nbytes, args[0])) * group.size())
        elif name == "c10d::allgather_coalesced_":  # (output lists, inputs, group, ...)
            group = dist.ProcessGroup.unbox(args[2])
            for tensor in args[1]:
                self._record("all_gather", group, _nbytes(tensor) * group.size())
        elif name == "c10d::gather_":  # ([outputs] at the root, [input], group, root rank in it, ...)
            group, piece = dist.ProcessGroup.unbox(args[2]), _nbytes(args[1][0])
            handed = [piece if rank == args[3] else 0 for rank in range(group.size())]
            self._record_direct("gather", group, piece * group.size(), handed)
        elif name == "c10d::scatter_":  # ([output], [inputs] at the root, group, root rank in it, ...)
            group, piece = dist.ProcessGroup.unbox(args[2]), _nbytes(args[0][0])
            handed = [_nbytes(tensor) for tensor in args[1][0]] if args[1] else []
            self._record_direct("scatter", group, piece * group.size(), handed)
        elif name == "c10d::alltoall_":  # all_to_all of lists: (outputs, inputs, group, ...)
            group = dist.ProcessGroup.unbox(args[2])
            handed = [_nbytes(tensor) for tensor in args[1]]
            self._record_direct("all_to_all", group, sum(handed), handed)
        elif name == "c10d::alltoall_base_":
            # (output, input, group, output splits, input splits, ...)
            self._record_all_to_all(dist.ProcessGroup.unbox(args[2]), args[1], args[4])
        elif name == "_c10d_functional::all_to_all_single":
            from torch.distributed.distributed_c10d import _resolve_process_group

            self._record_all_to_all(_resolve_process_group(args[-1]), args[0], args[2])
        elif _functional_kind(name) in _FUNCTIONAL:
            from torch.distributed.distributed_c10d import _resolve_process_group

            kind, group = _FUNCTIONAL[_functional_kind(name)], _resolve_process_group(args[-1])
            scale = group.size() if kind == "all_gather" else 1
            for tensor in args[0] if "_coalesced" in name else [args[0]]:
                self._record(kind, group, _nbytes(tensor) * scale)
        return func(*args, **(kwargs or {}))


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    # views of one buffer (FSDP2's padded shards, TP's scatter buffer) count once
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def resident_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state, from storages.

    The keys match `Cost`'s ``params_bytes``, ``grads_bytes`` and ``optimizer_bytes``.

    Examples:
        >>> # fs.resident_bytes(model, optimizer)["optimizer"] == plan.cost("adamw", rank=r).optimizer_bytes
    """
    instance_of(module, torch.nn.Module, "module")
    instance_of(optimizer, torch.optim.Optimizer, "optimizer", meaning="its optimizer")
    params = list(module.parameters())
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
    states = [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _storage_bytes(states),
    }


def probe_local_rates(size: int = 1024, tensor_bytes: int = 1 << 22, repeats: int = 3) -> dict[str, Any]:
    """This rank's matmul FLOP/s and gloo all-reduce bandwidth, with every rank running at once.

    The one place in this module that issues collectives of its own: `fs.hardware("local")`
    runs it on `fs.LocalWorld` ranks to measure the machine it plans for.

    Returns:
        ``{"flops": {dtype: FLOP/s}, "bandwidth": bytes sent per second per rank, "latency":
        seconds of a one-element all-reduce}``, the best of ``repeats`` timings, counting ring
        all-reduce bytes as the cost model does.

    Examples:
        >>> # fs.LocalWorld(4).run(probe_local_rates)[0]["bandwidth"]
    """
    import time

    flops = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        dist.barrier()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        flops[str(dtype).removeprefix("torch.")] = 2 * size**3 / best
    n = dist.get_world_size()
    tensor = torch.zeros(tensor_bytes // 4)
    dist.all_reduce(tensor)  # first call sets up gloo's connections
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        best = min(best, time.perf_counter() - start)
    sent = 2 * (n - 1) / n * tensor_bytes if n > 1 else 0.0
    tiny, latencies = torch.zeros(1), []
    for _ in range(2 * repeats + 1):  # the median: a typical collective, not the luckiest
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tiny)
        latencies.append(time.perf_counter() - start)
    engine = {kind: _engine_collective_seconds(kind, repeats) for kind in ("fsdp", "tp")}
    source, target = torch.ones(1 << 24), torch.empty(1 << 24)
    dist.barrier()
    copy = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        copy = min(copy, time.perf_counter() - start)
    return {
        "flops": flops,
        "bandwidth": sent / best if sent else float("inf"),
        "latency": sorted(latencies)[repeats],
        "engine_latency": engine,
        "memory_bandwidth": 2 * source.nbytes / copy,  # read and write
    }


def _engine_collective_seconds(kind: str, repeats: int, layers: int = 8, width: int = 64) -> float:
    """Seconds each collective adds to a real training step of ``kind`` ("fsdp" or "tp").

    Inside a step ranks reach each collective at different moments and the engine wraps it in
    work of its own (FSDP2's copies, DTensor's dispatch): on a shared CPU about 10 ms against a
    bare all-reduce's 0.6 ms. So: time ``layers`` small linear layers with and without the
    engine, and divide the difference by the collectives it issued.
    """
    import warnings

    from torch import nn

    from functional_shard.planning.planner import shard
    from functional_shard.planning.policy.builders import fsdp, tp

    from .apply import apply

    n = dist.get_world_size()
    if n == 1:
        return 0.0

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])

    x = torch.randn(8, width)
    if kind == "fsdp":
        mesh, policy = Mesh(dp=n), fsdp("dp")
    else:
        styles = [(str(i), "colwise" if i % 2 == 0 else "rowwise") for i in range(layers)]
        mesh, policy = Mesh(tp=n), tp(styles, "tp")
    plain = model()
    run = model()
    apply(shard(run, mesh, policy), run)
    with warnings.catch_warnings():
        # FSDP2's view-output notice and CommDebugMode's backward-hook notice: nothing to act on
        warnings.simplefilter("ignore")
        return _added_per_collective(run, plain, x, repeats)


def _added_per_collective(run: Any, plain: Any, x: torch.Tensor, repeats: int) -> float:
    import statistics
    import time

    from torch.distributed.tensor.debug import CommDebugMode

    def seconds(module: Any) -> float:
        module(x).sum().backward()  # warm-up: lazy state, gloo connections
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            module(x).sum().backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    with CommDebugMode() as comm:
        run(x).sum().backward()
    issued = comm.get_total_counts()
    return max(0.0, seconds(run) - seconds(plain)) / max(issued, 1)


def _parameter_like(tensor: torch.Tensor) -> bool:
    # a parameter (DTensor, FSDP2's gathered one swapped in mid-forward, a plain one) or a view
    # of one (w.t()); a leaf that merely requires grad (an input, a pipeline stage's received
    # activations) is not one: autograd saves it like any activation
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, torch.nn.Parameter)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def saved_tensor_bytes(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """Bytes autograd saves for backward during ``module(*args, **kwargs)``, and its output.

    Counted with ``torch.autograd.graph.saved_tensors_hooks``: unique storages, parameters,
    the module's buffers (`Plan.cost` counts them) and views of them excluded; an input that
    requires grad counts, as autograd saves it. Checkpointed modules hide their inner saves
    behind their own hooks: use `kept_activation_bytes` there.

    Examples:
        >>> layer = nn.Linear(4, 3)
        >>> fs.saved_tensor_bytes(layer, torch.ones(2, 4))[0]  # the input, for the weight gradient
        32
    """
    instance_of(module, torch.nn.Module, "module", meaning="the module to call on the arguments")
    from torch.multiprocessing.reductions import StorageWeakRef

    saved: dict[Any, torch.UntypedStorage] = {}
    # the module's own tensors by storage too: a plain tensor the forward takes of one (a
    # DTensor parameter's local shard) is no activation either
    owned = {StorageWeakRef(_local(t).untyped_storage()) for t in [*module.buffers(), *module.parameters()]}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not _parameter_like(tensor):
            storage = _local(tensor).untyped_storage()
            key = StorageWeakRef(storage)
            if key not in owned:
                saved[key] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = module(*args, **kwargs)
    return sum(storage.nbytes() for storage in saved.values()), output


def kept_activation_bytes(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """Bytes still held for backward once ``module(*args, **kwargs)`` returns, and its output.

    Every storage the forward makes (the tensor inputs are copied first) is watched by weak
    reference; those alive afterwards, but for the output and the parameters, are what autograd
    and checkpoint frames keep. Agrees with `saved_tensor_bytes` without checkpointing, and
    sees through it. With DTensor parameters or inside a cp step, every rank calls it together:
    it waits on a barrier per group, since gloo's threads may hold an ended collective's buffers.

    Examples:
        >>> layer = nn.Linear(4, 3)
        >>> fs.kept_activation_bytes(layer, torch.ones(2, 4, requires_grad=True))[0]
        32
    """
    instance_of(module, torch.nn.Module, "module", meaning="the module to call on the arguments")
    # lazily: the trace's counters load torch's fake-tensor machinery
    from functional_shard.costing.trace.counting import Births, kept_bytes, storage_key

    births = Births()

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        clone = tensor.detach().clone().requires_grad_(tensor.requires_grad)
        births.note(clone)
        return clone

    args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, copy, (args, kwargs))
    with births:
        output = module(*args, **kwargs)
    del args, kwargs
    leaves = [leaf for leaf in torch.utils._pytree.tree_flatten(output)[0] if isinstance(leaf, torch.Tensor)]
    logits = getattr(output, "logits", None)
    leaves += [logits] if isinstance(logits, torch.Tensor) else []
    exclude = {storage_key(t) for t in leaves} | {storage_key(p) for p in module.parameters()}
    _collectives_ended(module)
    return kept_bytes(births.storages, exclude), output


def _collectives_ended(module: torch.nn.Module) -> None:
    """Wait until every collective on ``module``'s DTensor parameters' groups has ended.

    And on the cp group of a running context-parallel step, whose attention gathers too. A
    barrier on each group (in rank order, the same on every rank) waits for the work before it.
    """
    from torch.distributed.tensor import DTensor

    from .engines.context.parallel import current_sequence_group

    groups = {}
    for parameter in module.parameters():
        if isinstance(parameter, DTensor):
            for group in parameter.device_mesh.get_all_groups():
                groups[tuple(dist.get_process_group_ranks(group))] = group
    if (sequence := current_sequence_group()) is not None:
        groups[tuple(dist.get_process_group_ranks(sequence))] = sequence
    for _, group in sorted(groups.items()):
        dist.barrier(group=group)


def local_rates(processes: int) -> dict[str, Any]:
    """This machine's rates, measured on ``processes`` local gloo ranks running at once.

    What ``fs.hardware("local", processes=...)`` makes its `Hardware` from: each rate the
    slowest rank's, the latencies each collective's as it costs inside a real step of its
    engine, and the memory a process may count on.

    Examples:
        >>> # local_rates(4)["flops"]["float32"]
    """
    world = LocalWorld(processes)
    try:
        results = world.run(probe_local_rates)
    finally:
        world.close()
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "flops": {k: min(r["flops"][k] for r in results) for k in results[0]["flops"]},
        "memory_bytes": pages // processes,
        "memory_bandwidth": min(r["memory_bandwidth"] for r in results),
        "bandwidth": min(r["bandwidth"] for r in results),
        "collective_latency": max(r["engine_latency"]["fsdp"] for r in results),
        "tensor_parallel_latency": max(r["engine_latency"]["tp"] for r in results),
        "per_rank": results,
    }
