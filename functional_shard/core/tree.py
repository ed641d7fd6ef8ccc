"""From a model to what a plan needs to know: each tensor's shape, dtype and owner.

`read_model` accepts an ``nn.Module`` (meta device included), a state dict, or any
optree pytree of tensors, and never touches tensor data.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from . import pytree as _pytree
from .errors import ShardingError

__all__ = [
    "Block",
    "ModelTree",
    "Pattern",
    "TensorSpec",
    "as_written",
    "is_hf_model",
    "matches",
    "read_model",
    "within",
]

Pattern = str | re.Pattern[str]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a policy sees of one tensor: shape, dtype and the module that owns it.

    Examples:
        >>> spec = TensorSpec((4096, 1024), torch.bfloat16, module_name="torch.nn.Linear")
        >>> spec.ndim, spec.numel, spec.nbytes
        (2, 4194304, 8388608)
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    module_name: str | None = None
    """Qualified class name of the owning module (``None`` for bare pytrees)."""
    kind: str = "param"
    """``"param"`` or ``"buffer"``."""
    module_type: type | None = field(default=None, compare=False, repr=False)
    """The owning module's class, when the plan was made from a live module."""
    frozen: bool = False
    """A floating-point parameter its module holds with ``requires_grad=False`` (a LoRA base weight)."""

    @property
    def ndim(self) -> int:
        """Number of dims."""
        return len(self.shape)

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def differentiable(self) -> bool:
        """Whether it gets a gradient: a float or complex tensor (torch allows no other) not frozen.

        An integer or bool parameter is always frozen (``requires_grad=False``), a float one when
        its module froze it: no gradient, no optimizer state, nothing reduced.

        Examples:
            >>> TensorSpec((4,), torch.bfloat16).differentiable, TensorSpec((4,), torch.int64).differentiable
            (True, False)
        """
        return not self.frozen and (self.dtype.is_floating_point or self.dtype.is_complex)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.numel * self.itemsize

    def module_is(self, cls: type) -> bool:
        """Whether the owning module is a ``cls`` (by class, else by qualified name)."""
        if self.module_type is not None:
            return issubclass(self.module_type, cls)
        return self.module_name in {_qualname(cls), f"{cls.__module__}.{cls.__name__}"}

    def to_json(self) -> dict[str, Any]:
        """Shape, dtype name, owner name and kind as JSON; ``"frozen": true`` for a frozen one."""
        data = {
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "module": self.module_name,
            "kind": self.kind,
        }
        # only when set: the plans of models without frozen parameters read and write as before
        return {**data, "frozen": True} if self.frozen else data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorSpec:
        """The inverse of `to_json`."""
        spec = cls(tuple(data["shape"]), dtype_from_name(data["dtype"]), data["module"], data["kind"])
        return replace(spec, frozen=True) if data.get("frozen") else spec


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``, with a clear error for unknown names."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ShardingError(f"{name!r} is not a torch dtype; use e.g. 'float32' or 'bfloat16'")
    return dtype


@dataclass(frozen=True, slots=True)
class Block:
    """One repeated block (``layers.3``): its tensors, and a key equal for blocks alike.

    Equal keys: same parent, same tensors and module classes at the same relative paths, nothing tied.
    """

    path: str
    key: Hashable
    params: tuple[str, ...]
    buffers: tuple[str, ...]


@dataclass(frozen=True)
class ModelTree:
    """Tensors by path, tied aliases, and the module tree (paths → class)."""

    params: dict[str, TensorSpec]
    buffers: dict[str, TensorSpec]
    aliases: dict[str, tuple[str, ...]]
    """Canonical path → every path that shares the tensor (canonical first)."""
    modules: dict[str, type | None]
    """Module path ("" is the root) → class, or None when read from a pytree."""
    alias_specs: dict[str, TensorSpec] = field(default_factory=dict)
    """Tied names other than the canonical one → the tensor as their own module owns it."""
    blocks: tuple[Block, ...] = ()
    """The outermost numbered modules (``layers.0``, ``layers.1``, ...) with no tied tensor."""

    def spec_as(self, name: str, canonical: str) -> TensorSpec:
        """The tensor at ``canonical`` as seen under the name ``name`` (its owner's type)."""
        return self.alias_specs.get(name, self.params.get(canonical) or self.buffers[canonical])


