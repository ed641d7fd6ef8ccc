"""The states a checkpoint holds, under any plan: this rank's shards, or whole tensors.

`model_state` / `optimizer_state` take them out of a parallelized module and its optimizer,
keyed by parameter path under every plan; `set_model_state` / `set_optimizer_state` put them
back. Whole states gather every pipeline stage's on rank 0, and put weights packing unequal
pieces back in the pieces' order (`engines.packed_pieces`). A ZeRO-1 optimizer's sharded
state is the whole tensors each rank owns.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
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
from functional_shard.runtime.engines.gradients import gradients_set_aside
from functional_shard.runtime.engines.packed_pieces import piece_major, rank_major, unequal_packed

from .integrity import index_tensors

if TYPE_CHECKING:
    from functional_shard.runtime.engines.pipeline import Pipelined

__all__ = [
    "made_state",
    "model_state",
    "optimizer_state",
    "refuse_packed",
    "saved_only",
    "set_model_state",
    "set_optimizer_state",
    "state_made",
    "zero1_template",
]


def _pipeline(module: nn.Module) -> Pipelined | None:
    """The pipeline ``module`` (or a module inside it, as a LightningModule's child) runs, if any."""
    from functional_shard.runtime.engines.pipeline import pipeline_of

    return next((found for m in module.modules() if (found := pipeline_of(m)) is not None), None)


Orders = dict[str, tuple[int, tuple[int, ...], int]]
Reorder = Callable[[torch.Tensor, int, tuple[int, ...], int], torch.Tensor]


def _model_in_order(state: dict[str, Any], orders: Orders, reorder: Reorder) -> dict[str, Any]:
    # a whole model state with each unequal packed weight reordered (see engines.packed_pieces)
    return {k: reorder(v, *orders[k]) if k in orders and torch.is_tensor(v) else v for k, v in state.items()}


def _optimizer_in_order(state: dict[str, Any], orders: Orders, reorder: Reorder) -> dict[str, Any]:
    # the same for a whole optimizer state: each such parameter's tensors of its shape (moments)
    def fixed(path: str, values: dict[str, Any]) -> dict[str, Any]:
        dim, pieces, _ = orders[path]
        return {
            name: reorder(t, *orders[path])
            if torch.is_tensor(t) and t.dim() > dim and t.size(dim) == sum(pieces)
            else t
            for name, t in values.items()
        }

    if "state" not in state:
        return state
    states = {k: fixed(k, v) if k in orders else v for k, v in state["state"].items()}
    return {**state, "state": states}


def _gathered_stages(
    pipelined: Pipelined,
    sharded: dict[str, Any],
    merge: Any,
    in_order: Callable[[dict[str, Any]], dict[str, Any]],
) -> dict[str, Any]:
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
    mine = in_order(_tree_map_in_order(whole, sharded))  # the stage's ranks know its packing
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
    if not full:
        return get_model_state_dict(module)
    orders = unequal_packed(module)
    pipelined = _pipeline(module)
    if pipelined is not None:
        ordered = functools.partial(_model_in_order, orders=orders, reorder=piece_major)
        return _gathered_stages(pipelined, model_state(module), _merge_models, ordered)
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _model_in_order(state, orders, piece_major)


def set_model_state(module: nn.Module, state: dict[str, Any], *, full: bool, strict: bool = True) -> None:
    """Load a state from `model_state` (sharded, or full on every rank) into the module.

    Under a pipeline plan a full state holds the other stages' tensors too; this rank
    loads its own (and still refuses, with ``strict``, one that lacks any of them).
    """
    if full and _pipeline(module) is not None:
        own = set(module.state_dict())
        state = {k: v for k, v in state.items() if k in own}
    if full:
        state = _model_in_order(state, unequal_packed(module), rank_major)
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=full, strict=strict))


def _names(module: nn.Module) -> dict[nn.Parameter, str]:
    return {param: name for name, param in module.named_parameters()}


