"""In from the ecosystem: a Hugging Face folder's weights into a parallelized model, each rank its slices.

`load_hf` runs on every rank after `apply`, under any plan. Each rank reads from the
memory-mapped safetensors files only the elements its local shards hold, cast to the
parameter's dtype. A model on the meta device gets its memory here, filled straight from the
files: no random initialisation, nothing the size of the whole model on any rank. Every rank
checks everything (keys through a name map, `names`; shapes; damaged files) before anything changes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import device as checked_device
from functional_shard.core.validate import entry_point, instance_of
from functional_shard.core.validate import path as checked_path
from functional_shard.runtime.checkpoint.integrity import agreed, distributed, every_rank_keys, raise_problems
from functional_shard.runtime.engines.applied import APPLIED, Applied
from functional_shard.runtime.engines.buffers import buffer_problems, meta_buffers, restore_buffers
from functional_shard.runtime.engines.data_parallel import host_params, reduce_whole_grads
from functional_shard.runtime.engines.materialize import allocate, parameter_names
from functional_shard.runtime.engines.tensor_parallel import packed_window, place_grads_as_params

from .names import Mapping_, Piece, checked_mapping, name_map
from .slices import Folder, Index, Source, composed_shape, fill_local, open_folder, quantized

__all__ = ["load_hf"]

_FIX = (
    "Pass the folder of the model this one is built from (the same config), or mapping= to name "
    "which of the folder's tensors fills which of the model's (docs: Hugging Face models)"
)
_TIED_HEAD = "lm_head.weight"
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight")


@entry_point
def load_hf(
    path: str | os.PathLike[str],
    module: nn.Module,
    *,
    mapping: Mapping_ | None = None,
    trust: bool = False,
    device: str | torch.device | None = None,
    root: str = "",
) -> nn.Module:
    """Fill a model's local shards from a Hugging Face folder, on every rank after `apply`.

    Args:
        path: the folder (``model.safetensors``, or shards and ``model.safetensors.index.json``).
        module: the module `apply` returned, on the meta device or materialized; or an unapplied module.
        mapping: which model tensor each folder key fills: a dict of patterns, a function, or None
            (the folder's names); ready maps in `runtime.checkpoint.hf.names` (``zoo_llama``, ...).
        trust: read a folder of pickled ``pytorch_model.bin`` files (with ``weights_only``).
        device: where a meta module's shards are made (the device mesh's device by default); under
            CPU offload its parameters' shards are made in host memory, as FSDP2 needs.
        root: the submodule the folder holds, when the plan was applied around it (``root="model"``).

    Returns:
        The module, filled.

    Raises:
        ShardingError: the folder does not fit the model (keys, shapes, quantized weights, damaged
            files, pickles without ``trust``), a buffer cannot be restored, ``root`` names no
            submodule, or ``module``, ``mapping``, ``trust`` or ``root`` is not of its type. On every
            rank, before anything changes.

    Examples:
        >>> # with torch.device("meta"): model = AutoModelForCausalLM.from_config(config)
        >>> # fs.apply(plan, model); fs.checkpoint.load_hf("Llama-3-8B/", model)
    """
    path = checked_path(path, "path")
    _check_device(device)
    instance_of(module, nn.Module, "module", meaning="the model fs.apply parallelized, or will")
    # a str ("no", "false" from a config file) is truthy: it would read pickles, which can run code
    instance_of(
        trust, bool, "trust", meaning="True reads pickled pytorch_model.bin files, which can run code"
    )
    instance_of(root, str, "root", meaning="the name of the submodule the plan was applied around, or ''")
    checked_mapping(mapping)
    model = _submodule(module, root)
    prefix = f"{root}." if root else ""
    applied = APPLIED.get(module)
    canonical = parameter_names(module)
    buffers = _persistent_buffers(module)
    local_names = {*canonical, *buffers}
    whole_names = every_rank_keys(local_names) if distributed() else local_names
    problems: list[str] = []
    folder: Folder | None = None
    try:
        folder = open_folder(path, trust=trust)
    except ShardingError as error:
        problems.append(str(error))
    # a folder that cannot be opened says its own fix: no fit to compare, no mapping to pass
    unopened = agreed(problems)
    if unopened:
        raise ShardingError(unopened[0])
    sources: dict[str, list[tuple[Source, Piece]]] = {}
    if folder is not None:
        try:
            sources, found = _sources(folder, module, mapping, canonical, buffers, whole_names, root=root)
        except ShardingError as error:
            found = [str(error)]
        problems += found
    on_meta = any(p.is_meta for p in module.parameters())
    # the buffers are the model's own: computed from its config, under its own names
    computed = [n for n in meta_buffers(model) if prefix + n not in sources] if on_meta else []
    problems += buffer_problems(model, computed)
    raise_problems(
        agreed(problems), f"fs.checkpoint.load_hf changed nothing: {path} does not fit the model", _FIX
    )
    assert folder is not None
    if on_meta:
        host = host_params(applied.local_plan) if applied is not None else ()
        allocate(module, _device(device, applied), host)
        restore_buffers(model, computed, _device(device, applied))
    rank = dist.get_rank() if distributed() else 0
    with torch.no_grad():
        for name, pieces in sources.items():
            tensor = module.get_parameter(name) if name in canonical else module.get_buffer(name)
            _fill(folder, module, applied, name, tensor, pieces=pieces, rank=rank)
            # the mapped pages this tensor's windows touched leave with the file: at most one
            # tensor's pages are resident beside the shards (bench/load_hf.py measures it)
            folder.release()
    if on_meta and applied is not None:
        place_grads_as_params(applied.local_plan, module)
        reduce_whole_grads(applied.local_plan, module, applied.device_mesh)
    return module


def _submodule(module: nn.Module, root: str) -> nn.Module:
    try:
        return module.get_submodule(root)
    except AttributeError:
        raise ShardingError(
            f"fs.checkpoint.load_hf(root={root!r}): the module has no such submodule; pass the name "
            "of the child that holds the model (the root given to fs.apply), or none"
        ) from None


def _persistent_buffers(module: nn.Module) -> set[str]:
    found = set()
    for path, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                found.add(f"{path}.{name}" if path else name)
    return found


def _under(root: str, resolve: Callable[[str], Piece | str | None]) -> Callable[[str], Piece | str | None]:
    # the map names the root's tensors: the module's are under the root's name
    if not root:
        return resolve

    def prefixed(key: str) -> Piece | str | None:
        target = resolve(key)
        if isinstance(target, Piece):
            return dataclasses.replace(target, name=f"{root}.{target.name}")
        return None if target is None else f"{root}.{target}"

    return prefixed


def _ignored(module: nn.Module, key: str) -> bool:
    # transformers' own list of folder keys its models drop (old rotary buffers, ...)
    import re

    patterns = getattr(module, "_keys_to_ignore_on_load_unexpected", None) or []
    return any(re.search(pattern, key) for pattern in patterns)


def _sources(
    folder: Folder,
    module: nn.Module,
    mapping: Mapping_ | None,
    canonical: Mapping[str, list[str]],
    buffers: set[str],
    whole_names: set[str],
    *,
    root: str,
) -> tuple[dict[str, list[tuple[Source, Piece]]], list[str]]:
    """Each local tensor's pieces in the folder, and what does not fit."""
    every_name = {*whole_names, *(n for names in canonical.values() for n in names)}
    model = module.get_submodule(root)
    prefix = f"{root}." if root else ""
    held = {n.removeprefix(prefix) for n in every_name if n.startswith(prefix)}
    resolve = _under(root, name_map(mapping, model, held))
    owner = {name: first for first, names in canonical.items() for name in names}
    owner.update({name: name for name in buffers})
    non_persistent = {name for name, _ in module.named_buffers()} - buffers
    problems: list[str] = []
    pieces: dict[str, list[tuple[Source, Piece]]] = {}
    quantization = folder.config.get("quantization_config")
    if quantization:  # the folder says so itself: its tensors need not be 8-bit (4-bit packed)
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        problems.append(
            f"config.json: quantization_config ({method}): the weights are quantized; load_hf reads "
            "float weights"
        )
    for key, source in folder.sources.items():
        target = resolve(key)
        name = target.name if isinstance(target, Piece) else target
        if name is None or name not in every_name:
            if name not in non_persistent and not _ignored(model, key):
                where = "maps to nothing" if name is None else f"maps to {name}, which the model lacks"
                problems.append(f"{key} ({source.file}): unexpected, {where}")
            continue
        if name not in owner:  # another pipeline stage's
            continue
        piece = target if isinstance(target, Piece) else Piece(name)
        placed = (source, dataclasses.replace(piece, name=owner[name]))
        # a tied weight saved under two names: the one under its own name fills it
        pieces.setdefault(owner[name], []).insert(
            0 if name == owner[name] else len(pieces.get(owner[name], [])), placed
        )
    _tie_head(folder, resolve, owner, pieces)
    for name, found in pieces.items():
        if len(found) > 1 and all(piece == Piece(name) for _, piece in found):
            if len(canonical.get(name, ())) > 1 and folder.config and not _ties(folder.config):
                # the folder's own config keeps them apart: one of its tensors would be dropped
                keys = " and ".join(source.key for source, _ in found)
                problems.append(
                    f"{name}: the model ties it to another weight, but the folder holds {keys} apart "
                    "(its config.json does not tie them), so one would be lost. Build the model from "
                    "the folder's config (tie_word_embeddings=False)"
                )
            del found[1:]
    for name in canonical:
        if name not in pieces:
            problems.append(f"{name}: missing, no tensor of the folder fills it")
    problems += _layout_problems(folder, pieces) + _fit_problems(module, canonical, pieces)
    return pieces, problems


