"""Models the library has no rules for, shaped as other codebases write them.

A torchtitan-shaped Llama 3 (blocks in an ``nn.ModuleDict``; ``wq``/``wk``/``wv``/``wo`` and
``w1``/``w2``/``w3``), a DeepSeek-shaped mixture of experts (dense then MoE blocks, grouped
expert tensors, a shared expert), and a timm-shaped vision transformer (blocks in an
``nn.Sequential``). Importable, so spawned gloo ranks can build them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


@dataclass(frozen=True)
class TitanConfig:
    vocab: int = 64
    dim: int = 32
    hidden: int = 48
    layers: int = 2
    heads: int = 4


class Attention(nn.Module):
    def __init__(self, config: TitanConfig) -> None:
        super().__init__()
        self.head_dim = config.dim // config.heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return causal_attention(x, (self.wq, self.wk, self.wv, self.wo), self.head_dim)


def causal_attention(x: torch.Tensor, projections: tuple[nn.Module, ...], head_dim: int) -> torch.Tensor:
    """Causal SDPA of ``x`` through the (query, key, value, output) ``projections``."""
    batch, seq, _ = x.shape
    query, key, value, output = projections

    # the local head count follows from the projections (fewer under tensor parallel)
    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, -1, head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(heads(query(x)), heads(key(x)), heads(value(x)), is_causal=True)
    return output(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: TitanConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config.dim, config.hidden)
        self.attention_norm = nn.RMSNorm(config.dim)
        self.ffn_norm = nn.RMSNorm(config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TitanLlama(nn.Module):
    """torchtitan's Llama 3 layout: ``layers`` is an ``nn.ModuleDict`` keyed "0", "1", ..."""

    def __init__(self, config: TitanConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.layers)})
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class Experts(nn.Module):
    """Grouped expert weights, one tensor per projection (DeepSeek V3 / torchtitan's MoE)."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.02)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * 0.02)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.02)


class MoE(nn.Module):
    def __init__(self, config: TitanConfig, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(config.dim, experts, bias=False)
        self.experts = Experts(experts, config.dim, config.hidden)
        self.shared_experts = FeedForward(config.dim, config.hidden)


class MoEBlock(nn.Module):
    def __init__(self, config: TitanConfig, moe: bool) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.attention_norm = nn.RMSNorm(config.dim)
        self.ffn_norm = nn.RMSNorm(config.dim)
        self.moe = MoE(config) if moe else None
        self.feed_forward = None if moe else FeedForward(config.dim, config.hidden)


class DeepSeekMoE(nn.Module):
    """DeepSeek's layout: the first blocks dense, the rest mixtures of experts, in a ModuleDict."""

    def __init__(self, config: TitanConfig, dense: int = 1, moe: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleDict({str(i): MoEBlock(config, moe=i >= dense) for i in range(dense + moe)})
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)


class VisionBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))