def _drop_unsaved(module: nn.Module, optimizer: torch.optim.Optimizer, saved: set[str]) -> None:
    # a tied parameter's state is saved under one of its names
    names: dict[nn.Parameter, set[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(param, set()).add(name)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param in names and not names[param] & saved:
                optimizer.state.pop(param, None)


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
    Full: every parameter's whole state on rank 0, nothing elsewhere. A parameter that was
    never stepped has none, and reading the state leaves the optimizer as it was.
    """
    never_stepped = not isinstance(optimizer, ZeroRedundancyOptimizer) and not optimizer.state
    state = _optimizer_state(module, optimizer, full=full)
    if never_stepped:
        # torch makes a never-stepped optimizer's state to read it (_init_optim_state: a step
        # of zero gradients at lr 0), after which Adam counts one step: the first real step's
        # bias correction, and so the training, would differ from a run that never saved
        optimizer.state.clear()
        return {**state, "state": {}} if state else state
    return state


def made_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's state of ``optimizer`` with an entry for every parameter: what a load fills.

    Torch makes a never-stepped optimizer's state (zeros) while the gradients are set aside
    (`state_made`); the optimizer keeps it until a load replaces it or `_restore` undoes it.
    """
    with state_made(optimizer):
        return _optimizer_state(module, optimizer, full=False)


def _optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool) -> dict[str, Any]:
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        if not full:
            return get_optimizer_state_dict(module, optimizer)
        orders = unequal_packed(module)
        pipelined = _pipeline(module)
        if pipelined is not None:
            ordered = functools.partial(_optimizer_in_order, orders=orders, reorder=piece_major)
            own = _optimizer_state(module, optimizer, full=False)
            return _gathered_stages(pipelined, own, _merge_optimizers, ordered)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return _optimizer_in_order(
            get_optimizer_state_dict(module, optimizer, options=options), orders, piece_major
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


def state_made(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
    """While torch loads into ``optimizer``: its gradients set aside, so that torch makes its state.

    Torch makes an empty optimizer's state to load into (a step with zero gradients and lr 0)
    only when no parameter has a gradient (``_init_optim_state`` in
    torch.distributed.checkpoint.state_dict); otherwise a sharded load finds no state to fill
    and drops the saved one, and a full load fails on an assertion.
    """
    return gradients_set_aside(p for group in optimizer.param_groups for p in group["params"])


def set_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], *, full: bool
) -> None:
    """Load a state from `optimizer_state` (sharded, or full on every rank), under any plan."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        if full and _pipeline(module) is not None:
            own = {name for name, _ in module.named_parameters()}
            state = {**state, "state": {k: v for k, v in state.get("state", {}).items() if k in own}}
        if full and not state.get("state"):
            # nothing per parameter (a stateless optimizer: SGD without momentum): torch's full
            # load learns the device from the optimizer's own state tensors, and asserts without
            optimizer.state.clear()
            for saved, group in zip(state.get("param_groups", []), optimizer.param_groups, strict=False):
                group.update({k: v for k, v in saved.items() if k != "params"})
            return
        if full:
            state = _optimizer_in_order(state, unequal_packed(module), rank_major)
            # torch's full load reads each hyperparameter into the optimizer's own groups, and
            # fails (KeyError) on one they lack: a scheduler's initial_lr, when the optimizer
            # is loaded before its scheduler is made
            for saved, group in zip(state.get("param_groups", []), optimizer.param_groups, strict=False):
                group.update({k: v for k, v in saved.items() if k not in group})
        # a parameter without saved state never stepped (the fit was checked before): torch's
        # strict load would refuse it, and its non-strict one keep the zeros torch made for it
        options = StateDictOptions(full_state_dict=full, strict=False)
        with state_made(optimizer):
            set_optimizer_state_dict(module, optimizer, state, options=options)
        _drop_unsaved(module, optimizer, set(state.get("state", {})))
        return
    saved_groups = state.get("param_groups", [])
    if saved_groups and len(saved_groups) != len(optimizer.param_groups):
        raise ShardingError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups"
        )
    listed = {name for group in saved_groups for name in group.get("params", [])}
    for name, param in _owned(module, optimizer).items():
        if name in state.get("state", {}):
            optimizer.optim.state[param] = {
                # 0-dim values (Adam's step) stay on the CPU, as torch's optimizers keep them
                key: value.to(param.device) if torch.is_tensor(value) and value.dim() else value
                for key, value in state["state"][name].items()
            }
        elif name in listed:  # the saved optimizer held it, and it never stepped there
            optimizer.optim.state.pop(param, None)
    # no groups saved (a checkpoint of the model alone): the hyperparameters stay
    for saved, group, local in zip(
        saved_groups, optimizer.param_groups, optimizer.optim.param_groups, strict=False
    ):
        hyper = {k: v for k, v in saved.items() if k != "params"}
        group.update(hyper)
        local.update(hyper)


def zero1_template(
    module: nn.Module, optimizer: ZeroRedundancyOptimizer, key: str, metadata: Any
) -> dict[str, Any]:
    """What a ZeRO-1 optimizer's rank owns, shaped as the checkpoint stored it (any plan's)."""
    owned = _owned(module, optimizer)
    prefix = f"{key}.state."
    state: dict[str, dict[str, Any]] = {}
    for stored, (shape, dtype) in index_tensors(metadata).items():
        name, _, field = stored[len(prefix) :].rpartition(".")
        if stored.startswith(prefix) and name in owned:
            state.setdefault(name, {})[field] = torch.empty(shape, dtype=dtype)
    groups = _with_saved_keys({"param_groups": _zero1_groups(module, optimizer)}, key, metadata)
    return {"state": state, "param_groups": groups}


def saved_only(state: dict[str, Any], key: str, index: Any, module_key: str) -> dict[str, Any]:
    """``state`` (a template to load into) less the parameters that never stepped in the checkpoint.

    A parameter the index (of ``key``'s optimizer) holds no state for gets none; one whose
    ``module_key`` entry the index lacks altogether (a load with strict=False) keeps what it has.
    """
    prefix = f"{key}.state."
    stored = {name.rpartition(".")[0] for name in index.state_dict_metadata if name.startswith(prefix)}
    saved = index.state_dict_metadata.keys()
    kept = {
        name: values
        for name, values in state.get("state", {}).items()
        if prefix + name in stored or f"{module_key}.{name}" not in saved
    }
    return {**state, "state": kept, "param_groups": _with_saved_keys(state, key, index)}


def _with_saved_keys(state: dict[str, Any], key: str, index: Any) -> list[dict[str, Any]]:
    # a hyperparameter the optimizer lacks (a scheduler's initial_lr, when the optimizer is
    # loaded before its scheduler is made) is read only if the template names it
    groups = [dict(group) for group in state.get("param_groups", [])]
    prefix = f"{key}.param_groups."
    for name in index.state_dict_metadata:
        number, _, field = name.removeprefix(prefix).partition(".")
        if name.startswith(prefix) and number.isdigit() and int(number) < len(groups) and "." not in field:
            groups[int(number)].setdefault(field, None)
    return groups


def refuse_packed(module: nn.Module, what: str) -> None:
    """Refuse a sharded checkpoint of a module with packed weights, split piece by piece."""
    # apply marks layers whose packed pieces it split one by one (GPT-2's c_attn, a fused
    # wqkv): equal pieces are placed _StridedShard, whose strided chunks torch's DCP cannot
    # describe, and unequal ones Shard on each rank's pieces laid end to end, which another
    # plan would cut wrongly; whole states put both in order
    packed = [path for path, sub in module.named_modules() if getattr(sub, "_fs_packed", None)]
    if packed:
        raise ShardingError(
            f"{what}: {packed[0]} ({len(packed)} layers in all) holds a packed weight (fs.packed, "
            "'packed_colwise'), split piece by piece, which torch's sharded checkpoint (DCP) cannot "
            "describe. Save and load with full=True (one file of whole tensors; it loads under any plan)"
        )
