"""torchtitan 0.3.0's Llama 3 and its main branch's MoE, written again for tests: names and forwards.

Read from the registry wheel (``torchtitan/models/llama3`` and ``models/common``; nothing
copied). The paths are torchtitan's: ``tok_embeddings``, ``layers`` (an ``nn.ModuleDict``
keyed "0", "1", ...), ``layers.N.attention.qkv_linear.wqkv`` (q, k and v fused), its
``attention.rope`` (the rotary table, a buffer), ``attention.wo``,
``attention.inner_attention``, ``feed_forward.w1/w2/w3``, ``attention_norm``,
``ffn_norm``, ``norm`` and ``lm_head``; ``fuse_qkv=False`` gives torchtitan's unfused
``qkv_linear.wq/wk/wv``.

Its fused ``wqkv`` is laid out by key/value group, not as q then k then v: output row
``(g, r, d)`` of ``(n_kv_heads, heads_per_kv + 2, head_dim)`` is query head ``r`` of group
``g`` for ``r < heads_per_kv``, then the group's key, then its value (`fuse_qkv` builds it
from separate q, k, v weights, as torchtitan's checkpoint hook does). A column split into
whole groups gives each rank its query heads with their keys and values, so torchtitan
splits ``wqkv`` colwise, which needs the tensor-parallel size to divide ``n_kv_heads``.

What differs, and why:
- attention is causal SDPA on the CPU. torchtitan 0.3.0's language models run flex
  attention (it needs CUDA to train and a BlockMask input) or varlen, and refuse
  ``attn_backend="sdpa"``; its ``ScaledDotProductAttention`` (used by Flux) is what
  ``inner_attention`` is here, with ``enable_gqa`` as torchtitan passes it (no repeat_kv).
- no state-dict hooks: torchtitan's ``FusedQKVLinear`` shows ``wq``/``wk``/``wv`` in its
  state dict and fuses them on load; here the state dict holds ``wqkv`` as it is.
- no configs of configs, sharding configs or ``positions``/masks: a plain dataclass, and
  the forward takes token ids (positions 0..seq-1, as torchtitan without ``positions``).
- initialisation: each module's ``reset_parameters`` draws what torchtitan's
  ``param_init`` draws (truncated normal, depth-scaled for ``wo``, ``w2`` and ``w3``), so
  ``fs.materialize`` replays it; ``wqkv`` is drawn whole, not piece by piece.

The rotary table is a non-persistent buffer computed in ``__init__`` (torchtitan's
``ComplexRoPE.cache``): built on the meta device it is meta too, and after ``to_empty``
or ``fs.materialize`` holds garbage until `Llama3Model.init_buffers` computes it again
(torchtitan's ``init_states(buffer_device=...)`` does the same).

torchtitan's mixture of experts as its main branch writes it today (`titan_moe`; read at
commit b5bcd76c of 2026-08-21, ``torchtitan/models/common/moe.py`` and ``moe_sharding.py``),
in the Llama 3 decoder above (today's Qwen3 and DeepSeek V3 blocks keep its names): a block
holds ``moe`` instead of ``feed_forward``, with ``router.gate`` (a Linear to the experts),
``routed_experts.inner_experts.w1_EFD``/``w3_EFD`` ``[E, F, D]`` and ``w2_EDF`` ``[E, D, F]``
(``routed_experts`` pairs the experts with a token dispatcher that holds no tensors),
``shared_experts.w1/w2/w3`` (a feed-forward, optional), the persistent buffer
``expert_bias_E`` and the non-persistent ``tokens_per_expert_E``. torchtitan splits it over
tp (no expert parallelism) as: router whole, ``w1_EFD``/``w3_EFD`` on F (dim 1),
``w2_EDF`` on F (dim 2), shared experts colwise/rowwise; ``GroupedExperts.forward`` reads
DTensor weights with ``to_local()``. torchtitan's 0.3.0 names (``moe.experts.w1/w2/w3``)
are `tests.unit_models.TitanMoELayer`'s. What differs here: the experts loop over experts in
the input's dtype (torchtitan runs ``torch._grouped_mm`` in bfloat16, which the estimate's
trace follows); the MoE takes ``(batch, seq, dim)`` and flattens it to tokens (today's
decoder hands it tokens already); nothing updates ``expert_bias_E`` (torchtitan's optimizer
hook does); ``index_add`` where torchtitan runs its deterministic scatter-add.

Examples:
    >>> model = titan_llama3("tiny")  # dim 64, 4 heads, 2 kv heads, 2 layers, vocab 256
    >>> tuple(model(torch.zeros(2, 8, dtype=torch.long)).shape)
    (2, 8, 256)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


@dataclass(frozen=True)
class Llama3Config:
    """The sizes of torchtitan's ``Llama3Model.Config`` (defaults: its 8B)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = 8
    vocab_size: int = 128256
    multiple_of: int = 1024
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = True  # torchtitan's "llama" frequency scaling (Llama 3.1)
    max_seq_len: int = 131072
    fuse_qkv: bool = True
    qk_norm: bool = False  # Qwen3's per-head RMSNorms of the queries and keys, before the rotation

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU width, as torchtitan's ``compute_ffn_hidden_dim``."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