def _module_path(path: str) -> str:
    return path.rpartition(".")[0]


def _numbered(name: str) -> bool:
    return name.isascii() and name.isdecimal()


def _block_of(path: str) -> str | None:
    """The outermost numbered module enclosing ``path`` (``layers.3`` of ``layers.3.mlp.w``)."""
    start = 0
    while True:
        end = path.find(".", start)
        part = path[start:] if end < 0 else path[start:end]
        if _numbered(part):
            return path if end < 0 else path[:end]
        if end < 0:
            return None
        start = end + 1


class _Members:
    """One block's tensors and modules as `_from_module` meets them (its key's parts)."""

    __slots__ = ("buffer_paths", "buffers", "modules", "param_paths", "params")

    def __init__(self) -> None:
        self.params: list[tuple[str, TensorSpec, type | None]] = []  # (relative path, tensor, owner)
        self.param_paths: list[str] = []
        self.buffers: list[tuple[str, TensorSpec, type | None]] = []
        self.buffer_paths: list[str] = []
        self.modules: list[tuple[str, type | None]] = []  # (relative path, class)


def _blocks(members: dict[str, _Members], tied: Iterable[str]) -> tuple[Block, ...]:
    """The model's blocks from their ``members``; a block holding a tied tensor is none."""
    # shard() plans each kind of block once: the key holds all a policy sees of a block but its index
    broken = {_block_of(name.rpartition(".")[0]) for name in tied}
    return tuple(
        Block(
            block,
            (block.rpartition(".")[0], tuple(parts.params), tuple(parts.buffers), tuple(parts.modules)),
            tuple(parts.param_paths),
            tuple(parts.buffer_paths),
        )
        for block, parts in members.items()
        if block not in broken
    )


def _plain_walk(cls: type) -> bool:
    # the fast walk below restates nn.Module's named_modules/_named_members; a class that
    # overrides them is read through its own methods
    return all(
        getattr(cls, name) is getattr(nn.Module, name)
        for name in ("named_modules", "named_parameters", "named_buffers", "_named_members")
    )


class _NotPlainError(Exception):
    pass


class _Reading:
    """What `read_model` gathers from a module: specs, ties and blocks, tensor by tensor."""

    def __init__(self) -> None:
        self.params: dict[str, TensorSpec] = {}
        self.buffers: dict[str, TensorSpec] = {}
        self.modules: dict[str, type | None] = {}
        self.alias_specs: dict[str, TensorSpec] = {}
        self.tied_names: dict[str, list[str]] = {}  # canonical path -> every name, for shared tensors only
        self.canonical: dict[int, str] = {}
        # blocks repeat: one TensorSpec per (shape, dtype, owner, kind) keeps reading cheap
        self.specs: dict[tuple[Any, ...], TensorSpec] = {}
        self.members: dict[str, _Members] = {}

    def spec(self, tensor: torch.Tensor, owner: type, kind: str) -> TensorSpec:
        differentiable = tensor.dtype.is_floating_point or tensor.dtype.is_complex
        frozen = kind == "param" and differentiable and not tensor.requires_grad
        key = (tensor.shape, tensor.dtype, owner, kind, frozen)
        spec = self.specs.get(key)
        if spec is None:
            spec = self.specs[key] = TensorSpec(
                tuple(tensor.shape), tensor.dtype, _qualname(owner), kind, owner, frozen=frozen
            )
        return spec

    def param(self, path: str, param: torch.Tensor, owner: type, block: str | None) -> None:
        spec = self.spec(param, owner, "param")
        first = self.canonical.get(id(param))
        if first is None:
            self.canonical[id(param)] = path
            self.params[path] = spec
            if block is not None:
                parts = self.members[block]
                parts.params.append((path[len(block) :], spec, owner))
                parts.param_paths.append(path)
        else:
            self.alias_specs[path] = spec
            self.tied_names.setdefault(first, [first]).append(path)

    def buffer(self, path: str, buffer: torch.Tensor, owner: type, block: str | None) -> None:
        spec = self.buffers[path] = self.spec(buffer, owner, "buffer")
        if block is not None:
            parts = self.members[block]
            parts.buffers.append((path[len(block) :], spec, owner))
            parts.buffer_paths.append(path)

    def module(self, path: str, cls: type, block: str | None) -> None:
        self.modules[path] = cls
        if block is not None:
            if block == path:
                self.members[block] = _Members()
            self.members[block].modules.append((path[len(block) :], cls))

    def tree(self) -> ModelTree:
        # the ties in the order of the tensors' first names, as named_parameters() meets them
        tied_names = self.tied_names
        position = (
            {first: index for index, first in enumerate(self.params) if first in tied_names}
            if tied_names
            else {}
        )
        tied = {first: tuple(tied_names[first]) for first in sorted(tied_names, key=position.__getitem__)}
        every_tied = [name for names in tied.values() for name in names]
        blocks = _blocks(self.members, every_tied)
        return ModelTree(self.params, self.buffers, tied, self.modules, self.alias_specs, blocks)


