"""Checkpoints that move between plans: sharded (a folder, one file per rank) or full (one file).

With `apply` and `launch`, the only module that talks to process groups. Sharded
checkpoints use torch's distributed checkpoint, which reshards on load, so a checkpoint
saved under one plan loads under any other (FSDP×4 → FSDP×2·TP×2 → ZeRO-1 → one process).
Every save writes aside and renames: a crash in the middle leaves the previous checkpoint whole.

Optimizer state is keyed by parameter path under every plan. ZeRO-1 optimizers
(``ZeroRedundancyOptimizer``) keep whole tensors on their owner rank; each owner writes its
own, so their checkpoints are as sharded as the state is.

`save` / `load` / `convert` are the user's functions; `model_state`, `optimizer_state`,
`set_model_state`, `set_optimizer_state`, `write` and `read` are the pieces they are made of,
for framework adapters that assemble their own checkpoints (Lightning's Trainer, Fabric).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from functional_shard.core.errors import ShardingError

if TYPE_CHECKING:
    from .engines.pipeline import Pipelined

__all__ = [
    "convert",
    "load",
    "model_state",
    "optimizer_state",
    "read",
    "save",
    "set_model_state",
    "set_optimizer_state",
    "write",
]

_META = "meta.pt"


def _pipeline(module: nn.Module) -> Pipelined | None:
    """The pipeline ``module`` (or a module inside it, as a LightningModule's child) runs, if any."""
    from .engines.pipeline import pipeline_of

    return next((found for m in module.modules() if (found := pipeline_of(m)) is not None), None)


def _gathered_stages(pipelined: Pipelined, sharded: dict[str, Any], merge: Any) -> dict[str, Any]:
    """Whole tensors of every stage on rank 0: each stage's shards gathered, then sent to rank 0.

    Under pp a rank holds only its stages, so torch's full state dict (whole tensors on
    rank 0) would hold only rank 0's. The ranks of rank 0's pipeline (one per stage) send
    their stages' whole tensors; the other ranks take part in the gathers only.
    """
    from torch.distributed.tensor import DTensor

    def whole(value: Any) -> Any:
        # full_tensor is a collective over the stage's own (dp, tp) ranks: every rank calls it
        if isinstance(value, DTensor):
            value = value.full_tensor()
        return value.detach().cpu() if torch.is_tensor(value) else value

    sends = 0 in dist.get_process_group_ranks(pipelined.group)
    mine = _tree_map_in_order(whole, sharded)
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine if sends else None, parts if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return {}
    return merge([part for part in parts if part is not None])


def _tree_map_in_order(fn: Any, tree: Any) -> Any:
    # dicts and lists in their own order, the same on every rank of a stage
    if isinstance(tree, dict):
        return {k: _tree_map_in_order(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tree_map_in_order(fn, v) for v in tree]
    return fn(tree)


def _merge_models(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: v for part in parts for k, v in part.items()}


def _merge_optimizers(parts: list[dict[str, Any]]) -> dict[str, Any]:
    # one optimizer per pipeline rank, built alike: the same groups, each over its own stages
    state = {k: v for part in parts for k, v in part["state"].items()}
    groups = [dict(group) for group in parts[0]["param_groups"]]
    for part in parts[1:]:
        for group, other in zip(groups, part["param_groups"], strict=True):
            group["params"] = [*group["params"], *other["params"]]
    return {"state": state, "param_groups": groups}


def model_state(module: nn.Module, *, full: bool = False) -> dict[str, Any]:
    """The module's state: this rank's shards, or (``full``) whole tensors on rank 0 only.

    Under a pipeline plan a rank holds its stages' tensors only; the full state is still
    every stage's, on rank 0.
    """
    pipelined = _pipeline(module) if full else None
    if pipelined is not None:
        return _gathered_stages(pipelined, model_state(module), _merge_models)
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


def set_model_state(module: nn.Module, state: dict[str, Any], *, full: bool, strict: bool = True) -> None:
    """Load a state from `model_state` (sharded, or full on every rank) into the module.

    Under a pipeline plan a full state holds the other stages' tensors too; this rank
    loads its own (and still refuses, with ``strict``, one that lacks any of them).
    """
    if full and _pipeline(module) is not None:
        own = set(module.state_dict())
        state = {k: v for k, v in state.items() if k in own}
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=full, strict=strict))


