"""The inputs that make a model keep attention inside each packed document.

`packed_inputs` turns a `PackedBatch` into the keyword arguments of one model's forward. A
Hugging Face causal LM finds the documents in its ``position_ids`` (they restart at 0 at each
document): its mask builder (``transformers.masking_utils.create_causal_mask``) makes the SDPA,
eager and flex attention masks block-diagonal, and flash attention reads the documents'
boundaries as its varlen ``cu_seq_lens``. transformers does so only without a cache and
without a 2-D ``attention_mask``: the arguments turn the cache off and carry no mask. A model
whose attention would cross documents is refused before anything runs.

Nothing here imports transformers unless the model is one of its own.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

import torch
from torch import nn

from .document_masks import check_packed_inputs
from .errors import ShardingError
from .packing import PackedBatch
from .tree import is_hf_model

__all__ = ["DOCUMENT_MASKS", "RECURRENT_LAYER_TYPES", "VARLEN", "packed_inputs"]

DOCUMENT_MASKS = ("sdpa", "eager", "flex_attention")
"""Hugging Face attention implementations whose mask transformers builds block-diagonal from
packed ``position_ids`` (any number of rows)."""

VARLEN = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
"""Hugging Face attention implementations that run each document apart given its boundaries
(``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``), over all the rows flattened."""

RECURRENT_LAYER_TYPES = ("linear_attention", "hybrid", "hybrid_sliding", "conv", "mamba")
"""transformers' ``config.layer_types`` of layers that carry a state from token to token (Mamba,
gated delta nets, lightning attention, short convolutions): masks do not reach that state."""

# the classes of those layers' state-carrying modules, to name them (transformers' own names)
_RECURRENT_MODULE = re.compile(
    r"(Mixer|MambaLayer|ShortConv|GatedDeltaNet|LightningAttention|LinearAttention)$"
)


def packed_inputs(model: nn.Module, batch: PackedBatch) -> dict[str, Any]:
    """The keyword arguments that run ``model`` on ``batch`` with each document attending only to itself.

    For a Hugging Face causal LM: ``input_ids``, ``position_ids`` (each document's own, so the
    model finds the documents in them) and ``use_cache=False``; with flash attention also the
    documents' boundaries. For a model whose forward takes ``tokens``, ``positions`` and
    ``document_ids`` (the zoo's ``Llama``): those. The tensors go to the model's device.

    Compute the loss from ``batch.labels`` (already the next token, `IGNORE_INDEX` where none),
    not by passing ``labels=`` to a Hugging Face model, which shifts them once more.

    Args:
        model: a Hugging Face causal LM, or a module whose forward takes ``document_ids``.
        batch: the documents, as `pack` returns them.

    Returns:
        A dict to call the model with: ``model(**packed_inputs(model, batch))``.

    Raises:
        ShardingError: ``batch`` is not a `PackedBatch` (or its positions and ids disagree), or
            ``model``'s attention cannot keep documents apart: its attention implementation, a
            mask built without transformers' packed-sequence path, bidirectional attention, layers
            that carry a state across tokens (a hybrid model), or a forward that takes no document
            boundaries at all; the message names the class.

    Examples:
        >>> from functional_shard.core.packing import pack
        >>> from functional_shard.zoo import llama
        >>> batch = pack([[5, 6, 7], [8, 9]], seq_len=6)
        >>> sorted(packed_inputs(llama("tiny"), batch))
        ['document_ids', 'positions', 'tokens']
        >>> packed_inputs(nn.Linear(2, 2), batch)
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: packed_inputs(Linear): its forward takes no document ...
    """
    name = type(model).__name__
    if not isinstance(batch, PackedBatch):
        raise ShardingError(
            f"packed_inputs({name}, batch={type(batch).__name__}): pass the PackedBatch that fs.pack returns"
        )
    check_packed_inputs(
        batch.tokens, positions=batch.positions, document_ids=batch.document_ids, who="packed_inputs"
    )
    device = _device(model)
    if is_hf_model(model):
        return _hf_inputs(model, batch, device)
    if {"positions", "document_ids"} <= _keywords(model):
        return {
            "tokens": batch.tokens.to(device),
            "positions": batch.positions.to(device),
            "document_ids": batch.document_ids.to(device),
        }
    raise ShardingError(
        f"packed_inputs({name}): its forward takes no document boundaries (no document_ids=, and it is "
        "not a Hugging Face model), so its attention would cross the packed documents. Pass a Hugging "
        "Face causal LM, or a model whose forward takes positions= and document_ids= (the zoo's Llama)."
    )


def _hf_inputs(model: nn.Module, batch: PackedBatch, device: torch.device) -> dict[str, Any]:
    implementation = _hf_attention(model)
    inputs: dict[str, Any] = {
        "input_ids": batch.tokens.to(device),
        "position_ids": batch.positions.to(device),
        # a cache, even an empty one, turns transformers' search for packed documents off
        "use_cache": False,
    }
    if implementation in VARLEN:
        # transformers finds documents in position_ids for flash attention only in one row;
        # the boundaries over the flattened rows (the padding a segment) hold for any number
        bounds = batch.cu_seqlens.to(device)
        longest = int(batch.cu_seqlens.diff().max())
        inputs |= {
            "cu_seq_lens_q": bounds,
            "cu_seq_lens_k": bounds,
            "max_length_q": longest,
            "max_length_k": longest,
        }
    return inputs


def _hf_attention(model: nn.Module) -> str:
    """A Hugging Face model's attention implementation; refused if it would cross packed documents."""
    name = type(model).__name__
    config: Any = model.config
    implementation = config._attn_implementation
    fix = "Load it with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))."
    if implementation not in DOCUMENT_MASKS + VARLEN:
        raise ShardingError(
            f"packed_inputs({name}): its attention implementation {implementation!r} cannot keep packed "
            f"documents apart; transformers does so for {', '.join(map(repr, DOCUMENT_MASKS))} (a "
            f"block-diagonal mask from position_ids) and {', '.join(map(repr, VARLEN))} (each "
            f"document's own varlen call). {fix}"
        )
    if not getattr(config, "is_causal", True):
        raise ShardingError(
            f"packed_inputs({name}): its attention is bidirectional (config.is_causal=False), and "
            "transformers keeps packed documents apart in causal masks only. Pack documents for a "
            "causal LM, or pad them instead."
        )
    import transformers.masking_utils as masking

    base = getattr(model, "base_model", model)
    builder = getattr(sys.modules.get(type(base).__module__), "create_causal_mask", None)
    if builder is not masking.create_causal_mask:
        raise ShardingError(
            f"packed_inputs({name}): {type(base).__module__} builds its attention without "
            "transformers.masking_utils.create_causal_mask, the path that finds packed documents in "
            "position_ids, so its attention (or its recurrent state) would cross documents. Pack "
            "documents for a model that builds its mask there (Llama, Qwen2, Mistral, ...), or pad them."
        )
    if recurrent := _recurrent_layers(model):
        raise ShardingError(
            f"packed_inputs({name}): {recurrent} carry a state from each token to the next, which "
            "would run on from one packed document into the next: transformers keeps documents apart "
            "in attention masks only. Pack documents for a model of attention layers alone, or pad them."
        )
    return str(implementation)


def _recurrent_layers(model: nn.Module) -> str:
    """The layers of a hybrid model whose state crosses documents, named for a message ('' if none)."""
    config: Any = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = [str(kind) for kind in getattr(text_config, "layer_types", None) or ()]
    layers = [index for index, kind in enumerate(kinds) if kind in RECURRENT_LAYER_TYPES]
    modules = [
        f"{path} ({type(module).__name__})"
        for path, module in model.named_modules()
        if _RECURRENT_MODULE.search(type(module).__name__)
    ]
    if not layers and not modules:
        return ""
    if not modules:
        return f"its layers {layers} ({', '.join(sorted({kinds[i] for i in layers}))} in config.layer_types)"
    more = f" and {len(modules) - 3} more" if len(modules) > 3 else ""
    return f"its layers {', '.join(modules[:3])}{more}"


def _keywords(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device
