"""Attention in the flops: every SDPA kernel, eager matmuls and Hugging Face's interfaces.

The convention (functional_shard/flops.py, docs/will-it-fit.md): causal or not, attention
costs its full score matrix, as eager matmuls compute it and as MFU is counted by PaLM,
Megatron-LM and torchtitan. A training step of a Llama then costs, per token,

    6 · (matmul weights) + 12 · layers · seq · (query heads · head dim)

where the matmul weights are q/o (hidden × heads·head_dim each), k/v (hidden × kv_heads ·
head_dim each: grouped-query attention), the three SwiGLU matrices and the lm_head; the
embedding is a lookup and the norms are element-wise (no matmul flops). Forward is 2 flops
per weight and token, backward 4 (input and weight gradients); attention's forward is
Q·Kᵀ and P·V, 2·seq·heads·head_dim each per token, and its backward twice that.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

import functional_shard as fs
from functional_shard.costing.time.flops import (
    ATTENTION_BACKWARD,
    ATTENTION_FORWARD,
    attention_forward,
    op_flops,
)
from functional_shard.costing.trace.counting import Flops as _Flops
from functional_shard.zoo import Llama, LlamaConfig

_aten = torch.ops.aten
ZOO = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=176, num_layers=3, num_heads=4, num_kv_heads=2
)
HF = {"vocab": 128, "hidden": 32, "ffn": 64, "layers": 3, "heads": 4, "kv_heads": 2}


def per_token(vocab: int, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, seq: int) -> int:
    head_dim = hidden // heads
    attention_weights = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    weights = layers * (attention_weights + 3 * hidden * ffn) + hidden * vocab
    return 6 * weights + 12 * layers * seq * heads * head_dim


def zoo_expected(seq: int) -> int:
    c = ZOO
    return per_token(
        c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, seq
    )


def hf_llama(attention: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=HF["vocab"],
        hidden_size=HF["hidden"],
        intermediate_size=HF["ffn"],
        num_hidden_layers=HF["layers"],
        num_attention_heads=HF["heads"],
        num_key_value_heads=HF["kv_heads"],
        tie_word_embeddings=False,
        attn_implementation=attention,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def traced_per_token(model: torch.nn.Module, batch: int, seq: int) -> float:
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    trace = fs.trace_activations(model, plan, batch=batch, seq=seq)
    assert trace.recompute_flops == 0
    return trace.step_flops / (batch * seq)


# ---- every kernel -------------------------------------------------------------------------------


def _fake_inputs() -> tuple[FakeTensorMode, dict[str, torch.Tensor]]:
    fake = FakeTensorMode()
    with fake:
        t = {
            "q": torch.empty(2, 4, 16, 8),  # (batch, heads, seq, dim)
            "k": torch.empty(2, 2, 12, 8),  # grouped-query: 2 key/value heads, 12 keys
            "v": torch.empty(2, 2, 12, 8),
            "o": torch.empty(2, 4, 16, 8),
            "lse": torch.empty(2, 4, 16),
            "seed": torch.empty((), dtype=torch.long),
        }
    return fake, t


def _kernel_calls(t: dict[str, torch.Tensor]) -> dict[str, tuple[bool, object]]:
    """(is backward, call) for every attention kernel torch 2.13 has, on this machine's fake tensors."""
    q, k, v, o, lse, seed = t["q"], t["k"], t["v"], t["o"], t["lse"], t["seed"]
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # the CUDA kernels want equal heads

    def tr(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)  # the lower-level kernels take (batch, seq, heads, dim)

    mask = [True, True, True, False]
    a = _aten
    return {
        "cpu_flash": (False, lambda: a._scaled_dot_product_flash_attention_for_cpu(q, kk, vv, 0.0, True)),
        "cpu_flash_backward": (
            True,
            lambda: a._scaled_dot_product_flash_attention_for_cpu_backward(o, q, kk, vv, o, lse, 0.0, True),
        ),
        "flash": (False, lambda: a._scaled_dot_product_flash_attention(q, kk, vv, 0.0, True)),
        "flash_backward": (
            True,
            lambda: a._scaled_dot_product_flash_attention_backward(
                o, q, kk, vv, o, lse, None, None, 16, 12, 0.0, True, seed, seed
            ),
        ),
        "efficient": (False, lambda: a._scaled_dot_product_efficient_attention(q, kk, vv, None, True)),
        "efficient_backward": (
            True,
            lambda: a._scaled_dot_product_efficient_attention_backward(
                o, q, kk, vv, None, o, lse, seed, seed, 0.0, mask
            ),
        ),
        "cudnn": (False, lambda: a._scaled_dot_product_cudnn_attention(q, kk, vv, None, True)),
        "cudnn_backward": (
            True,
            lambda: a._scaled_dot_product_cudnn_attention_backward(
                o, q, kk, vv, o, lse, seed, seed, None, None, None, 16, 12, 0.0, True
            ),
        ),
        "overrideable": (False, lambda: a._scaled_dot_product_fused_attention_overrideable(q, kk, vv)),
        "overrideable_backward": (
            True,
            lambda: a._scaled_dot_product_fused_attention_overrideable_backward(
                o, q, kk, vv, None, mask, o, lse, None, None, 16, 12, 0.0, True, seed, seed
            ),
        ),
        "flash_lower": (
            False,
            lambda: a._flash_attention_forward(tr(q), tr(kk), tr(vv), None, None, 16, 12, 0.0, True, False),
        ),
        "flash_lower_backward": (
            True,
            lambda: a._flash_attention_backward(
                tr(o), tr(q), tr(kk), tr(vv), tr(o), lse, None, None, 16, 12, 0.0, True, seed, seed
            ),
        ),
        "efficient_lower": (
            False,
            lambda: a._efficient_attention_forward(
                tr(q), tr(kk), tr(vv), None, None, None, 16, 12, 0.0, 0, True
            ),
        ),
        "efficient_lower_backward": (
            True,
            lambda: a._efficient_attention_backward(
                tr(o), tr(q), tr(kk), tr(vv), None, tr(o), None, None, 16, 12, lse, 0.0, seed, seed, 0, False
            ),
        ),
    }