def _names(module: nn.Module) -> dict[nn.Parameter, str]:
    return {param: name for name, param in module.named_parameters()}


def _zero1_groups(module: nn.Module, optimizer: ZeroRedundancyOptimizer) -> list[dict[str, Any]]:
    names = _names(module)
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[p] for p in group["params"]]}
        for group in optimizer.param_groups
    ]


def _owned(module: nn.Module, optimizer: ZeroRedundancyOptimizer) -> dict[str, nn.Parameter]:
    names = _names(module)
    return {names[p]: p for group in optimizer.optim.param_groups for p in group["params"]}


def optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool = False
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter path (``{"state": ..., "param_groups": ...}``).

    Sharded: this rank's shards (a ZeRO-1 optimizer: the whole tensors this rank owns).
    Full: every parameter's whole state on rank 0, nothing elsewhere.
    """
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        pipelined = _pipeline(module) if full else None
        if pipelined is not None:
            return _gathered_stages(pipelined, optimizer_state(module, optimizer), _merge_optimizers)
        return get_optimizer_state_dict(
            module, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full)
        )
    owned = _owned(module, optimizer)
    state = {name: dict(optimizer.optim.state[p]) for name, p in owned.items() if p in optimizer.optim.state}
    if full:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, {name: _on_cpu(values) for name, values in state.items()})
        if dist.get_rank() != 0:
            return {}
        state = {name: values for part in every for name, values in part.items()}
    return {"state": state, "param_groups": _zero1_groups(module, optimizer)}


def _on_cpu(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in values.items()}


def set_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], *, full: bool
) -> None:
    """Load a state from `optimizer_state` (sharded, or full on every rank), under any plan."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        if full and _pipeline(module) is not None:
            own = {name for name, _ in module.named_parameters()}
            state = {**state, "state": {k: v for k, v in state.get("state", {}).items() if k in own}}
        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=full))
        return
    saved_groups = state.get("param_groups", [])
    if saved_groups and len(saved_groups) != len(optimizer.param_groups):
        raise ShardingError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups"
        )
    for name, param in _owned(module, optimizer).items():
        if name in state.get("state", {}):
            optimizer.optim.state[param] = {
                # 0-dim values (Adam's step) stay on the CPU, as torch's optimizers keep them
                key: value.to(param.device) if torch.is_tensor(value) and value.dim() else value
                for key, value in state["state"][name].items()
            }
    # no groups saved (a checkpoint of the model alone): the hyperparameters stay
    for saved, group, local in zip(
        saved_groups, optimizer.param_groups, optimizer.optim.param_groups, strict=False
    ):
        hyper = {k: v for k, v in saved.items() if k != "params"}
        group.update(hyper)
        local.update(hyper)


def _zero1_template(
    module: nn.Module, optimizer: ZeroRedundancyOptimizer, key: str, metadata: Any
) -> dict[str, Any]:
    # what this rank owns, shaped as the checkpoint stored it (whichever plan saved it)
    owned = _owned(module, optimizer)
    prefix = f"{key}.state."
    state: dict[str, dict[str, Any]] = {}
    for stored, meta in metadata.state_dict_metadata.items():
        name, _, field = stored[len(prefix) :].rpartition(".")
        if stored.startswith(prefix) and name in owned and hasattr(meta, "size"):
            state.setdefault(name, {})[field] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return {"state": state, "param_groups": _zero1_groups(module, optimizer)}


def _shared_name(path: Path) -> Path:
    # every rank must write to the same temporary folder: rank 0 picks, all hear it
    names = [f"{path.name}.tmp-{uuid.uuid4().hex[:8]}"] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(names, src=0)
    return path.with_name(str(names[0]))