def as_written(cls: type) -> type:
    """The module class the model's code wrote, under the one torch swapped in when it parallelized it.

    FSDP2's ``fully_shard`` and ``replicate`` give a module a class made on the fly,
    ``FSDPBlock(FSDPModule, Block)``: a plan of the parallelized module is the model's plan.

    Examples:
        >>> class Block(nn.Module): ...
        >>> class Wrapper: ...
        >>> swapped = type("FSDPBlock", (Wrapper, Block), {"__module__": "torch.distributed.fsdp"})
        >>> as_written(swapped).__name__, as_written(Block).__name__
        ('Block', 'Block')
    """
    while (
        len(cls.__bases__) == 2
        and cls.__module__.startswith("torch.distributed.")
        and cls.__name__.endswith(cls.__bases__[1].__name__)
    ):
        cls = cls.__bases__[1]
    return cls


def _walk(module: nn.Module, reading: _Reading) -> None:
    """named_parameters(remove_duplicate=False), named_buffers() and named_modules(), one pass.

    named_modules() lists a module at its first visit in the full pre-order walk, so one walk gives all three.
    """
    seen_modules: set[int] = set()
    seen_buffers: set[int] = set()
    # a model has a handful of module classes: each is asked once whether it walks plainly, and
    # which class the model's code wrote
    written_classes: dict[type, type] = {}
    take_param, take_buffer, take_module = reading.param, reading.buffer, reading.module

    def visit(mod: nn.Module, prefix: str, block: str | None) -> None:
        cls = written_classes.get(type(mod))
        if cls is None:
            if not _plain_walk(type(mod)):
                raise _NotPlainError
            cls = written_classes[type(mod)] = as_written(type(mod))
        dot = prefix + "." if prefix else ""
        if id(mod) not in seen_modules:
            seen_modules.add(id(mod))
            take_module(prefix, cls, block)
            for name, buffer in mod._buffers.items():
                if buffer is not None and id(buffer) not in seen_buffers:
                    seen_buffers.add(id(buffer))
                    take_buffer(dot + name, buffer, cls, block)
        for name, param in mod._parameters.items():
            if param is not None:
                take_param(dot + name, param, cls, block)
        for name, child in mod._modules.items():
            if child is not None:
                path = dot + name
                visit(child, path, path if block is None and _numbered(name) else block)

    visit(module, "", None)


def _read_slowly(module: nn.Module, reading: _Reading) -> None:
    """`_walk`'s reading through the module's own named_* methods (a class overrides them)."""
    owners = dict(module.named_modules(remove_duplicate=False))
    for path, mod in module.named_modules():
        reading.module(path, as_written(type(mod)), _block_of(path))
    for path, buffer in module.named_buffers():
        owner = _module_path(path)
        reading.buffer(path, buffer, as_written(type(owners[owner])), _block_of(owner))
    for path, param in module.named_parameters(remove_duplicate=False):
        owner = _module_path(path)
        reading.param(path, param, as_written(type(owners[owner])), _block_of(owner))


def _from_module(module: nn.Module) -> ModelTree:
    reading = _Reading()
    try:
        _walk(module, reading)
    except _NotPlainError:
        reading = _Reading()
        _read_slowly(module, reading)
    return reading.tree()


def _tensor_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    # Views that share storage (a state dict's tied entries) are one tensor; meta
    # tensors have no storage to compare, so there only the object identifies it.
    if tensor.device.type == "meta":
        return ("id", id(tensor))
    storage = tensor.untyped_storage()
    return (storage.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())


