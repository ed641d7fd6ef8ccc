"""What a model's modules let tensor parallel split: whole heads, even features, packed pieces.

Pure: it reads the styled modules only. The runtime's `check_runnable` asks every question here,
`fs.estimate` the heads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

from .styles import is_conv1d

if TYPE_CHECKING:
    from functional_shard.planning.plan.config import TpConfig
    from functional_shard.planning.plan.plan import Plan

__all__ = [
    "CONV1D_STYLES",
    "features_of",
    "head_problems",
    "is_conv1d_module",
    "is_projection",
    "split_problems",
]

# styles functional_shard runs itself on Hugging Face's Conv1D (torch's styles have none)
CONV1D_STYLES = ("colwise", "packed_colwise", "rowwise")


def is_conv1d_module(module: object) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D`` (weight ``(in, out)``)."""
    return is_conv1d(f"{type(module).__module__}.{type(module).__qualname__}")


def is_projection(module: object) -> bool:
    """Whether ``module`` is an ``nn.Linear`` or a ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d_module(module)


def features_of(module: Any) -> tuple[int, int]:
    """(in, out) features of an nn.Linear or a Conv1D (weight (in, out))."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    rows, cols = module.weight.shape
    return rows, cols


def split_problems(plan: Plan, module: nn.Module) -> list[str]:
    """Every tensor-parallel split of ``plan`` that ``module``'s modules or the engines cannot run.

    Whole attention heads per rank (`head_problems`), even rowwise inputs (``RowwiseParallel`` assumes it),
    even packed pieces, a Conv1D only as our own split runs it. One line each.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")  # 4 query heads, 2 key/value heads
        >>> plan = fs.shard(model, fs.Mesh(tp=4), fs.tp(fs.rules.llama, "tp"))
        >>> print(split_problems(plan, model)[0])  # doctest: +ELLIPSIS
        layers.0.self_attn.k_proj: its 2 attention heads (32 features, head_dim 16) do not split over 4 ...
    """
    found: list[str] = []
    for path, style, target, parent, tp_size in _split_modules(plan, module):
        rowwise = style in ("rowwise", "rowwise_split_input")
        if rowwise and is_projection(target) and features_of(target)[0] % tp_size:
            found.append(
                f"{path}: rowwise {type(target).__name__} with in_features={features_of(target)[0]} over "
                f"{_tp(plan).axes[0]!r} (size {tp_size}); torch's RowwiseParallel rebuilds "
                f"its input from local shards as if they were even ({features_of(target)[0]} % {tp_size} "
                "!= 0). Make the dim divisible"
            )
        pieces = _tp(plan).pieces_of(path)
        found.extend(_conv1d_problems(path, style, target, parent, tp_size, pieces=pieces))
        found.extend(_heads_split(path, style, target, parent, tp_size, pieces=pieces))
    return found


def head_problems(plan: Plan, module: nn.Module) -> list[str]:
    """The attention projections ``plan`` splits into parts of heads, one line each.

    The forward cannot run them (it reshapes its features into whole heads): `fs.estimate` refuses them.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> head_problems(fs.shard(model, fs.Mesh(tp=2), fs.tp(fs.rules.llama, "tp")), model)
        []
    """
    found: list[str] = []
    for path, style, target, parent, tp_size in _split_modules(plan, module):
        found.extend(_heads_split(path, style, target, parent, tp_size, pieces=plan.config.pieces_of(path)))
    return found


def _split_modules(plan: Plan, module: nn.Module) -> Iterator[tuple[str, str, Any, Any, int]]:
    """(path, style, module, its parent, tp size) of each module a dense tensor-parallel style names."""
    tp = plan.config.tp
    if tp is None or not tp.axes:
        return
    modules = dict(module.named_modules())
    for path, style, kind in tp.styles:
        if kind != "experts":  # 3-D expert weights: the experts engine checks them
            yield path, style, modules.get(path), modules.get(path.rpartition(".")[0]), plan.mesh[tp.axes[0]]


