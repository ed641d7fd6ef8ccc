"""fs.estimate: memory pieces equal the exact cost model, the peak adds activations and the
loss workspace, and step time follows the stated overlap rules."""

from __future__ import annotations

import functools
import importlib
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.costing.time.kernel_time import optimizer_bytes
from functional_shard.costing.time.step_model import (
    gathered_in_flight,
    recomputed_collectives,
    unit_gathered_bytes,
)
from functional_shard.planning.tp import rules
from functional_shard.zoo import Block, Llama, LlamaConfig, llama

_TRACED: dict = {}


@pytest.fixture(autouse=True)
def _tracer(monkeypatch):
    # the plans below are built once, so a trace is reused by every test that asks again
    module = importlib.import_module("functional_shard.costing.estimate.estimate")
    trace = module._trace

    def remembered(model, plan, *, batch, seq, rank=None, inputs=None, **options):
        if inputs is not None or options:
            return trace(model, plan, batch=batch, seq=seq, rank=rank, inputs=inputs, **options)
        key = (id(model), id(plan), batch, seq, rank)
        if key not in _TRACED:
            _TRACED[key] = (model, plan, trace(model, plan, batch=batch, seq=seq, rank=rank, inputs=inputs))
        return _TRACED[key][2]

    monkeypatch.setattr(module, "_trace", remembered)


@functools.cache
def _plans():
    model = llama("tiny")
    return model, {
        "ddp": fs.shard(model, fs.Mesh(dp=4), fs.replicate("dp")),
        "zero1": fs.shard(model, fs.Mesh(dp=4), fs.zero(1, "dp")),
        "zero2": fs.shard(model, fs.Mesh(dp=4), fs.zero(2, "dp") + fs.mixed_precision()),
        "fsdp": fs.shard(model, fs.Mesh(dp=4), fs.fsdp("dp") + fs.mixed_precision()),
        "fsdp+tp": fs.shard(model, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp(rules.llama, "tp")),
        "offload": fs.shard(model, fs.Mesh(dp=4), fs.fsdp("dp") + fs.offload()),
    }


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "fsdp", "fsdp+tp", "offload"])
def test_memory_pieces_are_the_cost_models(name):
    model, plans = _plans()
    plan = plans[name]
    for rank in (0, plan.mesh.size - 1):
        est = fs.estimate(model, plan, batch=2, seq=16, rank=rank)
        exact = plan.cost("adamw", rank=rank)
        assert est.memory["params"] == exact.params_bytes
        # no gradient is made yet at the start of backward; every one at the end (where the
        # optimizer step holds more, what it adds is beyond one of the two)
        assert est.cost.grads_bytes == exact.grads_bytes
        assert est.memory["grads"] in (0, exact.grads_bytes)
        if est.peak_at.startswith("the start of backward"):
            assert est.memory["grads"] == 0
        if est.peak_at.startswith("the end of backward"):
            assert est.memory["grads"] == exact.grads_bytes
            assert est.memory["activations"] == 0  # backward freed them
        assert est.memory["optimizer"] == exact.optimizer_bytes
        assert est.memory["buffers"] == exact.buffers_bytes
        assert est.host_bytes == exact.host_bytes
        assert est.peak_bytes == sum(est.memory.values())
        assert est.activation_bytes == (est.activations or est.memory["activations"]) > 0


def test_gathered_units_agree_with_the_cost_model_and_add_the_prefetched_one():
    _model, plans = _plans()
    for name in ("fsdp", "zero2", "fsdp+tp"):
        plan = plans[name]
        units = unit_gathered_bytes(plan)
        root = units.pop("", 0)
        if plan.config.fsdp.reshard_after_forward:
            assert root + max(units.values()) == plan.cost().gathered_bytes
            second = sorted(units.values())[-2]
            assert gathered_in_flight(plan) == plan.cost().gathered_bytes + second
        else:
            assert gathered_in_flight(plan) == plan.cost().gathered_bytes == root + sum(units.values())
    assert gathered_in_flight(plans["ddp"]) == 0