def _from_pytree(tree: Any) -> ModelTree:
    paths, leaves = _pytree.flatten_with_path(tree)
    params: dict[str, TensorSpec] = {}
    by_key: dict[tuple[Any, ...], list[str]] = {}
    problems = []
    for keys, leaf in zip(paths, leaves, strict=True):
        path = ".".join(str(key) for key in keys)
        if isinstance(leaf, TensorSpec):
            by_key.setdefault(("path", path), []).append(path)
            params[path] = leaf
        elif isinstance(leaf, torch.Tensor):
            group = by_key.setdefault(_tensor_key(leaf), [])
            group.append(path)
            if len(group) == 1:
                params[path] = TensorSpec(tuple(leaf.shape), leaf.dtype)
        else:
            problems.append(f"{path or '<root>'}: a {type(leaf).__name__}, not a tensor")
    if problems:
        raise ShardingError(
            "shard() reads tensors only, but the pytree holds other leaves:\n"
            + "\n".join(f"* {p}" for p in problems)
            + "\nDrop them from the tree, or pass the nn.Module itself."
        )
    if not params:
        raise ShardingError("the model has no tensors to shard; pass an nn.Module or state dict")
    modules: dict[str, type | None] = {"": None}
    for path in params:
        parts = path.split(".")[:-1]
        for end in range(1, len(parts) + 1):
            modules[".".join(parts[:end])] = None
    tied = {paths[0]: tuple(paths) for paths in by_key.values() if len(paths) > 1}
    tied_names = [name for names in tied.values() for name in names]
    members: dict[str, _Members] = {}
    for path in modules:
        block = _block_of(path)
        if block is not None:
            members.setdefault(block, _Members()).modules.append((path[len(block) :], None))
    for path, tensor in params.items():
        block = _block_of(_module_path(path))
        if block is not None:
            members[block].params.append((path[len(block) :], tensor, tensor.module_type))
            members[block].param_paths.append(path)
    return ModelTree(params, {}, tied, modules, {}, _blocks(members, tied_names))


def read_model(model: Any) -> ModelTree:
    """Read shapes, dtypes, owners and ties of ``model`` without touching its data.

    Args:
        model: an ``nn.Module`` (meta too), a state dict, a pytree of tensors or `TensorSpec`s, a `ModelTree`.

    Returns:
        The tensors by path (``named_parameters()`` names; a shared one once, its names in ``aliases``).

    Raises:
        ShardingError: a pytree leaf is not a tensor, or there are no tensors.

    Examples:
        >>> tree = read_model(nn.Linear(4, 2))
        >>> list(tree.params), tree.params["weight"].shape
        (['weight', 'bias'], (2, 4))
    """
    if isinstance(model, ModelTree):
        return model
    if isinstance(model, nn.Module):
        return _from_module(model)
    return _from_pytree(model)


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: Pattern) -> re.Pattern[str]:
    if isinstance(pattern, re.Pattern):
        return pattern
    return re.compile(fnmatch.translate(pattern))


def matches(pattern: Pattern, path: str) -> bool:
    r"""Whether ``path`` matches a glob (``*`` spans dots) or a compiled regex (fullmatch).

    Examples:
        >>> matches("*.q_proj", "model.layers.0.self_attn.q_proj")
        True
        >>> matches(re.compile(r"layers\.\d+\.mlp"), "layers.3.mlp")
        True
    """
    return compile_pattern(pattern).fullmatch(path) is not None


def within(path: str, modules: Iterable[str]) -> bool:
    """Whether the module or tensor at ``path`` is one of ``modules`` or inside one ("" is the root).

    Examples:
        >>> within("layers.1.mlp", ["layers.1"]), within("layers.10", ["layers.1"]), within("x", [""])
        (True, False, True)
    """
    return any(m == "" or path == m or path.startswith(m + ".") for m in modules)


def owner_paths(path: str) -> Iterable[str]:
    """The path itself, then every enclosing module path up to the root ("")."""
    yield path
    while path:
        path = _module_path(path)
        yield path


def is_hf_model(model: object) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers).

    Examples:
        >>> is_hf_model(nn.Linear(2, 2))
        False
    """
    return isinstance(model, nn.Module) and any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(model).__mro__
    )