class SequentialViT(nn.Module):
    """timm's layout: ``blocks`` is an ``nn.Sequential`` of blocks."""

    def __init__(self, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.blocks = nn.Sequential(*[VisionBlock(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts: ``w1``/``w3`` ``[E, hidden, dim]``, ``w2`` ``[E, dim, hidden]``.

    ``forward(x [T, dim], counts [E])`` on tokens sorted by expert; split weights are
    DTensors, read locally as torchtitan's own forward reads them.
    """

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * 0.1)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.1)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        out = [
            (F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())) @ w2[e].t()
            for e, rows in enumerate(torch.split(x, counts))
        ]
        return torch.cat(out)


class TokenChoiceRouter(nn.Module):
    """torchtitan's router: ``gate`` scores each token's experts, the top ``k`` chosen."""

    def __init__(self, dim: int, experts: int, top_k: int = 2) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, chosen = torch.topk(torch.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        return scores, chosen


class TitanMoELayer(nn.Module):
    """torchtitan's MoE naming: ``router.gate``, ``experts.w1/w2/w3``, ``shared_experts.w1/w2/w3``."""

    def __init__(self, config: TitanConfig, experts: int = 4) -> None:
        super().__init__()
        self.router = TokenChoiceRouter(config.dim, experts)
        self.experts = GroupedExperts(experts, config.dim, config.hidden)
        self.shared_experts = FeedForward(config.dim, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores, chosen = self.router(tokens)
        order = torch.argsort(chosen.reshape(-1), stable=True)
        counts = torch.bincount(chosen.reshape(-1), minlength=self.experts.w1.shape[0]).tolist()
        token = order // chosen.shape[1]
        routed = self.experts(tokens[token], counts) * scores.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(tokens).index_add(0, token, routed)
        return (out + self.shared_experts(tokens)).reshape(batch, seq, dim)


class TitanMoEBlock(nn.Module):
    def __init__(self, config: TitanConfig, moe: bool) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.attention_norm = nn.RMSNorm(config.dim)
        self.ffn_norm = nn.RMSNorm(config.dim)
        self.moe = TitanMoELayer(config) if moe else None
        self.feed_forward = None if moe else FeedForward(config.dim, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        ffn = self.moe if self.moe is not None else self.feed_forward
        assert ffn is not None
        return x + ffn(self.ffn_norm(x))


class TitanDeepSeek(nn.Module):
    """A DeepSeek-shaped MoE with torchtitan's names and a forward: dense then MoE blocks."""

    def __init__(self, config: TitanConfig, dense: int = 1, moe: int = 1) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): TitanMoEBlock(config, moe=i >= dense) for i in range(dense + moe)}
        )
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)

    forward = TitanLlama.forward  # the same names, the same forward


class FusedAttention(nn.Module):
    """Grouped-query attention with q, k and v in one ``wqkv`` (pieces of unequal sizes).

    The local head counts follow from the local width (fewer under tensor parallel): q
    takes ``n_heads / (n_heads + 2·n_kv)`` of it, k and v the rest, as torchtitan reads its heads.
    """

    def __init__(self, config: TitanConfig, kv_heads: int, bias: bool = False) -> None:
        super().__init__()
        self.head_dim = config.dim // config.heads
        self.n_heads, self.n_kv = config.heads, kv_heads
        self.wqkv = nn.Linear(config.dim, (config.heads + 2 * kv_heads) * self.head_dim, bias=bias)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        fused = self.wqkv(x)
        kv = fused.shape[-1] * self.n_kv // (self.n_heads + 2 * self.n_kv)
        q, k, v = fused.split([fused.shape[-1] - 2 * kv, kv, kv], dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        repeat = self.n_heads // self.n_kv
        k, v = (heads(t).repeat_interleave(repeat, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(heads(q), k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FusedFeedForward(nn.Module):
    """SwiGLU with w1 and w3 stacked in one projection (``w13``, or Hugging Face's ``gate_up_proj``)."""

    def __init__(self, dim: int, hidden: int, fused: str = "w13", out: str = "w2") -> None:
        super().__init__()
        self.fused, self.out = fused, out
        self.add_module(fused, nn.Linear(dim, 2 * hidden, bias=False))
        self.add_module(out, nn.Linear(hidden, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = getattr(self, self.fused)(x).chunk(2, dim=-1)
        return getattr(self, self.out)(F.silu(gate) * up)


class FusedBlock(nn.Module):
    def __init__(self, config: TitanConfig, kv_heads: int, hf_mlp: bool, bias: bool = False) -> None:
        super().__init__()
        self.attention = FusedAttention(config, kv_heads, bias)
        self.attention_norm = nn.RMSNorm(config.dim)
        self.ffn_norm = nn.RMSNorm(config.dim)
        if hf_mlp:  # Hugging Face's names (Phi-3): mlp.gate_up_proj, mlp.down_proj
            self.mlp = FusedFeedForward(config.dim, config.hidden, "gate_up_proj", "down_proj")
        else:
            self.feed_forward = FusedFeedForward(config.dim, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        ffn = self.mlp if hasattr(self, "mlp") else self.feed_forward
        return x + ffn(self.ffn_norm(x))


class FusedLlama(nn.Module):
    """A Llama with fused projections: ``attention.wqkv`` (grouped-query), ``feed_forward.w13``
    in even blocks and ``mlp.gate_up_proj`` in odd ones; with ``bias``, ``wqkv`` has a bias."""

    def __init__(self, config: TitanConfig, kv_heads: int, bias: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleList(
            [FusedBlock(config, kv_heads, hf_mlp=i % 2 == 1, bias=bias) for i in range(config.layers)]
        )
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def fused_rules(config: TitanConfig, kv_heads: int) -> list[tuple[str, object]]:
    """Rules for `FusedLlama`: each fused projection's pieces sized from the config."""
    import functional_shard as fs

    head_dim = config.dim // config.heads
    qkv = fs.packed((config.heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))
    return [
        ("*.attention.wqkv", qkv),
        ("*.attention.wo", "rowwise"),
        ("*.feed_forward.w13", fs.packed((config.hidden, config.hidden))),
        ("*.feed_forward.w2", "rowwise"),
        ("*.mlp.gate_up_proj", fs.packed((config.hidden, config.hidden))),
        ("*.mlp.down_proj", "rowwise"),
        ("tok_embeddings", "rowwise"),
        ("output", "colwise_gather"),
    ]


class OddMix(nn.Module):
    """Attention under names no rule set knows: ``a``, ``b``, ``c`` (q, k, v) and ``d`` (out)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.a, self.b, self.c, self.d = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return causal_attention(x, (self.a, self.b, self.c, self.d), self.head_dim)


class OddFF(nn.Module):
    def __init__(self, dim: int, hidden: int, chain: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.mid = nn.Linear(hidden, hidden) if chain else None  # a projection of a projection
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        return self.down(self.mid(h) if self.mid is not None else h)


class OddBlock(nn.Module):
    def __init__(self, config: TitanConfig, chain: bool) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(config.dim), nn.LayerNorm(config.dim)
        self.mix = OddMix(config.dim, config.heads)
        self.ff = OddFF(config.dim, config.hidden, chain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.n1(x))
        return x + self.ff(self.n2(x))


class OddNames(nn.Module):
    """A transformer whose names no rule set knows (``blocks.0.mix.a``, ``blocks.0.ff.up``,
    ``emb``, ``proj_out``); with ``chain``, a feed-forward of three projections in a row."""

    def __init__(self, config: TitanConfig, chain: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList([OddBlock(config, chain) for _ in range(config.layers)])
        self.final = nn.LayerNorm(config.dim)
        self.proj_out = nn.Linear(config.dim, config.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.proj_out(self.final(h))


def rope_frequencies(seq: int, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Rotary position embedding as complex numbers ``(seq, head_dim / 2)``, as torchtitan makes them."""
    inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), inverse)
    return torch.polar(torch.ones_like(angles), angles)


def _rotated(t: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * frequencies[None, :, None, :]).flatten(3).type_as(t)


class RopeMix(nn.Module):
    """``OddMix`` with rotary positions: called as ``mix(x, frequencies)``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.a, self.b, self.c, self.d = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, self.head_dim)

        q, k = _rotated(heads(self.a(x)), frequencies), _rotated(heads(self.b(x)), frequencies)
        v = heads(self.c(x))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.d(out.transpose(1, 2).reshape(batch, seq, -1))


class RopeBlock(nn.Module):
    def __init__(self, config: TitanConfig) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(config.dim), nn.LayerNorm(config.dim)
        self.mix = RopeMix(config.dim, config.heads)
        self.ff = OddFF(config.dim, config.hidden)

    def forward(self, x: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.n1(x), frequencies)
        return x + self.ff(self.n2(x))


class RopeNames(nn.Module):
    """`OddNames` whose blocks take two inputs, ``block(h, frequencies)``: the rotary
    positions the model makes once, as torchtitan's blocks take ``freqs_cis``."""

    def __init__(self, config: TitanConfig) -> None:
        super().__init__()
        self.head_dim = config.dim // config.heads
        self.emb = nn.Embedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList([RopeBlock(config) for _ in range(config.layers)])
        self.final = nn.LayerNorm(config.dim)
        self.proj_out = nn.Linear(config.dim, config.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        frequencies = rope_frequencies(tokens.shape[1], self.head_dim, tokens.device)
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h, frequencies)
        return self.proj_out(self.final(h))


ODD_RULES = [
    ("*.mix.a", "colwise"),
    ("*.mix.b", "colwise"),
    ("*.mix.c", "colwise"),
    ("*.mix.d", "rowwise"),
    ("*.ff.up", "colwise"),
    ("*.ff.down", "rowwise"),
    ("emb", "rowwise"),
    ("proj_out", "colwise_gather"),
    ("*.n?", "sequence"),
    ("final", "sequence"),
]
"""What named rules would say of `OddNames`, as `fs.rules.llama` splits its own names."""