def test_a_peak_at_the_end_of_backward_holds_the_states_and_gathered_units_alone():
    # SGD steps in place: with gradients larger than what the forward keeps, the peak is the
    # end of backward, every gradient made and every activation freed
    model = llama("tiny")
    plan = fs.shard(model, fs.Mesh(dp=1), fs.fsdp("dp"))
    est = fs.estimate(model, plan, batch=1, seq=4, optimizer="sgd")
    assert est.peak_at == "the end of backward, every gradient made"
    held = est.cost.params_bytes + est.cost.grads_bytes + est.cost.optimizer_bytes + est.cost.buffers_bytes
    assert est.peak_bytes == held + est.memory["gathered"]
    assert est.memory["activations"] == est.memory["loss_workspace"] == 0
    assert est.activation_bytes > 0  # what the forward kept, as at any other peak


def test_a_short_sequence_peaks_in_the_optimizer_step():
    # foreach AdamW's step holds every gradient and one _foreach_sqrt temporary per
    # parameter, half its state, once backward freed the activations and the loss's workspace
    # (measured: bench/data/h200/memory-llama-1b_4k_full.json.gz, tests/unit/test_gpu_truth.py)
    model = llama("tiny")
    plan = fs.shard(model, fs.Mesh(dp=1), fs.fsdp("dp") + fs.mixed_precision())
    est = fs.estimate(model, plan, batch=1, seq=2)
    held = est.cost.params_bytes + est.cost.grads_bytes + est.cost.optimizer_bytes + est.cost.buffers_bytes
    assert est.peak_at == "the optimizer step, every gradient made"
    assert est.peak_bytes == held + est.cost.optimizer_bytes // 2
    assert est.memory["activations"] == est.activation_bytes > 0  # the parts keep their sizes
    sgd = fs.estimate(model, plan, batch=1, seq=2, optimizer="sgd")  # steps in place
    assert "optimizer_step" not in sgd.memory
    assert not sgd.peak_at.startswith("the optimizer step")
    longer = fs.estimate(model, plan, batch=8, seq=64)
    assert "optimizer_step" not in longer.memory


def test_loss_workspace_is_the_loss_backwards_three_fp32_tensors():
    # bf16 logits: the forward holds them, the fp32 copy and the log-softmax (2 + 4 + 4
    # bytes each); the backward, the logits gone, the log-softmax and two fp32 gradients
    # (12): the larger (measured in tests/dist/test_loss_workspace.py)
    model, plans = _plans()
    est = fs.estimate(model, plans["fsdp"], batch=2, seq=16)
    logits = 2 * 16 * 256
    assert est.memory["loss_workspace"] == 3 * logits * 4


def test_step_time_is_compute_plus_exposed_communication():
    model, plans = _plans()
    for plan in plans.values():
        est = fs.estimate(model, plan, batch=2, seq=16, hardware="a100")
        assert est.step_seconds == pytest.approx(est.compute_seconds + sum(est.exposed_seconds.values()))
        if est.compute_parts:  # bf16 on a profile with kernel rates: by kernel kind
            assert est.compute_seconds == pytest.approx(sum(est.compute_parts.values()))
        else:
            assert est.compute_seconds == pytest.approx(
                est.flops / fs.hardware("a100").achievable_flops(est.dtype)
            )
        assert 0 < est.mfu < 1
        tp = plan.mesh.shape.get("tp", 1)
        assert est.tokens_per_second == pytest.approx(2 * 16 / tp / est.step_seconds)


def test_tensor_parallel_collectives_are_on_the_critical_path():
    model, plans = _plans()
    est = fs.estimate(model, plans["fsdp+tp"], batch=2, seq=16)
    tp_seconds = sum(s for what, s in est.comm_seconds.items() if " over tp " in what)
    assert tp_seconds > 0
    assert est.exposed_seconds["tensor parallel"] == pytest.approx(tp_seconds)


def test_ddp_all_reduce_hides_under_backward_until_it_is_longer():
    model, plans = _plans()
    plan = plans["ddp"]
    slow_link = fs.hardware("h100").replace(intra_node_bandwidth=1e6)
    fast_link = fs.hardware("h100").replace(intra_node_bandwidth=1e15)
    assert (
        "grad all-reduce" not in fs.estimate(model, plan, batch=2, seq=16, hardware=fast_link).exposed_seconds
    )
    est = fs.estimate(model, plan, batch=2, seq=16, hardware=slow_link)
    backward = est.compute_seconds * 2 / 3  # stand-in and real traces: backward is 2x forward
    all_reduce = sum(est.comm_seconds.values())
    assert est.exposed_seconds["grad all-reduce"] == pytest.approx(all_reduce - backward, rel=0.05)


