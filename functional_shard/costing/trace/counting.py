"""Counters a trace runs under: storages born during a forward, and flops by phase.

`Births` notes every storage an op makes, so that what is alive after the forward can be summed by
`kept_bytes` (`functional_shard.runtime.measure` does the same on real runs); `Flops` counts flops by
phase.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten

from functional_shard.costing.time.documents import RowDocuments
from functional_shard.costing.time.flops import (
    attention_kernel_flops,
    document_attention_flops,
    is_attention,
    op_flops,
)

from .checkpointing import CallKeeps, one_unkept_kernel

__all__ = [
    "Births",
    "Flops",
    "fused_kernel",
    "kept_bytes",
    "moved_bytes",
    "kept_bytes_by_owner",
    "recomputed_bytes",
    "storage_key",
]

_aten = torch.ops.aten
_DEVICE = torch.ops.prim.device.default


def _device_query(func: Any, args: Any) -> torch.device | None:
    """The answer to torch's device query of a fake tensor, as FakeTensor gives it; else None.

    Two thirds of a trace's dispatches are this query: answering it at once saves handing it down.
    """
    if func is _DEVICE and len(args) == 1 and isinstance(args[0], FakeTensor):
        return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
    return None


class Births(TorchDispatchMode):
    """Weak references to the storage of every tensor an op makes (a DTensor's local one).

    ``owner``: the pipeline stage whose module ran when each storage was made (-1: none), from
    ``running``, the stack of stages a trace pushes and pops at module edges.

    Examples:
        >>> births = Births()
        >>> with births:
        ...     kept = torch.ones(3) * 2
        >>> kept_bytes(births.storages, set())
        12
    """

    # flex attention is a higher-order operator: it passes through, its outputs noted
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[StorageWeakRef, None] = {}
        self.owner: dict[StorageWeakRef, int] = {}
        self.running: list[int] = []

    def note(self, tensor: torch.Tensor) -> None:
        """Record ``tensor``'s storage as born now, under the running stage."""
        ref = storage_key(tensor)
        # a dead storage's address may be reused: the dict must hold the live one's reference
        self.storages.pop(ref, None)
        self.storages[ref] = None
        self.owner[ref] = self.running[-1] if self.running else -1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if (device := _device_query(func, args)) is not None:
            return device
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs it as local ops, which come back through here
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.note(leaf)
        return out


_WEIGHT_GRAD_OPS = frozenset(
    op for name in ("mm", "addmm") if (op := getattr(getattr(_aten, name, None), "default", None)) is not None
)


_COPIES = frozenset(
    op
    for name in ("_to_copy", "clone", "to")
    if (op := getattr(getattr(_aten, name, None), "default", None)) is not None
)


_INDEX_PUT = _aten.index_put.default
_INDEX_PUT_IN_PLACE = _aten.index_put_.default


class Flops(TorchDispatchMode):
    """Flops by `functional_shard.costing.time.flops.op_flops`, split into forward, backward, recompute.

    Backward kernels run with grad mode off and checkpoint's recompute with it on, which tells them apart.
    With ``documents``, attention over whole rows is counted per document (`document_attention_flops`).
    """

    supports_higher_order_operators = True

    def __init__(self, documents: RowDocuments | None = None) -> None:
        super().__init__()
        self.documents = documents
        self.backward = False
        self.counts = {"forward": 0, "backward": 0, "recompute": 0, "weight": 0}
        # of those, attention's by phase: the work context parallel shares out by chunk
        self.attention = {"forward": 0, "backward": 0, "recompute": 0}
        # the shapes of the 2-D parameters (either way round): a backward matmul whose
        # output has one and whose operands are both activations is a weight's gradient
        # (dW = dY^T X); one that multiplies by a weight (or its cast copy) is an input's
        self.weight_shapes: set[tuple[int, ...]] = set()
        self.weights: set[StorageWeakRef] = set()
        # forward flops inside checkpointed modules (``checkpointed`` deep), and those of
        # them the policy keeps (``call``, the running call's): what recomputation will re-run
        self.checkpointed = 0
        self.call = CallKeeps("full")
        self.inside = {"all": 0, "saved": 0}
        self.attention_inside = {"all": 0, "saved": 0}  # attention's part of ``inside``
        # of those, the flops up to the last op that saved a tensor for backward in each
        # checkpointed call: what torch's recompute runs before it stops (early stop)
        self.rerun = 0
        # per checkpointed call, the storages it was asked to save (`checkpointed` fills it)
        self.packed: list[dict[StorageWeakRef, int]] = []
        self.running: list[int] = []
        self.by_stage: dict[int, int] = {}
        # what the kernels themselves run, by phase: attention's flops as a fused kernel runs
        # them (`flops.attention_kernel_flops`), and the bytes memory-bound ops read and write
        self.attention_kernel = {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
        self.memory = {"forward": 0, "backward": 0, "recompute": 0}
        self.memory_by_stage: dict[int, int] = {}  # the forward's, as ``by_stage``
        self.fused = 0  # inside a fused kernel's ops (`fused_kernel`): its bytes come whole
        # the same inside checkpointed modules' forwards, for a trace without a backward
        self.memory_inside = 0
        self.memory_rerun = 0
        self.kernel_inside = {"all": 0.0, "saved": 0.0}

    def phase(self) -> str:
        """The phase an op runs in now: forward, backward, or checkpoint's recompute."""
        return "forward" if not self.backward else "recompute" if torch.is_grad_enabled() else "backward"

    def add_memory(self, moved: int) -> None:
        """Count ``moved`` bytes of memory-bound work in the running phase."""
        if moved:
            phase = self.phase()
            self.memory[phase] += moved
            if phase == "forward":
                owner = self.running[-1] if self.running else -1
                self.memory_by_stage[owner] = self.memory_by_stage.get(owner, 0) + moved
            if self.checkpointed and not self.backward:
                self.memory_inside += moved

    def note_packed(self, call: dict[StorageWeakRef, int], tensor: torch.Tensor) -> None:
        """Record in ``call`` (one of ``packed``) the storage of ``tensor``, which it saves."""
        key = storage_key(tensor)
        call[key] = torch.UntypedStorage._new_with_weak_ptr(key.cdata).nbytes()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if (device := _device_query(func, args)) is not None:
            return device
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (
            func in _COPIES
            and self.weights
            and isinstance(out, torch.Tensor)
            and args
            and isinstance(args[0], torch.Tensor)
            and storage_key(args[0]) in self.weights
        ):
            self.weights.add(storage_key(out))  # mixed precision's cast of a weight
        count = op_flops(func, args, kwargs, out)
        if not count and not self.fused:
            # autograd's backward of indexing adds the gradient into fresh zeros in place
            # (at::_index_put_impl_) but under a dispatch mode, as this one, takes the functional
            # index_put (torch's FunctionsManual.cpp index_backward, isTensorSubclassLike)
            runs = _INDEX_PUT_IN_PLACE if func is _INDEX_PUT and self.phase() == "backward" else func
            self.add_memory(moved_bytes(runs, args, kwargs, out, self.weights))
        attention = bool(count) and is_attention(func)
        kept = self.checkpointed > 0 and not self.backward and self.call.keeps(func)
        kernel = 0.0
        if attention:
            per_document = (
                document_attention_flops(func, args, kwargs, count, self.documents)
                if self.documents is not None
                else None
            )
            count, kernel = per_document or (count, attention_kernel_flops(func, args, kwargs, count))
        if count:
            phase = self.phase()
            self.counts[phase] += count
            if attention:
                self.attention[phase] += count
                self.attention_kernel[phase] += kernel
                if self.checkpointed and not self.backward:
                    self.kernel_inside["all"] += kernel
                    self.kernel_inside["saved"] += kernel if kept else 0.0
            if (
                phase == "backward"
                and func in _WEIGHT_GRAD_OPS
                and isinstance(out, torch.Tensor)
                and tuple(out.shape) in self.weight_shapes
                and not any(storage_key(a) in self.weights for a in args if isinstance(a, torch.Tensor))
            ):
                self.counts["weight"] += count
            if phase == "forward":
                owner = self.running[-1] if self.running else -1
                self.by_stage[owner] = self.by_stage.get(owner, 0) + count
            if self.checkpointed and not self.backward:
                self.inside["all"] += count
                self.inside["saved"] += count if kept else 0
                if attention:
                    self.attention_inside["all"] += count
                    self.attention_inside["saved"] += count if kept else 0
        return out


# ops that write no data: handles, and allocations (torch.empty is empty.memory_format)
_FREE = frozenset(
    op
    for name, overload in (
        ("detach", "default"),
        ("alias", "default"),
        ("empty", "memory_format"),
        ("new_empty", "default"),
        ("empty_like", "default"),
        ("empty_strided", "default"),
        ("lift_fresh", "default"),
        ("set_", "default"),
        ("resize_", "default"),
    )
    if (op := getattr(getattr(_aten, name, None), overload, None)) is not None
)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    # a broadcast (expanded) tensor is read once: at most its storage
    size = tensor.numel() * tensor.element_size()
    try:
        return min(size, tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return size


# in-place writes through an index: (dim or indices, source) arguments, and whether they add
_INDEXED_WRITES = {
    op: adds
    for name, adds in (
        ("index_add_", True),
        ("index_copy_", False),
        ("index_put_", None),
        ("_index_put_impl_", None),
    )
    if (op := getattr(getattr(_aten, name, None), "default", None)) is not None
}


def _indexed_write_bytes(func: Any, args: Any, kwargs: Mapping[str, Any]) -> int:
    # the kernel reads the index and the source and touches only the destination's indexed
    # elements (read and written when it adds, written when it copies), not the whole of it
    destination = args[0]
    adds = _INDEXED_WRITES[func]
    if adds is None:  # index_put_(self, indices, values, accumulate=False)
        adds = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
        others = [i for i in args[1] if i is not None] + [args[2]]
        touched = _indexed_elements(destination, args[1])
    else:  # index_add_(self, dim, index, source) and index_copy_ alike
        touched, others = args[3].numel(), [args[2], args[3]]
    read = {storage_key(t): _tensor_bytes(t) for t in others if isinstance(t, torch.Tensor)}
    # a repeated index touches its element again in cache: at most the whole destination
    touched = min(touched, destination.numel())
    return sum(read.values()) + (2 if adds else 1) * touched * destination.element_size()


def _indexed_elements(destination: torch.Tensor, indices: Any) -> int:
    # the elements ``destination[indices]`` names: the indices' positions (a boolean mask counts
    # all it covers, at most what it selects) times the elements of the dims left whole
    dim, indexed_size, shapes = 0, 1, []
    for index in indices:
        span = 1 if index is None or index.dtype != torch.bool else index.ndim
        if index is not None:
            indexed_size *= math.prod(destination.shape[dim : dim + span])
            shapes.append(index.shape)
        dim += span
    if not shapes or not indexed_size:
        return destination.numel() if not shapes else 0
    return math.prod(torch.broadcast_shapes(*shapes)) * (destination.numel() // indexed_size)


def moved_bytes(
    func: Any, args: Any, kwargs: Mapping[str, Any], out: Any, weights: set[StorageWeakRef]
) -> int:
    """Bytes a memory-bound op reads and writes: its tensor inputs and its new outputs.

    Views move nothing; an in-place op writes what it read, an in-place indexed write (``index_add_``,
    ``index_put_``) only the elements its index names; a weight's cast is FSDP's, counted apart.

    Examples:
        >>> x, y = torch.ones(4), torch.ones(4)
        >>> moved_bytes(torch.ops.aten.add.Tensor, (x, y), {}, x + y, set())
        48
        >>> moved_bytes(torch.ops.aten.view.default, (x, [2, 2]), {}, x.view(2, 2), set())
        0
        >>> moved_bytes(torch.ops.aten.empty.memory_format, ([4],), {}, torch.empty(4), set())  # torch.empty
        0
        >>> rows, index, source = torch.zeros(1000, 4), torch.tensor([3, 7]), torch.ones(2, 4)
        >>> rows.index_add_(0, index, source).shape  # reads index and source, adds into 2 rows
        torch.Size([1000, 4])
        >>> moved_bytes(torch.ops.aten.index_add_.default, (rows, 0, index, source), {}, rows, set())
        112
    """
    if func in _FREE or getattr(func, "is_view", False):
        return 0
    if func in _INDEXED_WRITES:
        return _indexed_write_bytes(func, args, kwargs)
    inputs = [t for t in tree_flatten((args, dict(kwargs)))[0] if isinstance(t, torch.Tensor)]
    if func in _COPIES and any(storage_key(t) in weights for t in inputs):
        return 0
    read = {storage_key(t): _tensor_bytes(t) for t in inputs}
    outputs = [leaf for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
    if not outputs:
        return 0  # a query (its device, its size), not a kernel
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in _schema_arguments(func))
    if outputs and not mutates and all(storage_key(t) in read for t in outputs):
        return 0  # a view by another name (``_unsafe_view``, ``reshape`` of a contiguous tensor)
    return sum(read.values()) + sum(t.numel() * t.element_size() for t in outputs)


def _schema_arguments(func: Any) -> list[Any]:
    schema = getattr(func, "_schema", None)
    return list(schema.arguments) if schema is not None else []


@contextlib.contextmanager
def fused_kernel(moved: int) -> Iterator[None]:
    """Within the block, ops are one fused kernel's: their bytes count as ``moved``, once.

    For ops one kernel runs (`functional_shard.costing.trace.cuda_kernels`' RMSNorm, `routing`'s
    grouped matmuls). The kernel is no op of `checkpointing.SAVED_OPS`: no checkpoint policy keeps its ops.
    """
    counters = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, Flops)]
    for counter in counters:
        counter.fused += 1
    try:
        with one_unkept_kernel():
            yield
    finally:
        for counter in counters:
            counter.fused -= 1
            counter.add_memory(moved)


def storage_key(tensor: torch.Tensor) -> StorageWeakRef:
    """The key of ``tensor``'s storage (a DTensor's local one), alive or dead."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return StorageWeakRef(local.untyped_storage())


def kept_bytes(
    births: Mapping[StorageWeakRef, None], exclude: set[StorageWeakRef], *, collect: int = 2
) -> int:
    """Bytes of the storages in ``births`` still alive, but for ``exclude``.

    A garbage collection up to generation ``collect`` runs first: checkpoint frames make cycles.
    """
    gc.collect(collect)
    total = 0
    for ref in births:
        if ref.expired() or ref in exclude:
            continue
        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        total += storage.nbytes()
    return total


def recomputed_bytes(packed: list[dict[StorageWeakRef, int]], *, collect: int = 2) -> int:
    """The most bytes one checkpointed call's recompute makes again and holds for its backward.

    ``packed``: per call, the storages it saved; those dead after the forward are what the recompute rebuilds.

    Examples:
        >>> kept, dropped = torch.ones(2), torch.ones(3)
        >>> packed = [{storage_key(kept): 8, storage_key(dropped): 12}]
        >>> del dropped
        >>> recomputed_bytes(packed)
        12
    """
    gc.collect(collect)
    return max((sum(n for ref, n in call.items() if ref.expired()) for call in packed), default=0)


def kept_bytes_by_owner(births: Births, exclude: set[StorageWeakRef], *, collect: int = 2) -> dict[int, int]:
    """`kept_bytes`, by the pipeline stage that made each storage (-1: made outside every stage)."""
    gc.collect(collect)
    out: dict[int, int] = {}
    for ref in births.storages:
        if ref.expired() or ref in exclude:
            continue
        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        owner = births.owner.get(ref, -1)
        out[owner] = out.get(owner, 0) + storage.nbytes()
    return out
