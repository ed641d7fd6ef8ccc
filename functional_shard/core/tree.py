"""From a model to what a plan needs to know: each tensor's shape, dtype and owner.

`read_model` accepts an ``nn.Module`` (meta device included), a state dict, or any
optree pytree of tensors, and never touches tensor data.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import pytree as _pytree
from .errors import ShardingError

__all__ = ["Block", "ModelTree", "Pattern", "TensorSpec", "matches", "read_model", "within"]

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
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.numel * self.itemsize

    def module_is(self, cls: type) -> bool:
        """Whether the owning module is a ``cls`` (by class, else by qualified name)."""
        if self.module_type is not None:
            return issubclass(self.module_type, cls)
        return self.module_name in {_qualname(cls), f"{cls.__module__}.{cls.__name__}"}

    def to_json(self) -> dict[str, Any]:
        """Shape, dtype name, owner name and kind as JSON."""
        return {
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "module": self.module_name,
            "kind": self.kind,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorSpec:
        """The inverse of `to_json`."""
        return cls(tuple(data["shape"]), dtype_from_name(data["dtype"]), data["module"], data["kind"])


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``, with a clear error for unknown names."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ShardingError(f"{name!r} is not a torch dtype; use e.g. 'float32' or 'bfloat16'")
    return dtype


@dataclass(frozen=True, slots=True)
class Block:
    """One repeated block (``layers.3``): its tensors, and a key equal for blocks alike.

    Two blocks with equal ``key`` sit under the same parent and hold tensors at the same
    relative paths with the same shapes, dtypes and owning module classes, and modules
    of the same classes at the same relative paths; none of their tensors is tied.
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


_Members = tuple[list[tuple[str, "TensorSpec"]], list[tuple[str, "TensorSpec"]], list[tuple[str, Any]]]
"""A block's (params, buffers, modules): tensors by path with their specs, modules by relative path."""


def _blocks(members: dict[str, _Members], tied: Iterable[str]) -> tuple[Block, ...]:
    """The model's blocks from their ``members``; a block holding a tied tensor is none."""
    # Big models repeat one block tens of times; finding the repeats here lets shard()
    # plan each kind of block once. The key holds everything a policy can see of a block
    # but its index: relative paths, tensors (with their owners' classes), module classes.
    broken = {_block_of(name.rpartition(".")[0]) for name in tied}
    blocks = []
    for block, (block_params, block_buffers, block_modules) in members.items():
        if block in broken:
            continue
        cut = len(block)
        key = (
            block.rpartition(".")[0],
            tuple((p[cut:], t, t.module_type) for p, t in block_params),
            tuple((p[cut:], t, t.module_type) for p, t in block_buffers),
            tuple(block_modules),
        )
        blocks.append(
            Block(block, key, tuple(p for p, _ in block_params), tuple(p for p, _ in block_buffers))
        )
    return tuple(blocks)


def _plain_walk(cls: type) -> bool:
    # the fast walk below restates nn.Module's named_modules/_named_members; a class that
    # overrides them is read through its own methods
    return all(
        getattr(cls, name) is getattr(nn.Module, name)
        for name in ("named_modules", "named_parameters", "named_buffers", "_named_members")
    )


class _NotPlainError(Exception):
    pass


def _walk(
    module: nn.Module,
) -> tuple[
    list[tuple[str, nn.Parameter, type, str | None]],
    list[tuple[str, torch.Tensor, type, str | None]],
    dict[str, type | None],
    dict[str, list[tuple[str, Any]]],
]:
    """named_parameters(remove_duplicate=False), named_buffers() and named_modules(), one pass.

    A module's first visit in the full pre-order walk is where named_modules() (which
    skips repeats) lists it, so one walk gives all three, each tensor with its block; and
    each block's modules by relative path.
    """
    params: list[tuple[str, nn.Parameter, type, str | None]] = []
    buffers: list[tuple[str, torch.Tensor, type, str | None]] = []
    modules: dict[str, type | None] = {}
    block_modules: dict[str, list[tuple[str, Any]]] = {}
    seen_modules: set[int] = set()
    seen_buffers: set[int] = set()

    plain_classes: dict[type, bool] = {}  # a model has a handful of module classes: ask once each
    add_param = params.append

    def visit(mod: nn.Module, prefix: str, block: str | None, inside: list[tuple[str, Any]] | None) -> None:
        cls = type(mod)
        plain = plain_classes.get(cls)
        if plain is None:
            plain = plain_classes[cls] = _plain_walk(cls)
        if not plain:
            raise _NotPlainError
        dot = prefix + "." if prefix else ""
        for name, param in mod._parameters.items():
            if param is not None:
                add_param((dot + name, param, cls, block))
        if id(mod) not in seen_modules:
            seen_modules.add(id(mod))
            modules[prefix] = cls
            if inside is not None:
                inside.append((prefix[len(block) :], cls))  # type: ignore[arg-type]
            for name, buffer in mod._buffers.items():
                if buffer is not None and id(buffer) not in seen_buffers:
                    seen_buffers.add(id(buffer))
                    buffers.append((dot + name, buffer, cls, block))
        for name, child in mod._modules.items():
            if child is not None:
                if block is None and _numbered(name):
                    path = dot + name
                    visit(child, path, path, block_modules.setdefault(path, []))
                else:
                    visit(child, dot + name, block, inside)

    visit(module, "", None, None)
    return params, buffers, modules, block_modules


