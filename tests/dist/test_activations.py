"""The activation trace against what torch really keeps for backward.

`fs.trace_activations` runs a meta-device model on fake tensors. Each case builds the same
model for real, runs a real forward and counts what it keeps: `fs.kept_activation_bytes`
(storages made by the forward still alive once it returns, parameters and the output
excluded: what autograd's graph and checkpoint frames hold) and, where nothing is
checkpointed, `fs.saved_tensor_bytes` (torch.autograd.graph.saved_tensors_hooks, unique
storages): the two agree, and the trace is within 3% of them (it is exact in every case
here). Under checkpointing, saved_tensors_hooks only sees what the checkpoint frame saves
(the layer's inputs), which the kept count includes.
"""

from __future__ import annotations

import itertools
import re
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import functional_shard as fs
from functional_shard.costing.trace.activations import trace_activations
from functional_shard.costing.trace.repeats import repeated_layers
from functional_shard.runtime.engines.activation_checkpointing import apply_checkpointing
from functional_shard.zoo import Block, Llama, LlamaConfig, llama

from .. import activation_cases

TOLERANCE = 0.03
# three layers: the trace runs one and two of them and extrapolates the third
ZOO = LlamaConfig(128, 32, 64, num_layers=3, num_heads=4, num_kv_heads=2, tie_embeddings=True)
BATCH, SEQ = 2, 12


def hf_llama(device: str = "cpu", attention: str = "sdpa") -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def build(kind: str, device: str = "cpu") -> nn.Module:
    if kind == "zoo":
        torch.manual_seed(0)
        with torch.device(device):
            return Llama(ZOO)
    return hf_llama(device, attention=kind.removeprefix("hf_"))


def layer_class(model: nn.Module) -> type:
    return Block if isinstance(model, Llama) else type(model.model.layers[0])


def checkpointing(kind: str, model: nn.Module) -> fs.Policy:
    if kind == "none":
        return fs.replicate()
    return fs.replicate() + fs.checkpointing(layer_class(model), policy=kind)


def measured(model: nn.Module, plan: fs.Plan, tokens: torch.Tensor) -> tuple[int, int]:
    """(kept, saved) bytes of a real forward; checkpointing applied as fs.apply applies it."""
    apply_checkpointing(plan, model)  # the step of fs.apply that checkpoints (no process group needed)
    extra = {} if isinstance(model, Llama) else {"use_cache": False}
    kept, output = fs.kept_activation_bytes(model, tokens, **extra)
    saved, _ = fs.saved_tensor_bytes(model, tokens, **extra)
    del output
    return kept, saved


@pytest.mark.parametrize("checkpoint", ["none", "full", "selective", "torchtitan"])
@pytest.mark.parametrize("kind", ["zoo", "hf_sdpa", pytest.param("hf_eager", marks=pytest.mark.slow)])
def test_traced_bytes_equal_a_real_forward(kind, checkpoint):
    model = build(kind)
    plan = fs.shard(model, fs.Mesh(dp=1), checkpointing(checkpoint, model))
    assert plan.config.checkpoint_policy == ("full" if checkpoint == "none" else checkpoint)
    trace = trace_activations(build(kind, "meta"), plan, batch=BATCH, seq=SEQ)
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    kept, saved = measured(model, plan, tokens)
    assert trace.activation_bytes == pytest.approx(kept, rel=TOLERANCE)
    assert trace.output_bytes == BATCH * SEQ * 128 * 4
    if checkpoint == "none":
        assert kept == saved  # the kept count and saved_tensors_hooks agree where both see everything
    elif checkpoint == "full":
        assert kept >= saved  # saved_tensors_hooks sees what the checkpoint frames save: inputs
    else:
        assert kept > saved  # ...and not the matmul outputs selective checkpointing stores


def test_checkpointing_keeps_less_and_selective_sits_between():
    traces = {}
    for checkpoint in ("none", "full", "selective"):
        model = build("zoo", "meta")
        plan = fs.shard(model, fs.Mesh(dp=1), checkpointing(checkpoint, model))
        traces[checkpoint] = trace_activations(model, plan, batch=BATCH, seq=SEQ)
    assert (
        traces["full"].activation_bytes
        < traces["selective"].activation_bytes
        < traces["none"].activation_bytes
    )
    # full recomputes every layer's matmuls; selective keeps their outputs and recomputes no flops
    assert traces["none"].recompute_flops == traces["selective"].recompute_flops == 0
    assert 0 < traces["full"].recompute_flops < traces["full"].forward_flops


