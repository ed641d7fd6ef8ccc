"""Run a plan with torch's own engines.

With `launch` and `checkpoint`, the only module that talks to torch.distributed process groups.

``apply`` turns a `Plan` into a module parallelized in place: tensor parallel through
``parallelize_module`` with the plan's styles, then data parallel through FSDP2
(``fully_shard``: ZeRO-2/3, FSDP, HSDP) or DDP (composable ``replicate``; ZeRO-1 adds
``ZeroRedundancyOptimizer`` in `optimizer`). Nothing here re-implements a collective.
Every check runs before any parameter is touched.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor.parallel import PrepareModuleInput

# build_device_mesh lives below mesh.py (Mesh.device_mesh uses it); re-exported here
from .device_mesh import build_device_mesh
from .errors import MeshError, PlanError, ShardingError, bullets
from .mesh import Mesh
from .plan import Plan
from .rules import first_input_name, is_conv1d, sequence_gathers, sequence_parallel_problems
from .tree import dtype_from_name, read_model

__all__ = [
    "apply",
    "build_device_mesh",
    "check_optimizer",
    "check_runnable",
    "clip_grad_norm_",
    "grad_scaler",
    "materialize",
    "optimizer",
]


@dataclass(frozen=True)
class _Applied:
    plan: Plan
    device_mesh: DeviceMesh


# which plan each parallelized module runs, for optimizer(); weak so modules can die
_APPLIED: weakref.WeakKeyDictionary[nn.Module, _Applied] = weakref.WeakKeyDictionary()

_SUPPORTED_STYLE_MODULES = (nn.Linear, nn.Embedding)
# styles functional_shard runs itself on Hugging Face's Conv1D (torch's styles have none)
_CONV1D_STYLES = ("colwise", "packed_colwise", "rowwise")


def _is_conv1d(module: object) -> bool:
    return is_conv1d(f"{type(module).__module__}.{type(module).__qualname__}")


def _projection(module: object) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _features(module: Any) -> tuple[int, int]:
    """(in, out) features of an nn.Linear or a Conv1D (weight (in, out))."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    rows, cols = module.weight.shape
    return rows, cols