def _tp(plan: Plan) -> TpConfig:
    # (asked only of the modules _split_modules yields, which a tensor-parallel plan has)
    assert plan.config.tp is not None
    return plan.config.tp


def _conv1d_problems(
    path: str, style: str, target: Any, parent: Any, tp_size: int, *, pieces: tuple[int, ...] | None = None
) -> list[str]:
    # Conv1D and packed pieces run through our own split (_split_projection); a packed
    # projection's pieces are its rule's sizes, else its attention's split_size (GPT-2)
    found = []
    if is_conv1d_module(target) and style not in (*CONV1D_STYLES, "sequence", "replicate"):
        found.append(
            f"{path}: style {style!r} on a Conv1D; functional_shard splits Conv1D as {CONV1D_STYLES} only"
        )
    split_here = style in CONV1D_STYLES and (is_conv1d_module(target) or style == "packed_colwise")
    if split_here and style == "colwise" and features_of(target)[1] % tp_size:  # (rowwise: checked above)
        found.append(
            f"{path}: colwise {type(target).__name__} with {features_of(target)[1]} output features over "
            f"{tp_size} tensor-parallel ranks; functional_shard splits it evenly only. Make the dim divisible"
        )
    if style == "packed_colwise" and pieces is not None:
        out = features_of(target)[1] if is_projection(target) else 0
        if not is_projection(target) or sum(pieces) != out:
            found.append(
                f"{path}: packed pieces {pieces} on a {type(target).__name__} with {out or 'no'} output "
                "features; functional_shard splits the packed pieces of an nn.Linear or Conv1D, which "
                "fill its output"
            )
        elif uneven := [n for n in pieces if n % tp_size]:
            found.append(
                f"{path}: its packed pieces {uneven} do not split over {tp_size} tensor-parallel ranks; "
                "use a tensor-parallel size that divides every piece"
            )
    elif style == "packed_colwise":
        split_size = getattr(parent, "split_size", None)
        out = features_of(target)[1] if is_projection(target) else 0
        if not is_projection(target) or not isinstance(split_size, int) or not split_size or out % split_size:
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


def _heads_split(
    path: str, style: str, target: Any, parent: Any, tp_size: int, *, pieces: tuple[int, ...] | None = None
) -> list[str]:
    # the module reshapes its local features into (heads, head_dim): each rank needs whole heads
    # (a gathered output or sliced whole input needs nothing); a packed projection each piece's,
    # torchtitan's fused wqkv (laid out by key/value group) whole groups
    head_dim = getattr(parent, "head_dim", None)
    splits_heads = style in ("colwise", "rowwise", "packed_colwise")
    # a head_dim of 0 (fewer features than heads) has no heads to count: the forward says what fails
    if not is_projection(target) or not isinstance(head_dim, int) or head_dim < 1 or not splits_heads:
        return []
    in_features, out_features = features_of(target)
    group = getattr(parent, "r_dim", None)
    if style == "colwise" and isinstance(group, int) and group > 0 and out_features % (group * head_dim) == 0:
        groups = out_features // (group * head_dim)
        if groups % tp_size == 0:
            return []
        return [
            f"{path}: its {groups} key/value groups (each {group} heads of head_dim {head_dim}: its query "
            f"heads, a key and a value) do not split over {tp_size} tensor-parallel ranks; use a "
            f"tensor-parallel size that divides {groups}"
        ]
    width = in_features if style == "rowwise" else out_features
    split_size = getattr(parent, "split_size", None)
    widths = [width]
    if style == "packed_colwise" and pieces is not None:
        widths = list(pieces)  # each piece (q, k, v) holds heads of its own
    elif style == "packed_colwise" and isinstance(split_size, int) and split_size:
        widths = [split_size]
    return [
        f"{path}: its {w // head_dim} attention heads ({w} features, head_dim {head_dim}) do not split "
        f"over {tp_size} tensor-parallel ranks; use a tensor-parallel size that divides {w // head_dim}"
        for w in dict.fromkeys(widths)
        if w % head_dim == 0 and (w // head_dim) % tp_size
    ][:1]
