"""What keeps context parallel from splitting a model's attention. Pure: it reads modules only.

Context parallel reaches attention two ways (`functional_shard.runtime.engines.context.parallel`):
a module calling ``F.scaled_dot_product_attention``, or a Hugging Face model taking attention
functions from transformers' registry. Attention computed in its own kernel
(``nn.MultiheadAttention``), within a sliding window, or bidirectionally it cannot split. The
runtime's `check_runnable` asks this before it runs a plan, `fs.estimate` before it traces
one, so both refuse the same models with the same words.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