def test_fsdp_exposes_the_first_gather_and_what_compute_cannot_hide():
    model, plans = _plans()
    plan = plans["fsdp"]
    fast = fs.estimate(
        model, plan, batch=2, seq=16, hardware=fs.hardware("h100").replace(intra_node_bandwidth=1e15)
    )
    assert set(fast.exposed_seconds) == {"first all-gather", "optimizer step"}
    exact = plan.cost("adamw")
    if fast.compute_parts:  # foreach AdamW's passes at the measured bandwidth
        moved = optimizer_bytes(exact.params_bytes, "adamw") / fs.hardware("h100").kernel_rates.bandwidth
    else:
        moved = (2 * exact.params_bytes + exact.grads_bytes + 2 * exact.optimizer_bytes) / 3.35e12
    assert fast.exposed_seconds["optimizer step"] == pytest.approx(moved)
    slow = fs.estimate(
        model, plan, batch=2, seq=16, hardware=fs.hardware("h100").replace(intra_node_bandwidth=1e6)
    )
    assert slow.exposed_seconds["fsdp not overlapped"] > 0
    assert slow.step_seconds > fast.step_seconds


def test_checkpointing_trades_memory_for_compute():
    model = llama("tiny")
    mesh, policy = fs.Mesh(dp=4), fs.fsdp("dp") + fs.mixed_precision()
    plain = fs.estimate(model, fs.shard(model, mesh, policy), batch=2, seq=16)
    recompute = fs.estimate(model, fs.shard(model, mesh, policy + fs.checkpointing(Block)), batch=2, seq=16)
    assert recompute.activation_bytes < plain.activation_bytes
    assert recompute.flops > plain.flops
    assert recompute.model_flops == pytest.approx(plain.model_flops)


def test_offload_moves_bytes_to_the_host_and_costs_transfer_time():
    model, plans = _plans()
    est = fs.estimate(model, plans["offload"], batch=2, seq=16)
    assert est.host_bytes > 0
    assert est.memory["optimizer"] == 0
    assert est.exposed_seconds["host transfers"] == pytest.approx(2 * est.host_bytes / 64e9)


def test_explain_names_every_part():
    model, plans = _plans()
    text = str(fs.estimate(model, plans["fsdp+tp"], batch=2, seq=16))
    for word in (
        "peak memory",
        "activations",
        "loss_workspace",
        "gathered",
        "tensor parallel",
        "MFU",
        "tokens/s",
    ):
        assert word in text
    assert fs.estimate(model, plans["fsdp"], batch=2, seq=16).to_dict()["peak_bytes"] > 0


def test_bad_input_is_a_sharding_error():
    model, plans = _plans()
    with pytest.raises(fs.ShardingError, match=re.escape("unknown hardware 'tpu9'")):
        fs.estimate(model, plans["ddp"], batch=2, seq=16, hardware="tpu9")
    with pytest.raises(fs.ShardingError, match=re.escape("estimate(batch=0): a positive int")):
        fs.estimate(model, plans["ddp"], batch=0, seq=16)
    with pytest.raises(
        fs.ShardingError, match=re.escape("hardware 'b200' has no FLOP/s for dtype 'float32'")
    ):
        fs.estimate(model, plans["ddp"], batch=2, seq=16, hardware="b200")


def test_inputs_that_do_not_fit_the_model_are_a_sharding_error():
    model, plans = _plans()
    bad = torch.zeros(2, 16, 3, device="meta")  # floats where the embedding wants token ids
    with pytest.raises(fs.ShardingError, match=re.escape("Llama's forward failed on inputs")):
        fs.estimate(model, plans["fsdp"], batch=2, seq=16, inputs=bad)
    with pytest.raises(fs.ShardingError, match=re.escape("got an unexpected keyword argument 'ids'")):
        fs.estimate(model, plans["fsdp"], batch=2, seq=16, inputs={"ids": bad})
    with pytest.raises(fs.ShardingError, match=re.escape("rank 7 is outside Mesh(dp=4)")):
        fs.estimate(model, plans["fsdp"], batch=2, seq=16, rank=7)