@pytest.mark.parametrize("checkpoint", ["none", "full"])
def test_flops_equal_flop_counter_mode_on_a_real_step(checkpoint):
    model = build("zoo")
    plan = fs.shard(model, fs.Mesh(dp=1), checkpointing(checkpoint, model))
    trace = trace_activations(build("zoo", "meta"), plan, batch=BATCH, seq=SEQ)
    apply_checkpointing(plan, model)
    tokens = torch.randint(0, 128, (BATCH, SEQ))
    # torch's FlopCounterMode has no formula for the CPU flash kernel: the real step runs
    # SDPA's math path, whose matmuls it counts (full score matrix, the trace's convention)
    with sdpa_kernel([SDPBackend.MATH]):
        with FlopCounterMode(display=False) as forward:
            output = model(tokens)
        with FlopCounterMode(display=False) as backward:
            output.sum().backward()
    assert trace.forward_flops == forward.get_total_flops()
    assert trace.backward_flops + trace.recompute_flops == backward.get_total_flops()
    assert trace.backward_flops == 2 * trace.forward_flops  # matmul backward: two matmuls per forward one


def test_mixed_precision_traces_parameters_and_activations_in_param_dtype():
    model = build("zoo", "meta")
    fp32 = trace_activations(model, fs.shard(model, fs.Mesh(dp=1), fs.replicate()), batch=BATCH, seq=SEQ)
    plan = fs.shard(model, fs.Mesh(dp=1), fs.fsdp() + fs.mixed_precision(torch.bfloat16, torch.float32))
    bf16 = trace_activations(model, plan, batch=BATCH, seq=SEQ)
    assert bf16.output_bytes * 2 == fp32.output_bytes
    # the token ids (int64) and float32 softmax statistics keep it above half
    assert fp32.activation_bytes / 2 < bf16.activation_bytes < fp32.activation_bytes


def test_repeated_layers_are_traced_twice_and_extrapolated_exactly():
    model = llama("tiny")  # 2 layers: too few to extrapolate, traced whole
    deep = Llama(LlamaConfig(num_layers=6)).to("meta")
    plan = fs.shard(deep, fs.Mesh(dp=1), fs.replicate() + fs.checkpointing(Block, policy="selective"))
    assert repeated_layers(deep, plan, dict(deep.named_parameters())) == [
        tuple(f"layers.{i}" for i in range(6))
    ]
    assert (
        repeated_layers(model, fs.shard(model, fs.Mesh(dp=1), fs.replicate()), dict(model.named_parameters()))
        == []
    )
    # a 6-layer trace equals 2 layers plus 4 times what one more layer adds, measured for real
    real = Llama(LlamaConfig(num_layers=6))
    apply_checkpointing(plan, real)
    kept, _ = fs.kept_activation_bytes(real, torch.randint(0, 256, (BATCH, SEQ)))
    assert trace_activations(deep, plan, batch=BATCH, seq=SEQ).activation_bytes == kept


class Levels(nn.Module):
    """Alike blocks that see other shapes (levels of a pyramid): they cannot stand in for each other."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(block(x[: len(x) >> level]).sum() for level, block in enumerate(self.blocks))


def test_alike_layers_that_see_other_shapes_are_all_traced():
    model = Levels()
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    assert repeated_layers(model, plan, dict(model.named_parameters())) == [
        ("blocks.0", "blocks.1", "blocks.2")
    ]
    x = torch.randn(8, 8)
    kept, _ = fs.kept_activation_bytes(model, x)
    assert trace_activations(model, plan, batch=8, seq=1, inputs=x.to("meta")).activation_bytes == kept


def test_a_70b_model_traces_in_a_few_seconds():
    model = llama("llama-70b")
    policy = fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp", sequence_parallel=True) + fs.mixed_precision()
    plan = fs.shard(model, fs.Mesh(dp=8, tp=8), policy)
    trace_activations(llama("tiny"), fs.shard(llama("tiny"), fs.Mesh(dp=1), fs.replicate()), batch=1, seq=8)
    start = time.perf_counter()
    trace = trace_activations(model, plan, batch=1, seq=4096)
    # about 2 s on a loaded 2-core machine; tracing all 80 layers takes about 30 s there
    assert time.perf_counter() - start < 10
    # 80 layers of bf16 activations at 4096 / 8 tokens per rank, outside the matmuls: tens of GiB
    assert 20 * 2**30 < trace.activation_bytes < 60 * 2**30


class TwoInputs(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.left = nn.Linear(width, width)
        self.right = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.left(x)) * self.right(y)


def test_inputs_as_a_tuple_or_keywords_trace_like_a_real_call():
    model = TwoInputs(8)
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    kept, _ = fs.kept_activation_bytes(model, x, y)
    assert kept == fs.saved_tensor_bytes(model, x, y)[0]
    meta = (x.to("meta"), y.to("meta"))
    assert trace_activations(model, plan, batch=3, seq=1, inputs=meta).activation_bytes == kept
    keywords = {"x": x.to("meta"), "y": y.to("meta")}
    assert trace_activations(model, plan, batch=3, seq=1, inputs=keywords).activation_bytes == kept


class ScaledByABuffer(nn.Module):
    """Gemma's scaled embedding: its output times a buffer, which the product saves."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_a_buffer_saved_for_backward_is_no_activation():
    # plan.cost() counts buffers; saved_tensor_bytes counted Gemma's embedding scale again
    model = ScaledByABuffer()
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    x = torch.randn(3, 8)
    kept, _ = fs.kept_activation_bytes(model, x)
    assert fs.saved_tensor_bytes(model, x)[0] == kept == 3 * 8 * 4  # the linear's input
    assert trace_activations(model, plan, batch=3, seq=1, inputs=x.to("meta")).activation_bytes == kept