KERNELS = list(_kernel_calls(_fake_inputs()[1]))


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_attention_kernel_counts_the_full_matrix(kernel):
    fake, tensors = _fake_inputs()
    backward, call = _kernel_calls(tensors)[kernel]
    flops = _Flops()
    with fake, flops:
        call()  # type: ignore[operator]
    forward = 2 * 2 * 4 * 16 * 12 * (8 + 8)  # 2·b·h·s_q·s_k·(d + d_v), full matrix though causal
    assert flops.counts["forward"] == (2 * forward if backward else forward)


def test_every_attention_op_of_torch_has_a_formula():
    # inference-only or other-device ops: nn.MultiheadAttention's fast path runs without
    # autograd; the MPS math op exists only on Apple GPUs
    not_training = {"_native_multi_head_attention", "_scaled_dot_product_attention_math_for_mps"}
    names = [n for n in dir(_aten) if "attention" in n and n not in not_training]
    covered = {packet.__name__ for packet in [*ATTENTION_FORWARD, *ATTENTION_BACKWARD]}
    assert len(names) >= 15
    assert set(names) <= covered, sorted(set(names) - covered)


def test_packed_sequences_count_each_sequence():
    # the lower-level flash kernel with cumulative offsets: sequences of 5 and 11 tokens
    q = torch.empty(16, 4, 8, device="meta")  # (total tokens, heads, dim)
    offsets = torch.tensor([0, 5, 16], dtype=torch.int32)
    got = op_flops(_aten._flash_attention_forward.default, (q, q, q, offsets, offsets, 11, 11), {}, None)
    assert got == attention_forward((1, 4, 5, 8), (1, 4, 5, 8), (1, 4, 5, 8)) + attention_forward(
        (1, 4, 11, 8), (1, 4, 11, 8), (1, 4, 11, 8)
    )


def test_math_path_decomposes_into_counted_matmuls():
    fake = FakeTensorMode()
    with fake:
        q = torch.empty(2, 4, 16, 8, requires_grad=True)
    flops = _Flops()
    with fake, sdpa_kernel([SDPBackend.MATH]), flops:
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        flops.backward = True
        out.sum().backward()
    forward = 2 * 2 * 4 * 16 * 16 * 16
    assert flops.counts == {"forward": forward, "backward": 2 * forward, "recompute": 0, "weight": 0}