def test_a_plan_the_model_cannot_run_is_refused_before_tracing_naming_the_module():
    model, _ = _plans()  # 2 key/value heads: 4 tensor-parallel ranks would split them
    plan = fs.shard(model, fs.Mesh(tp=4), fs.tp(rules.llama, "tp"))
    heads = r"layers.0.self_attn.k_proj: its 2 attention heads .* do not split over 4"
    with pytest.raises(fs.PlanError, match=heads):
        fs.estimate(model, plan, batch=2, seq=16)
    with pytest.raises(fs.PlanError, match=heads):
        fs.check_runnable(plan, model)  # the runtime asks the same question
    piped = fs.shard(model, fs.Mesh(pp=2, tp=4), fs.pipeline("pp", microbatches=2) + fs.tp(rules.llama, "tp"))
    with pytest.raises(fs.PlanError, match=heads):
        fs.compare_schedules(model, piped, batch=2, seq=16)  # its trace is estimate's
    # a forward that fails for another reason under tensor parallel still says where to look
    fits = fs.shard(model, fs.Mesh(tp=2), fs.tp(rules.llama, "tp"))
    bad = torch.zeros(2, 16, 3, device="meta")
    with pytest.raises(fs.ShardingError, match=re.escape("fs.check_runnable(plan, model) names it")):
        fs.estimate(model, fits, batch=2, seq=16, inputs=bad)
    # a plan without tensor parallel has nothing to split: the message stays about inputs
    with pytest.raises(fs.ShardingError) as refused:
        fs.estimate(model, _plans()[1]["fsdp"], batch=2, seq=16, inputs=bad)
    assert "check_runnable" not in str(refused.value)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")
def test_a_model_with_fewer_features_than_heads_is_refused_by_its_forward_not_a_division():
    # hidden 2 over 4 heads: head_dim 0, no heads to count for the tensor-parallel check
    with torch.device("meta"):
        model = Llama(LlamaConfig(hidden_size=2, num_heads=4, num_kv_heads=2))
    plan = fs.shard(model, fs.Mesh(tp=2), fs.tp(rules.llama, "tp"))
    with pytest.raises(fs.ShardingError, match=re.escape("Llama's forward failed on inputs")):
        fs.estimate(model, plan, batch=1, seq=4)