def _fit_problems(
    module: nn.Module, canonical: Mapping[str, list[str]], pieces: Mapping[str, list[tuple[Source, Piece]]]
) -> list[str]:
    """Shapes the pieces do not compose into, and quantized pieces for float tensors."""
    problems = []
    for name, found in pieces.items():
        tensor = module.get_parameter(name) if name in canonical else module.get_buffer(name)
        shape = composed_shape(found)
        keys = ", ".join(source.key for source, _ in found[:3]) + (" ..." if len(found) > 3 else "")
        if isinstance(shape, str):
            problems.append(f"{name}: {keys} {shape}")
        elif shape != tuple(tensor.shape):
            problems.append(
                f"{name}: shape {list(tensor.shape)} in the model, {list(shape)} in the folder ({keys})"
            )
        for source, _ in found:
            if tensor.is_floating_point() and quantized(source):
                problems.append(
                    f"{source.key} ({source.file}): stored as {source.stored}, quantized; load_hf "
                    "reads float weights (dequantize the folder first)"
                )
            elif (
                tensor.is_floating_point() and source.dtype is not None and not source.dtype.is_floating_point
            ):
                # a header whose dtype was damaged (I32 for F32 keeps every length consistent)
                # or another model's folder: its bytes would be read as whole numbers
                problems.append(
                    f"{source.key} ({source.file}): stored as {source.stored}, whole numbers, for the "
                    f"model's {tensor.dtype} {name}; pass a folder of float weights (copy it again if it was)"
                )
    return problems


