"""The inputs that make a model keep attention inside each packed document.

`packed_inputs` turns a `PackedBatch` into the keyword arguments of one model's forward. A
Hugging Face causal LM finds the documents in its ``position_ids`` (they restart at 0 at each
document): its mask builder (``transformers.masking_utils.create_causal_mask``) makes the SDPA,
eager and flex attention masks block-diagonal, and flash attention reads the documents'
boundaries as its varlen ``cu_seq_lens``. transformers does so only without a cache and
without a 2-D ``attention_mask``: the arguments turn the cache off and carry no mask. A model
whose attention would cross documents is refused before anything runs.

`packed_forward` reads once how a model's forward takes packed rows (`PackedForward`), and its
`PackedForward.keywords` turns the rows' positions and document ids into that forward's keyword
arguments: `packed_inputs` runs on it, and so do `fs.forward_backward`, `fs.forward_only` and
`fs.forward_loss` given ``positions=`` and ``document_ids=``, each pipeline stage on its micro-batch.

Nothing here imports transformers unless the model is one of its own.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .document_masks import check_packed_inputs, document_positions, values_checked
from .errors import ShardingError
from .mask_builder_calls import mask_without_positions, reads_text_positions_first
from .packing import PackedBatch
from .tree import is_hf_model

__all__ = [
    "DOCUMENT_MASKS",
    "RECURRENT_LAYER_TYPES",
    "VARLEN",
    "PackedForward",
    "packed_forward",
    "packed_inputs",
]

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
    if not isinstance(model, nn.Module):
        raise ShardingError(f"packed_inputs(model={name}): pass the model to run on the batch, a Module")
    if not isinstance(batch, PackedBatch):
        raise ShardingError(
            f"packed_inputs({name}, batch={type(batch).__name__}): pass the PackedBatch that fs.pack returns"
        )
    check_packed_inputs(
        batch.tokens, positions=batch.positions, document_ids=batch.document_ids, who="packed_inputs"
    )
    device = _device(model)
    forward = packed_forward(model)
    tokens = batch.tokens.to(device)
    with values_checked():  # above, on the batch as given
        keywords = forward.keywords(
            tokens, batch.positions.to(device), batch.document_ids.to(device), who="packed_inputs"
        )
    return {("input_ids" if forward.attention else "tokens"): tokens} | keywords


@dataclass(frozen=True)
class PackedForward:
    """How one model's forward takes packed rows, read from the whole model by `packed_forward`.

    Under a pipeline a rank holds its own stages alone: read before they are cut, every rank
    refuses alike, and each stage turns its micro-batch's rows into the forward's keywords.

    Attributes:
        name: the model's class, to name it in a refusal.
        attention: a Hugging Face model's attention implementation; "" for a forward that takes
            ``positions=`` and ``document_ids=`` itself (the zoo's Llama).
        takes: the keywords of the model's forward.
        refusal: why the model's attention would cross packed documents, and the fix; "" if it would not.
        text_positions_first: the model finds documents only in the first of four rows of position
            ids (Qwen2-VL's text positions, then its rotary ones: `reads_text_positions_first`).
    """

    name: str
    attention: str
    takes: frozenset[str]
    refusal: str = ""
    text_positions_first: bool = False

    def refuse(self, given: tuple[str, ...], who: str) -> None:
        """Refuse packed rows' ``given`` keywords (``"positions"``, ``"document_ids"``) the model cannot take.

        Raises:
            ShardingError: the model's attention would cross documents (the `refusal`), or its forward
                takes none of Hugging Face's arguments and not ``given``; named ``who(name)``.
        """
        if self.refusal:
            raise ShardingError(f"{who}({self.name}): {self.refusal}")
        missing = [] if self.attention else [f"{n}=" for n in given if n not in self.takes]
        if missing:
            raise ShardingError(
                f"{who}({self.name}): its forward takes no document boundaries (no {' or '.join(missing)}, "
                "and it is not a Hugging Face model), so its attention would cross the packed documents. "
                "Pass a Hugging Face causal LM, or a model whose forward takes positions= and "
                "document_ids= (the zoo's Llama)."
            )

    def taken(
        self,
        who: str,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        *,
        refusal: str = "",
    ) -> dict[str, torch.Tensor]:
        """The packed rows' keywords given (``None`` left out), refused before anything runs.

        ``refusal``: why the caller's plan runs no packed rows, and what instead; "" if it does.

        Raises:
            ShardingError: rows given where ``refusal`` says why not, or as `refuse`.

        Examples:
            >>> forward = PackedForward("Llama", "", frozenset({"positions", "document_ids"}))
            >>> sorted(forward.taken("fs.forward_loss", None, torch.zeros(1, 4, dtype=torch.long)))
            ['document_ids']
        """
        given = {
            name: value
            for name, value in (("positions", positions), ("document_ids", document_ids))
            if value is not None
        }
        if given and refusal:
            raise ShardingError(
                f"{who}: the step was given {' and '.join(f'{n}=' for n in given)}, but {refusal}"
            )
        if given:
            self.refuse(tuple(given), who)
        return given

    def keywords(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        *,
        who: str,
    ) -> dict[str, Any]:
        """The forward's keyword arguments for packed rows, beside the ``tokens`` (or hidden states).

        For a forward that takes them: ``positions`` and ``document_ids`` as given (it checks them
        itself). For a Hugging Face model, whose forward does not, they are checked first
        (`check_packed_inputs`; their shapes alone within `values_checked`, where a pipeline's
        stages run, whose step checked the rows whole), then turned into ``position_ids`` (from
        ``document_ids`` where no positions are given; four rows of them for a model that reads its
        text positions first, `PackedForward.text_positions_first`), ``use_cache=False`` and, under flash
        attention, the segments' boundaries over the flattened rows (the padding a segment of its
        own, as `PackedBatch.cu_seqlens`).

        Raises:
            ShardingError: as `refuse`; for a Hugging Face model, rows whose positions and ids disagree.

        Examples:
            >>> from functional_shard.core.packing import pack
            >>> from functional_shard.zoo import llama
            >>> batch = pack([[5, 6, 7], [8, 9]], seq_len=6)
            >>> keywords = packed_forward(llama("tiny")).keywords(
            ...     batch.tokens, batch.positions, None, who="step")
            >>> sorted(keywords)
            ['positions']
        """
        given = {
            name: value
            for name, value in (("positions", positions), ("document_ids", document_ids))
            if value is not None
        }
        self.refuse(tuple(given), who)
        if not self.attention or not given:
            return given
        check_packed_inputs(tokens, positions=positions, document_ids=document_ids, who=who)
        if positions is None:
            assert document_ids is not None  # (given holds one of them)
            positions = document_positions(document_ids)
        keywords: dict[str, Any] = {
            # a text token's temporal, height and width positions are its text position
            "position_ids": positions.expand(4, -1, -1) if self.text_positions_first else positions,
            # a cache, even an empty one, turns transformers' search for packed documents off
            "use_cache": False,
        }
        if self.attention in VARLEN:
            # transformers finds documents in position_ids for flash attention only in one row;
            # the boundaries over the flattened rows hold for any number
            bounds = segment_bounds(torch.zeros_like(positions) if document_ids is None else document_ids)
            longest = int(bounds.diff().max())
            keywords |= {
                "cu_seq_lens_q": bounds,
                "cu_seq_lens_k": bounds,
                "max_length_q": longest,
                "max_length_k": longest,
            }
        return keywords


def packed_forward(model: nn.Module) -> PackedForward:
    """How ``model``'s forward takes packed rows, or why its attention would cross documents.

    Reads the model alone (its class, config and modules), never raises: the refusal is kept for
    `PackedForward.refuse`, as a model may never be given packed rows.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> packed_forward(llama("tiny")).attention, "document_ids" in packed_forward(llama("tiny")).takes
        ('', True)
        >>> packed_forward(nn.Linear(2, 2)).refuse(("document_ids",), who="step")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: step(Linear): its forward takes no document boundaries (no ...
    """
    # torch.compile's wrapper takes (*args, **kwargs) and hands them to the model it compiled
    model = getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model
    takes = _keywords(model)
    name = _class_name(model)
    if not is_hf_model(model):
        return PackedForward(name, "", frozenset(takes))
    implementation, refusal = _hf_attention(model)
    first = reads_text_positions_first(type(_decoder(model)))
    return PackedForward(name, implementation, frozenset(takes), refusal, text_positions_first=first)


def segment_bounds(document_ids: torch.Tensor) -> torch.Tensor:
    """Every segment's boundaries over the flattened rows of ``document_ids``, int32, as varlen kernels take.

    A segment is a run of one id in a row (a document, or the padding after a row's last one).

    Examples:
        >>> segment_bounds(torch.tensor([[0, 0, 0], [0, 1, 1]])).tolist()
        [0, 3, 4, 6]
    """
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    end = torch.tensor([document_ids.numel()], device=document_ids.device)
    return torch.cat([starts.flatten().nonzero().flatten(), end]).to(torch.int32)


def _hf_attention(model: nn.Module) -> tuple[str, str]:
    """A Hugging Face model's attention implementation, and why it would cross packed documents, or ''."""
    config: Any = model.config
    implementation = str(getattr(config, "_attn_implementation", None))
    fix = "Load it with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))."
    if implementation not in DOCUMENT_MASKS + VARLEN:
        return implementation, (
            f"its attention implementation {implementation!r} cannot keep packed "
            f"documents apart; transformers does so for {', '.join(map(repr, DOCUMENT_MASKS))} (a "
            f"block-diagonal mask from position_ids) and {', '.join(map(repr, VARLEN))} (each "
            f"document's own varlen call). {fix}"
        )
    if not getattr(config, "is_causal", True):
        return implementation, (
            "its attention is bidirectional (config.is_causal=False), and "
            "transformers keeps packed documents apart in causal masks only. Pack documents for a "
            "causal LM, or pad them instead."
        )
    if encoder := _bidirectional_layer(model):
        return implementation, (
            f"its attention {encoder} is bidirectional (is_causal=False, an encoder's), and "
            "transformers keeps packed documents apart in causal masks only. Pack documents for a "
            "causal LM, or pad them instead."
        )
    try:
        import transformers.masking_utils as masking
    except ImportError:
        return implementation, (
            "this transformers has no masking_utils.create_causal_mask, the mask builder that finds "
            "packed documents in position_ids. Install transformers 4.53 or later."
        )

    base = getattr(model, "base_model", model)
    builder = getattr(sys.modules.get(type(base).__module__), "create_causal_mask", None)
    if builder is not masking.create_causal_mask:
        return implementation, (
            f"{type(base).__module__} builds its attention without "
            "transformers.masking_utils.create_causal_mask, the path that finds packed documents in "
            "position_ids, so its attention (or its recurrent state) would cross documents. Pack "
            "documents for a model that builds its mask there (Llama, Qwen2, Mistral, ...), or pad them."
        )
    if unpositioned := mask_without_positions([type(_decoder(model)), type(base)]):
        return implementation, (
            f"{unpositioned} without handing it position_ids, where "
            "transformers finds packed documents, so its attention would cross documents. Pack "
            "documents for a model that hands them to its mask (Llama, Qwen2, Mistral, ...), or pad them."
        )
    if recurrent := _recurrent_layers(model):
        return implementation, (
            f"{recurrent} carry a state from each token to the next, which "
            "would run on from one packed document into the next: transformers keeps documents apart "
            "in attention masks only. Pack documents for a model of attention layers alone, or pad them."
        )
    return implementation, ""


def _bidirectional_layer(model: nn.Module) -> str:
    """The first attention layer of the model's text decoder that sees the whole row, named ('' if none).

    An encoder (BERT) says so in its layers alone, not in its config; a vision tower beside the
    decoder (Qwen2-VL) is left out, as its attention never sees the packed tokens.
    """
    decoder = _decoder(model)
    paths = {id(module): path for path, module in model.named_modules()}
    return next(
        (
            f"{paths.get(id(module), path)} ({type(module).__name__})"
            for path, module in decoder.named_modules()
            if getattr(module, "is_causal", None) is False
        ),
        "",
    )


def _decoder(model: nn.Module) -> nn.Module:
    """The model's text decoder, as transformers names it (``get_decoder``), else the model itself."""
    try:
        decoder = model.get_decoder()  # type: ignore[operator]
    except (AttributeError, TypeError, NotImplementedError):
        decoder = None
    return decoder if isinstance(decoder, nn.Module) else model


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


def _class_name(model: nn.Module) -> str:
    """The model's own class, not the one a torch engine (FSDP2, replicate) made around it."""
    own = (c for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed"))
    return next(own, type(model)).__name__


def _keywords(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device
