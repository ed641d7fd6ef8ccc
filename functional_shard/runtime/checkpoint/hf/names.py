"""Which of a model's tensors each tensor of a Hugging Face folder fills: name maps.

Pure: names in, names out. A map takes a folder's key (``model.layers.0.self_attn.q_proj.weight``)
to the model's tensor it fills: a name, or a `Piece` of one when several of the folder's
tensors lie end to end in one parameter (q, k and v in a fused ``wqkv``; Mixtral's experts,
one file tensor each, stacked in one 3-D parameter). `name_map` builds one from a dict of
patterns, a function, or, for a transformers model, from transformers' own conversions (the
legacy names ``save_pretrained`` writes). `reverse_map` runs a map the other way for
`export_hf`. Ready maps: `zoo_llama` and `torchtitan_llama`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import nn

from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import refuse

__all__ = [
    "NameMap",
    "Piece",
    "Target",
    "checked_mapping",
    "name_map",
    "piece_of_whole",
    "pattern_map",
    "reverse_map",
    "rotary_rows",
    "torchtitan_llama",
    "zoo_llama",
]


@dataclass(frozen=True)
class Piece:
    """One of several folder tensors laid end to end in one of the model's tensors.

    Args:
        name: the model's tensor.
        index: its place among the pieces laid along ``dim`` (0 first).
        dim: the model tensor's dim the pieces are laid along.
        expert: the place along dim 0 where the model tensor stacks this expert's folder tensor.
        rotary: the model interleaves each head's rotary pairs where the folder splits them in halves.
        grouped: the pieces are laid per key/value head (its queries, key, value), as torchtitan's ``wqkv``.

    Examples:
        >>> Piece("layers.0.attention.wqkv.weight", 1)  # k, after q
        Piece(name='layers.0.attention.wqkv.weight', index=1, dim=0, expert=None, rotary=False, grouped=False)
    """

    name: str
    index: int = 0
    dim: int = 0
    expert: int | None = None
    rotary: bool = False
    grouped: bool = False


Target: TypeAlias = "str | Piece"
NameMap: TypeAlias = Callable[[str], "Target | Sequence[Target] | None"]
"""A folder key -> the model's tensor it fills, candidates (the first the model holds wins), or None."""
Mapping_: TypeAlias = "Mapping[str, Target | Sequence[Target]] | NameMap"


def _name(target: Target) -> str:
    return target.name if isinstance(target, Piece) else target


def _pattern(glob: str) -> re.Pattern[str]:
    # '*' stands for one dotted segment (a layer index, an expert number)
    return re.compile("^" + re.escape(glob).replace(r"\*", r"([^.]+)") + "$")


def _fill(template: Target, parts: Sequence[str]) -> Target:
    values = iter(parts)
    name = re.sub(r"\*", lambda _: next(values, "*"), _name(template))
    if isinstance(template, Piece):
        return dataclasses.replace(template, name=name)
    return name


def pattern_map(patterns: Mapping[str, Target | Sequence[Target]]) -> NameMap:
    """A map from ``{folder pattern: model name}``, ``*`` standing for one dotted segment.

    The ``*`` s a key matches fill the value's ``*`` s in order. A value may list candidates;
    the first the model holds is used.

    Examples:
        >>> m = pattern_map({"model.layers.*.mlp.up_proj.weight": "layers.*.feed_forward.w3.weight"})
        >>> m("model.layers.7.mlp.up_proj.weight")
        ['layers.7.feed_forward.w3.weight']
        >>> m("lm_head.weight") is None
        True
    """
    compiled = []
    for key, value in patterns.items():
        if not isinstance(key, str) or not _targets_ok(value):
            raise ShardingError(
                f"mapping: {key!r}: {value!r}; give folder patterns (str) to model names (str), "
                "fs.checkpoint.Piece(...) for a fused parameter, or a list of either"
            )
        values = [value] if isinstance(value, str | Piece) else list(value)
        compiled.append((_pattern(key), values))

    def lookup(key: str) -> list[Target] | None:
        for pattern, values in compiled:
            found = pattern.match(key)
            if found:
                return [_fill(value, found.groups()) for value in values]
        return None

    return lookup


def _targets_ok(value: Any) -> bool:
    if isinstance(value, str | Piece):
        return True
    return isinstance(value, Sequence) and bool(value) and all(isinstance(v, str | Piece) for v in value)


def _candidates(found: Any, key: str) -> list[Target]:
    if found is None:
        return []
    if isinstance(found, str | Piece):
        return [found]
    if _targets_ok(found):
        return list(found)
    raise ShardingError(
        f"mapping({key!r}) returned {found!r}; a name map returns the model's tensor name (str), "
        "an fs.checkpoint.Piece, a list of candidates, or None for a tensor the model does not hold"
    )