SIZES = {
    # grouped-query and small enough to train on gloo ranks: head_dim 16, hidden 192
    "tiny": Llama3Config(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
        ffn_dim_multiplier=None, max_seq_len=64,
    ),
    # torchtitan's "debugmodel" (no grouped-query attention)
    "debugmodel": Llama3Config(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=None, vocab_size=2048, multiple_of=256,
        ffn_dim_multiplier=None,
    ),
    "8B": Llama3Config(),
}  # fmt: skip


@dataclass(frozen=True)
class MoEConfig:
    """The sizes and routing of today's torchtitan ``MoE.Config`` (defaults: small, DeepSeek V3's routing)."""

    num_experts: int = 4
    hidden_dim: int = 32  # each expert's F
    top_k: int = 2
    shared_hidden_dim: int | None = 32  # None: no shared experts (Qwen3's MoE)
    score_func: str = "sigmoid"  # or "softmax" (Qwen3's)
    route_norm: bool = True
    route_scale: float = 1.0
    load_balance_coeff: float | None = 1e-3  # None: no expert_bias_E buffer
    first_moe_layer: int = 1  # the blocks before it dense (DeepSeek V3's first dense layers)


class Linear(nn.Linear):
    """``nn.Linear`` without bias, drawn from a truncated normal of torchtitan's std for it."""

    def __init__(self, in_features: int, out_features: int, std: float = 0.02) -> None:
        self.std = std  # set first: nn.Linear.__init__ calls reset_parameters
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=self.std, a=-3 * self.std, b=3 * self.std)


def _depth_std(layer_id: int) -> float:
    # torchtitan's depth_scaled_std(0.02, layer_id), for wo, w2 and w3
    return 0.02 / (2 * (layer_id + 1)) ** 0.5


