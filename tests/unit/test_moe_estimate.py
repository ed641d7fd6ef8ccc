"""Mixture-of-experts layers in the estimate: every token visits top-k of E experts.

On fake tensors the router's choice has no values, so the trace routes deterministically
(`functional_shard.costing.trace.routing.expert_loads`: balanced by default, or one hot expert) and
runs each experts module as its implementation (grouped_mm or eager) runs it. Two proofs, on tiny Hugging Face
Mixtral, Qwen2-MoE (with its shared expert) and Qwen3-MoE configs built from their
config classes (no download):

- flops per token equal 6 x active parameters + eager attention, within 5%: active are all
  parameters but the input embedding, with k/E of each layer's expert weights (the router
  and the shared expert whole); eager attention adds 12 x layers x seq x heads x head_dim
  (the two score matmuls, forward and backward, counted over the whole matrix as eager
  attention runs it);
- activation bytes equal to what a real forward on the CPU saves for backward
  (saved_tensors_hooks), with its router forced to the same balanced assignment
  (visit j of the tokens x k goes to expert j mod E), for both experts implementations
  the trace re-enacts ("grouped_mm", transformers' default, and "eager"), and to what it
  keeps under selective checkpointing.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard.costing.trace.activations import trace_activations
from functional_shard.costing.trace.counting import Flops
from functional_shard.costing.trace.routing import expert_loads, routed_experts
from functional_shard.runtime.engines.activation_checkpointing import apply_checkpointing

from ..moe_cost_cases import traced_memory_bytes

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 2, 16
EXPERTS, TOP_K = 8, 2
SIZES = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 3,  # the trace runs one and two layers and extrapolates the third
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": TOP_K,
}


def config(family: str, attention: str = "eager", experts: str = "eager") -> object:
    extra = {"attn_implementation": attention, "experts_implementation": experts}
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=48, num_local_experts=EXPERTS, **SIZES, **extra)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=EXPERTS,
            **SIZES,
            **extra,
        )
    return transformers.Qwen3MoeConfig(
        intermediate_size=64, moe_intermediate_size=24, num_experts=EXPERTS, head_dim=8, **SIZES, **extra
    )


CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def build(family: str, device: str = "meta", **kwargs: str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(transformers, CLASSES[family])(config(family, **kwargs))


def active_parameters(model: nn.Module) -> float:
    """Parameters a token's step touches: all but the input embedding, k/E of the routed experts."""
    total = 0.0
    for path, param in model.named_parameters():
        if path.endswith("embed_tokens.weight"):
            continue
        routed = path.endswith(("experts.gate_up_proj", "experts.down_proj"))
        total += param.numel() * (TOP_K / EXPERTS if routed else 1)
    return total


def eager_attention_flops_per_token(model: nn.Module, seq: int) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 12 * c.num_hidden_layers * seq * c.num_attention_heads * head_dim