def checked_mapping(mapping: Any) -> Any:
    """``mapping`` if it is a dict of patterns, a function of a folder key, or None, else refused.

    Examples:
        >>> checked_mapping(5)
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: mapping=int: a dict of folder patterns to model names, ...)
    """
    if mapping is not None and not isinstance(mapping, Mapping) and not callable(mapping):
        refuse(
            "mapping",
            type(mapping).__name__,
            "a dict of folder patterns to model names, a function of a folder key, or None",
            meaning="None reads the folder's own names",
        )
    return mapping


def name_map(
    mapping: Mapping_ | None, model: nn.Module, held: Collection[str]
) -> Callable[[str], Target | None]:
    """The map a load uses: each folder key to the tensor of ``model`` it fills, or None.

    Args:
        mapping: a dict of patterns (`pattern_map`), a function, or None (`transformers_map` for a
            transformers model, otherwise the folder's names as they are).
        model: the model loaded into (a transformers model is recognised by its class).
        held: every tensor name the whole model holds (all pipeline stages).

    Raises:
        ShardingError: ``mapping`` is neither a dict nor a function (`checked_mapping`).

    Examples:
        >>> m = name_map(None, nn.Linear(2, 2), {"weight", "bias"})
        >>> m("weight"), m("other")  # a name the model lacks: the load names it
        ('weight', 'other')
    """
    if mapping is None:
        base: NameMap = transformers_map(model, held) if _is_transformers(model) else (lambda key: key)
    elif isinstance(mapping, Mapping):
        base = pattern_map(mapping)
    else:
        base = checked_mapping(mapping)

    def resolve(key: str) -> Target | None:
        candidates = _candidates(base(key), key)
        return next((target for target in candidates if _name(target) in held), None) or (
            candidates[0] if candidates else None
        )

    return resolve


def _is_transformers(model: nn.Module) -> bool:
    try:
        import transformers
    except ImportError:
        return False
    return isinstance(model, transformers.PreTrainedModel)


def transformers_map(model: nn.Module, held: Collection[str]) -> NameMap:
    """A transformers model's map: the folder's names through transformers' own conversions.

    ``save_pretrained`` writes some families under legacy names (Mixtral's
    ``block_sparse_moe.experts.N.w1``) that transformers converts while loading. Stacked
    experts and concatenated pieces are read as `Piece` s; any other conversion is refused by
    name (it cannot be read in slices).
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            apply_renamings,
            rename_source_key,
        )
    except ImportError:  # transformers 4 converts nothing: its models hold the folder's names
        return lambda key: key

    transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)
    known = dict.fromkeys(held, True)

    def lookup(key: str) -> Target | None:
        renamed, matched = rename_source_key(key, renamings, converters, prefix, known)
        if matched is None:
            return renamed
        converter = next(c for c in converters if matched in c.source_patterns)
        return _converted(renamed, matched, converter, apply_renamings(key, renamings))

    return lookup


def _converted(renamed: str, matched: str, converter: Any, source: str) -> Piece:
    ops = [type(op).__name__ for op in converter.operations]
    expert = None
    if ops[:1] == ["MergeModulelist"]:
        if converter.operations[0].dim != 0:
            ops = ["MergeModulelist(dim != 0)"]
        else:
            found = re.search(re.escape(matched).replace(r"\*", r"(\d+)"), source)
            expert = int(found.group(1)) if found and found.groups() else None
            ops = ops[1:]
    if ops == []:
        return Piece(renamed, 0, 0, expert)
    if ops == ["Concatenate"]:
        return Piece(renamed, converter.source_patterns.index(matched), converter.operations[-1].dim, expert)
    raise ShardingError(
        f"{source}: transformers converts it into {renamed} by {', '.join(ops)}, which cannot be "
        "read in slices; load this folder with transformers' from_pretrained, or pass mapping="
    )


def reverse_map(
    resolve: Callable[[str], Target | None], keys: Iterable[str]
) -> dict[str, list[tuple[str, Piece]]]:
    """The model's tensor -> the folder keys that fill it, each as a `Piece` (in piece order).

    Examples:
        >>> m = name_map({"q": Piece("qkv", 0), "k": Piece("qkv", 1)}, nn.Linear(1, 1), {"qkv"})
        >>> reverse_map(m, ["k", "q"])["qkv"][0][0]
        'q'
    """
    filled: dict[str, list[tuple[str, Piece]]] = {}
    for key in keys:
        target = resolve(key)
        if target is None:
            continue
        piece = target if isinstance(target, Piece) else Piece(target)
        filled.setdefault(piece.name, []).append((key, piece))
    for pieces in filled.values():
        pieces.sort(key=lambda item: (item[1].expert or 0, item[1].index))
    return filled


zoo_llama: dict[str, Target | list[Target]] = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.*.*.weight": "layers.*.*.weight",  # the norms
    "model.layers.*.*.*.weight": "layers.*.*.*.weight",  # the projections
}
"""Hugging Face Llama names -> `functional_shard.zoo.llama` (the same names, without ``model.``)."""


def _titan(hf: str, *ours: Target) -> tuple[str, list[Target]]:
    return f"model.layers.*.{hf}.weight", list(ours)


def _titan_attention(hf: str, index: int, alone: str) -> tuple[str, list[Target]]:
    # torchtitan rotates interleaved pairs: its query and key rows are Hugging Face's permuted
    rotary = alone in ("wq", "wk")
    return _titan(
        f"self_attn.{hf}",
        Piece("layers.*.attention.qkv_linear.wqkv.weight", index, rotary=rotary, grouped=True),
        Piece(f"layers.*.attention.qkv_linear.{alone}.weight", rotary=rotary),
        Piece(f"layers.*.attention.{alone}.weight", rotary=rotary),
        Piece("layers.*.attention.wqkv.weight", index, rotary=rotary),
    )


torchtitan_llama: dict[str, Target | list[Target]] = dict(
    [
        ("model.embed_tokens.weight", ["tok_embeddings.weight"]),
        ("model.norm.weight", ["norm.weight"]),
        ("lm_head.weight", ["lm_head.weight", "output.weight"]),
        _titan_attention("q_proj", 0, "wq"),
        _titan_attention("k_proj", 1, "wk"),
        _titan_attention("v_proj", 2, "wv"),
        _titan("self_attn.o_proj", "layers.*.attention.wo.weight"),
        _titan(
            "mlp.gate_proj", Piece("layers.*.feed_forward.w13.weight", 0), "layers.*.feed_forward.w1.weight"
        ),
        _titan(
            "mlp.up_proj", Piece("layers.*.feed_forward.w13.weight", 1), "layers.*.feed_forward.w3.weight"
        ),
        _titan("mlp.down_proj", "layers.*.feed_forward.w2.weight"),
        _titan("input_layernorm", "layers.*.attention_norm.weight"),
        _titan("post_attention_layernorm", "layers.*.ffn_norm.weight"),
    ]
)
"""Hugging Face Llama names -> torchtitan's Llama 3, whichever names the model holds: 0.3.0's
``attention.qkv_linear.wqkv`` (laid by key/value group) or ``qkv_linear.wq/wk/wv`` and
``lm_head``; the older ``attention.wq/wk/wv`` and ``output``; a ``wqkv`` of q, k, v end to end;
``feed_forward.w1/w2/w3`` or a fused ``w13``. Query and key rows are permuted as torchtitan's own
converter permutes them: its rotary embedding rotates interleaved pairs, Hugging Face's halves."""


