"""Tensor-parallel styles: how torch's parallel styles split each parameter of a module.

A style expands to per-parameter specs by the owning module's type, as torch's parallel
styles shard them:

| style      | nn.Linear (out, in)          | nn.Embedding (num, dim) |
|------------|------------------------------|-------------------------|
| colwise    | weight P(tp, None), bias P(tp) | weight P(None, tp)    |
| colwise_gather | as colwise; the output is all-gathered | —             |
| rowwise    | weight P(None, tp), bias P()   | weight P(tp, None)    |
| rowwise_split_input | as rowwise; a whole input is split here | —        |
| packed_colwise | as colwise, each packed piece split on its own | —     |
| sequence   | replicated (activations split on the sequence dim) | — |
| replicate_grad_allreduce | replicated; gradients all-reduced | —           |
| replicate  | replicated                   | replicated              |
| moe_tp_experts | (marks an experts module whose 3-D weights are split; replicated otherwise) | — |

3-D expert weights (``[E, out, in]``) split per expert as a Linear would (colwise dim 1, rowwise
dim 2); Hugging Face's ``Conv1D`` stores ``(in, out)`` (colwise dim 1, rowwise dim 0). Buffers stay
replicated: torch's styles distribute parameters only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, get_args

from torch import nn

from functional_shard.core.errors import PolicyError
from functional_shard.core.spec import P
from functional_shard.core.tree import TensorSpec

__all__ = [
    "STYLES",
    "TITAN_EXPERT_WEIGHTS",
    "Packed",
    "Style",
    "StyleError",
    "expand_style",
    "is_conv1d",
    "layout_of",
    "packed",
    "titan_expert_names",
]

Style: TypeAlias = Literal[
    "colwise",
    "colwise_gather",
    "rowwise",
    "rowwise_split_input",
    "packed_colwise",
    "sequence",
    "replicate_grad_allreduce",
    "replicate",
    "moe_tp_experts",
]
STYLES: tuple[str, ...] = get_args(Style)
"""The style names (the module's table). ``replicate_grad_allreduce`` is for a whole module that sees
only this rank's heads (a per-head norm): its gradient is a partial sum, all-reduced. ``packed_colwise``
splits each packed piece on its own; apply shrinks the attention's ``split_size`` and ``num_heads``."""

TITAN_EXPERT_WEIGHTS: tuple[tuple[str, str, str], ...] = (("w1", "w2", "w3"), ("w1_EFD", "w2_EDF", "w3_EFD"))
"""torchtitan's grouped experts' weights, ``(w1, w2, w3)`` of shapes ``[E, f, d]``, ``[E, d, f]``,
``[E, f, d]``, under each name its versions give them: 0.3.0's, then its main branch's, named by
their dims (E experts, F hidden, D model) since May 2026."""


def titan_expert_names(module: Any) -> tuple[str, str, str] | None:
    """The names of ``module``'s (w1, w2, w3) when it holds torchtitan's grouped experts, else None.

    ``w1``/``w3`` [E, f, d] and ``w2`` [E, d, f], under one of `TITAN_EXPERT_WEIGHTS`'s namings.
    """
    params = dict(module.named_parameters(recurse=False)) if isinstance(module, nn.Module) else {}
    names = next((names for names in TITAN_EXPERT_WEIGHTS if set(params) == set(names)), None)
    if names is None or any(p.ndim != 3 for p in params.values()):
        return None
    w1, w2, w3 = (tuple(params[name].shape) for name in names)
    return names if w1 == w3 and w2 == (w1[0], w1[2], w1[1]) else None


@dataclass(frozen=True, slots=True)
class Packed:
    """A projection whose output packs pieces of the given sizes, each split on its own.

    The rule target of a fused projection (``wqkv``, ``w13``): each rank holds ``n / tp`` of each piece
    of ``n`` features; sizes may differ. The plan keeps them (``PlanConfig.tp_pieces``).
    """

    pieces: tuple[int, ...]

    def __post_init__(self) -> None:
        if (
            not isinstance(self.pieces, tuple)
            or len(self.pieces) < 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.pieces)
        ):
            raise PolicyError(
                f"packed({self.pieces!r}): give the sizes of two or more packed pieces as positive ints, "
                "in output order, e.g. fs.packed((n_heads * head_dim, n_kv * head_dim, n_kv * head_dim))"
            )

    @property
    def style(self) -> Style:
        """The style its parameters split by: ``packed_colwise``."""
        return "packed_colwise"