def test_flex_attention_has_formulas_and_traces_as_sdpa_does():
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward

    shapes = [torch.empty(1, 4, 32, 8, device="meta")] * 3
    forward = attention_forward((1, 4, 32, 8), (1, 4, 32, 8), (1, 4, 32, 8))
    assert op_flops(flex_attention, shapes, {}, None) == forward
    assert op_flops(flex_attention_backward, shapes, {}, None) == 2 * forward
    # torch 2.13 has no flex attention backward on CPU and compiles its eager forward, which
    # refuses dispatch modes; on fake tensors the trace runs the operators uncompiled
    traces = {}
    for attention in ("sdpa", "flex_attention"):
        model = hf_llama(attention)
        plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
        traces[attention] = fs.trace_activations(model, plan, batch=1, seq=128)
    sdpa, flex = traces["sdpa"], traces["flex_attention"]
    assert (flex.forward_flops, flex.backward_flops) == (sdpa.forward_flops, sdpa.backward_flops)
    # both keep q, k, v, the output and the log-sum-exp, no score matrix; flex also its block mask
    assert sdpa.activation_bytes <= flex.activation_bytes <= 1.05 * sdpa.activation_bytes


def test_a_module_calling_flex_attention_with_a_block_mask_traces():
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    class Attention(torch.nn.Module):  # torchtitan's default attention: flex with a causal BlockMask
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
            mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, s, s, device=x.device)
            return flex(q, k, v, block_mask=mask).transpose(1, 2).reshape(b, s, 32)

    model = torch.nn.Sequential(Attention())
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    trace = fs.trace_activations(model, plan, batch=2, seq=128, inputs=torch.ones(2, 128, 32))
    projection = 2 * 2 * 128 * 32 * 96
    assert trace.forward_flops == projection + attention_forward(
        (2, 4, 128, 8), (2, 4, 128, 8), (2, 4, 128, 8)
    )


# ---- whole models against the formula -----------------------------------------------------------

SEQS = (64, 256, 1024)


def test_zoo_llama_sdpa_per_token_at_three_lengths():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(ZOO)
    for seq in SEQS:
        assert traced_per_token(model, 1, seq) == zoo_expected(seq)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_hf_llama_per_token_at_three_lengths(attention):
    model = hf_llama(attention)
    for seq in SEQS:
        assert traced_per_token(model, 1, seq) == per_token(**HF, seq=seq)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_hf_llama_per_token_at_four_lengths(attention, batch):
    model = hf_llama(attention)
    for seq in (*SEQS, 2048):
        assert traced_per_token(model, batch, seq) == per_token(**HF, seq=seq)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
def test_zoo_llama_math_backend_is_the_eager_path(batch):
    with torch.device("meta"):
        model = Llama(ZOO)
    with sdpa_kernel([SDPBackend.MATH]):
        for seq in SEQS:
            assert traced_per_token(model, batch, seq) == zoo_expected(seq)


