"""Tensor and sequence parallel: torch's ``parallelize_module`` with the plan's styles.

Hugging Face's Conv1D layers and packed projections (GPT-2's ``c_attn``), which torch's
styles do not take, are split here with the collectives those styles would issue.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import PrepareModuleInput

from functional_shard.core.errors import ShardingError
from functional_shard.planning.plan.plan import Plan
from functional_shard.planning.tp.module_splits import CONV1D_STYLES, features_of, is_conv1d_module
from functional_shard.planning.tp.rules import first_input_name, sequence_gathers

from .experts import apply_expert_tensor_parallel
from .gradients import hook_accumulated_grad
from .packed_pieces import rank_share


def _torch_styles(
    tp_styles: tuple[tuple[str, str, str], ...],
    module: nn.Module,
    sequence: bool,
    *,
    loss_parallel: bool = False,
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The torch parallel style of each styled module, and the layers split here (Conv1D, packed)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    # Under sequence parallel (as torchtitan runs it) the residual stream is split on the
    # sequence dim and stays a DTensor, whose shape reads whole (Hugging Face derives position
    # ids and the mask from it); attention and MLP gather their input once on entry, and
    # row-split layers reduce-scatter their output back. Without it activations are whole.
    between = Shard(1) if sequence else Replicate()
    local = not sequence
    gathers = set(sequence_gathers(tp_styles)) if sequence else set()
    styles: dict[str, Any] = {
        path: _SequenceGather(first_input_name(module.get_submodule(path)) or "") for path in gathers
    }
    own: list[tuple[str, str]] = []  # split here: Conv1D layers and packed projections
    for path, style, kind in tp_styles:
        if kind == "experts":  # 3-D expert weights: engines.experts splits them
            continue
        target = module.get_submodule(path)
        embedding = isinstance(target, nn.Embedding)
        taken = Replicate() if path.rpartition(".")[0] in gathers else between  # a column split's input
        if style in CONV1D_STYLES and (is_conv1d_module(target) or style == "packed_colwise"):
            own.append((path, style))
        elif style == "colwise":
            styles[path] = (
                ColwiseParallel(input_layouts=Replicate(), output_layouts=between, use_local_output=local)
                if embedding
                else ColwiseParallel(input_layouts=taken)
            )
        elif style == "colwise_gather" and loss_parallel:
            # the head's logits stay split on the vocabulary, a DTensor for torch's loss_parallel()
            styles[path] = ColwiseParallel(input_layouts=taken, use_local_output=False)
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


def loss_context(plan: Plan) -> contextlib.AbstractContextManager[None]:
    """Torch's ``loss_parallel()`` under a loss-parallel plan (forward and backward in it), else nothing."""
    if plan.config.tp is None or not plan.config.tp.loss_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def vocabulary_split_loss(
    plan: Plan, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """``loss_fn`` as a loss-parallel plan calls it, on logits split over the vocabulary (a DTensor).

    Torch's ``loss_parallel()`` computes ``F.cross_entropy`` of them; most other operations on them
    fail deep inside DTensor, so such a failure is refused naming loss parallel and its fix. Without
    loss parallel ``loss_fn`` itself.
    """
    if plan.config.tp is None or not plan.config.tp.loss_parallel:
        return loss_fn

    @functools.wraps(loss_fn)
    def on_split_logits(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        try:
            return loss_fn(outputs, targets)
        except (RuntimeError, NotImplementedError) as error:
            failure = str(error).strip().partition("\n")[0]
            raise ShardingError(
                f"loss_parallel=True: loss_fn failed on the logits, which the plan keeps split over the "
                f"vocabulary as a DTensor for torch's loss_parallel(): {type(error).__name__}: {failure}; "
                "compute the loss as F.cross_entropy(logits, class indices) (no label_smoothing), or plan "
                "without loss_parallel"
            ) from None

    return on_split_logits


def plain_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss, detached, as a plain tensor (a loss-parallel loss is a replicated DTensor)."""
    loss = loss.detach()
    full = getattr(loss, "full_tensor", None)
    return full() if callable(full) else loss


def apply_tensor_parallel(plan: Plan, module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Split ``module``'s styled layers over the plan's tensor-parallel axis, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = plan.config.tp
    if tp is None or not tp.axes:
        return
    styles, own = _torch_styles(tp.styles, module, tp.sequence_parallel, loss_parallel=tp.loss_parallel)
    tp_mesh = device_mesh[tp.axes[0]]
    parallelize_module(module, tp_mesh, styles)
    apply_expert_tensor_parallel(plan, module, device_mesh)
    for path, style in own:
        parent_path = path.rpartition(".")[0]
        parent: Any = module.get_submodule(parent_path) if parent_path else module
        sized = tp.pieces_of(path)  # sizes a rule gave (fs.packed), else the attention's split_size
        pieces: int | tuple[int, ...] = (
            (sized or features_of(module.get_submodule(path))[1] // parent.split_size)
            if style == "packed_colwise"
            else 1
        )
        _split_projection(module.get_submodule(path), tp_mesh, style, pieces)
        if style == "packed_colwise" and sized is None:
            # the attention splits the packed output by split_size and infers its heads from
            # the local width; torch TP users shrink these to the rank's share (torchtitan's
            # n_heads): the local output holds split_size / tp features of each piece
            parent.split_size //= tp_mesh.size()
            if isinstance(getattr(parent, "num_heads", None), int):
                parent.num_heads //= tp_mesh.size()
    place_grads_as_params(plan, module)


def _equal(pieces: int | tuple[int, ...]) -> int | None:
    # the count of equal pieces (torch's _StridedShard describes those), or None
    if isinstance(pieces, int):
        return pieces
    return len(pieces) if len(set(pieces)) == 1 else None


def _split_projection(target: Any, tp_mesh: DeviceMesh, style: str, pieces: int | tuple[int, ...]) -> None:
    # Torch's styles take nn.Linear and nn.Embedding only, and a plain Shard cannot split
    # each packed piece on its own. So the parameters become DTensors placed as the plan says
    # (equal pieces as _StridedShard, so full_tensor() gives the weight back in order) and the
    # forward issues the collectives torch's styles would. A packed bias stays whole (FSDP2
    # cannot describe a strided split inside a strided split) and each rank slices its pieces.
    # Unequal pieces (q, k, v under grouped-query attention) have no torch placement: Shard on
    # the rank's pieces laid end to end, which fs.checkpoint refuses by name.
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    conv1d = is_conv1d_module(target)
    size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    packed = pieces != 1
    equal = _equal(pieces)
    colwise = style != "rowwise"
    weight_dim = (1 if colwise else 0) if conv1d else (0 if colwise else 1)

    def placed(tensor: torch.Tensor, dim: int | None) -> nn.Parameter:
        placement: Any
        if dim is None:
            local, placement = tensor.detach(), Replicate()
        elif packed:
            local = rank_share(tensor.detach(), dim, pieces, size, rank)
            placement = _StridedShard(dim, split_factor=equal) if equal else Shard(dim)
        else:
            local, placement = tensor.detach().chunk(size, dim)[rank].contiguous(), Shard(dim)
        value = DTensor.from_local(
            local, tp_mesh, [placement], run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
        return nn.Parameter(value, requires_grad=tensor.requires_grad)

    target.register_parameter("weight", placed(target.weight, weight_dim))
    bias = getattr(target, "bias", None)
    if isinstance(bias, torch.Tensor):
        target.register_parameter("bias", placed(bias, 0 if colwise and not packed else None))

    def local_forward(x: torch.Tensor) -> torch.Tensor:
        weight = target.weight.to_local()
        bias: Any = target.bias if isinstance(target.bias, DTensor) else None
        if bias is not None and colwise and packed and equal:
            bias = bias.redistribute(tp_mesh, [_StridedShard(0, split_factor=equal)]).to_local()
        elif bias is not None and colwise and packed:  # this rank's slices; the gradient sums them
            bias = rank_share(bias.to_local(grad_placements=[Partial()]), 0, pieces, size, rank)
        elif bias is not None:
            bias = bias.to_local()
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
    if packed:  # materialize fills the weight's strided local part from a whole value
        target._fs_packed = (weight_dim, pieces)  # type: ignore[assignment]


def packed_window(
    full_value: torch.Tensor, param: Any, dim: int, pieces: int | tuple[int, ...]
) -> torch.Tensor:
    """This rank's local values of a packed weight (tensor-parallel pieces, then FSDP2's dim-0 shard)."""
    from torch.distributed.tensor import Shard

    mesh, placements = param.device_mesh, param.placements
    value = rank_share(full_value, dim, pieces, mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1))
    for mesh_dim, placement in enumerate(placements[:-1]):
        if isinstance(placement, Shard) and placement.dim == 0:  # FSDP2's shard, padded at the end
            chunks = value.chunk(mesh.size(mesh_dim), 0)
            index = mesh.get_local_rank(mesh_dim)
            value = chunks[index] if index < len(chunks) else value[:0]
    return value


def place_grads_as_params(plan: Plan, module: nn.Module) -> None:
    """Without FSDP2, hook each DTensor parameter so its gradient is placed as the parameter."""
    # Only without FSDP2, which reduces gradients itself. Meta parameters get theirs in
    # materialize: to_empty swaps their tensors, and hooks registered before do not fire.
    if plan.config.tp is None or plan.config.data_axes:
        return
    from torch.distributed.tensor import DTensor

    for param in module.parameters():
        if isinstance(param, DTensor) and not param.is_meta:
            hook_accumulated_grad(param, _grad_placed_as_param)


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


def refuse_uneven_sequences(plan: Plan, root: nn.Module) -> None:
    """Under sequence parallel, refuse in ``root``'s forward a sequence the tp size does not divide."""
    # Sequence parallel splits the sequence evenly (torch pads no activation): an uneven
    # length fails deep in a rank (a reshape with the wrong length) or aborts the group in
    # a collective. Checked first in the root's forward, before FSDP2's hooks gather
    # anything; every rank of a tensor-parallel group gets the same shape and refuses alike.
    tp = plan.config.tp
    if tp is None or not (tp.sequence_parallel and tp.axes):
        return
    axis = tp.axes[0]
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