def engine_problems(plan: Plan, module: nn.Module) -> list[str]:
    """Everything about ``plan`` that torch's engines cannot run on ``module``, one line each."""
    config = plan.config
    found: list[str] = []
    tree = read_model(module)
    for path in plan.params.keys() - tree.params.keys():
        found.append(f"{path}: in the plan but not a parameter of the module")
    for path in tree.params.keys() - plan.params.keys():
        found.append(f"{path}: a parameter of the module but not in the plan; plan this module")
    for path in plan.params.keys() & tree.params.keys():
        if tree.params[path].shape != plan.tensors[path].shape:
            found.append(
                f"{path}: shape {tree.params[path].shape} in the module, "
                f"{plan.tensors[path].shape} in the plan"
            )
    if found:
        return found
    kind = config.data_parallel
    tp_axes = config.tensor_parallel_axes
    if len(tp_axes) > 1:
        found.append(f"tensor parallel over {tp_axes}: apply() runs one tensor-parallel axis")
    if tp_axes and kind in ("ddp", "zero1"):
        found.append(
            f"{kind} with tensor parallel: torch's DDP does not run over DTensor shards; "
            "use fs.fsdp(...) (or fs.zero(2)) for the data-parallel axis"
        )
    if config.checkpointed and config.checkpoint_policy not in ("full", "selective"):
        found.append(
            f"checkpoint_policy {config.checkpoint_policy!r}: apply() runs 'full' or 'selective' "
            "(set it with fs.checkpointing(..., policy=...))"
        )
    if kind in ("ddp", "zero1") and any(p.is_meta for p in module.parameters()):
        found.append(
            f"{kind} on a meta-device module: DDP keeps every parameter on every rank (meta init saves "
            "nothing) and holds on to the parameter objects that materializing replaces; build the "
            "model on a real device"
        )
    if kind in ("ddp", "zero1", "none"):
        if config.param_dtype or config.reduce_dtype:
            found.append(f"mixed precision with {kind}: apply() casts through FSDP2; use fs.fsdp(...)")
        if config.offload_params or config.offload_grads or config.offload_optimizer:
            found.append(f"CPU offload with {kind}: apply() offloads through FSDP2; use fs.fsdp(...)")
    offloads = {config.offload_params, config.offload_grads, config.offload_optimizer}
    if len(offloads) > 1:
        found.append(
            "offload of only some of params/grads/optimizer: FSDP2 offloads all three together "
            "(the optimizer steps on the CPU); use fs.offload() or to_lightning() for DeepSpeed"
        )
    if len(config.replicate_axes) > 1 or (config.replicate_axes and len(config.shard_axes) > 1):
        found.append(
            f"replicate axes {config.replicate_axes} with shard axes {config.shard_axes}: apply() runs "
            "HSDP on one replicate and one shard axis"
        )
    styled = {path: style for path, style, _ in config.tp_styles}
    modules = dict(module.named_modules())
    tp_size = plan.mesh[tp_axes[0]] if tp_axes else 1
    found.extend(_unfed_splits(config.tp_styles, modules))
    for path, style, _ in config.tp_styles:
        target = modules.get(path)
        parent = modules.get(path.rpartition(".")[0])
        rowwise = style in ("rowwise", "rowwise_split_input")
        if rowwise and _projection(target) and _features(target)[0] % tp_size:
            found.append(
                f"{path}: rowwise {type(target).__name__} with in_features={_features(target)[0]} over "
                f"{tp_axes[0]!r} (size {tp_size}); torch's RowwiseParallel rebuilds its input from local "
                f"shards as if they were even ({_features(target)[0]} % {tp_size} != 0). Make the dim "
                "divisible"
            )
        found.extend(_conv1d_problems(path, style, target, parent, tp_size))
        if style == "packed_colwise" and isinstance(target, nn.Linear) and config.shard_axes:
            found.append(
                f"{path}: 'packed_colwise' on an nn.Linear splits its weight's dim 0, which FSDP2 shards "
                f"again over {config.shard_axes}; FSDP2 cannot describe a strided split inside a strided "
                "split. Use plain tensor parallel for this layer, or replicate it"
            )
        found.extend(_heads_split(path, style, target, parent, tp_size))
    if config.sequence_parallel and tp_axes:
        found.extend(sequence_parallel_problems(config.tp_styles, modules))
    shard_axes = set(config.shard_axes)
    for path, sharding in plan.params.items():
        owner_path = path.rpartition(".")[0]
        owner = modules.get(owner_path)
        if not sharding.compute.is_replicated:
            if owner_path not in styled:
                found.append(
                    f"{path}: compute {sharding.compute!r} comes from no tensor-parallel style; apply() "
                    "splits computation only through torch's styles (colwise/rowwise rules)"
                )
            elif not isinstance(owner, _SUPPORTED_STYLE_MODULES) and not _is_conv1d(owner):
                found.append(
                    f"{path}: style {styled[owner_path]!r} on a {type(owner).__name__}; torch's parallel "
                    "styles support nn.Linear and nn.Embedding"
                )
        at_rest = sharding.at_rest_axes
        if at_rest and set(at_rest) != shard_axes:
            found.append(
                f"{path}: split at rest over {sorted(at_rest)}, but FSDP2 shards over {config.shard_axes}"
            )
        ndim = plan.tensors[path].ndim
        for d, axes in enumerate(sharding.storage.dim_axes(ndim)):
            if d and any(a in at_rest for a in axes):
                found.append(f"{path}: split at rest on dim {d}; apply() lets FSDP2 shard dim 0 only")
        names = plan.aliases.get(path, (path,))
        units = {plan.unit_of(name) for name in names}
        if len(units) > 1:
            found.append(f"{path}: tied names {names} fall in different FSDP units {sorted(units)}")
    return found


def check_runnable(plan: Plan, module: nn.Module) -> None:
    """Raise if torch's engines cannot run ``plan`` on ``module``; pure (no process group).

    `apply` runs it first; call it early (before launching processes, say) to fail sooner.

    Raises:
        PlanError: every problem `engine_problems` finds, one bullet each.

    Examples:
        >>> plan = fs.shard(nn.Linear(8, 8), fs.Mesh(dp=2), fs.fsdp())
        >>> check_runnable(plan, nn.Linear(8, 8))  # fine: returns None
    """
    if problems := engine_problems(plan, module):
        raise PlanError(
            bullets(
                f"torch's engines cannot run this plan on {plan.mesh!r}:",
                problems,
                "Change the policy, or plan for what apply() supports (see docs: Applying plans).",
            )
        ) from None


def _unfed_splits(tp_styles: tuple[tuple[str, str, str], ...], modules: dict[str, nn.Module]) -> list[str]:
    # A rowwise Linear takes its input split on the feature dim: some colwise Linear beside
    # it (same parent module) must produce that split. A colwise Linear's split output must
    # reach a rowwise Linear beside it, or the module between them sees a fraction of the
    # features it expects. Layers whose split is made whole at the edge (colwise_gather,
    # rowwise_split_input) need no partner; embeddings take and give whole activations.
    # (packed_colwise counts as colwise: its pieces stay split too.)
    style_of = {
        path: "colwise" if style == "packed_colwise" else style
        for path, style, kind in tp_styles
        if kind != "embedding"
    }
    found = []
    for path, style in style_of.items():
        if style not in ("rowwise", "colwise") or not _projection(modules.get(path)):
            continue
        parent = path.rpartition(".")[0]
        siblings = [
            other
            for other, module in modules.items()
            if other != path and other.rpartition(".")[0] == parent and _projection(module)
        ]
        partner = "colwise" if style == "rowwise" else "rowwise"
        if any(style_of.get(other) == partner for other in siblings):
            continue
        whole = [other for other in siblings if other not in style_of]
        if style == "rowwise":
            feeders = f"its feeding layer(s) {whole} stay whole" if whole else "no colwise layer beside it"
            found.append(
                f"{path}: split rowwise (it expects its input split over the tensor-parallel ranks), but "
                f"{feeders}, so no layer splits its input. Split the feeding layer colwise, or make "
                f"{path!r} 'rowwise_split_input' (it then slices a whole input)"
            )
        else:
            readers = f"{whole} beside it stay whole" if whole else "no rowwise layer is beside it"
            found.append(
                f"{path}: split colwise (its output stays split over the tensor-parallel ranks), but "
                f"{readers}, so nothing takes the split output. Split the consuming layer rowwise, or "
                f"make {path!r} 'colwise_gather'"
            )
    return found


