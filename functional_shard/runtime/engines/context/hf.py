"""The all-gather engine behind a Hugging Face model's attention (transformers' ``AttentionInterface``).

`use_hf_attention` registers `sequence_attention` under `HF_ATTENTION` and points the model at
it; the mask function refuses padding, which the engine cannot honour.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from functional_shard.core.errors import ShardingError
from functional_shard.planning.context_checks import takes_hf_attention as _is_hf

from .parallel import sequence_attention

__all__ = ["HF_ATTENTION", "use_hf_attention"]

HF_ATTENTION = "functional_shard_context_parallel"
"""The name the engine's attention function has in transformers' registry."""


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    name = type(module).__name__
    if attention_mask is not None:
        raise ShardingError(
            f"context parallel: {name} got an attention mask (padding, or a custom 4-D mask); the engine "
            "splits causal attention over whole sequences only: pack sequences without padding"
        )
    if kwargs.get("sliding_window") is not None:
        raise ShardingError(
            f"context parallel: {name} attends within a sliding window, which cp cannot split"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = sequence_attention(query, key, value, causal=bool(causal), scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def _hf_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    # the engine masks by global positions itself; a padding mask it cannot honour
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ShardingError(
            "context parallel: the batch has padding (an attention_mask with zeros); the engine splits "
            "whole sequences only: pack sequences without padding, or drop the attention_mask"
        )


def _register_hf() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(HF_ATTENTION, _hf_mask)


def use_hf_attention(model: nn.Module) -> None:
    """Point a Hugging Face model's attention at the engine (nothing for other modules)."""
    if _is_hf(model):
        _register_hf()
        model.set_attn_implementation(HF_ATTENTION)  # type: ignore[operator]
