"""Every rank of every plan can be estimated, uneven splits included.

Under tensor parallel a dim the tp size does not divide splits as torch.chunk does (251 over
2 is 126 + 125): trailing ranks hold less, and the trace must run each rank at the shapes
torch gives it there. Two things about a zoo Llama's trace can be computed from the plan
alone: the logits are gathered to the whole vocabulary on every rank, and each Linear does
2·tokens·(its local weight's numel) flops forward and twice that backward. What is left of
the traced flops (attention, split evenly by whole heads) is then the same on every rank of
a tensor-parallel group, whatever the matmul shapes there are. On real gloo ranks (slow),
the trace of each rank equals what torch saves there, for a vocabulary of 251 over tp=2
(plain, sequence parallel, an embedding split over its features, and HF Phi-3, whose fused
projections gather their output and slice the next layer's input).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard.costing.trace.activations import trace_activations
from functional_shard.zoo import Llama, LlamaConfig

from ..strategies import uneven_llama_plans


def linear_flops(model: nn.Module, plan: fs.Plan, rank: int, tokens: int) -> int:
    """2·tokens·numel of each Linear's weight at its compute shape on ``rank``."""
    total = 0
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            shape = plan.local_shape(plan.canonical(f"{path}.weight"), rank, "compute")
            total += 2 * tokens * math.prod(shape)
    return total


def check_every_rank(model: nn.Module, plan: fs.Plan, batch: int, seq: int) -> None:
    vocab = model.lm_head.out_features
    rest: dict[tuple[int, ...], set[tuple[int, int]]] = {}
    for rank in range(plan.mesh.size):
        estimate = fs.estimate(model, plan, batch=batch, seq=seq, rank=rank)
        trace = trace_activations(model, plan, batch=batch, seq=seq, rank=rank, cuda=True)  # h100's kernels
        assert estimate.activation_bytes == trace.activation_bytes > 0
        assert trace.output_bytes == batch * seq * vocab * 4, f"rank {rank}: logits not gathered whole"
        matmuls = linear_flops(model, plan, rank, batch * seq)
        attention = (trace.forward_flops - matmuls, trace.backward_flops - 2 * matmuls)
        assert min(attention) >= 0, f"rank {rank}: fewer flops than its own Linear layers do"
        group = tuple(c for axis, c in plan.mesh.coords(rank).items() if axis != "tp")
        rest.setdefault(group, set()).add(attention)
    for group, seen in rest.items():
        assert len(seen) == 1, f"tensor-parallel group {group}: attention flops differ by rank: {seen}"


@settings(max_examples=4, deadline=None)
@given(drawn=uneven_llama_plans(), batch=st.integers(1, 2), seq_per_rank=st.integers(1, 3))
def test_every_rank_of_an_uneven_plan_traces_at_its_own_shapes(drawn, batch, seq_per_rank):
    model, plan = drawn
    tp = plan.mesh["tp"]
    check_every_rank(model, plan, batch, seq_per_rank * tp)  # sequence parallel splits the sequence evenly


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(drawn=uneven_llama_plans(), batch=st.integers(1, 3), seq_per_rank=st.integers(1, 4))
def test_every_rank_of_many_uneven_plans_traces_at_its_own_shapes(drawn, batch, seq_per_rank):
    model, plan = drawn
    check_every_rank(model, plan, batch, seq_per_rank * plan.mesh["tp"])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocabulary_251_over_two_ranks_estimates_on_both(sequence_parallel):
    # the case: rank 1 holds 125 of 251 rows and its gathered logits are still 251 wide
    config = LlamaConfig(vocab_size=251, hidden_size=32, intermediate_size=75, num_heads=4, num_kv_heads=2)
    with torch.device("meta"):
        model = Llama(config)
    policy = fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp", sequence_parallel=sequence_parallel)
    plan = fs.shard(model, fs.Mesh(dp=2, tp=2), policy)
    assert plan.local_shape("lm_head.weight", 1, "compute") == (125, 32)
    check_every_rank(model, plan, batch=2, seq=8)


def test_a_split_input_is_sliced_to_the_rank_s_features():
    # Phi-3's fused projections gather their output; the next layer slices its whole input
    pytest.importorskip("transformers")
    model = phi3("meta", intermediate_size=37)
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp("hf", "tp"))
    assert ("model.layers.0.mlp.down_proj", "rowwise_split_input", "linear") in plan.config.tp.styles
    assert plan.local_shape("model.layers.0.mlp.down_proj.weight", 1, "compute") == (32, 18)
    flops = []
    for rank in range(2):
        trace = trace_activations(model, plan, batch=2, seq=8, rank=rank)
        assert trace.output_bytes == 2 * 8 * 251 * 4
        flops.append(trace.forward_flops - linear_flops(model, plan, rank, 2 * 8))
    assert flops[0] == flops[1] >= 0


# apply refuses a rowwise Linear over uneven in-features (RowwiseParallel assumes even
# shards), so the MLP width is even here; the vocabulary is not
UNEVEN = LlamaConfig(vocab_size=251, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2)


def phi3(device: str, intermediate_size: int = 48) -> nn.Module:
    """A tiny Hugging Face Phi-3 (fused qkv and gate_up projections: colwise_gather, then
    rowwise_split_input in transformers' tp plan), vocabulary 251, seed 0."""
    import transformers

    config = transformers.Phi3Config(
        vocab_size=251,
        hidden_size=32,
        intermediate_size=intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        eos_token_id=0,
        bos_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.Phi3ForCausalLM(config)


def measure_uneven(case: str) -> dict[str, int]:
    """On a real rank of tp=2 (spawnable): traced and saved activation bytes, traced and real logits bytes."""
    import torch.distributed as dist

    if case == "phi3":
        model, meta, policy, extra = phi3("cpu"), phi3("meta"), fs.tp("hf", "tp"), {"use_cache": False}
    else:
        torch.manual_seed(0)
        model, meta = Llama(UNEVEN), Llama(UNEVEN).to("meta")
        rules = fs.rules.llama
        if case.startswith("embedding_colwise"):  # the embedding split over its features instead
            rules = fs.Rules([("*embed_tokens", "colwise"), *((r.pattern, r.target) for r in rules.rules)])
        policy, extra = fs.tp(rules, "tp", sequence_parallel=case.endswith("sp")), {}
    plan = fs.shard(model, fs.Mesh(tp=2), policy)
    trace = trace_activations(meta, plan, batch=2, seq=12, rank=dist.get_rank())
    fs.apply(plan, model)
    tokens = torch.randint(0, 251, (2, 12), generator=torch.Generator().manual_seed(1))
    saved, output = fs.saved_tensor_bytes(model, tokens, **extra)
    logits = getattr(output, "logits", output)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {
        "traced": trace.activation_bytes,
        "saved": saved,
        "traced_output": trace.output_bytes,
        "output": logits.numel() * logits.element_size(),
    }


@pytest.mark.slow
def test_an_uneven_rank_traces_what_torch_saves_there(worlds):
    pytest.importorskip("transformers")
    for case in ("tp", "sp", "embedding_colwise", "embedding_colwise_sp", "phi3"):
        ranks = worlds(2).run(measure_uneven, case)
        for rank, result in enumerate(ranks):
            where = (case, rank, result)
            assert result["traced_output"] == result["output"] == 2 * 12 * 251 * 4, where
            assert result["traced"] == pytest.approx(result["saved"], rel=0.03), where