def test_inputs_that_do_not_fit_the_forward_name_what_was_passed():
    model = TwoInputs(8)
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    message = "trace_activations: TwoInputs's forward failed on inputs (('torch.float32[3, 5]',"
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        trace_activations(model, plan, batch=3, seq=1, inputs=(torch.randn(3, 5), torch.randn(3, 8)))
    with pytest.raises(fs.ShardingError, match=re.escape("TwoInputs's forward failed on inputs")):
        trace_activations(model, plan, batch=3, seq=1)  # default token ids: one argument missing
    with pytest.raises(
        fs.ShardingError, match=re.escape("trace_activations(inputs=int): a tensor, a tuple of them")
    ):
        trace_activations(model, plan, batch=3, seq=1, inputs=3)


@settings(max_examples=8, deadline=None)
@given(
    widths=st.lists(st.integers(1, 24), min_size=2, max_size=5),
    batch=st.integers(1, 4),
    seq=st.integers(1, 6),
    checkpoint=st.sampled_from(["none", "full", "selective"]),
)
def test_any_mlp_traces_as_it_runs(widths, batch, seq, checkpoint):
    layers: list[nn.Module] = []
    for d_in, d_out in itertools.pairwise(widths):
        layers += [nn.Linear(d_in, d_out), nn.GELU()]
    model = nn.Sequential(nn.Sequential(*layers), nn.LayerNorm(widths[-1]))
    policy = fs.replicate()
    if checkpoint != "none":
        policy = policy + fs.checkpointing("0", policy=checkpoint)
    plan = fs.shard(model, fs.Mesh(dp=1), policy)
    x = torch.randn(batch, seq, widths[0])
    trace = trace_activations(model, plan, batch=batch, seq=seq, inputs=x.to("meta"))
    apply_checkpointing(plan, model)
    kept, _ = fs.kept_activation_bytes(model, x)
    assert trace.activation_bytes == pytest.approx(kept, rel=TOLERANCE)


# what each checkpointed case is measured against: the same plan without checkpointing
BASE = {
    "fsdp_tp_full": "fsdp_tp",
    "fsdp_tp_selective": "fsdp_tp",
    "hf_fsdp_tp_selective": "hf_fsdp_tp",
    "hf_fsdp_sp_selective": "hf_fsdp_sp",
}


def check_ranks(world, names: list[str]) -> None:
    ranks = world.run(activation_cases.measure, names)
    for rank, cases in enumerate(ranks):
        for name, result in cases.items():
            where = f"rank {rank}, {name}: {result}"
            assert result["traced_output"] == result["output"], where
            if name not in BASE:
                # saved_tensors_hooks sees everything here: the trace must match it
                assert result["traced"] == pytest.approx(result["saved"], rel=TOLERANCE), where
                continue
            # Under checkpointing only the kept count sees the saves. On real process groups it
            # also counts a few activation-sized buffers that torch's DTensor/FSDP2 runtime holds
            # past the forward without autograd saving them (kept - saved of the same plan without
            # checkpointing, identical with it): taken out, the rest is what autograd keeps.
            base = cases[BASE[name]]
            runtime = base["kept"] - base["saved"]
            assert result["traced"] == pytest.approx(result["kept"] - runtime, rel=TOLERANCE), where


def test_each_rank_traces_what_it_keeps_under_tensor_parallel_and_fsdp(world4):
    """tp under FSDP, and with selective checkpointing (measured against it); the slow test below
    runs tp alone and full checkpointing."""
    check_ranks(world4, ["fsdp_tp", "fsdp_tp_selective"])