def _conv1d_problems(path: str, style: str, target: Any, parent: Any, tp_size: int) -> list[str]:
    # Conv1D (and packed pieces) run through functional_shard's own split (_split_projection):
    # colwise, packed_colwise and rowwise, with whole activations between layers; a packed
    # projection's pieces are told apart by its attention's split_size (Hugging Face GPT-2)
    found = []
    if _is_conv1d(target) and style not in (*_CONV1D_STYLES, "sequence", "replicate"):
        found.append(
            f"{path}: style {style!r} on a Conv1D; functional_shard splits Conv1D as {_CONV1D_STYLES} only"
        )
    split_here = style in _CONV1D_STYLES and (_is_conv1d(target) or style == "packed_colwise")
    if split_here and style == "colwise" and _features(target)[1] % tp_size:  # (rowwise: checked above)
        found.append(
            f"{path}: colwise {type(target).__name__} with {_features(target)[1]} output features over "
            f"{tp_size} tensor-parallel ranks; functional_shard splits it evenly only. Make the dim divisible"
        )
    if style == "packed_colwise":
        split_size = getattr(parent, "split_size", None)
        out = _features(target)[1] if _projection(target) else 0
        if not _projection(target) or not isinstance(split_size, int) or not split_size or out % split_size:
            found.append(
                f"{path}: 'packed_colwise' needs an nn.Linear or Conv1D whose attention module says the "
                f"size of each packed piece in an int 'split_size' (Hugging Face GPT-2's); "
                f"{type(parent).__name__} has split_size={split_size!r}"
            )
        elif split_size % tp_size:
            found.append(
                f"{path}: each of its {out // split_size} packed pieces ({split_size} features) does not "
                f"split over {tp_size} tensor-parallel ranks; use a size that divides {split_size}"
            )
    return found