def packed(pieces: tuple[int, ...] | list[int]) -> Packed:
    """The rule target of a fused projection packing pieces of these sizes in its output.

    Args:
        pieces: each piece's output features, in order (q, k, v; or w1, w3).

    Returns:
        A `Packed` target: ``fs.tp([("*.wqkv", fs.packed((q, k, v))), ...], "tp")``.

    Raises:
        PolicyError: fewer than two pieces, or a size that is not a positive int.

    Examples:
        >>> packed([64, 16, 16]).pieces
        (64, 16, 16)
    """
    return Packed(tuple(pieces) if isinstance(pieces, list) else pieces)


def packed_problem(target: Packed, path: str, tensor: TensorSpec) -> str | None:
    """Why ``target``'s pieces do not fill the output of the parameter at ``path`` (None when they do)."""
    layout = layout_of(tensor)
    if layout not in ("linear", "conv1d") or tensor.ndim not in (1, 2):
        return None  # expand_style says what a packed split cannot take
    out = tensor.shape[1] if layout == "conv1d" and tensor.ndim == 2 else tensor.shape[0]
    if sum(target.pieces) == out:
        return None
    return (
        f"packed{target.pieces} sums to {sum(target.pieces)} features, but {path} has {out} output "
        "features; give the size of every packed piece, in output order"
    )


class StyleError(Exception):
    """A style that torch's tensor parallel cannot apply to this parameter (internal)."""


def is_conv1d(module_name: str | None) -> bool:
    """Whether ``module_name`` is Hugging Face's ``Conv1D`` (GPT-2), without importing it.

    Examples:
        >>> is_conv1d("transformers.pytorch_utils.Conv1D"), is_conv1d("torch.nn.modules.linear.Linear")
        (True, False)
    """
    return (
        module_name is not None
        and module_name.startswith("transformers.")
        and module_name.endswith(".Conv1D")
    )


def layout_of(tensor: TensorSpec) -> str:
    """How torch's styles see the owning module: "linear", "embedding", "conv1d", "experts" or "other".

    A bare pytree reads as Linear (out, in); "experts" is a 3-D parameter of any other module.
    """
    if tensor.module_is(nn.Linear):
        return "linear"
    if tensor.module_is(nn.Embedding):
        return "embedding"
    if is_conv1d(tensor.module_name):
        return "conv1d"
    if tensor.ndim == 3 and tensor.kind != "buffer" and not (tensor.module_name or "").startswith("torch."):
        return "experts"
    if tensor.module_name is None:  # a bare pytree: assume the (out, in) Linear layout
        return "linear"
    return "other"


def expand_style(style: Style, path: str, tensor: TensorSpec, axis: str) -> P:
    """The spec that torch's ``style`` gives the parameter ``path`` of ``tensor``'s module.

    Raises:
        StyleError: torch has no such style for this module type or parameter.
    """
    whole = ("sequence", "replicate", "replicate_grad_allreduce", "moe_tp_experts")
    if style in whole or tensor.kind == "buffer":
        return P()
    layout = layout_of(tensor)
    name = path.rpartition(".")[2]
    # the edge variants split their parameters as the plain styles do
    split = {"colwise_gather": "colwise", "rowwise_split_input": "rowwise", "packed_colwise": "colwise"}.get(
        style, style
    )
    if layout == "other":
        raise StyleError(
            f"style {split!r} on a {tensor.module_name}: torch's ColwiseParallel and "
            "RowwiseParallel support nn.Linear and nn.Embedding only (functional_shard splits "
            "Hugging Face's Conv1D too). Give this path a P(...) rule, or 'replicate'"
        )
    if layout == "experts":
        # each expert's (out, in) matrix split as a Linear's: the packed gate/up pieces are told
        # apart by halving dim 1 (gate then up), which apply splits piece by piece
        return P(None, axis, None) if split == "colwise" else P(None, None, axis)
    if style == "packed_colwise" and layout == "embedding":
        raise StyleError(
            f"style 'packed_colwise' on an embedding ({path}): only projections pack pieces in their "
            "output; use 'colwise' or 'rowwise'"
        )
    if name == "weight" and tensor.ndim == 2:
        split_dim = {
            ("linear", "colwise"): 0,
            ("linear", "rowwise"): 1,
            ("embedding", "colwise"): 1,
            ("embedding", "rowwise"): 0,
            ("conv1d", "colwise"): 1,
            ("conv1d", "rowwise"): 0,
        }[(layout, split)]
        return P(*(axis if dim == split_dim else None for dim in range(2)))
    if name == "bias" and tensor.ndim == 1 and layout in ("linear", "conv1d"):
        # a packed bias stays whole: each rank slices its pieces in forward (see apply)
        return P(axis) if split == "colwise" and style != "packed_colwise" else P()
    raise StyleError(
        f"style {split!r} does not know how to split {name!r} of shape {tensor.shape} "
        f"in a {tensor.module_name}; give this path a P(...) rule"
    )
