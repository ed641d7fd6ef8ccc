"""Whether Hugging Face modeling code hands its ``position_ids`` to transformers' mask builders.

transformers finds packed documents in the ``position_ids`` a model hands ``create_causal_mask`` (or
the sliding-window and chunked builders). Some models (OPT, BLOOM, GPT-OSS, ...) import the builder
but never hand it their positions: their masks are causal over the whole row, and packed documents
attend to the ones before them. `mask_without_positions` finds such a call in the source of the
classes that build a model's mask, before anything runs. Pure: it reads source, imports nothing.
"""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import sys
import textwrap
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MASK_BUILDERS", "mask_without_positions", "reads_text_positions_first"]

MASK_BUILDERS = frozenset(
    {"create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"}
)
"""transformers' mask builders, which find packed documents in the ``position_ids`` they are handed."""

_POSITION_IDS_AT = 4  # position_ids' place among the builders' positional arguments


def mask_without_positions(classes: Sequence[type]) -> str:
    """Where the first of ``classes`` to build a mask does so without ``position_ids``; '' if it hands them.

    ``classes``: those that may build the model's mask, the decoder's first. Read from the first of
    them whose source calls a builder at all, else from their modules' (a helper function there may
    build it), so that a vision tower beside the decoder, building a mask of its own, is not counted.
    A ``**`` dict of keys not known from the same function is given the benefit of the doubt.

    Examples:
        >>> mask_without_positions([int])  # no mask built here at all
        ''
    """
    owners: list[type | ModuleType] = [*classes]
    owners += [module for owner in classes if (module := sys.modules.get(owner.__module__))]
    for owner in owners:
        if calls := _builder_calls(owner):
            missing = [line for line, hands in calls if not hands]
            if not missing:
                return ""
            where = f"{owner.__module__}.{owner.__name__}" if isinstance(owner, type) else owner.__name__
            file = pathlib.Path(inspect.getsourcefile(owner) or "?").name
            return f"{where} builds its attention mask (line {missing[0]} of {file})"
    return ""


def reads_text_positions_first(decoder: type) -> bool:
    """Whether ``decoder`` finds packed documents only in the first of four rows of ``position_ids``.

    Qwen2-VL's and Qwen2.5-VL's text models (and others of multimodal rotary positions) take
    ``[4, rows, seq]`` position ids, the text positions before the temporal, height and width ones,
    and hand the mask builder that first row alone; given ``[rows, seq]`` they hand it none, and their
    attention crosses documents. Read from its source: a comparison ``position_ids.shape[0] == 4``.

    Examples:
        >>> reads_text_positions_first(int)
        False
    """
    found = _tree(decoder)
    return found is not None and any(_is_four_rows(node) for node in ast.walk(found[0]))


def _is_four_rows(node: ast.AST) -> bool:
    """``position_ids.shape[0] == 4``."""
    if not isinstance(node, ast.Compare) or len(node.comparators) != 1:
        return False
    left, right = node.left, node.comparators[0]
    return (
        isinstance(node.ops[0], ast.Eq)
        and isinstance(right, ast.Constant)
        and right.value == 4
        and isinstance(left, ast.Subscript)
        and isinstance(left.slice, ast.Constant)
        and left.slice.value == 0
        and isinstance(left.value, ast.Attribute)
        and left.value.attr == "shape"
        and _name(left.value.value) == "position_ids"
    )


@functools.cache
def _tree(owner: type | ModuleType) -> tuple[ast.AST, int] | None:
    """``owner``'s source parsed, and the line of the file it starts at; None where there is none."""
    try:
        lines, first = inspect.getsourcelines(owner)
        return ast.parse(textwrap.dedent("".join(lines))), max(first, 1)  # a module's first is given as 0
    except (OSError, TypeError, ValueError, SyntaxError):
        return None


@functools.cache
def _builder_calls(owner: type | ModuleType) -> tuple[tuple[int, bool], ...]:
    """Each call of a mask builder in ``owner``'s source: its line in the file, and whether it hands them.

    Handed: by keyword, by place, or in a ``**`` dict built in the same function (or one unknown there).
    """
    found = _tree(owner)
    if found is None:
        return ()
    tree, first = found
    calls: dict[int, bool] = {}
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            keys, builders = _dicts_and_builders(function)
            for call in ast.walk(function):
                if isinstance(call, ast.Call) and _name(call.func) in builders:
                    line = call.lineno + first - 1
                    calls[line] = calls.get(line, True) and _hands_positions(call, keys)
    return tuple(sorted(calls.items()))


def _dicts_and_builders(function: ast.AST) -> tuple[dict[str, set[str]], set[str]]:
    """The keys of the dicts ``function`` builds by name, and the names that hold a mask builder."""
    keys: dict[str, set[str]] = {}
    builders = set(MASK_BUILDERS)
    for node in ast.walk(function):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
            keys.setdefault(_name(target.value), set()).add(str(target.slice.value))
        elif not isinstance(target, ast.Name):
            continue
        elif isinstance(value, ast.Dict):
            keys[target.id] = {str(key.value) for key in value.keys if isinstance(key, ast.Constant)}
        elif (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and value.func.attr == "copy"
        ):
            keys[target.id] = set(keys.get(_name(value.func.value), ()))  # mask_kwargs.copy()
        elif not isinstance(value, ast.Call) and any(_name(n) in MASK_BUILDERS for n in ast.walk(value)):
            builders.add(target.id)  # mask_function = create_causal_mask if ... else create_sliding_...
    return keys, builders


def _hands_positions(call: ast.Call, keys: dict[str, set[str]]) -> bool:
    if len(call.args) > _POSITION_IDS_AT:
        return True
    for keyword in call.keywords:
        if keyword.arg == "position_ids":
            return True
        if keyword.arg is None:  # **mask_kwargs
            known = keys.get(_name(keyword.value))
            if known is None or "position_ids" in known:
                return True
    return False


def _name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
