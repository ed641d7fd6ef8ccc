"""What keeps context parallel from splitting a model's attention. Pure: it reads modules only.

Context parallel reaches attention through ``F.scaled_dot_product_attention`` or transformers'
registry; it cannot split ``nn.MultiheadAttention``, attention a module's ``forward`` computes by
hand (a softmax of a product of activations), sliding windows or bidirectional attention. The
runtime's `check_runnable` and `fs.estimate` both ask this, so they refuse alike.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from .plan.plan import Plan

__all__ = ["attention_problems", "context_parallel_problems", "takes_hf_attention"]


def takes_hf_attention(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model whose attention function can be chosen.

    Examples:
        >>> takes_hf_attention(nn.Linear(2, 2))
        False
    """
    return hasattr(model, "set_attn_implementation") and hasattr(model, "config")


def attention_problems(model: nn.Module) -> list[str]:
    """What keeps the engine from splitting ``model``'s attention, one line each (pure).

    Examples:
        >>> attention_problems(nn.Sequential(nn.MultiheadAttention(8, 2)))[0][:50]
        '0 (MultiheadAttention): computes attention in its '
        >>> attention_problems(nn.Linear(2, 2))
        []
    """
    found = [
        f"{path} ({type(module).__name__}): computes attention in its own kernel, which cp cannot reach; "
        "use a module calling F.scaled_dot_product_attention"
        for path, module in model.named_modules()
        if isinstance(module, nn.MultiheadAttention | nn.TransformerEncoderLayer | nn.TransformerDecoderLayer)
    ]
    found += [
        f"{path} ({type(module).__name__}): computes attention by hand in its forward (a softmax of "
        "a matmul), which cp cannot reach: its queries would attend within their rank's chunks only; "
        "call F.scaled_dot_product_attention instead"
        for path, module in model.named_modules()
        if _attends_by_hand(type(module).forward)
    ]
    if takes_hf_attention(model):
        config = model.config
        kinds = set(getattr(config, "layer_types", None) or ())
        windowed = kinds & {"sliding_attention", "chunked_attention"}
        if windowed or (not kinds and getattr(config, "sliding_window", None) is not None):
            found.append(
                f"{type(model).__name__}: attends within a sliding window "
                f"({', '.join(sorted(windowed)) or 'sliding_window'}); cp splits causal attention over the "
                "whole sequence only"
            )
        if not getattr(config, "is_causal", True):
            found.append(f"{type(model).__name__}: bidirectional attention (config.is_causal=False)")
        if not getattr(model, "_supports_attention_backend", False):
            found.append(
                f"{type(model).__name__}: does not take attention functions from transformers' registry "
                "(_supports_attention_backend is False), so cp cannot reach its attention"
            )
    return found


def context_parallel_problems(plan: Plan, module: nn.Module) -> list[str]:
    """What keeps the context-parallel engine from running ``plan`` on ``module``, one line each.

    Examples:
        >>> plan = fs.shard(nn.Linear(8, 8), fs.Mesh(cp=2), fs.fsdp("cp") + fs.cp("cp"))
        >>> context_parallel_problems(plan, nn.Sequential(nn.MultiheadAttention(8, 2)))[0][:40]
        "cp('cp'): 0 (MultiheadAttention): comput"
        >>> context_parallel_problems(fs.shard(nn.Linear(8, 8), fs.Mesh(dp=2), fs.fsdp()), nn.Linear(8, 8))
        []
    """
    context = plan.config.context
    if context is None:
        return []
    return [f"cp({context.axis!r}): {problem}" for problem in attention_problems(module)]


# calls multiplying two tensors, as attention's scores and its weighted values are made
_PRODUCTS = frozenset({"matmul", "bmm", "baddbmm", "einsum"})


@functools.cache
def _attends_by_hand(forward: Callable[..., Any]) -> bool:
    """Whether ``forward``'s source takes a softmax of a product of activations (pure, by its syntax).

    Flow-insensitive: a name assigned from a product, or from a name so made, is a product too.
    A product with a ``self.`` attribute (a weight) is no attention score; source that cannot be
    read (built-ins, say) is passed; torch's own modules are not read.
    """
    if getattr(forward, "__module__", "").startswith("torch."):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    assignments = [
        (targets, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and node.value is not None
        for targets in [node.targets if isinstance(node, ast.Assign) else [node.target]]
    ]
    products: set[str] = set()
    while True:
        grown = {
            name.id
            for targets, value in assignments
            if _holds_product(value, products)
            for target in targets
            for name in ast.walk(target)
            if isinstance(name, ast.Name)
        }
        if grown <= products:
            break
        products |= grown
    return any(
        _holds_product(node, products)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _called_name(node.func) == "softmax"
    )


def _holds_product(node: ast.AST, products: set[str]) -> bool:
    """Whether ``node`` contains a product of two activations, or a name in ``products``."""
    for part in ast.walk(node):
        if isinstance(part, ast.Name) and part.id in products:
            return True
        if isinstance(part, ast.BinOp) and isinstance(part.op, ast.MatMult):
            operands: list[ast.AST] = [part.left, part.right]
        elif isinstance(part, ast.Call) and _called_name(part.func) in _PRODUCTS:
            operands = list(part.args)
        else:
            continue
        if not any(_on_self(operand) for operand in operands):
            return True
    return False


def _called_name(func: ast.AST) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _on_self(node: ast.AST) -> bool:
    """Whether ``node`` is a module's own tensor: ``self.weight``, ``self.weight.t()``, ``self.w[0]``.

    A call of ``self``'s own (a submodule, ``self.k_proj(x)``) makes an activation instead.
    """
    while True:
        if isinstance(node, ast.Call):
            func = node.func
            if not isinstance(func, ast.Attribute) or _is_self(func.value):
                return False
            node = func.value
        elif isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        else:
            return _is_self(node)


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"