@pytest.mark.parametrize("text", ["80 parsecs", "GiB", "-1GiB", "", "1e3GB"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(fs.ShardingError, match=re.escape(f"memory size {text!r}")):
        fs.parse_bytes(text)


@given(
    st.integers(1, 10**6), st.sampled_from(["B", "kB", "MB", "GB", "KiB", "MiB", "GiB", "TiB"]), st.booleans()
)
def test_parse_bytes_reads_decimal_and_binary_units(n, unit, space):
    scale = {
        "B": 1,
        "kB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KiB": 2**10,
        "MiB": 2**20,
        "GiB": 2**30,
        "TiB": 2**40,
    }
    assert fs.parse_bytes(f"{n}{' ' if space else ''}{unit}") == n * scale[unit]
    assert fs.parse_bytes(n) == n


def test_recomputation_reissues_the_forward_tensor_parallel_collectives():
    model, plans = _plans()
    mesh, policy = fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp(rules.llama, "tp", sequence_parallel=True)
    checkpointed = fs.shard(model, mesh, policy + fs.checkpointing(Block))
    est = fs.estimate(model, checkpointed, batch=2, seq=16)
    again = {what: s for what, s in est.comm_seconds.items() if what.endswith("recompute)")}
    assert set(again) == {
        "all_gather over tp (intra, recompute)",
        "reduce_scatter over tp (intra, recompute)",
    }
    assert est.exposed_seconds["tensor parallel recompute"] == pytest.approx(sum(again.values()))
    # under sequence parallelism the attention and the MLP of a block gather their input once
    # (for the colwise Linears inside) and every rowwise Linear reduce-scatters its output in
    # forward: one of the two collectives of each, half its bytes
    blocks = {}
    for path, style, _ in checkpointed.config.tp.styles:
        if path.startswith("layers.") and style in ("colwise", "rowwise"):
            weight = checkpointed.tensors[f"{path}.weight"]
            features = weight.shape[1] if style == "colwise" else weight.shape[0]
            key = path.rpartition(".")[0] if style == "colwise" else path
            blocks[key] = features * 2 * 16 * 4 / 2  # (n - 1) / n of a fp32 (32, features) tensor
    sent = recomputed_collectives(checkpointed, checkpointed.config.checkpointed, tokens=32)
    assert sum(sent.values()) == pytest.approx(sum(blocks.values()))
    assert est.step_seconds > fs.estimate(model, fs.shard(model, mesh, policy), batch=2, seq=16).step_seconds
    for plain in (plans["fsdp+tp"], fs.shard(model, fs.Mesh(dp=4), fs.fsdp("dp") + fs.checkpointing(Block))):
        assert "tensor parallel recompute" not in fs.estimate(model, plain, batch=2, seq=16).exposed_seconds


class _Tabled(torch.nn.Module):
    """An embedding and a linear layer, beside an int64 table read in forward (always frozen)."""

    def __init__(self, table: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 64)
        self.lin = torch.nn.Linear(64, 64, bias=False)
        if table:
            self.table = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.int64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(self.emb(x))
        return out + self.table[0].float() if hasattr(self, "table") else out


def test_an_integer_parameter_is_traced_frozen_and_counted_without_optimizer_state():
    # before: torch's raw "Only Tensors of floating point and complex dtype can require gradients"
    # from the trace's fake parameters
    def estimated(table: bool) -> fs.Estimate:
        model = _Tabled(table)
        return fs.estimate(
            model, fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp")), batch=2, seq=8, hardware="h100"
        )

    with_table, plain = estimated(True), estimated(False)
    assert with_table.memory["params"] == plain.memory["params"] + 64 * 64 * 8 // 2
    assert with_table.memory["optimizer"] == plain.memory["optimizer"]


def test_local_hardware_is_measured_on_as_many_processes_as_the_plan_has_devices(local_measured_on):
    # before: on 4 processes, whatever the plan's mesh
    model = _plans()[0]
    fs.estimate(model, fs.shard(model, fs.Mesh(dp=2), fs.replicate("dp")), batch=2, seq=16, hardware="local")
    assert local_measured_on == [2]


def test_frozen_weights_make_no_weight_gradients_in_the_traced_compute():
    """A frozen linear (requires_grad=False, LoRA's base weights) runs its forward and its input's
    gradient, not its weight's: 2 x tokens x weight elements fewer flops, as torch's autograd skips."""

    def estimate(frozen: bool) -> fs.Estimate:
        model = llama("tiny")
        for name, param in model.named_parameters():
            param.requires_grad_(not (frozen and ".mlp." in name))
        return fs.estimate(
            model, fs.shard(model, fs.Mesh(dp=1), fs.fsdp("dp")), batch=2, seq=64, hardware="h100"
        )

    frozen = [p for name, p in llama("tiny").named_parameters() if ".mlp." in name]
    skipped = sum(2 * 2 * 64 * p.numel() for p in frozen)
    assert skipped > 0
    assert estimate(False).flops - estimate(True).flops == skipped


def test_frozen_blocks_are_gathered_but_copy_nothing_into_a_reduce_scatter():
    """FSDP2 reduce-scatters the gradients there are: a unit of frozen weights (LoRA's base) is
    gathered in forward and again in backward, and its copies into a reduce-scatter's input and
    back into the shard (1 + 1 + 2 / 2 of its fp32 bytes on dp=2) are not in the step."""
    from functional_shard.costing.time.kernel_time import fsdp_copy_bytes
    from functional_shard.costing.time.step_model import unit_gathered_bytes

    def plan(frozen: bool) -> fs.Plan:
        model = llama("tiny")
        for name, param in model.named_parameters():
            param.requires_grad_(not (frozen and name.startswith("layers.")))
        return fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp"))

    units = unit_gathered_bytes(plan(False))
    blocks = sum(nbytes for unit, nbytes in units.items() if unit)
    trained, frozen = (fsdp_copy_bytes(plan(frozen), units) for frozen in (False, True))
    assert frozen["forward"] == trained["forward"]
    assert trained["backward"] - frozen["backward"] == pytest.approx(3 * blocks)