def balanced_router(
    module: nn.Module, args: object, output: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """Replace a router's top-k pick by the balanced one: visit j goes to expert j mod E."""
    logits, scores, indices = output
    tokens, top_k = indices.shape
    forced = (torch.arange(tokens * top_k) % module.num_experts).view(tokens, top_k)
    return logits, scores, forced


def saved_bytes_with_balanced_routing(family: str, experts: str = "eager") -> int:
    model = build(family, "cpu", experts=experts)
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(balanced_router)
    tokens = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    saved, _ = fs.saved_tensor_bytes(model, tokens, use_cache=False)
    return saved


def check_flops(family: str, experts: str) -> None:
    model = build(family, experts=experts)
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    trace = trace_activations(model, plan, batch=BATCH, seq=SEQ)
    per_token = trace.step_flops / (BATCH * SEQ)
    expected = 6 * active_parameters(model) + eager_attention_flops_per_token(model, SEQ)
    assert per_token == pytest.approx(expected, rel=0.05)


def check_bytes(family: str, experts: str) -> None:
    model = build(family, experts=experts)
    trace = trace_activations(model, fs.shard(model, fs.Mesh(dp=1), fs.replicate()), batch=BATCH, seq=SEQ)
    saved = saved_bytes_with_balanced_routing(family, experts)
    assert trace.activation_bytes == saved


def test_mixtral_flops_are_six_times_its_active_parameters_plus_attention():
    check_flops("mixtral", "grouped_mm")  # transformers' default experts implementation


def test_qwen2_moe_saves_what_a_balanced_real_forward_saves():
    check_bytes("qwen2_moe", "grouped_mm")


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_flops_are_six_times_the_active_parameters_plus_attention(family, experts):
    check_flops(family, experts)


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_traced_bytes_equal_a_balanced_real_forward(family, experts):
    check_bytes(family, experts)


@pytest.mark.parametrize("policy", ["selective", pytest.param("torchtitan", marks=pytest.mark.slow)])
def test_checkpointing_recomputes_grouped_experts_as_torch_does(policy):
    # transformers' grouped_mm runs torch._grouped_mm, no op a selective policy keeps: the
    # checkpointed block recomputes the experts' matmuls, which the trace runs one per expert
    meta = build("mixtral", experts="grouped_mm")
    layer = type(meta.model.layers[0])
    plan = fs.shard(meta, fs.Mesh(dp=1), fs.replicate() + fs.checkpointing(layer, policy=policy))
    trace = trace_activations(meta, plan, batch=BATCH, seq=SEQ)
    model = build("mixtral", "cpu", experts="grouped_mm")
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(balanced_router)
    apply_checkpointing(plan, model)
    tokens = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    kept, _ = fs.kept_activation_bytes(model, tokens, use_cache=False)
    assert trace.activation_bytes == kept


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 64),
    top_k=st.integers(1, 4),
    extra_experts=st.integers(0, 12),
    imbalance=st.floats(1, 8),
)
def test_expert_loads_give_each_token_top_k_experts(tokens, top_k, extra_experts, imbalance):
    experts = top_k + extra_experts
    visits = tokens * top_k
    if math.ceil(round(imbalance * visits / experts, 9)) > tokens:
        with pytest.raises(fs.ShardingError, match="experts / top-k"):
            expert_loads(tokens, top_k, experts, imbalance)
        return
    loads = expert_loads(tokens, top_k, experts, imbalance)
    assert len(loads) == experts
    assert sum(loads) == visits
    assert max(loads) <= tokens  # a token visits an expert once
    assert (
        loads[0]
        == max(loads)
        == max(math.ceil(round(imbalance * visits / experts, 9)), -(-visits // experts))
    )
    assert max(loads[1:], default=0) - min(loads[1:], default=0) <= 1  # the others share evenly
    if imbalance == 1:
        assert max(loads) - min(loads) <= 1


def grouped_experts_memory_bytes(
    experts: int, tokens: int, top_k: int, hidden: int, intermediate: int
) -> int:
    """Memory-bound bytes the trace counts for a grouped_mm Mixtral experts module's forward and backward."""
    config = transformers.MixtralConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        experts_implementation="grouped_mm",
    )
    with torch.device("meta"):
        module = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
        x = torch.empty(tokens, hidden, requires_grad=True)
        weights = torch.empty(tokens, top_k, requires_grad=True)
        chosen = torch.empty(tokens, top_k, dtype=torch.long)  # the trace routes by expert_loads
    with routed_experts([module], 1.0):
        return traced_memory_bytes(lambda: module(x, chosen, weights))


@settings(max_examples=20, deadline=None)
@given(
    tokens=st.integers(1, 24),
    top_k=st.integers(1, 3),
    experts=st.lists(st.integers(0, 6), min_size=2, max_size=2),
    hidden=st.integers(1, 16),
    intermediate=st.integers(1, 16),
)
def test_grouped_experts_move_no_memory_bound_bytes_per_expert(tokens, top_k, experts, hidden, intermediate):
    # transformers' grouped_mm runs each projection as one kernel over every expert's rows: its
    # weights and their gradient are read and written by the matmul itself, so the memory-bound work
    # around it (gather, activation, weighting, the sum of the top-k) is the same for any expert count
    few, many = (
        grouped_experts_memory_bytes(top_k + e, tokens, top_k, hidden, intermediate) for e in experts
    )
    assert few == many


@pytest.mark.parametrize(("tokens", "experts"), [(4, 2), (8, 8), (3, 5)])
def test_grouped_experts_memory_bound_bytes_match_one_expert(tokens, experts):
    assert grouped_experts_memory_bytes(experts, tokens, 2, 8, 12) == grouped_experts_memory_bytes(
        2, tokens, 2, 8, 12
    )


def indexed_write_bytes(rows: int, touched: int, width: int, write: str) -> int:
    """Memory-bound bytes the trace counts for one in-place indexed write of ``touched`` rows."""
    with torch.device("meta"):
        destination = torch.empty(rows, width)
        index, source = torch.empty(touched, dtype=torch.long), torch.empty(touched, width)
    flops = Flops()
    with flops:
        if write == "index_add_":
            destination.index_add_(0, index, source)
        elif write == "index_copy_":
            destination.index_copy_(0, index, source)
        else:
            destination.index_put_((index,), source, accumulate=write == "index_put_ accumulate")
    return flops.memory["forward"]


@settings(max_examples=30, deadline=None)
@given(
    touched=st.integers(0, 8),
    rows=st.lists(st.integers(0, 64), min_size=2, max_size=2),
    width=st.integers(1, 8),
    write=st.sampled_from(["index_add_", "index_copy_", "index_put_", "index_put_ accumulate"]),
)
def test_an_indexed_write_moves_the_rows_it_names_not_its_whole_destination(touched, rows, width, write):
    # CUDA's index_add_ (transformers' eager experts add each expert's rows into the whole output)
    # and index_put_ read the index and the source and touch only the rows named
    few, many = (indexed_write_bytes(touched + extra, touched, width, write) for extra in rows)
    assert few == many


def gather_backward_bytes(rows: int, touched: int, width: int) -> int:
    """Memory-bound bytes the trace counts for the backward of ``x[index]``."""
    with torch.device("meta"):
        x = torch.empty(rows, width, requires_grad=True)
        index = torch.empty(touched, dtype=torch.long)
    gathered = x[index]
    flops = Flops()
    with flops:
        flops.backward = True
        gathered.backward(torch.ones_like(gathered))
    return flops.memory["backward"]


@settings(max_examples=30, deadline=None)
@given(touched=st.integers(1, 8), rows=st.integers(8, 64), extra=st.integers(0, 64), width=st.integers(1, 8))
def test_the_backward_of_a_gather_writes_its_zeros_once(touched, rows, extra, width):
    # torch adds the gradient into fresh zeros in place: the whole input's gradient is written
    # once (the zeros), the rest is the touched rows, however many rows the input has
    grown = gather_backward_bytes(rows + extra, touched, width) - gather_backward_bytes(rows, touched, width)
    assert grown == extra * width * 4


@pytest.mark.parametrize(
    ("write", "moved"),
    [
        ("index_add_", 3 * 8 + 3 * 4 * 4 + 2 * 3 * 4 * 4),  # index, source; the rows read and written
        ("index_copy_", 3 * 8 + 3 * 4 * 4 + 3 * 4 * 4),  # the rows written
        ("index_put_", 3 * 8 + 3 * 4 * 4 + 3 * 4 * 4),
        ("index_put_ accumulate", 3 * 8 + 3 * 4 * 4 + 2 * 3 * 4 * 4),
    ],
)
def test_indexed_write_bytes_by_hand(write, moved):
    assert indexed_write_bytes(100, 3, 4, write) == moved


@pytest.mark.parametrize("imbalance", [0.5, 0, -1, float("nan"), float("inf"), True, "2"])
def test_an_imbalance_that_is_not_a_number_from_one_up_is_refused(imbalance):
    model = build("mixtral")
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    with pytest.raises(
        fs.ShardingError, match=re.escape(f"estimate(expert_imbalance={imbalance!r}): a finite number >= 1")
    ):
        fs.estimate(model, plan, batch=1, seq=4, expert_imbalance=imbalance)


def test_an_imbalance_beyond_experts_over_top_k_names_the_bound():
    model = build("mixtral")
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    with pytest.raises(fs.ShardingError, match=re.escape("use at most 4 (experts / top-k)")):
        fs.estimate(model, plan, batch=1, seq=4, expert_imbalance=4.5)


def test_with_every_expert_on_every_rank_imbalance_moves_no_work():
    # each token still visits top-k experts: the same rows go through the same matmuls
    model = build("qwen3_moe")
    plan = fs.shard(model, fs.Mesh(dp=4), fs.fsdp("dp"))
    balanced = fs.estimate(model, plan, batch=BATCH, seq=SEQ)
    skewed = fs.estimate(model, plan, batch=BATCH, seq=SEQ, expert_imbalance=3.0)
    assert skewed.flops == balanced.flops
    assert skewed.memory == balanced.memory


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_data_parallel_plans_of_moe_models_estimate_end_to_end(family):
    model = build(family, attention="sdpa", experts="grouped_mm")
    flops = set()
    for policy in (fs.replicate("dp"), fs.zero(1, "dp"), fs.fsdp("dp"), fs.fsdp("dp") + fs.mixed_precision()):
        plan = fs.shard(model, fs.Mesh(dp=4), policy)
        estimate = fs.estimate(model, plan, batch=BATCH, seq=SEQ, rank=3)
        assert estimate.activation_bytes > 0
        assert estimate.step_seconds > 0
        flops.add(estimate.flops)
    assert len(flops) == 1  # data parallel and mixed precision leave the work alone
    # the experts' matmuls are counted: more than the dense rest's 6 x active parameters alone
    dense = 6 * (
        active_parameters(model)
        - sum(p.numel() * TOP_K / EXPERTS for n, p in model.named_parameters() if ".experts." in n)
    )
    assert flops.pop() / (BATCH * SEQ) > dense