def _replace(temporary: Path, path: Path) -> None:
    # the old checkpoint is moved away only once the new one is complete
    old = path.with_name(path.name + ".old")
    if path.exists():
        os.replace(path, old)
    os.replace(temporary, path)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()


def write(path: str | os.PathLike[str], state: dict[str, Any], *, full: bool, meta: dict[str, Any]) -> Path:
    """Write states from `model_state` / `optimizer_state` on every rank, aside then renamed.

    Sharded: a distributed-checkpoint folder of ``state`` with ``meta`` in ``meta.pt`` beside.
    Full: one file of ``{**state, **meta}``, written by rank 0 (whose states are whole).
    """
    path = Path(path)
    temporary = _shared_name(path)
    if full:
        if dist.get_rank() == 0:
            torch.save({**state, **meta}, temporary)
    else:
        dcp.save(state, checkpoint_id=temporary)
        if dist.get_rank() == 0:  # beside the shards: DCP loads only the keys asked for
            torch.save(meta, temporary / _META)
    dist.barrier()
    if dist.get_rank() == 0:
        _replace(temporary, path)
    dist.barrier()
    return path


def _optimizers_by_key(saved: dict[str, Any]) -> dict[str, Any]:
    # a Trainer's file keeps its optimizers in Lightning's list; a folder, by key
    for index, optimizer in enumerate(saved.pop("optimizer_states", [])):
        saved[f"optimizer_{index}"] = optimizer
    return saved