def _tie_head(
    folder: Folder, resolve: Any, owner: Mapping[str, str], pieces: dict[str, list[tuple[Source, Piece]]]
) -> None:
    # save_pretrained leaves a tied head out: a model that keeps its own head reads the embedding
    if _TIED_HEAD in folder.sources or not _ties(folder.config):
        return
    target = resolve(_TIED_HEAD)
    name = owner.get(target.name if isinstance(target, Piece) else target or "")
    embedding = next((k for k in folder.sources if k.endswith(_EMBEDDINGS)), None)
    if name is not None and name not in pieces and embedding is not None:
        pieces[name] = [(folder.sources[embedding], Piece(name))]


def _check_device(where: Any) -> None:
    # before the folder is read: a meta module is allocated on it only after every check
    if where is not None:
        meaning = 'where a meta module\'s shards are made: "cpu", "cuda", "cuda:1" or a torch.device'
        checked_device(where, "device", meaning=meaning)


def _device(device: str | torch.device | None, applied: Applied | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    kind = applied.device_mesh.device_type if applied is not None else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())


def _indices(
    module: nn.Module, applied: Applied | None, name: str, tensor: torch.Tensor, rank: int
) -> list[Index]:
    """The global index, on each dim, of every element this rank holds of ``name``."""
    from torch.distributed.tensor import DTensor

    shape = tuple(tensor.shape)
    if applied is None or not isinstance(tensor, DTensor):
        return [range(size) for size in shape]
    owner_path, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_path)
    packed = getattr(owner, "_fs_packed", None)
    # the packed weight: a layer's, or an experts module's gate and up (engines.experts)
    if packed and attr == ("gate_up_proj" if hasattr(owner, "gate_up_proj") else "weight"):
        # the engine's own split of a packed weight, applied to each dim's positions
        found: list[Index] = []
        for dim, size in enumerate(shape):
            view = [1] * len(shape)
            view[dim] = size
            grid = torch.arange(size).view(view).expand(shape)
            local = packed_window(grid, tensor, *packed).movedim(dim, 0)
            found.append(local.reshape(local.shape[0], -1)[:, 0] if local.numel() else local.new_empty(0))
        return found
    local_shape, offset = applied.local_plan.local_shape_and_offset(name, rank)
    return [range(start, start + size) for start, size in zip(offset, local_shape, strict=True)]


