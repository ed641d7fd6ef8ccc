"""Small, real models with Hugging Face naming, for examples, benchmarks and tests.

`Llama` is a faithful-in-shape Llama (RMSNorm, grouped-query attention, SwiGLU MLP,
optional tied embedding) whose parameter names match Hugging Face's, so `rules.llama`
applies to it as to the real thing. Build big ones on the meta device.

It takes packed documents (`functional_shard.core.packing.pack`): ``document_ids`` keep
attention inside each document, ``positions`` turn queries and keys by the rotary embedding.
Given the tokens alone it attends causally over the whole row, with no rotary embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from functional_shard.core.document_masks import (
    attend_within_documents,
    check_packed_inputs,
    document_attention_mask,
)

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask
    from typing_extensions import Unpack  # typing's from Python 3.11

__all__ = ["CONFIGS", "ROPE_THETA", "Llama", "LlamaConfig", "llama", "rotary_angles"]

ROPE_THETA = 10000.0
"""The rotary embedding's base (Llama 2's; Llama 3 uses 500,000)."""


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama-shaped model."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    tie_embeddings: bool = False


CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "tiny-tied": LlamaConfig(tie_embeddings=True),
    "llama-1b": LlamaConfig(128256, 2048, 8192, 16, 32, 8, tie_embeddings=True),
    "llama-7b": LlamaConfig(32000, 4096, 11008, 32, 32, 32),
    # meta-llama/Meta-Llama-3-8B's config.json: untied, grouped-query (8 key/value heads)
    "llama-3-8b": LlamaConfig(128256, 4096, 14336, 32, 32, 8),
    "llama-70b": LlamaConfig(128256, 8192, 28672, 80, 64, 8),
    # meta-llama/Llama-3.1-405B's config.json: 126 layers, hidden 16384, ffn 53248, 128
    # heads, 8 key/value heads; torchtitan's published 405B run used FSDP 8 x TP 8 x PP 8
    "llama-3-405b": LlamaConfig(128256, 16384, 53248, 126, 128, 8),
}


def rotary_angles(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding's cosines and sines at ``positions``, shaped ``(rows, 1, seq, head_dim)``.

    Hugging Face's layout: the first half of each head's features pairs with the second half.

    Examples:
        >>> cos, sin = rotary_angles(torch.tensor([[0, 1, 0]]), head_dim=4)
        >>> cos.shape, cos[0, 0, 0].tolist(), sin[0, 0, 2].tolist()
        (torch.Size([1, 1, 3, 4]), [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    angles = positions[..., None].float() * ROPE_THETA**-exponents
    angles = torch.cat((angles, angles), dim=-1)[:, None]
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = (part.to(x.dtype) for part in rotary)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class AttentionKeywords(TypedDict, total=False):
    """What attention takes beside the hidden states, which a block passes on as it gets it."""

    rotary: tuple[torch.Tensor, torch.Tensor] | None
    mask: torch.Tensor | BlockMask | None


class Attention(nn.Module):
    """Causal grouped-query self-attention."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        head_dim = config.hidden_size // config.num_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        *,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """Attend causally, within ``mask``'s documents where one is given.

        Head counts come from the (possibly TP-local) projections; ``rotary`` is
        `rotary_angles`'s cosines and sines, ``mask`` `document_attention_mask`'s.
        """
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if rotary is not None:
            q, k = _rotate(q, rotary), _rotate(k, rotary)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = attend_within_documents(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=1e-5)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=1e-5)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, **attention: Unpack[AttentionKeywords]) -> torch.Tensor:
        """Residual attention, then residual MLP."""
        x = x + self.self_attn(self.input_layernorm(x), **attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """A Llama-shaped causal language model with Hugging Face parameter names.

    Examples:
        >>> model = Llama(CONFIGS["tiny"])
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 256])
        >>> batch = fs.pack([[5, 6, 7], [8, 9, 10, 11]], seq_len=8)
        >>> model(batch.tokens, positions=batch.positions, document_ids=batch.document_ids).shape
        torch.Size([1, 8, 256])
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=1e-5)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every position.

        Args:
            tokens: ``(rows, seq)`` token ids.
            positions: ``(rows, seq)`` rotary positions (`PackedBatch.positions`); None: no rotary embedding.
            document_ids: ``(rows, seq)`` each token's document, attention staying inside it; None: the row.

        Raises:
            ShardingError: ``positions`` or ``document_ids`` shaped unlike the tokens, or not documents
                laid end to end (`check_packed_inputs`).
        """
        check_packed_inputs(tokens, positions=positions, document_ids=document_ids, who="Llama.forward")
        x = self.embed_tokens(tokens)
        if positions is None and document_ids is None:
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))
        head_dim = self.config.hidden_size // self.config.num_heads
        rotary = None if positions is None else rotary_angles(positions, head_dim)
        mask = None if document_ids is None else document_attention_mask(document_ids)
        for layer in self.layers:
            x = layer(x, rotary=rotary, mask=mask)
        return self.lm_head(self.norm(x))


def llama(name: str = "tiny", device: str | torch.device = "meta") -> Llama:
    """A Llama-shaped model by config name (see `CONFIGS`), on the meta device by default.

    Examples:
        >>> sum(p.numel() for p in llama("llama-7b").parameters()) // 10**6
        6738
        >>> sum(p.numel() for p in llama("llama-3-8b").parameters())  # Llama 3 8B's 8.03B
        8030261248
    """
    if name not in CONFIGS:
        from functional_shard.core.errors import ShardingError

        raise ShardingError(f"no model config {name!r}; choose one of {sorted(CONFIGS)}")
    with torch.device(device):
        return Llama(CONFIGS[name])
