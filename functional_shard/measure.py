"""Measure what a running plan costs, to hold beside `Plan.cost`'s prediction.

An edge module like `apply`: it observes the collectives torch issues and the tensors a
rank holds, and issues no collective of its own. Bytes follow the cost model's ring
conventions, from the full (gathered) size S of each collective: all-gather and
reduce-scatter send (n-1)/n·S per rank, all-reduce 2(n-1)/n·S, broadcast (n-1)/n·S.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .mesh import Mesh

__all__ = ["CollectiveLog", "resident_bytes"]

# DTensor and FSDP2 issue these functional collectives; they name their group last
_FUNCTIONAL = {
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::all_reduce": "all_reduce",
}


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
        self.mesh = mesh
        self.sent: dict[str, dict[str, float]] = {}
        self.ops: list[tuple[str, str, int]] = []

    def _axes(self, group: Any) -> str:
        coords = [self.mesh.coords(rank) for rank in dist.get_process_group_ranks(group)]
        return ",".join(a for a in self.mesh.axis_names if len({c[a] for c in coords}) > 1)

    def _record(self, kind: str, group: Any, full_bytes: int) -> None:
        n = group.size()
        factor = 2 if kind == "all_reduce" else 1
        axes = self._axes(group)
        self.ops.append((kind, axes, full_bytes))
        by_axes = self.sent.setdefault(kind, {})
        by_axes[axes] = by_axes.get(axes, 0.0) + factor * (n - 1) / n * full_bytes

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
        elif name == "c10d::allreduce_":
            self._record("all_reduce", dist.ProcessGroup.unbox(args[1]), sum(map(_nbytes, args[0])))
        elif name == "c10d::broadcast_":
            self._record("broadcast", dist.ProcessGroup.unbox(args[1]), sum(map(_nbytes, args[0])))
        elif name in _FUNCTIONAL:
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(args[-1])
            scale = group.size() if _FUNCTIONAL[name] == "all_gather" else 1
            self._record(_FUNCTIONAL[name], group, _nbytes(args[0]) * scale)
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
    params = list(module.parameters())
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
    states = [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _storage_bytes(states),
    }
