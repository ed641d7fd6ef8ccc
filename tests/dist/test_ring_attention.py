"""torch's ring attention (`fs.cp(engine="ring")`) in the cost model, the trace and the estimate.

torch's own ring functions run here with the CPU flash kernels (tests/ring_cases.py): on the
fake process group for drawn cp sizes, heads and lengths, their collectives are
`plan.cost`'s ring bytes; on 4 gloo ranks they give one SDPA's output and gradients, and a
model whose attention runs through them sends on cp what `plan.cost` says and keeps for
backward what the trace says (within 1 KiB, as the all-gather engine's trace).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.costing.time.context_engines import ring_workspace_bytes
from functional_shard.zoo import Block, Llama, LlamaConfig, llama

from .. import ring_cases


def _llama(heads: int, kv_heads: int, head_dim: int, layers: int) -> Llama:
    config = LlamaConfig(64, heads * head_dim, 16, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads)
    with torch.device("meta"):
        return Llama(config)


# ---- bytes: torch's ring functions on the fake process group ---------------------------


# fake_world joins the fake process group afresh for every example
@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cp=st.integers(2, 8),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([2, 4]),
    per_chunk=st.integers(1, 3),
    batch=st.integers(1, 2),
    layers=st.integers(1, 2),
    bf16=st.booleans(),
    checkpointing=st.sampled_from(["none", "full", "selective"]),
    data=st.data(),
)
def test_plan_cost_counts_what_torchs_ring_sends(
    fake_world, cp, kv_heads, group, head_dim, per_chunk, batch, layers, bf16, checkpointing, data
):
    heads, seq = kv_heads * group, 2 * cp * per_chunk
    model = _llama(heads, kv_heads, head_dim, layers)
    policy = fs.replicate() + fs.cp("cp", engine="ring")
    if bf16:
        policy = policy + fs.mixed_precision()
    if checkpointing != "none":
        policy = policy + fs.checkpointing(Block, policy=checkpointing)
    plan = fs.shard(model, fs.Mesh(cp=cp), policy)
    predicted = plan.cost(tokens=batch * seq).comm_bytes
    # each layer: the ring's forward (again where full checkpointing recomputes the layer;
    # selective checkpointing keeps the attention's outputs) and its backward, on this rank's
    # tokens with the key/value heads repeated to the query heads
    fake_world(cp, rank=data.draw(st.integers(0, cp - 1)))
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v = (torch.randn(batch, heads, seq // cp, head_dim, dtype=dtype) for _ in range(3))
    log = fs.measure.CollectiveLog(plan.mesh)
    with log:
        for _ in range(layers):
            for _ in range(2 if checkpointing == "full" else 1):
                out, logsumexp = ring_cases.ring_forward(dist.group.WORLD, q, k, v)
            ring_cases.ring_backward(dist.group.WORLD, torch.ones_like(out), q, k, v, out, logsumexp)
    # (n-1)/n of a sum against a sum of (n-1)/n: equal but for float rounding
    assert predicted["all_gather"]["cp"] == pytest.approx(log.sent["all_gather"]["cp"], rel=1e-12)
    assert predicted["all_to_all"]["cp"] == pytest.approx(log.sent["all_to_all"]["cp"], rel=1e-12)
    # against our engine (measured in tests/dist/test_context_parallel.py): the ring gathers the
    # keys and values in forward and again in backward where ours reduce-scatters their
    # gradients, with grouped heads repeated, and passes float32 gradients round the ring
    ours = plan.cost(tokens=batch * seq, context_engine="all_gather").comm_bytes
    if group == 1 and checkpointing == "none":
        assert predicted["all_gather"]["cp"] == pytest.approx(
            ours["all_gather"]["cp"] + ours["reduce_scatter"]["cp"], rel=1e-12
        )
    ring_total = sum(by_axes.get("cp", 0.0) for by_axes in predicted.values())
    ours_total = sum(by_axes.get("cp", 0.0) for by_axes in ours.values())
    assert ring_total > ours_total


# ---- on 4 gloo ranks -------------------------------------------------------------------


def test_torchs_ring_runs_on_cpu_ranks_as_one_sdpa_and_sends_float32_gradients(world4):
    batch, heads, seq, head_dim = 2, 2, 16, 4
    for dtype, itemsize, tolerance in (("float32", 4, 1e-5), ("bfloat16", 2, 5e-2)):
        results = world4.run(ring_cases.attention_call, (batch, heads, seq, head_dim), dtype)
        local = batch * heads * (seq // 4) * head_dim * 2  # keys and values of a rank's tokens
        for result in results:
            assert max(result["errors"]) < tolerance, result["errors"]
            # out and the gradients in the inputs' dtype, logsumexp float32
            assert result["dtypes"] == [f"torch.{dtype}", "torch.float32", *[f"torch.{dtype}"] * 3]
            # one all-gather forward, one backward, and 4 permutes of the float32 gradients
            assert result["forward"] == {"all_gather": {"cp": 3 * local * itemsize}}
            assert result["backward"] == {
                "all_gather": {"cp": 3 * local * itemsize},
                "all_to_all": {"cp": 4 * local * 4},
            }


@pytest.mark.parametrize(
    ("kind", "mesh", "policy"),
    [
        # grouped-query attention: the zoo repeats its 2 key/value heads to 4 before SDPA
        ("zoo", {"cp": 4}, "replicate(cp) + cp(cp, engine=ring)"),
        # a checkpointed layer runs the ring's forward again in backward; under selective
        # checkpointing torch's caching mode keeps the SDPA op's outputs whole, ring included
        # (the stand-in's kernel is an aten op too): no second gather
        ("zoo", {"dp": 2, "cp": 2}, "fsdp(dp, cp) + cp(cp, engine=ring) + checkpointing(Block)"),
        pytest.param(
            "zoo",
            {"cp": 4},
            "replicate(cp) + cp(cp, engine=ring) + checkpointing(Block, selective)",
            marks=pytest.mark.slow,
            id="zoo-selective",
        ),
        pytest.param(
            "hf_qwen2",
            {"cp": 4},
            "replicate(cp) + cp(cp, engine=ring)",
            marks=pytest.mark.slow,
            id="hf-qwen2",
        ),
    ],
)
def test_a_model_through_torchs_ring_sends_and_keeps_what_cost_and_trace_say(world4, kind, mesh, policy):
    for result in world4.run(ring_cases.model_step, kind, mesh, policy, 32):
        assert result["measured"] == result["predicted"]
        assert abs(result["kept"] - result["traced"]) <= 1024, result


# ---- the estimate ------------------------------------------------------------------------


def test_the_estimate_counts_the_engine_its_hardware_runs():
    model = llama("tiny")
    config, batch, seq, cp = model.config, 2, 1024, 4
    tokens = batch * seq
    flat = fs.shard(model, fs.Mesh(dp=cp), fs.fsdp("dp"))
    whole = fs.estimate(model, flat, batch=batch, seq=seq, hardware="h100")
    plan = fs.shard(model, fs.Mesh(dp=1, cp=cp), fs.fsdp(("dp", "cp")) + fs.cp("cp"))  # engine "auto"
    last = fs.estimate(model, plan, batch=batch, seq=seq, hardware="h100", rank=cp - 1)
    first = fs.estimate(model, plan, batch=batch, seq=seq, hardware="h100", rank=0)
    # on a CUDA profile "auto" is torch's ring: no gathered keys or values kept, so the last cp
    # rank keeps exactly what a cp-th of the tokens keeps without cp; on the others torch's
    # merge concatenates each layer's output, which the zoo's transpose back then copies
    assert last.memory["activations"] == whole.memory["activations"] / cp
    head_dim = config.hidden_size // config.num_heads
    output = batch * config.num_heads * (seq // cp) * head_dim * 4
    assert first.memory["activations"] == last.memory["activations"] + config.num_layers * output
    assert first.flops == pytest.approx(whole.flops / cp, rel=1e-6)  # a cp-th of the queries, all keys
    assert first.context_engine == "ring"
    assert "context parallel 4: attention by torch's ring attention" in first.explain()
    assert first.to_dict()["context_engine"] == "ring"
    assert "all_to_all over cp (intra)" in first.comm_seconds
    assert first.cost.comm_bytes == plan.cost(tokens=tokens, rank=0, context_engine="ring").comm_bytes
    # its backward's buffers (all the keys and values, float32 gradients) outgrow this tiny
    # vocabulary's loss workspace, which is freed before them: the peak rises by the difference
    workspace = ring_workspace_bytes(plan, tokens)
    assert workspace > first.memory["loss_workspace"]
    assert first.memory["ring_workspace"] == workspace - first.memory["loss_workspace"]
    # a profile without CUDA runs our all-gather engine: what plan.cost counts for "auto"
    cpu = fs.estimate(model, plan, batch=batch, seq=seq, hardware=fs.hardware("h100").replace(cuda=False))
    assert cpu.context_engine == "all_gather"
    assert "ring_workspace" not in cpu.memory
    assert cpu.cost.comm_bytes == plan.cost(tokens=tokens, rank=0).comm_bytes
    assert cpu.memory["activations"] > first.memory["activations"]  # the gathered keys and values
    # an engine named in the plan is counted on any hardware
    named = fs.shard(model, plan.mesh, fs.fsdp(("dp", "cp")) + fs.cp("cp", engine="all_gather"))
    assert fs.estimate(model, named, batch=batch, seq=seq, hardware="h100").context_engine == "all_gather"
    with pytest.raises(fs.ShardingError, match=r"cost\(context_engine='ringg'\): one of 'auto', 'ring'"):
        plan.cost(tokens=tokens, context_engine="ringg")


def test_the_rings_collectives_hide_under_its_own_attention_chunks_only():
    model = llama("tiny")
    batch, seq, cp = 2, 1024, 4
    plan = fs.shard(model, fs.Mesh(dp=1, cp=cp), fs.fsdp(("dp", "cp")) + fs.cp("cp", engine="ring"))
    h100 = fs.hardware("h100")
    found = fs.estimate(model, plan, batch=batch, seq=seq, hardware=h100)
    exposed = found.exposed_seconds["context parallel ring not overlapped"]
    sent = found.cost.comm_bytes
    bandwidth = h100.bandwidth(plan.mesh, ("cp",))
    # each layer's last gradient permute waits after every chunk's attention: never hidden;
    # the rest hides at most under the attention op's own chunks, never under the whole step
    last_permutes = sent["all_to_all"]["cp"] / cp / bandwidth
    everything = sum(by_axes.get("cp", 0.0) for by_axes in sent.values()) / bandwidth
    assert last_permutes <= exposed <= everything
    slower = h100.replace(intra_node_bandwidth=h100.intra_node_bandwidth / 100)
    slow = fs.estimate(model, plan, batch=batch, seq=seq, hardware=slower)
    assert slow.exposed_seconds["context parallel ring not overlapped"] > 100 * last_permutes
    # hardware that does not overlap (gloo on CPUs) exposes every byte
    serial = fs.estimate(
        model, plan, batch=batch, seq=seq, hardware=h100.replace(overlap_communication=False)
    )
    assert "context parallel ring not overlapped" not in serial.exposed_seconds
    assert serial.exposed_seconds["communication (no overlap)"] >= everything