class ComplexRoPE(nn.Module):
    """Rotary positions as complex numbers, torchtitan's ``ComplexRoPE`` (adjacent pairs rotated)."""

    def __init__(self, config: Llama3Config) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cache", self._precompute_cache(), persistent=False)

    def _precompute_cache(self) -> torch.Tensor:
        # (max_seq_len, head_dim / 2) complex64, on the current default device
        config, dim = self.config, self.config.head_dim
        freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        if config.rope_scaling:  # Llama 3.1: factor 8, low 1, high 4, original length 8192
            factor, low, high, original = 8.0, 1.0, 4.0, 8192
            wavelen = 2 * math.pi / freqs
            freqs = torch.where(wavelen > original / low, freqs / factor, freqs)
            smooth = (original / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * freqs / factor + smooth * freqs
            medium = ~(wavelen < original / high) * ~(wavelen > original / low)
            freqs = torch.where(medium, smoothed, freqs)
        angles = torch.outer(torch.arange(config.max_seq_len, device=freqs.device), freqs).float()
        return torch.polar(torch.ones_like(angles), angles)

    def _init_self_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        """Compute the table again (torchtitan's name), where ``buffer_device`` says or where it is."""
        with torch.device(buffer_device or self.cache.device):
            self.cache = self._precompute_cache()

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # query, key: (batch, seq, heads, head_dim); positions 0..seq-1
        seq = query.shape[1]
        table = self.cache[0:seq].view(1, seq, 1, query.shape[-1] // 2)
        q = torch.view_as_complex(query.float().reshape(*query.shape[:-1], -1, 2))
        k = torch.view_as_complex(key.float().reshape(*key.shape[:-1], -1, 2))
        q_out = torch.view_as_real(q * table).flatten(3)
        k_out = torch.view_as_real(k * table).flatten(3)
        return q_out.type_as(query), k_out.type_as(key)


class FusedQKVLinear(nn.Module):
    """torchtitan's ``FusedQKVLinear``: one ``wqkv``, laid out by key/value group (see the module doc)."""

    def __init__(self, config: Llama3Config) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.heads_per_kv = config.n_heads // config.kv_heads
        self.r_dim = self.heads_per_kv + 2  # rows of a group: its query heads, a key, a value
        self.wqkv = Linear(config.dim, (config.n_heads + 2 * config.kv_heads) * config.head_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, _ = x.shape
        # -1 groups: under tensor parallel each rank holds some whole groups
        qkv = self.wqkv(x).view(batch, seq, -1, self.r_dim, self.head_dim)
        pieces = torch.split(qkv, [self.heads_per_kv, 1, 1], dim=-2)
        xq, xk, xv = (t.reshape(batch, seq, -1, self.head_dim).contiguous() for t in pieces)
        return xq, xk, xv


class QKVLinear(nn.Module):
    """torchtitan's unfused ``QKVLinear``: ``wq``, ``wk``, ``wv``, heads read with ``-1``."""

    def __init__(self, config: Llama3Config) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = Linear(config.dim, config.n_heads * config.head_dim)
        self.wk = Linear(config.dim, config.kv_heads * config.head_dim)
        self.wv = Linear(config.dim, config.kv_heads * config.head_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, _ = x.shape
        xq, xk, xv = (p(x).view(batch, seq, -1, self.head_dim) for p in (self.wq, self.wk, self.wv))
        return xq, xk, xv


class ScaledDotProductAttention(nn.Module):
    """torchtitan's ``ScaledDotProductAttention``: causal SDPA on ``(batch, seq, heads, head_dim)``."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None, enable_gqa: bool
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=enable_gqa,
        )  # fmt: skip
        return out.transpose(1, 2)


class GQAttention(nn.Module):
    def __init__(self, config: Llama3Config, layer_id: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.enable_gqa = self.n_heads > self.n_kv_heads
        self.rope = ComplexRoPE(config)
        self.qkv_linear = FusedQKVLinear(config) if config.fuse_qkv else QKVLinear(config)
        self.wo = Linear(config.n_heads * config.head_dim, config.dim, std=_depth_std(layer_id))
        self.inner_attention = ScaledDotProductAttention()
        if config.qk_norm:  # one weight of head_dim for every head: a tp rank sees its own heads only
            self.q_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xk, xv = self.qkv_linear(x)
        if hasattr(self, "q_norm"):
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = self.rope(xq, xk)
        out = self.inner_attention(xq, xk, xv, scale=None, enable_gqa=self.enable_gqa).contiguous()
        return self.wo(out.flatten(2))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, layer_id: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden_dim)
        self.w2 = Linear(hidden_dim, dim, std=_depth_std(layer_id))
        self.w3 = Linear(dim, hidden_dim, std=_depth_std(layer_id))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """Today's torchtitan ``GroupedExperts``: ``w1_EFD``, ``w2_EDF``, ``w3_EFD``, one SwiGLU per expert.

    ``forward(rows, tokens_per_expert)`` takes token rows sorted by expert; split weights are
    DTensors, read locally as torchtitan's forward reads them.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, layer_id: int) -> None:
        super().__init__()
        self.num_experts, self.layer_id = num_experts, layer_id
        # torchtitan's names: the letters give the dims (E experts, F hidden, D model)
        self.w1_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight, std in (
            (self.w1_EFD, 0.02),
            (self.w2_EDF, _depth_std(self.layer_id)),
            (self.w3_EFD, 0.02),
        ):
            nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        weights = (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in weights)
        pieces = torch.split(rows, tokens_per_expert.tolist())
        out = [(F.silu(x @ w1[e].t()) * (x @ w3[e].t())) @ w2[e].t() for e, x in enumerate(pieces)]
        return torch.cat(out)


class LocalTokenDispatcher:
    """torchtitan's dispatcher without expert parallelism (no tensors): tokens sorted by expert and back."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def dispatch(
        self, tokens: torch.Tensor, scores: torch.Tensor, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        order = torch.argsort(expert_ids.reshape(-1), stable=True)
        token_of_row = order // self.top_k
        return tokens[token_of_row], (token_of_row, scores.reshape(-1)[order])

    def combine(
        self, out: torch.Tensor, metadata: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor
    ) -> torch.Tensor:
        # the scores weigh the experts' outputs after them, in float32, as torchtitan's combine
        token_of_row, scores = metadata
        scored = (out.float() * scores.reshape(-1, 1)).to(out.dtype)
        return torch.zeros_like(tokens).index_add(0, token_of_row, scored)


class RoutedExperts(nn.Module):
    """torchtitan's ``RoutedExperts``: the dispatcher and ``inner_experts`` side by side."""

    def __init__(self, config: MoEConfig, dim: int, layer_id: int) -> None:
        super().__init__()
        self.inner_experts = GroupedExperts(config.num_experts, dim, config.hidden_dim, layer_id)
        self.token_dispatcher = LocalTokenDispatcher(config.top_k)

    def forward(
        self,
        tokens: torch.Tensor,
        scores: torch.Tensor,
        expert_ids: torch.Tensor,
        tokens_per_expert: torch.Tensor,
    ) -> torch.Tensor:
        rows, metadata = self.token_dispatcher.dispatch(tokens, scores, expert_ids)
        return self.token_dispatcher.combine(self.inner_experts(rows, tokens_per_expert), metadata, tokens)


class TokenChoiceTopKRouter(nn.Module):
    """torchtitan's router: ``gate`` scores the experts, each token takes its ``top_k``."""

    def __init__(self, config: MoEConfig, dim: int) -> None:
        super().__init__()
        self.gate = Linear(dim, config.num_experts)
        self.config, self.top_k = config, config.top_k

    def forward(
        self, tokens: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(tokens).float()
        scores = torch.sigmoid(logits) if self.config.score_func == "sigmoid" else logits.softmax(-1)
        # the bias steers the choice only; the weights come from the scores themselves
        choice = scores if expert_bias is None else scores + expert_bias
        expert_ids = torch.topk(choice, self.top_k, dim=-1).indices
        chosen = scores.gather(-1, expert_ids)
        if self.config.route_norm:
            chosen = chosen / (chosen.sum(-1, keepdim=True) + 1e-20)
        return chosen * self.config.route_scale, expert_ids, scores


class MoE(nn.Module):
    """Today's torchtitan ``MoE``: ``router``, ``routed_experts``, ``shared_experts`` and two buffers."""

    def __init__(self, config: MoEConfig, dim: int, layer_id: int) -> None:
        super().__init__()
        self.config = config
        self.routed_experts = RoutedExperts(config, dim, layer_id)
        self.router = TokenChoiceTopKRouter(config, dim)
        self.shared_experts = (
            FeedForward(dim, config.shared_hidden_dim, layer_id) if config.shared_hidden_dim else None
        )
        self.expert_bias_E: torch.Tensor | None
        bias = torch.zeros(config.num_experts) if config.load_balance_coeff is not None else None
        self.register_buffer("expert_bias_E", bias, persistent=True)
        # how many tokens each expert took while training (torchtitan's load balancing reads it)
        self.register_buffer("tokens_per_expert_E", torch.zeros(config.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores, expert_ids, all_scores = self.router(tokens, self.expert_bias_E)
        chosen = torch.zeros_like(all_scores, dtype=torch.bool).scatter_(-1, expert_ids, True)
        tokens_per_expert = chosen.sum(0)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(tokens_per_expert)
        out = self.routed_experts(tokens, scores, expert_ids, tokens_per_expert)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.reshape(x.shape)

    def _init_self_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        """Zero the counters again (torchtitan's name), where ``buffer_device`` says or where they are."""
        with torch.device(buffer_device or self.tokens_per_expert_E.device):
            self.tokens_per_expert_E = torch.zeros(self.config.num_experts)
            if self.expert_bias_E is not None:
                self.expert_bias_E = torch.zeros(self.config.num_experts)


class TransformerBlock(nn.Module):
    def __init__(self, config: Llama3Config, layer_id: int, moe: MoEConfig | None = None) -> None:
        super().__init__()
        self.attention = GQAttention(config, layer_id)
        # torchtitan's blocks hold one of the two, by whether the layer is a mixture of experts
        self.moe_enabled = moe is not None
        if moe is not None:
            self.moe = MoE(moe, config.dim, layer_id)
        else:
            self.feed_forward = FeedForward(config.dim, config.hidden_dim, layer_id)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + (self.moe if self.moe_enabled else self.feed_forward)(self.ffn_norm(h))


class Llama3Model(nn.Module):
    """torchtitan's ``Llama3Model`` (a ``Decoder``): token ids ``(batch, seq)`` to logits.

    With ``moe``, the blocks from ``moe.first_moe_layer`` on are today's mixtures of experts.
    """

    def __init__(self, config: Llama3Config, moe: MoEConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)  # normal(0, 1), as torchtitan's

        def moe_of(layer_id: int) -> MoEConfig | None:
            return moe if moe is not None and layer_id >= moe.first_moe_layer else None

        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config, i, moe_of(i)) for i in range(config.n_layers)}
        )
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = Linear(config.dim, config.vocab_size, std=config.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.norm(h))

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        """Compute every rotary table again and zero the experts' counters (after ``to_empty`` or
        ``fs.materialize``)."""
        for module in self.modules():
            if isinstance(module, ComplexRoPE | MoE):
                module._init_self_buffers(buffer_device)


def titan_llama3(
    config_or_size: Llama3Config | str = "tiny", device: torch.device | str | None = None, **changes: object
) -> Llama3Model:
    """torchtitan's Llama 3 of a size in `SIZES` (or a config), built on ``device``.

    ``changes`` replace config fields (``fuse_qkv=False``, ``n_kv_heads=4``). On the meta
    device nothing is allocated; see the module doc for the rotary table.

    Examples:
        >>> model = titan_llama3("8B", device="meta")
        >>> tuple(model.layers["0"].attention.qkv_linear.wqkv.weight.shape)
        (6144, 4096)
    """
    config = SIZES[config_or_size] if isinstance(config_or_size, str) else config_or_size
    config = dataclasses.replace(config, **changes)  # type: ignore[arg-type]
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return Llama3Model(config)


def titan_moe(
    config_or_size: Llama3Config | str = "tiny",
    moe: MoEConfig | None = None,
    device: torch.device | str | None = None,
    **changes: object,
) -> Llama3Model:
    """`titan_llama3` whose blocks from ``moe.first_moe_layer`` on are today's torchtitan MoE.

    Examples:
        >>> model = titan_moe("tiny", MoEConfig(num_experts=8), device="meta")
        >>> tuple(model.layers["1"].moe.routed_experts.inner_experts.w2_EDF.shape)
        (8, 64, 32)
        >>> moe = model.layers["1"].moe  # layer 0 is dense: it has a feed_forward instead
        >>> "expert_bias_E" in moe.state_dict(), "tokens_per_expert_E" in moe.state_dict()
        (True, False)
    """
    config = SIZES[config_or_size] if isinstance(config_or_size, str) else config_or_size
    config = dataclasses.replace(config, **changes)  # type: ignore[arg-type]
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return Llama3Model(config, moe if moe is not None else MoEConfig())


def fuse_qkv(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """``wqkv`` from separate q, k, v weights (or biases): rows by key/value group, as torchtitan lays it out.

    Examples:
        >>> wq, wk, wv = torch.arange(4.0)[:, None], torch.tensor([[10.0]]), torch.tensor([[20.0]])
        >>> fuse_qkv(wq, wk, wv, n_kv_heads=1).flatten().tolist()
        [0.0, 1.0, 2.0, 3.0, 10.0, 20.0]
    """
    tail, head_dim = wq.shape[1:], wk.shape[0] // n_kv_heads
    groups = [t.reshape(n_kv_heads, -1, head_dim, *tail) for t in (wq, wk, wv)]
    return torch.cat(groups, dim=1).reshape(-1, *tail)


def split_qkv(wqkv: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """The separate q, k, v weights (or biases) of a torchtitan ``wqkv``: `fuse_qkv` undone."""
    per_kv, tail = n_heads // n_kv_heads, wqkv.shape[1:]
    groups = wqkv.reshape(n_kv_heads, per_kv + 2, -1, *tail)
    return tuple(t.reshape(-1, *tail) for t in groups.split([per_kv, 1, 1], dim=1))