@pytest.mark.slow
def test_each_rank_traces_what_it_keeps_under_tp_alone_and_full_checkpointing(world4):
    check_ranks(world4, ["tp", "fsdp_tp", "fsdp_tp_full"])


@pytest.mark.slow
def test_each_rank_traces_what_it_keeps_under_sequence_parallel_and_mixed_precision(world4):
    check_ranks(world4, ["tp_sp", "fsdp_tp_sp", "fsdp_tp_bf16"])


@pytest.mark.slow
def test_each_rank_of_a_hugging_face_model_traces_what_it_keeps(world4):
    pytest.importorskip("transformers")
    check_ranks(world4, ["hf_tp", "hf_fsdp_tp", "hf_fsdp_tp_selective"])


@pytest.mark.slow
def test_each_rank_of_a_hugging_face_model_traces_what_it_keeps_under_sequence_parallel(world4):
    """The residual stream split on the sequence, gathered at the attention and MLP inputs
    (tp = 4 alone, tp = 2 under FSDP, with selective checkpointing); the default suite checks
    one such case in test_hf_parity."""
    pytest.importorskip("transformers")
    check_ranks(world4, ["hf_sp", "hf_fsdp_sp", "hf_fsdp_sp_selective"])


def test_a_forward_that_fails_after_its_layers_turned_out_unpassable_is_a_sharding_error():
    # each layer adds a dim, so a left-out layer cannot hand its input on and the trace
    # falls back to running every layer; a forward that then fails for its own reason is
    # named in a ShardingError, not left as the fallback's private signal
    class Growing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).unsqueeze(1)

    class Failing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Growing() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            raise RuntimeError("this model's own failure")

    model = Failing()
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    with pytest.raises(fs.ShardingError, match="this model's own failure"):
        trace_activations(model, plan, batch=2, seq=8, inputs=torch.zeros(2, 8))


@settings(max_examples=6, deadline=None)
@given(
    heads=st.sampled_from([(4, 2), (4, 4), (2, 1)]),
    head_dim=st.sampled_from([4, 8]),
    hidden=st.integers(8, 40),
    batch=st.integers(1, 3),
    seq=st.integers(2, 10),
)
def test_a_full_recompute_rebuilds_what_checkpointing_dropped(heads, head_dim, hidden, batch, seq):
    # invariant: a fully checkpointed block's recompute (the packed storages dead once the
    # forward is over) holds what one block keeps without checkpointing beyond what it keeps
    # with it: two counts, the pack hooks' and the live storages', that must agree
    num_heads, num_kv_heads = heads

    def per_layer(checkpoint: bool) -> tuple[int, int]:
        found = []
        for layers in (2, 3):
            config = LlamaConfig(64, num_heads * head_dim, hidden, layers, num_heads, num_kv_heads)
            model = Llama(config).to("meta")
            policy = fs.replicate() + (fs.checkpointing(Block) if checkpoint else fs.Policy())
            plan = fs.shard(model, fs.Mesh(dp=1), policy)
            found.append(trace_activations(model, plan, batch=batch, seq=seq))
        return found[1].activation_bytes - found[0].activation_bytes, found[1].recompute_bytes

    whole, none_recomputed = per_layer(checkpoint=False)
    kept, recomputed = per_layer(checkpoint=True)
    assert none_recomputed == 0
    assert recomputed == whole - kept > 0


def test_selective_checkpointing_recomputes_less_than_full():
    model = llama("tiny").to("meta")
    found = {
        policy: trace_activations(
            model,
            fs.shard(model, fs.Mesh(dp=1), fs.replicate() + fs.checkpointing(Block, policy=policy)),
            batch=BATCH,
            seq=SEQ,
        ).recompute_bytes
        for policy in ("full", "selective", "torchtitan")
    }
    # torchtitan's policy recomputes every second matmul as well: more than selective holds
    assert 0 < found["selective"] < found["torchtitan"] < found["full"]


@pytest.mark.parametrize("checkpoint", ["full", "selective"])
def test_a_hugging_face_model_trains_through_checkpointing_without_use_cache(checkpoint, caplog):
    """Its forward would fill a key/value cache that the recompute then sees twice."""
    model = hf_llama()
    plan = fs.shard(model, fs.Mesh(dp=1), checkpointing(checkpoint, model))
    apply_checkpointing(plan, model)
    assert "use_cache set to False" in caplog.text
    tokens = torch.randint(0, 128, (BATCH, SEQ))
    model(input_ids=tokens).logits.sum().backward()  # no use_cache=False from the caller
    assert model.config.use_cache is False
    assert all(p.grad is not None for p in model.parameters())