def read(
    path: str | os.PathLike[str],
    module: tuple[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    *,
    strict: bool = True,
    weights_only: bool = False,
) -> dict[str, Any]:
    """Load what `write` made (a folder or a file), whatever plan saved it.

    ``module`` is its key and the module; ``optimizers`` go by key. A file's optimizer list
    (Lightning's ``optimizer_states``) is read as ``optimizer_0``, ``optimizer_1``, ...

    Returns:
        The ``meta`` saved beside (for a file: everything but the states loaded).

    Raises:
        ShardingError: no checkpoint at ``path``, or one that does not fit the module.
    """
    path = Path(path)
    if not path.exists():
        raise ShardingError(f"no checkpoint at {path}")
    if path.is_dir():
        _refuse_packed(module[1], f"reading the sharded checkpoint {path}")
        return _read_sharded(path, module, optimizers, strict=strict)
    # every rank reads the file and keeps its own shards (a full copy per rank while
    # loading: the price of the one-file format)
    saved = _optimizers_by_key(torch.load(path, map_location="cpu", weights_only=weights_only))
    key, target = module
    # a pipeline rank takes its own stages' part of the file (set_model_state)
    set_model_state(target, saved.pop(key), full=True, strict=strict)
    for name, optimizer in optimizers.items():
        if name in saved:
            set_optimizer_state(target, optimizer, saved.pop(name), full=True)
    return saved


def _read_sharded(
    path: Path, module: tuple[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], *, strict: bool
) -> dict[str, Any]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    key, target = module
    metadata = FileSystemReader(path).read_metadata()
    state: dict[str, Any] = {key: model_state(target)}
    for name, optimizer in optimizers.items():
        state[name] = (
            _zero1_template(target, optimizer, name, metadata)
            if isinstance(optimizer, ZeroRedundancyOptimizer)
            else optimizer_state(target, optimizer)
        )
    # DCP keeps one rank's copy of a non-tensor value such as the param groups; under a
    # pipeline plan each rank's optimizer holds other parameters (its stages'), so each
    # group keeps this rank's parameter names and takes the saved hyperparameters
    own_params = {
        name: [group["params"] for group in state[name].get("param_groups", [])]
        for name, optimizer in optimizers.items()
        if not isinstance(optimizer, ZeroRedundancyOptimizer)
    }
    try:
        dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    except (Exception, CheckpointException) as error:  # a BaseException: it wraps each rank's failure
        failures = getattr(error, "failures", {})
        cause = next(iter(failures.values()))[0] if failures else error
        raise ShardingError(
            f"the checkpoint at {path} does not fit this module: {cause}. "
            "Load it under a module of the same shapes, or with strict=False to skip what is missing"
        ) from error
    for name, params in own_params.items():
        groups = state[name].get("param_groups", [])
        if len(groups) == len(params):
            for group, own in zip(groups, params, strict=True):
                group["params"] = own
    set_model_state(target, state[key], full=False, strict=strict)
    for name, optimizer in optimizers.items():
        set_optimizer_state(target, optimizer, state[name], full=False)
    return torch.load(path / _META, weights_only=False) if (path / _META).exists() else {}


def _refuse_packed(module: nn.Module, what: str) -> None:
    # apply marks layers whose packed pieces it split one by one (GPT-2's c_attn): their
    # weights are placed _StridedShard, whose strided chunks torch's DCP cannot describe
    packed = [path for path, sub in module.named_modules() if getattr(sub, "_fs_packed", None)]
    if packed:
        raise ShardingError(
            f"{what}: {packed[0]} ({len(packed)} layers in all) holds a 'packed_colwise' weight, split "
            "piece by piece (a strided split), which torch's sharded checkpoint (DCP) cannot describe. "
            "Save and load with full=True (one file of whole tensors; it loads under any plan)"
        )


def save(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    full: bool = False,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save a parallelized module (and optimizer) on every rank, atomically.

    Args:
        path: a folder (sharded) or a file (``full=True``).
        module: the module `apply` parallelized.
        optimizer: its optimizer (any plan's, ZeRO-1's included), if its state should be saved too.
        full: one file with full tensors, written by rank 0, instead of one file per rank.
        extra: small picklable values to keep beside (step counters, say).

    Returns:
        The path written.

    Examples:
        >>> # fs.checkpoint.save("ckpt", model, optimizer); fs.checkpoint.load("ckpt", model, optimizer)
    """
    if not full:
        _refuse_packed(module, "fs.checkpoint.save(full=False)")
    state: dict[str, Any] = {"model": model_state(module, full=full)}
    if optimizer is not None:
        state["optimizer"] = optimizer_state(module, optimizer, full=full)
    return write(path, state, full=full, meta={"extra": extra or {}})


def load(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into a parallelized module (and optimizer), whatever plan saved it.

    ``strict=False`` skips what the checkpoint lacks instead of refusing it.

    Returns:
        The ``extra`` values saved beside.

    Raises:
        ShardingError: no checkpoint at ``path``, or one that does not fit the module.
    """
    optimizers = {"optimizer": optimizer} if optimizer is not None else {}
    return dict(read(path, ("model", module), optimizers, strict=strict).get("extra", {}))


def convert(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Convert offline between a sharded folder and a full file (direction from ``source``).

    No process group is needed. The result is written aside and renamed. Works for
    `save`'s checkpoints and for the Trainer's (``ShardStrategy``), whose optimizers are
    ``optimizer_states`` in a file and ``optimizer_0``, ``optimizer_1``, ... in a folder.

    Raises:
        ShardingError: ``source`` does not exist.

    Examples:
        >>> # fs.checkpoint.convert("ckpt", "ckpt.pt")   # sharded -> full
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source, target = Path(source), Path(target)
    if not source.exists():
        raise ShardingError(f"no checkpoint at {source}")
    temporary = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    if source.is_dir():
        dcp_to_torch_save(source, temporary)
        state = torch.load(temporary, weights_only=False)
        optimizers = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k[10:]))
        if optimizers:
            state["optimizer_states"] = [state.pop(k) for k in optimizers]
        meta = torch.load(source / _META, weights_only=False) if (source / _META).exists() else {}
        torch.save({**state, **meta}, temporary)
    else:
        saved = _optimizers_by_key(torch.load(source, weights_only=False))
        states = [k for k in saved if k in ("model", "optimizer", "state_dict") or k.startswith("optimizer_")]
        tensors = {k: saved.pop(k) for k in states}
        dcp.save(tensors, checkpoint_id=temporary, no_dist=True)
        torch.save(saved, temporary / _META)
    _replace(temporary, target)
    return target