@pytest.mark.slow
def test_estimate_model_flops_and_checkpointing_keep_the_convention():
    from functional_shard.zoo import Block

    with torch.device("meta"):
        model = Llama(ZOO)
    seq = 512
    plain = fs.estimate(model, fs.shard(model, fs.Mesh(dp=1), fs.replicate()), batch=1, seq=seq)
    assert plain.model_flops == plain.flops == zoo_expected(seq) * seq
    full = fs.estimate(
        model, fs.shard(model, fs.Mesh(dp=1), fs.replicate() + fs.checkpointing(Block)), batch=1, seq=seq
    )
    assert full.model_flops == plain.model_flops
    # full checkpointing runs every block's forward again (a third of the blocks' flops, its
    # attention included), but for the last matmul: torch's non-reentrant checkpoint stops
    # recomputing once every tensor backward needs is back, and down_proj's output is not one
    blocks = zoo_expected(seq) - 6 * ZOO.hidden_size * ZOO.vocab_size
    down_proj = 2 * ZOO.intermediate_size * ZOO.hidden_size * ZOO.num_layers
    assert full.flops - full.model_flops == (blocks // 3 - down_proj) * seq


# ---- long context: what torch keeps, and the logits ---------------------------------------------


def kept(model: torch.nn.Module, seq: int, batch: int = 1) -> int:
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    return fs.trace_activations(model, plan, batch=batch, seq=seq).activation_bytes


def test_sdpa_keeps_linear_bytes_and_eager_one_score_matrix_per_head():
    # fake tensors: 32k and 128k tokens cost no memory. SDPA's kernel keeps its output and
    # log-sum-exp, nothing s x s: bytes are proportional to the sequence. Eager attention
    # keeps its softmax probabilities, fp32 (batch, heads, s, s), once per layer.
    sdpa, eager = hf_llama("sdpa"), hf_llama("eager")
    base = kept(sdpa, 256)
    for seq in (1024, 32768, 131072):
        assert kept(sdpa, seq) == base * seq // 256
    lengths = (256, 512, 32768)
    eager_bytes = {seq: kept(eager, seq) for seq in lengths}
    quadratic = HF["layers"] * HF["heads"] * 4  # bytes per s² per sequence
    linear = (eager_bytes[256] - quadratic * 256**2) / 256
    assert linear == (eager_bytes[512] - quadratic * 512**2) / 512 > 0
    assert eager_bytes[32768] == linear * 32768 + quadratic * 32768**2


def _tiny_tp_rules(lm_head: str) -> list[tuple[str, str]]:
    return [
        ("*.q_proj", "colwise"),
        ("*.k_proj", "colwise"),
        ("*.v_proj", "colwise"),
        ("*.o_proj", "rowwise"),
        ("*.gate_proj", "colwise"),
        ("*.up_proj", "colwise"),
        ("*.down_proj", "rowwise"),
        ("*embed_tokens", "rowwise"),
        ("*lm_head", lm_head),
    ]


@pytest.mark.parametrize(
    ("mesh", "lm_head", "vocab_per_rank"),
    [
        ({"dp": 1}, None, 256),
        ({"tp": 2}, "colwise_gather", 256),  # gathered for the loss: every rank holds all logits
        ({"tp": 2}, "colwise", 128),  # left split (a loss-parallel cross-entropy): half each
    ],
)
def test_loss_workspace_counts_the_logits_at_long_context(mesh, lm_head, vocab_per_rank):
    # bf16 logits: the loss's backward holds its fp32 log-softmax and two fp32 gradients,
    # more than its forward's logits, fp32 copy and log-softmax (2 + 4 + 4 bytes)
    with torch.device("meta"):
        model = Llama(ZOO)
    policy = fs.replicate() if lm_head is None else fs.tp(_tiny_tp_rules(lm_head), "tp")
    plan = fs.shard(model, fs.Mesh(**mesh), policy + fs.mixed_precision())
    batch, seq = 2, 32768
    est = fs.estimate(model, plan, batch=batch, seq=seq)
    assert est.memory["loss_workspace"] == batch * seq * vocab_per_rank * (4 + 4 + 4)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_real_forwards_grow_as_the_trace_says(attention):
    # the trace runs torch itself on fake tensors; a real CPU forward at two lengths keeps
    # exactly the bytes the trace counts (HF builds no mask for whole causal sequences,
    # as the trace assumes)
    model = hf_llama(attention).to_empty(device="cpu")
    model.train()
    for seq in (128, 512):
        tokens = torch.randint(0, HF["vocab"], (1, seq))
        real, output = fs.kept_activation_bytes(model, tokens, use_cache=False)
        del output
        assert real == kept(hf_llama(attention), seq)


class _Fp32Logits(Llama):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens).float()


def test_loss_workspace_counts_fp32_logits_by_their_elements():
    # fp32 logits from a bf16 forward: cross-entropy's upcast copies nothing; its backward's
    # fp32 log-softmax and two gradients remain; the elements, not the compute dtype, set the size
    with torch.device("meta"):
        model = _Fp32Logits(ZOO)
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate() + fs.mixed_precision())
    est = fs.estimate(model, plan, batch=1, seq=4096)
    assert est.memory["loss_workspace"] == 4096 * ZOO.vocab_size * (4 + 4 + 4)