def _heads_split(path: str, style: str, target: Any, parent: Any, tp_size: int) -> list[str]:
    # An attention projection split for tensor parallel must keep whole heads on each rank:
    # the module reshapes its local features into (heads, head_dim). Attention modules
    # (Hugging Face's, the zoo's) say their head width in ``head_dim``. A gathered output
    # or a sliced whole input is whole again for the attention, which needs nothing then.
    # A packed projection holds its pieces' heads: each piece (q, k or v) must split whole.
    head_dim = getattr(parent, "head_dim", None)
    splits_heads = style in ("colwise", "rowwise", "packed_colwise")
    if not _projection(target) or not isinstance(head_dim, int) or not splits_heads:
        return []
    in_features, out_features = _features(target)
    width = in_features if style == "rowwise" else out_features
    split_size = getattr(parent, "split_size", None)
    if style == "packed_colwise" and isinstance(split_size, int) and split_size:
        width = split_size
    if width % head_dim or (width // head_dim) % tp_size == 0:
        return []
    heads = width // head_dim
    return [
        f"{path}: its {heads} attention heads ({width} features, head_dim {head_dim}) do not split "
        f"over {tp_size} tensor-parallel ranks; use a tensor-parallel size that divides {heads}"
    ]


def _axes_mesh(device_mesh: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh:
    if len(axes) == 1:
        return device_mesh[axes[0]]
    return device_mesh[axes]._flatten("_".join(axes))


def _torch_styles(
    tp_styles: tuple[tuple[str, str, str], ...], module: nn.Module, sequence: bool
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The torch parallel style of each styled module, and the layers split here (Conv1D, packed)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    # Without sequence parallel the activations between styled modules are whole
    # (replicated). With it, as torchtitan runs it: the residual stream is split on the
    # sequence dim (1) and stays a DTensor (its shape reads whole: Hugging Face derives
    # position ids and the attention mask from it); each module that holds column-split
    # layers (attention, MLP) gathers its input once on entry, the layers inside take it
    # whole, and row-split layers reduce-scatter their output back over the sequence.
    between = Shard(1) if sequence else Replicate()
    local = not sequence
    gathers = set(sequence_gathers(tp_styles)) if sequence else set()
    styles: dict[str, Any] = {
        path: _SequenceGather(first_input_name(module.get_submodule(path)) or "") for path in gathers
    }
    own: list[tuple[str, str]] = []  # split here: Conv1D layers and packed projections
    for path, style, _ in tp_styles:
        target = module.get_submodule(path)
        embedding = isinstance(target, nn.Embedding)
        taken = Replicate() if path.rpartition(".")[0] in gathers else between  # a column split's input
        if style in _CONV1D_STYLES and (_is_conv1d(target) or style == "packed_colwise"):
            own.append((path, style))
        elif style == "colwise":
            styles[path] = (
                ColwiseParallel(input_layouts=Replicate(), output_layouts=between, use_local_output=local)
                if embedding
                else ColwiseParallel(input_layouts=taken)
            )
        elif style == "colwise_gather":
            styles[path] = ColwiseParallel(input_layouts=taken, output_layouts=Replicate())
        elif style == "rowwise":
            styles[path] = (
                RowwiseParallel(input_layouts=Replicate(), output_layouts=between, use_local_output=local)
                if embedding
                else RowwiseParallel(output_layouts=between, use_local_output=local)
            )
        elif style == "rowwise_split_input":
            # the input arrives whole (after a colwise_gather layer); each rank slices its part
            styles[path] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=between, use_local_output=local
            )
        elif style == "sequence" and sequence:
            styles[path] = SequenceParallel()
        elif style == "replicate_grad_allreduce":
            # a per-head module (q/k norm) after a colwise projection sees this rank's heads
            # (dim -2); its weight stays whole and its gradient, a partial sum, is all-reduced
            styles[path] = SequenceParallel(sequence_dim=-2, use_local_output=True)
    return styles, own


class _SequenceGather(PrepareModuleInput):
    """torch's ``PrepareModuleInput`` gathering a module's first input over the sequence.

    The input may come by position (the zoo's blocks, Hugging Face's MLPs) or by name
    (Hugging Face's attention gets ``hidden_states=``); the other arguments (position
    embeddings, the attention mask) pass through untouched.
    """

    def __init__(self, name: str) -> None:
        from torch.distributed.tensor import Replicate, Shard

        super().__init__(
            input_kwarg_layouts={name: Shard(1)}, desired_input_kwarg_layouts={name: Replicate()}
        )

    def _prepare_input_fn(self, inputs: Any, device_mesh: DeviceMesh) -> Any:
        from torch.distributed.tensor import Replicate, Shard

        if not inputs:
            return inputs
        rest = (None,) * (len(inputs) - 1)
        first = PrepareModuleInput(
            input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest)
        )
        return first._prepare_input_fn(inputs, device_mesh)


def _tensor_parallel(plan: Plan, module: nn.Module, device_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    config = plan.config
    if not config.tensor_parallel_axes:
        return
    styles, own = _torch_styles(config.tp_styles, module, config.sequence_parallel)
    tp_mesh = device_mesh[config.tensor_parallel_axes[0]]
    parallelize_module(module, tp_mesh, styles)
    for path, style in own:
        parent_path = path.rpartition(".")[0]
        parent: Any = module.get_submodule(parent_path) if parent_path else module
        pieces = (
            _features(module.get_submodule(path))[1] // parent.split_size if style == "packed_colwise" else 1
        )
        _split_projection(module.get_submodule(path), tp_mesh, style, pieces)
        if style == "packed_colwise":
            # the attention splits the packed output by split_size and infers its heads from
            # the local width; torch TP users shrink these to the rank's share (torchtitan's
            # n_heads): the local output holds split_size / tp features of each piece
            parent.split_size //= tp_mesh.size()
            if isinstance(getattr(parent, "num_heads", None), int):
                parent.num_heads //= tp_mesh.size()
    _place_grads_as_params(plan, module)


def _packed_local(full: torch.Tensor, dim: int, pieces: int, size: int, rank: int) -> torch.Tensor:
    """This rank's part of ``full`` split over ``size`` ranks on ``dim``, each of ``pieces`` on its own."""
    return torch.cat([piece.chunk(size, dim)[rank] for piece in full.chunk(pieces, dim)], dim).contiguous()


def _split_projection(target: Any, tp_mesh: DeviceMesh, style: str, pieces: int) -> None:
    # Torch's styles take nn.Linear and nn.Embedding only, and a plain Shard cannot say
    # "each packed piece split on its own". Here the parameters become DTensors placed as
    # the plan says (a packed weight as _StridedShard, torch's placement for a dim split
    # again inside each of split_factor pieces, so full_tensor() and state dicts give the
    # unpermuted weight back), and the forward computes on the local shards with the
    # collectives torch's styles would issue: a colwise layer takes its whole input and
    # all-reduces the input's gradient; a rowwise layer takes its input split on the
    # feature dim and all-reduces its output (its bias added once, after). A packed bias
    # stays whole (FSDP2 shards dim 0 again and cannot describe a strided split inside a
    # strided split): each rank slices its pieces through DTensor, whose backward
    # all-gathers the gradient.
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    conv1d = _is_conv1d(target)
    size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    colwise = style != "rowwise"
    weight_dim = (1 if colwise else 0) if conv1d else (0 if colwise else 1)

    def placed(tensor: torch.Tensor, dim: int | None) -> nn.Parameter:
        placement: Any
        if dim is None:
            local, placement = tensor.detach(), Replicate()
        elif pieces > 1:
            local = _packed_local(tensor.detach(), dim, pieces, size, rank)
            placement = _StridedShard(dim, split_factor=pieces)
        else:
            local, placement = tensor.detach().chunk(size, dim)[rank].contiguous(), Shard(dim)
        value = DTensor.from_local(
            local, tp_mesh, [placement], run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
        return nn.Parameter(value, requires_grad=tensor.requires_grad)

    target.register_parameter("weight", placed(target.weight, weight_dim))
    bias = getattr(target, "bias", None)
    if isinstance(bias, torch.Tensor):
        target.register_parameter("bias", placed(bias, 0 if colwise and pieces == 1 else None))

    def local_forward(x: torch.Tensor) -> torch.Tensor:
        weight = target.weight.to_local()
        bias: Any = target.bias if isinstance(target.bias, DTensor) else None
        if bias is not None and colwise and pieces > 1:
            bias = bias.redistribute(tp_mesh, [_StridedShard(0, split_factor=pieces)])
        bias = bias.to_local() if bias is not None else None
        if colwise:  # identity forward; backward all-reduces the input's gradient
            x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()]
            )
        y = x @ weight if conv1d else x @ weight.t()
        if colwise:
            return y if bias is None else y + bias
        y = DTensor.from_local(y, tp_mesh, [Partial()], run_check=False)
        y = y.redistribute(tp_mesh, [Replicate()]).to_local()
        return y if bias is None else y + bias

    target.forward = local_forward  # type: ignore[method-assign]
    if pieces > 1:  # materialize fills the weight's strided local part from a whole value
        target._fs_packed = (weight_dim, pieces)  # type: ignore[assignment]


def _packed_window(full_value: torch.Tensor, param: Any, dim: int, pieces: int) -> torch.Tensor:
    """This rank's local values of a packed weight (tensor-parallel pieces, then FSDP2's dim-0 shard)."""
    from torch.distributed.tensor import Shard

    mesh, placements = param.device_mesh, param.placements
    value = _packed_local(
        full_value, dim, pieces, mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    )
    for mesh_dim, placement in enumerate(placements[:-1]):
        if isinstance(placement, Shard) and placement.dim == 0:  # FSDP2's shard, padded at the end
            chunks = value.chunk(mesh.size(mesh_dim), 0)
            index = mesh.get_local_rank(mesh_dim)
            value = chunks[index] if index < len(chunks) else value[:0]
    return value


def _place_grads_as_params(plan: Plan, module: nn.Module) -> None:
    # Only without FSDP2, which reduces gradients itself. Meta parameters get theirs in
    # materialize: to_empty swaps their tensors, and hooks registered before do not fire.
    if not plan.config.tensor_parallel_axes or plan.config.data_axes:
        return
    from torch.distributed.tensor import DTensor

    for param in module.parameters():
        if isinstance(param, DTensor) and not param.is_meta:
            param.register_post_accumulate_grad_hook(_grad_placed_as_param)


def _grad_placed_as_param(param: torch.Tensor) -> None:
    # DTensor leaves some gradients placed otherwise than their parameter: a sequence-
    # parallel norm's is a partial sum (it saw this rank's tokens only), a vocabulary-split
    # embedding's arrives whole. Left so, the norm's would be all-reduced again in every
    # optimizer op that reads it (three times in AdamW), and the embedding's would stay
    # full-size on every rank; placed as the parameter once, here, neither happens.
    from torch.distributed.tensor import DTensor

    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)