def piece_of_whole(
    pieces: Sequence[tuple[str, Piece]],
    shapes: Mapping[str, Sequence[int]],
    head_dim: int | None,
    groups: int = 1,
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """For each folder key, how to cut its tensor out of the model's whole tensor (`export_hf`).

    ``pieces``: one model tensor's folder keys (`reverse_map`); ``shapes``: the folder's shapes;
    ``head_dim`` and ``groups`` serve `Piece.rotary` and `Piece.grouped`.

    Examples:
        >>> pieces = [("q", Piece("qkv", 0)), ("k", Piece("qkv", 1))]
        >>> cut = piece_of_whole(pieces, {"q": (2,), "k": (1,)}, None)
        >>> cut["k"](torch.tensor([5, 6, 7])).tolist()
        [7]
    """
    cuts: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    starts: dict[int | None, int] = {}
    for key, piece in pieces:
        stacked = piece.expert is not None
        dim = piece.dim - stacked
        start = starts.get(piece.expert, 0)
        size = shapes[key][dim] if shapes[key] else 0
        starts[piece.expert] = start + size
        several = sum(p.expert == piece.expert for _, p in pieces) > 1

        def cut(
            whole: torch.Tensor,
            piece: Piece = piece,
            dim: int = dim,
            start: int = start,
            size: int = size,
            several: bool = several,
        ) -> torch.Tensor:
            value = whole[piece.expert] if piece.expert is not None else whole
            if several and piece.grouped and groups > 1:
                laid = value.unflatten(dim, (groups, -1)).narrow(dim + 1, start // groups, size // groups)
                value = laid.flatten(dim, dim + 1)
            elif several:
                value = value.narrow(dim, start, size)
            if piece.rotary and head_dim:
                # the folder's row rotary_rows(r) holds the model's row r
                order = rotary_rows(torch.arange(value.shape[dim]), head_dim).argsort()
                value = value.index_select(dim, order)
            return value.contiguous()

        cuts[key] = cut
    return cuts


def rotary_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The folder's row of each model row when the model interleaves each head's rotary pairs.

    Hugging Face lays a head's query/key rows as two halves (``rotate_half``); torchtitan and
    Meta's original checkpoints interleave them in pairs (complex rotary). Model row
    ``2i + j`` of a head is the folder's row ``j * head_dim / 2 + i``.

    Examples:
        >>> rotary_rows(torch.arange(4), 4).tolist()
        [0, 2, 1, 3]
    """
    head, within = rows // head_dim, rows % head_dim
    return head * head_dim + (within % 2) * (head_dim // 2) + within // 2