def _fill(
    folder: Folder,
    module: nn.Module,
    applied: Applied | None,
    name: str,
    tensor: torch.Tensor,
    *,
    pieces: Sequence[tuple[Source, Piece]],
    rank: int,
) -> None:
    from torch.distributed.tensor import DTensor

    indices = _indices(module, applied, name, tensor, rank)
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.dim() and local.shape[0] != len(indices[0]):  # FSDP2 pads dim 0 at the end
        local = local.narrow(0, 0, len(indices[0]))
    if any(len(index) == 0 for index in indices):
        return
    head_dim, groups = _heads(folder.config)
    fill_local(folder, local.data, indices, pieces, head_dim, groups or 1)


def _heads(config: Mapping[str, Any]) -> tuple[int | None, int | None]:
    # a Hugging Face config's attention head size (its own, or hidden size over heads) and its
    # key/value head count (the query heads' without grouped-query attention): None if absent
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    heads = heads if isinstance(heads, int) and heads else None
    head_dim = config.get("head_dim")
    if not isinstance(head_dim, int):
        head_dim = hidden // heads if isinstance(hidden, int) and heads else None
    groups = config.get("num_key_value_heads") or heads
    return head_dim, groups if isinstance(groups, int) else None


def _layout_problems(folder: Folder, pieces: Mapping[str, list[tuple[Source, Piece]]]) -> list[str]:
    # what rotary and grouped pieces need from the folder's config.json
    problems = []
    head_dim, groups = _heads(folder.config)
    for name, found in pieces.items():
        if any(piece.rotary for _, piece in found) and head_dim is None:
            problems.append(f"{name}: its rows are rotary pairs, but config.json gives no head size")
        if any(piece.grouped for _, piece in found):
            sizes = [source.shape[piece.dim - (piece.expert is not None)] for source, piece in found]
            if groups is None or any(size % groups for size in sizes):
                problems.append(
                    f"{name}: laid by key/value group, but config.json's num_key_value_heads "
                    f"({groups}) does not divide its pieces {sizes}"
                )
    return problems


def _ties(config: Mapping[str, Any]) -> bool:
    # save_pretrained writes only what differs from the config class's defaults: a missing
    # tie_word_embeddings is the model type's default (Gemma ties, Llama does not)
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    try:
        import transformers

        return bool(transformers.AutoConfig.for_model(config.get("model_type", "")).tie_word_embeddings)
    except (ImportError, ValueError, AttributeError):
        return False