def _retie(plan: Plan, module: nn.Module) -> None:
    # parallelize_module and fully_shard replace Parameter objects; tied names must
    # point at one parameter again
    for canonical, names in plan.aliases.items():
        shared = module.get_parameter(canonical)
        for name in names[1:]:
            owner_path, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner_path), attr, shared)


def _checkpointing(plan: Plan, module: nn.Module) -> None:
    # the composable checkpoint works through hooks: parameter paths stay as they are
    from torch.distributed._composable import checkpoint

    from .activations import selective_context

    selective = plan.config.checkpoint_policy == "selective"
    for path in plan.config.checkpointed:
        if selective:
            checkpoint(module.get_submodule(path), context_fn=selective_context)
        else:
            checkpoint(module.get_submodule(path))


def _data_parallel(plan: Plan, module: nn.Module, device_mesh: DeviceMesh, root: str) -> None:
    config = plan.config
    kind = config.data_parallel
    if kind == "none":
        return
    if kind in ("ddp", "zero1"):
        from torch.distributed._composable import replicate

        group = _axes_mesh(device_mesh, config.data_axes).get_group()
        replicate(module.get_submodule(root), process_group=group)
        return
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if config.replicate_axes:  # HSDP: a 2D (replicate, shard) mesh
        fsdp_mesh = device_mesh[(*config.replicate_axes, *config.shard_axes)]
    else:
        fsdp_mesh = _axes_mesh(device_mesh, config.shard_axes)
    options: dict[str, Any] = {
        "mesh": fsdp_mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=dtype_from_name(config.param_dtype) if config.param_dtype else None,
            reduce_dtype=dtype_from_name(config.reduce_dtype) if config.reduce_dtype else None,
        ),
        # pinned host memory speeds copies to an accelerator and needs one to exist
        "offload_policy": (
            CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
            if config.offload_params
            else OffloadPolicy()
        ),
    }
    # FSDP2 refuses 0-d parameters ("fully_shard doesn't support scalar parameters"); the
    # plan keeps them whole, so FSDP2 leaves them alone and _reduce_whole_grads reduces them
    whole = {module.get_parameter(path) for path in _whole_params(plan)}
    if whole:
        options["ignored_params"] = whole
    # bottom-up, as fully_shard requires: a unit takes the parameters no inner unit took
    for unit in sorted((u for u in config.units if u), key=lambda u: -u.count(".")):
        fully_shard(module.get_submodule(unit), reshard_after_forward=config.reshard_after_forward, **options)
    # the root: left to FSDP2's default it stays gathered from forward to backward (an
    # explicit True would make it reshard); ZeRO-2 says False everywhere
    fully_shard(
        module.get_submodule(root),
        reshard_after_forward=None if config.reshard_after_forward else False,
        **options,
    )