def _read_slowly(
    module: nn.Module,
) -> tuple[
    list[tuple[str, nn.Parameter, type, str | None]],
    list[tuple[str, torch.Tensor, type, str | None]],
    dict[str, type | None],
    dict[str, list[tuple[str, Any]]],
]:
    """`_walk`'s answers through the module's own named_* methods (a class overrides them)."""
    modules: dict[str, type | None] = {name: type(m) for name, m in module.named_modules()}
    owners = dict(module.named_modules(remove_duplicate=False))
    block_of: dict[str, str | None] = {path: _block_of(path) for path in owners}
    block_modules: dict[str, list[tuple[str, Any]]] = {}
    for path, cls in modules.items():
        block = block_of[path]
        if block is not None:
            block_modules.setdefault(block, []).append((path[len(block) :], cls))
    found_params = [
        (path, param, type(owners[_module_path(path)]), block_of[_module_path(path)])
        for path, param in module.named_parameters(remove_duplicate=False)
    ]
    found_buffers = [
        (path, buffer, type(owners[_module_path(path)]), block_of[_module_path(path)])
        for path, buffer in module.named_buffers()
    ]
    return found_params, found_buffers, modules, block_modules


def _from_module(module: nn.Module) -> ModelTree:
    try:
        found_params, found_buffers, modules, block_modules = _walk(module)
    except _NotPlainError:
        found_params, found_buffers, modules, block_modules = _read_slowly(module)
    members: dict[str, _Members] = {block: ([], [], kids) for block, kids in block_modules.items()}
    # blocks repeat: one TensorSpec per (shape, dtype, owner, kind) keeps reading cheap
    specs: dict[tuple[Any, ...], TensorSpec] = {}
    params: dict[str, TensorSpec] = {}
    canonical: dict[int, str] = {}
    tied_names: dict[str, list[str]] = {}  # canonical path -> every name, for shared tensors only
    alias_specs: dict[str, TensorSpec] = {}
    # once per parameter, so inlined: a 70B model reads 723 parameters in a few hundred us
    for path, param, owner, block in found_params:
        key = (param.shape, param.dtype, owner, "param")
        spec = specs.get(key)
        if spec is None:
            spec = specs[key] = TensorSpec(tuple(param.shape), param.dtype, _qualname(owner), "param", owner)
        first = canonical.get(id(param))
        if first is None:
            canonical[id(param)] = path
            params[path] = spec
            if block is not None:
                members[block][0].append((path, spec))
        else:
            alias_specs[path] = spec
            tied_names.setdefault(first, [first]).append(path)
    buffers: dict[str, TensorSpec] = {}
    for path, buffer, owner, block in found_buffers:
        key = (buffer.shape, buffer.dtype, owner, "buffer")
        spec = specs.get(key)
        if spec is None:
            spec = specs[key] = TensorSpec(
                tuple(buffer.shape), buffer.dtype, _qualname(owner), "buffer", owner
            )
        buffers[path] = spec
        if block is not None:
            members[block][1].append((path, spec))
    # in the order of the tensors' first names, as named_parameters() meets them
    position = (
        {first: index for index, first in enumerate(params) if first in tied_names} if tied_names else {}
    )
    tied = {first: tuple(tied_names[first]) for first in sorted(tied_names, key=position.__getitem__)}
    every_tied = [name for names in tied.values() for name in names]
    return ModelTree(params, buffers, tied, modules, alias_specs, _blocks(members, every_tied))


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
    block_of = {path: _block_of(path) for path in modules}
    members: dict[str, _Members] = {}
    for path in modules:
        block = block_of[path]
        if block is not None:
            members.setdefault(block, ([], [], []))[2].append((path[len(block) :], None))
    for path, tensor in params.items():
        block = block_of[_module_path(path)]
        if block is not None:
            members[block][0].append((path, tensor))
    return ModelTree(params, {}, tied, modules, {}, _blocks(members, tied_names))


def read_model(model: Any) -> ModelTree:
    """Read shapes, dtypes, owners and ties of ``model`` without touching its data.

    Args:
        model: an ``nn.Module`` (any device, meta included), a state dict, any optree
            pytree whose leaves are tensors or `TensorSpec`s, or a `ModelTree` already
            read (returned as it is: a search plans one model many times).

    Returns:
        The model's tensors by path. For modules the paths are ``named_parameters()``
        names; a parameter shared by several modules appears once, under its first
        name, with every name in ``aliases``.

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
