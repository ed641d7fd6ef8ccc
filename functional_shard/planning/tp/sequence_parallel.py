"""Sequence parallel: which modules gather the sequence, and what it cannot run.

Pure: the planner, the cost model, the activation trace and `functional_shard.apply` read the same answers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Iterator, Mapping

from torch import nn

from .styles import is_conv1d

__all__ = ["first_input_name", "sequence_gathers", "sequence_parallel_problems"]

_GATHERED_STYLES = ("colwise", "colwise_gather", "packed_colwise")


def sequence_gathers(tp_styles: Iterable[tuple[str, str, str]]) -> tuple[str, ...]:
    """Modules that gather the sequence under sequence parallel: attention and MLP blocks.

    As torchtitan does, the module holding column-split projections all-gathers its input once on entry
    (``PrepareModuleInput``); a column-split layer whose parent holds an embedding or other such
    modules (``lm_head``) gathers its own.

    Args:
        tp_styles: ``(module path, style, layout)`` as ``PlanConfig.tp_styles`` holds them.

    Returns:
        The innermost parents of column-split projections holding no split embedding, in first-seen order.

    Examples:
        >>> sequence_gathers([("embed", "rowwise", "embedding"),
        ...     ("layers.0.mlp.up_proj", "colwise", "linear"),
        ...     ("layers.0.mlp.down_proj", "rowwise", "linear"),
        ...     ("lm_head", "colwise_gather", "linear")])
        ('layers.0.mlp',)
    """
    return _sequence_gathers(tuple(tp_styles))


def _ancestors(path: str) -> Iterator[str]:
    """The module paths strictly enclosing ``path``, innermost first ("" encloses every other)."""
    while path:
        path = path.rpartition(".")[0]
        yield path


@functools.lru_cache(maxsize=256)
def _sequence_gathers(styles: tuple[tuple[str, str, str], ...]) -> tuple[str, ...]:
    # a search plans many meshes with one set of styles: worked out once per set
    candidates: dict[str, None] = {}
    for path, style, kind in styles:
        if style in _GATHERED_STYLES and kind != "embedding":
            candidates.setdefault(path.rpartition(".")[0])

    # a candidate that encloses another one, or a split embedding, does not gather
    enclosing = {a for path in candidates for a in _ancestors(path)}
    enclosing |= {a for path, _, kind in styles if kind == "embedding" for a in _ancestors(path)}
    return tuple(parent for parent in candidates if parent not in enclosing)


def first_input_name(module: nn.Module) -> str | None:
    """The first parameter of ``module.forward`` that can be passed by position or by name.

    Examples:
        >>> first_input_name(nn.Linear(2, 2))
        'input'
    """
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    return next((p.name for p in parameters if p.kind in kinds), None)


# functional_shard splits these on Hugging Face's Conv1D itself (and packed projections)
_OWN_SPLIT_STYLES = ("colwise", "packed_colwise", "rowwise")


def sequence_parallel_problems(
    tp_styles: tuple[tuple[str, str, str], ...], modules: Mapping[str, nn.Module]
) -> list[str]:
    """What sequence parallel cannot run of ``tp_styles`` on these modules, one line each.

    `functional_shard.apply` and the activation trace refuse the same.

    Args:
        tp_styles: ``(module path, style, layout)`` as ``PlanConfig.tp_styles`` holds them.
        modules: the model's modules by path (``dict(model.named_modules())``).

    Examples:
        >>> model = nn.Sequential(nn.LayerNorm(4), nn.Sequential(nn.Linear(4, 4)))
        >>> sequence_parallel_problems((("1.0", "colwise", "linear"),), dict(model.named_modules()))[0][:40]
        '0: a LayerNorm with weights but no tenso'
    """
    gathering = sequence_gathers(tp_styles)
    gathers = set(gathering)
    styled = {path for path, _, _ in tp_styles}
    found = []

    def under(path: str, parents: set[str]) -> str | None:
        return next((p for p in _ancestors(path) if p in parents), None)

    for path, style, _ in tp_styles:
        target = modules.get(path)
        name = f"{type(target).__module__}.{type(target).__qualname__}"
        if style in _OWN_SPLIT_STYLES and (is_conv1d(name) or style == "packed_colwise"):
            # (functional_shard's own split: Conv1D layers, packed projections)
            found.append(
                f"{path}: style {style!r} on a {type(target).__name__} with sequence parallel; "
                "functional_shard's own split of Conv1D layers and packed projections (Hugging Face "
                "GPT-2) takes whole activations, which sequence parallel does not hand it. Drop "
                "sequence_parallel (plain tensor parallel runs it)"
            )
    # outside the gathering modules a module with weights sees part of the sequence: only a split
    # layer or a 'sequence' one computes its gradient whole; inside, a 'sequence' one would take
    # its whole input for a part
    for path in gathering:
        if first_input_name(modules[path]) is None:
            found.append(
                f"{path}: gathers the sequence under sequence parallel (it holds column-split layers), but "
                f"{type(modules[path]).__name__}.forward takes no input by position or name to gather"
            )
    for path, style, _ in tp_styles:
        gather = under(path, gathers)
        if style == "sequence" and gather is not None:
            found.append(
                f"{path}: style 'sequence' inside {gather!r}, which gathers the whole sequence on entry (it "
                "holds column-split layers); give it 'replicate_grad_allreduce' (a per-head norm) or no style"
            )
    for path, module in modules.items():
        if path in styled or under(path, styled) or under(path, gathers):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            found.append(
                f"{path or '<root>'}: a {type(module).__name__} with weights but no tensor-parallel style, "
                "outside the modules that gather the sequence: under sequence parallel it sees this rank's "
                "tokens only, so its gradient would be a part. Give it the style 'sequence' (a norm), split "
                "it, or drop sequence_parallel"
            )
    return found