def _whole_params(plan: Plan) -> list[str]:
    """0-d parameters of an FSDP2 plan: kept whole on every rank, outside FSDP2."""
    if plan.config.data_parallel not in ("zero2", "zero3", "fsdp", "hsdp"):
        return []
    return [path for path in plan.params if plan.tensors[path].ndim == 0]


_AVERAGED: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()  # whole parameters given a hook


def _reduce_whole_grads(plan: Plan, module: nn.Module, device_mesh: DeviceMesh) -> None:
    # A parameter FSDP2 ignores gets no gradient reduction from it: average its gradient
    # over the data-parallel ranks here, once it is accumulated, as DDP would. Meta
    # parameters get their hook in materialize (to_empty replaces them).
    paths = _whole_params(plan)
    if not paths:
        return
    config = plan.config
    group = _axes_mesh(device_mesh, config.data_axes).get_group()
    size = plan.mesh.axes_size(config.data_axes)
    reduce_dtype = dtype_from_name(config.reduce_dtype) if config.reduce_dtype else None

    def average(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        buffer = grad if reduce_dtype is None or grad.dtype == reduce_dtype else grad.to(reduce_dtype)
        dist.all_reduce(buffer, group=group)
        buffer.div_(size)
        if buffer is not grad:
            grad.copy_(buffer)

    for path in paths:
        param = module.get_parameter(path)
        # materialize keeps a real parameter object (to_empty swaps only meta ones): one hook
        if not param.is_meta and param not in _AVERAGED:
            param.register_post_accumulate_grad_hook(average)
            _AVERAGED.add(param)


def apply(
    plan: Plan, module: nn.Module, device_mesh: DeviceMesh | None = None, *, root: str = ""
) -> nn.Module:
    """Parallelize ``module`` in place as ``plan`` says, with torch's engines.

    Call it on every rank, after ``torch.distributed`` is initialised and before the
    optimizer is built (use `optimizer`).

    Args:
        plan: the plan, made for this module.
        module: the module, with the same parameters on every rank (same seed).
        device_mesh: the mesh to run on; by default one is built from ``plan.mesh`` on the
            module's device type.
        root: the submodule whose ``forward`` runs the model, when the module's own
            forward is not called (a LightningModule's ``training_step`` calls its
            ``self.model``): it takes FSDP's root unit, or DDP. Every parameter must be
            inside it.

    Returns:
        ``module`` itself, parallelized.

    Raises:
        MeshError: no process group, or a world size / device mesh that differs from the plan's.
        PlanError: what the engines cannot run, one bullet per parameter, before anything changes.
        ShardingError: later, from the module's forward under sequence parallel, on every
            rank and before any collective: an input whose sequence length (dim 1) is not
            a multiple of the tensor-parallel size.

    Examples:
        >>> # on each of 4 ranks:
        >>> # plan = fs.shard(model, fs.Mesh(dp=4), fs.fsdp())
        >>> # fs.apply(plan, model)
        >>> # opt = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-3)
    """
    if not dist.is_initialized():
        raise MeshError("fs.apply needs torch.distributed: call dist.init_process_group(...) first")
    if plan.mesh.size != dist.get_world_size():
        raise MeshError(
            f"the plan's {plan.mesh!r} has {plan.mesh.size} devices but the world size is "
            f"{dist.get_world_size()}; plan for this world (an axis of size -1 takes the rest)"
        )
    if device_mesh is None:
        device = next(module.parameters(), torch.empty(0)).device.type
        device_mesh = build_device_mesh(plan.mesh, "cpu" if device == "meta" else device)
    elif Mesh.from_device_mesh(device_mesh) != plan.mesh:
        raise MeshError(
            f"the device mesh is {Mesh.from_device_mesh(device_mesh)!r} but the plan is for {plan.mesh!r}"
        )
    if module in _APPLIED:
        raise ShardingError("this module is already parallelized; apply a plan to a fresh module")
    try:
        module.get_submodule(root)
    except AttributeError:
        raise ShardingError(f"apply(root={root!r}): the module has no such submodule") from None
    outside = [p for p in plan.params if root and not p.startswith(root + ".")]
    if outside:
        raise ShardingError(
            f"apply(root={root!r}): parameters {outside[:3]} lie outside the root, where no engine would "
            "gather or reduce them; move them under it or choose an enclosing root"
        )
    check_runnable(plan, module)
    _tensor_parallel(plan, module, device_mesh)
    _retie(plan, module)
    _checkpointing(plan, module)
    _data_parallel(plan, module, device_mesh, root)
    _reduce_whole_grads(plan, module, device_mesh)
    _refuse_uneven_sequences(plan, module.get_submodule(root))
    _APPLIED[module] = _Applied(plan, device_mesh)
    return module


def _refuse_uneven_sequences(plan: Plan, root: nn.Module) -> None:
    # Sequence parallel splits the sequence evenly (torch pads no activation): an uneven
    # length fails deep in a rank (a reshape with the wrong length) or aborts the group in
    # a collective. Checked first in the root's forward, before FSDP2's hooks gather
    # anything; every rank of a tensor-parallel group gets the same shape and refuses alike.
    config = plan.config
    if not (config.sequence_parallel and config.tensor_parallel_axes):
        return
    axis = config.tensor_parallel_axes[0]
    size = plan.mesh[axis]

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        if first is not None and first.ndim >= 2 and first.shape[1] % size:
            raise ShardingError(
                f"sequence parallel over {axis!r} splits the sequence (dim 1) evenly over its {size} ranks, "
                f"but this input's sequence length is {first.shape[1]}, which {size} does not divide. Pad or "
                f"cut sequences to a multiple of {size}, or drop sequence_parallel"
            )

    root.register_forward_pre_hook(check, with_kwargs=True, prepend=True)


def _applied_with(plan: Plan, module: nn.Module, caller: str) -> _Applied:
    applied = _APPLIED.get(module)
    if applied is None or applied.plan != plan:
        raise ShardingError(f"{caller} needs the module fs.apply(plan, module) returned, with the same plan")
    return applied


def check_optimizer(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """Refuse an optimizer that holds parameters the module no longer has.

    Sharding replaces Parameter objects; an optimizer built before would step tensors
    no forward uses, and train nothing, silently.

    Raises:
        ShardingError: some of the optimizer's parameters are not the module's.
    """
    current = {id(p) for p in module.parameters()}
    stale = sum(id(p) not in current for group in optimizer.param_groups for p in group["params"])
    if stale:
        raise ShardingError(
            f"the optimizer holds {stale} parameters that are not the module's current ones: it was "
            "built before sharding replaced them. Build it after fs.apply, e.g. "
            "fs.optimizer(plan, module, torch.optim.AdamW, lr=...)"
        )


def optimizer(
    plan: Plan, module: nn.Module, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
) -> torch.optim.Optimizer:
    """An optimizer whose state sits where the plan's ``optim`` specs say.

    ZeRO-1 plans get torch's ``ZeroRedundancyOptimizer`` over the data-parallel group;
    other plans the plain optimizer over the module's (DTensor) shards.

    Raises:
        ShardingError: ``module`` was not parallelized by `apply` with this plan.

    Examples:
        >>> # opt = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-3)
    """
    applied = _applied_with(plan, module, "fs.optimizer")
    params: Iterable[nn.Parameter] = module.parameters()
    if plan.config.data_parallel == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        group = _axes_mesh(applied.device_mesh, plan.config.shard_axes).get_group()
        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=group, **kwargs)
    result = optimizer_class(params, **kwargs)
    check_optimizer(result, module)
    return result


def materialize(
    plan: Plan,
    module: nn.Module,
    device: str | torch.device = "cpu",
    *,
    seed: int | None = None,
    init: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Give a module built on the meta device real parameters, shard by shard, after `apply`.

    Each rank allocates only its local shards. They are initialised by replaying each
    module's own ``reset_parameters`` (or ``init``) in module order on full-size
    temporaries, one module at a time, and copying in this rank's slice (the plan's
    offsets). So the result equals initialising the whole model in one process with the
    same seed and then sharding it — tied modules consume their random numbers as they do
    in construction, and only the owner's values are kept.

    Args:
        plan: the plan `apply` ran.
        module: the parallelized module, its parameters on the meta device.
        device: where the shards live.
        seed: ``torch.manual_seed`` first, if given.
        init: called on each module (children first in module order) instead of
            ``reset_parameters``.

    Raises:
        ShardingError: the module was not applied with this plan, or a module with
            parameters has no ``reset_parameters`` and no ``init`` was given.

    Examples:
        >>> # with torch.device("meta"): model = Llama(config)
        >>> # fs.apply(plan, model); fs.materialize(plan, model, seed=0)
    """
    from torch.distributed.tensor import DTensor

    applied = _applied_with(plan, module, "fs.materialize")
    missing = [
        path or "<root>"
        for path, sub in module.named_modules()
        if init is None
        and any(True for _ in sub.parameters(recurse=False))
        and not hasattr(sub, "reset_parameters")
    ]
    if missing:
        raise ShardingError(
            f"cannot initialise {missing}: they hold parameters but have no reset_parameters; pass init=..."
        )
    module.to_empty(device=device)
    _retie(plan, module)  # to_empty makes new Parameter objects for plain tensors
    if seed is not None:
        torch.manual_seed(seed)
    rank = dist.get_rank()
    owner_of = {name: canonical for canonical, names in plan.aliases.items() for name in names}
    with torch.no_grad():
        for path, sub in module.named_modules():
            direct = dict(sub.named_parameters(recurse=False))
            if not direct:
                continue
            real = dict(sub._parameters)
            for name, param in direct.items():
                shape = param.shape  # a DTensor's shape is the global shape
                sub._parameters[name] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=device))
            try:
                (init or type(sub).reset_parameters)(sub)
                initialised = {name: sub._parameters[name] for name in direct}
            finally:
                sub._parameters.update(real)
            for name, full_value in initialised.items():
                qualified = f"{path}.{name}" if path else name
                if owner_of.get(qualified, qualified) != qualified:
                    continue  # a tied alias: its owner's values win, as in construction
                target = real[name]
                if target is None:  # a parameter slot set to None: nothing to fill
                    continue
                local = target.to_local() if isinstance(target, DTensor) else target
                shape, offset = plan.local_shape_and_offset(qualified, rank)
                packed = getattr(sub, "_fs_packed", None)
                if isinstance(target, DTensor) and packed and name == "weight":
                    value = _packed_window(full_value, target, *packed)
                    local.narrow(0, 0, value.shape[0]).copy_(value)
                elif isinstance(target, DTensor):
                    window = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
                    local.copy_(full_value[window])
                else:  # replicated (DDP, or a parameter no layer splits)
                    local.copy_(full_value)
    _place_grads_as_params(plan, module)
    _reduce_whole_grads(plan, module, applied.device_mesh)
    return module


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients by their global norm, across every shard of every mesh.

    torch's ``clip_grad_norm_`` stacks per-parameter norms, which fails when parameters
    live on different meshes (FSDP-only norm weights beside FSDP x TP projections). Here
    the norm is taken per mesh, made whole, then combined.

    Returns:
        The total norm before clipping.

    Examples:
        >>> # fs.clip_grad_norm_(model.parameters(), 1.0)
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else "local"
        groups.setdefault(key, []).append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), norm_type)
    coefficient = float(max_norm) / (float(total) + 1e-6)
    if coefficient < 1.0:  # as torch: scale only when the norm is above the limit
        for grad in grads:
            grad.mul_(coefficient)
    return total


def grad_scaler(device: str = "cuda", **kwargs: Any) -> torch.amp.GradScaler:
    """A loss scaler for float16 training under any plan: every rank skips the same steps.

    torch's ``GradScaler`` decides per rank whether gradients overflowed, so one rank may
    step while another skips; its ``ShardedGradScaler`` agrees across ranks but hands
    DTensor gradients of different meshes (FSDP x TP beside FSDP-only norms) to one
    kernel, which DTensor refuses. This one unscales each rank's local shards, then agrees
    over every rank.

    Args:
        device: where the gradients live (``"cuda"``, or ``"cpu"``).
        kwargs: ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
            ``enabled``, as for ``torch.amp.GradScaler``.

    Examples:
        >>> # scaler = fs.grad_scaler("cuda"); scaler.scale(loss).backward()
        >>> # scaler.step(optimizer); scaler.update()
    """
    if not dist.is_initialized():
        raise ShardingError(
            "fs.grad_scaler agrees over the process group: initialise torch.distributed first"
        )
    return _LocalShardsGradScaler(device, **kwargs)


def _local_grads_of(optimizer: torch.optim.Optimizer) -> Any:
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor

    # the same storage as the DTensor gradients, so unscaling in place unscales them
    local = [
        SimpleNamespace(grad=p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    return SimpleNamespace(param_groups=[{"params": local}])


class _LocalShardsGradScaler(ShardedGradScaler):
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        # the base class then all-reduces found_inf over the whole world
        return super()._unscale_grads_(_local_grads_of(optimizer), inv_scale, found_inf, allow_fp16)
