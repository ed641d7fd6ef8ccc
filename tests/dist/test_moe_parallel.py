"""Mixture-of-experts models under tensor parallel inside the experts and expert parallelism.

Tensor parallel follows transformers' own plan (``tp("hf", tp)``: the experts' packed
gate/up split as packed columns, down as rows, on the 3-D expert tensors; the experts'
output all-reduced). Expert parallelism (``fs.ep``) splits the expert tensors whole by
expert index and dispatches tokens with torch's autograd-aware all-to-all. Each case
trains 3 AdamW steps on 4 gloo ranks and is compared with one process training on the
whole global batch, with `test_hf_parity`'s tolerances: the first step's gradients
(router and experts included) within 1e-6 absolute plus 1e-4 relative, losses within
1e-5, parameters within 5e-4 absolute plus 1e-4 relative.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.planning.policy.types import resolve_rules

from .. import hf_cases, moe_cases, worlds

transformers = pytest.importorskip("transformers")

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
TP = tuple((family, 4, name) for family in FAMILIES for name in ("tp", "fsdp_tp"))
EP = tuple(
    (family, experts, name)
    for family in ("mixtral", "qwen3_moe")
    for experts in (4, 8)
    for name in ("ep_dp", "ep_2d")
)
# expert parallelism beside tensor parallel on the attention (tp rules that leave the experts to ep)
BESIDE = (("mixtral", 8, "ep_tp"),)
# one representative per capability: tensor parallel inside the experts (Qwen2-MoE: shared
# expert and its gate beside them, under FSDP), dispatch over a 2-D mesh (experts FSDP-sharded
# over the other data axis)
DEFAULT = (("qwen2_moe", 4, "fsdp_tp"), ("mixtral", 8, "ep_2d"))


@pytest.fixture(scope="module")
def world(world4):
    return world4


def check(world: fs.LocalWorld, cases: tuple[tuple[str, int, str], ...]) -> None:
    results = world.run(moe_cases.run_cases, tuple(("train", f, str(e), s) for f, e, s in cases))[0]
    references: dict[tuple[str, int, int], tuple[list[float], dict[str, Any], dict[str, Any]]] = {}
    for (family, experts, strategy), result in zip(cases, results, strict=True):
        key = (family, experts, result["data_parallel"])
        if key not in references:
            references[key] = moe_cases.reference(*key)
        losses, params, grads = references[key]
        label = f"{family} with {experts} experts under {strategy}"
        assert any("experts" in name for name in grads), label
        # the experts really are split: by expert index (dim 0) under ep, inside each expert under tp
        split = "Shard(dim=0)" if strategy.startswith("ep") else "_StridedShard(dim=1, sf=2)"
        gate_up = "model.layers.0.mlp.experts.gate_up_proj"
        assert split in result["placements"][gate_up], f"{label}: {result['placements'][gate_up]}"
        assert result["grads"].keys() == grads.keys(), label
        for name, value in grads.items():
            gap = (result["grads"][name] - value).abs().max().item()
            torch.testing.assert_close(
                result["grads"][name], value, atol=1e-6, rtol=1e-4, msg=f"{label}: grad of {name}: {gap}"
            )
        assert result["losses"] == pytest.approx(losses, abs=1e-5), label
        for name, value in params.items():
            gap = (result["params"][name] - value).abs().max().item()
            torch.testing.assert_close(
                result["params"][name], value, atol=5e-4, rtol=1e-4, msg=f"{label}: {name} off by {gap}"
            )


def test_moe_models_train_as_one_process_with_split_experts(world):
    """Qwen2-MoE under fsdp(dp) + tp(hf, tp) (tp = 2); Mixtral (8 experts) under
    fsdp(("dp", "ep")) + ep("ep") on Mesh(dp=2, ep=2). The slow test runs every other pair."""
    check(world, DEFAULT)


def test_a_lightning_trainer_trains_mixtral_under_expert_parallelism_as_one_process(world):
    """ShardStrategy(fsdp("dp") + ep("dp")) on Mesh(dp=4) in a real Trainer: two experts per rank,
    tokens dispatched by all-to-all inside training_step, Lightning's own backward and optimizer
    step (here, on this module's ranks; the slower Trainer cases are in test_moe_lightning)."""
    from .. import moe_lightning_cases

    results = world.run(moe_lightning_cases.fit, fs.fsdp("dp") + fs.ep("dp"), fs.Mesh(dp=4))
    moe_lightning_cases.assert_matches_one_process(results, moe_lightning_cases.reference(4))


def test_moe_plans_send_hold_and_save_what_cost_and_estimate_predict(world):
    """`test_moe_cost`'s default gloo case, run in this module's world (one world start for both)."""
    from .. import moe_cost_cases
    from .test_moe_cost import DEFAULT_GLOO, check_measured

    results = world.run(moe_cost_cases.run_cases, DEFAULT_GLOO)
    check_measured(DEFAULT_GLOO[0], [result[0] for result in results])


@pytest.mark.slow
def test_every_moe_model_under_tp_and_ep_trains_as_one_process(world):
    check(world, tuple(case for case in TP + EP + BESIDE if case not in DEFAULT))


def test_dispatch_sends_any_number_of_tokens_to_each_expert(world):
    """The dispatching forward on 4 ranks against one process: output, input and routing-weight
    gradients, and each rank's expert gradients, for random top-2 routing, every token to
    experts 0 and 1 (rank 0 receives all, three ranks none, six experts idle), and ranks with
    5, 0, 3 and 9 tokens."""
    cases = (("dispatch", "random"), ("dispatch", "skewed"), ("dispatch", "ragged"))
    for rank, results in enumerate(world.run(moe_cases.run_cases, cases)):
        for (_, routing), result in zip(cases, results, strict=True):
            for key in ("out", "x_grad", "w_grad", "gate_up_grad", "down_grad"):
                assert result[key] < 1e-6, f"{routing}, rank {rank}: {key} off by {result[key]} (relative)"


def test_expert_tensors_are_split_by_expert_and_fsdp_nests_inside():
    model = moe_cases.build("mixtral", 8)
    plan = fs.shard(model, fs.Mesh(dp=2, ep=2), fs.fsdp(("dp", "ep")) + fs.ep("ep"))
    experts = plan.params["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.storage == fs.P(("ep", "dp"), None, None)
    assert experts.compute == fs.P("ep", None, None)
    assert plan.params["model.layers.0.mlp.gate.weight"].storage == fs.P(("dp", "ep"), None)
    assert plan.config.experts.modules == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    alone = fs.shard(model, fs.Mesh(dp=4), fs.fsdp("dp") + fs.ep("dp"))
    assert alone.params["model.layers.1.mlp.experts.down_proj"].storage == fs.P("dp", None, None)
    tp = fs.shard(model, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp("hf", "tp"))
    assert tp.params["model.layers.0.mlp.experts.gate_up_proj"].compute == fs.P(None, "tp", None)
    assert tp.params["model.layers.0.mlp.experts.down_proj"].compute == fs.P(None, None, "tp")
    assert ("model.layers.0.mlp.experts", "packed_colwise", "experts") in tp.config.tp.styles


def test_experts_are_found_by_ep_plan_by_name_or_by_pattern():
    model = moe_cases.build("qwen3_moe", 4)
    assert resolve_rules(fs.ep("dp"), model).layers[0].experts == (
        "model.layers.*.mlp.experts.gate_up_proj",
        "model.layers.*.mlp.experts.down_proj",
    )
    state = {k: v for k, v in model.state_dict().items()}  # no module, no plan: by name
    assert set(resolve_rules(fs.ep("dp"), state).layers[0].experts) == {
        "model.layers.*.mlp.experts.gate_up_proj",
        "model.layers.*.mlp.experts.down_proj",
    }
    plan = fs.shard(model, fs.Mesh(dp=4), fs.fsdp("dp") + fs.ep("dp", experts="model.layers.0.*.down_proj"))
    assert plan.config.experts.modules == ("model.layers.0.mlp.experts",)
    assert plan.params["model.layers.1.mlp.experts.down_proj"].compute == fs.P(None, None, None)
    with pytest.raises(fs.PolicyError, match=re.escape("found no expert tensors")):
        fs.shard(torch.nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp("dp") + fs.ep("dp"))


def test_bad_expert_parallel_plans_are_refused_before_anything_runs():
    model = moe_cases.build("mixtral", 4)
    with pytest.raises(
        fs.PlanError, match=re.escape("4 experts (dim 0) do not split whole over axis 'dp' of size 8")
    ):
        fs.shard(model, fs.Mesh(dp=8), fs.fsdp("dp") + fs.ep("dp"))
    not_data = fs.shard(model, fs.Mesh(dp=2, ep=2), fs.fsdp("dp") + fs.ep("ep"))
    with pytest.raises(fs.PlanError, match=re.escape("'ep' is not a data-parallel axis")):
        fs.check_runnable(not_data, model)
    ddp = fs.shard(model, fs.Mesh(dp=4), fs.replicate("dp") + fs.ep("dp"))
    with pytest.raises(fs.PlanError, match=re.escape("ep('dp') with ddp")):
        fs.check_runnable(ddp, model)
    both = fs.shard(model, fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.ep("dp") + fs.tp("hf", "tp"))
    with pytest.raises(fs.PlanError, match=re.escape("split both by expert")):
        fs.check_runnable(both, model)
    with torch.device("meta"):  # split experts on the meta device run: fs.checkpoint.load_hf fills them
        meta = moe_cases.build("mixtral", 4)
    fs.check_runnable(fs.shard(meta, fs.Mesh(dp=4), fs.fsdp("dp") + fs.ep("dp")), meta)
    with worlds.alone():  # materialize cannot fill them, and says what can
        plan = fs.shard(meta, fs.Mesh(dp=1), fs.fsdp("dp") + fs.ep("dp"))
        fs.apply(plan, meta)
        with pytest.raises(
            fs.ShardingError, match=re.escape("mlp.experts: its experts are split on the meta")
        ):
            fs.materialize(plan, meta)
    sequence = fs.shard(model, fs.Mesh(tp=4), fs.tp("hf", "tp", sequence_parallel=True))
    with pytest.raises(fs.PlanError, match=re.escape("split by tensor parallel take whole activations")):
        fs.check_runnable(sequence, model)


def test_expert_parallelism_reads_and_writes_as_text():
    assert fs.parse_policy("fsdp(dp) + ep(dp)") == fs.fsdp("dp") + fs.ep("dp")
    policy = fs.fsdp(("dp", "ep")) + fs.ep("ep", experts="*.experts.*")
    assert fs.format_policy(policy) == "fsdp(dp, ep) + ep(ep, experts=('*.experts.*',))"
    assert fs.parse_policy(fs.format_policy(policy)) == policy


CHECKPOINTS = (
    ("mixtral", "8", "ep_2d>fsdp", "sharded"),
    ("mixtral", "8", "fsdp>ep_dp", "sharded"),
    ("qwen3_moe", "4", "ep_dp>ep_2d", "full"),
    ("qwen3_moe", "4", "ep_2d>fsdp", "full"),
    ("qwen2_moe", "4", "fsdp_tp>ep_dp", "full"),
    ("qwen2_moe", "4", "ep_dp>fsdp_tp", "full"),
)


@pytest.mark.slow
def test_checkpoints_move_between_expert_parallel_and_fsdp(world):
    """Saved after a step under one plan (a DCP folder or one full file), loaded under another
    into a model with another seed and its own optimizer state: every whole parameter and the
    experts' AdamW first moments equal, exactly."""
    cases = tuple(("checkpoint", *case) for case in CHECKPOINTS)
    for rank, results in enumerate(world.run(moe_cases.run_cases, cases)):
        for case, result in zip(CHECKPOINTS, results, strict=True):
            assert result["moved"] > 0, f"{case}, rank {rank}: the load changed nothing"
            assert len(result["experts"]) == 4, f"{case}, rank {rank}"
            assert result["gap"] == 0, f"{case}, rank {rank}: parameters off by {result['gap']}"
            assert result["moment_gap"] == 0, f"{case}, rank {rank}: moments off by {result['moment_gap']}"


# (family, experts, decoder layers, micro-batches, schedule, beside): pp=2 x dp=2 under
# pipeline(pp) + fsdp(dp) + ep(dp); "tp" beside: tensor parallel on the attention, pp=2 x dp=2 x tp=2
PIPELINE_DEFAULT = ("mixtral", 8, 4, 2, "1f1b", "")
PIPELINE_SLOW = (
    ("mixtral", 4, 4, 2, "gpipe", ""),
    ("mixtral", 8, 2, 2, "1f1b", ""),
    ("qwen3_moe", 8, 4, 2, "1f1b", ""),
    ("qwen2_moe", 4, 4, 2, "gpipe", ""),
    ("mixtral", 8, 4, 2, "interleaved1f1b", ""),  # two stages per rank, one layer each
)


def check_pipeline(results: list[Any], case: tuple[Any, ...]) -> None:
    """Losses, every stage's whole parameters and first gradients as one process; each experts
    module dispatched once per micro-batch on the ranks of its own stage; per-rank bytes of
    parameters, gradients and AdamW state equal ``plan.cost()``'s."""
    family, experts, layers, microbatches, schedule, beside = case
    label = f"{family} ({experts} experts, {layers} layers) under pp x ep, {schedule} {beside}"
    losses, params, grads = moe_cases.pipeline_reference(family, experts, layers, results[0]["data_parallel"])
    merged: dict[str, torch.Tensor] = {}
    merged_grads: dict[str, torch.Tensor] = {}
    for result in results:
        assert result["losses"] == pytest.approx(losses, abs=1e-5), label
        merged.update(result["params"])
        merged_grads.update(result["grads"])
    assert merged.keys() == params.keys(), label
    assert merged_grads.keys() == grads.keys(), label
    for name, value in grads.items():
        gap = (merged_grads[name] - value).abs().max().item()
        torch.testing.assert_close(
            merged_grads[name], value, atol=1e-6, rtol=1e-4, msg=f"{label}: grad of {name}: {gap}"
        )
    for name, value in params.items():
        torch.testing.assert_close(merged[name], value, atol=5e-4, rtol=1e-4, msg=f"{label}: {name}")
    model = moe_cases.build(family, experts, layers=layers)
    mesh = fs.Mesh(**moe_cases._PIPELINE_MESHES[beside])
    plan = fs.shard(model, mesh, moe_cases.pipeline_policy(microbatches, schedule, beside))
    tokens = moe_cases.MICRO_BATCH // microbatches * hf_cases.SEQ  # one micro-batch of one rank
    # A dim 0 that dp does not divide (Qwen2-MoE's shared_expert_gate, [1, 32]) leaves a rank
    # an empty local shard that FSDP2 pads in its own storage: plan.cost() counts the padded
    # row, to_local() (and AdamW's state, made like it) does not. Bytes compared when even.
    uneven = [p for p in plan.params if plan.tensors[p].ndim and plan.tensors[p].shape[0] % mesh["dp"]]
    for rank, result in enumerate(results):
        mine = [
            path
            for path in plan.config.experts.modules
            if rank in plan.ranks_of_stage(plan.stage_of(f"{path}.gate_up_proj"))
        ]
        assert sorted(result["tokens_per_call"]) == mine, f"{label}, rank {rank}"
        for path, calls in result["tokens_per_call"].items():
            assert calls == [tokens] * microbatches, f"{label}, rank {rank}, {path}: {calls}"
        assert all("Shard(dim=0)" in p for p in result["placements"].values()), label
        if uneven:
            continue
        cost = plan.cost(rank=rank)
        assert result["param_bytes"] == cost.params_bytes, f"{label}, rank {rank}"
        assert result["grad_bytes"] == cost.grads_bytes, f"{label}, rank {rank}"
        assert result["optimizer_bytes"] == cost.optimizer_bytes, f"{label}, rank {rank}"


def test_expert_parallelism_under_a_pipeline_trains_as_one_process(world):
    """pipeline("pp", microbatches=2) + fsdp("dp") + ep("dp") on Mesh(pp=2, dp=2): a 4-layer
    Mixtral with 8 experts, through fs.forward_backward with torch's 1F1B schedule."""
    case = PIPELINE_DEFAULT
    results = world.run(moe_cases.run_cases, (("pipeline", *map(str, case)),))
    check_pipeline([r[0] for r in results], case)


@pytest.mark.slow
def test_expert_parallelism_under_every_pipeline_case_trains_as_one_process(world):
    cases = tuple(("pipeline", *map(str, case)) for case in PIPELINE_SLOW)
    results = world.run(moe_cases.run_cases, cases)
    for number, case in enumerate(PIPELINE_SLOW):
        check_pipeline([r[number] for r in results], case)


@pytest.mark.slow
def test_expert_parallelism_beside_tensor_parallel_under_a_pipeline_trains_as_one_process(worlds):
    """pp=2 x dp=2 x tp=2 on 8 gloo ranks: tensor parallel on the attention, ep over dp."""
    case = ("mixtral", 8, 4, 2, "1f1b", "tp")
    results = worlds(8).run(moe_cases.run_cases, (("pipeline", *map(str, case)),))
    check_pipeline([r[0] for r in results], case)


def test_expert_tensors_under_a_pipeline_live_on_their_stage():
    model = moe_cases.build("mixtral", 8, layers=4)
    mesh = fs.Mesh(pp=2, dp=2)
    plan = fs.shard(model, mesh, moe_cases.pipeline_policy(2))
    fs.check_runnable(plan, model)  # ep under a pipeline is no longer refused
    late = "model.layers.3.mlp.experts.gate_up_proj"
    assert plan.stage_of("model.layers.0.mlp.experts.down_proj") == 0
    assert plan.stage_of(late) == 1
    assert plan.params[late].compute == fs.P("dp", None, None, on=("pp", 1))
    # the stage's two ranks hold 4 experts each; the other stage's ranks none
    shapes = [plan.local_shape(late, rank) for rank in range(4)]
    assert shapes == [(0, 0, 0), (0, 0, 0), (4, 96, 32), (4, 96, 32)]
    table = plan.explain()
    assert re.search(r"model\.layers\.\*\.mlp\.experts\.gate_up_proj ×2 +1 \(pp=1\) +8×96×32", table), table
    assert re.search(r"model\.layers\.\*\.mlp\.experts\.down_proj ×2 +0 \(pp=0\) +8×32×48", table), table

    # a stage-0 rank holds its two layers' 4 experts of 8 whole, and plan.cost() counts what it
    # holds (the gloo test compares every rank's measured bytes with plan.cost())
    def local_bytes(path: str, rank: int) -> int:
        return math.prod(plan.local_shape(path, rank)) * 4

    experts = [p for p in plan.params if ".experts." in p]
    assert sum(local_bytes(p, 0) for p in experts) == 2 * 4 * (96 * 32 + 32 * 48) * 4
    assert plan.cost(rank=0).params_bytes == sum(local_bytes(p, 0) for p in plan.params)


PIPELINE_CHECKPOINTS = (
    ("mixtral", "8", "ep_pp>fsdp", "sharded"),
    ("mixtral", "8", "fsdp>ep_pp", "sharded"),
    ("qwen3_moe", "4", "ep_pp>ep_2d", "full"),
    ("mixtral", "8", "ep_2d>ep_pp", "full"),
)


@pytest.mark.slow
def test_checkpoints_move_between_expert_parallel_pipelines_and_flat_plans(world):
    """As above, with pipeline("pp") + fsdp("dp") + ep("dp") on Mesh(pp=2, dp=2) on one side: each
    rank compares the tensors of its own stage (its layer's two expert tensors among them)."""
    cases = tuple(("checkpoint", *case) for case in PIPELINE_CHECKPOINTS)
    for rank, results in enumerate(world.run(moe_cases.run_cases, cases)):
        layer = "0" if rank < 2 else "1"  # stage 0 (embedding, layer 0) on ranks 0 and 1
        for case, result in zip(PIPELINE_CHECKPOINTS, results, strict=True):
            assert result["moved"] > 0, f"{case}, rank {rank}: the load changed nothing"
            assert {path.split(".")[2] for path in result["experts"]} == {layer}, f"{case}, rank {rank}"
            assert len(result["experts"]) == 2, f"{case}, rank {rank}"
            assert result["gap"] == 0, f"{case}, rank {rank}: parameters off by {result['gap']}"
            assert result["moment_gap"] == 0, f"{case}, rank {rank}: moments off by {result['moment_gap']}"


class _Block(torch.nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.router = torch.nn.Linear(4, experts, bias=False)
        self.experts = moe_cases._Experts(experts, 4, 2)


@settings(max_examples=40)
@given(experts=st.integers(1, 24), ep_size=st.sampled_from([1, 2, 3, 4, 8]), dp_size=st.sampled_from([1, 2]))
def test_each_ep_rank_holds_whole_experts_or_the_plan_is_refused(experts, ep_size, dp_size):
    """Under fsdp(("dp", "ep")) + ep("ep"): when ep divides the expert count every rank holds
    experts / ep whole experts (before FSDP's split of those over dp), the ranks of one ep group
    hold different ones, and the router stays FSDP-sharded over both axes; otherwise shard()
    refuses, naming the count and the axis size."""
    with torch.device("meta"):
        model = torch.nn.ModuleList([_Block(experts), _Block(experts)])
    mesh = fs.Mesh(dp=dp_size, ep=ep_size)
    policy = fs.fsdp(("dp", "ep")) + fs.ep("ep")
    if experts % ep_size:
        with pytest.raises(fs.PlanError, match=re.escape(f"{experts} experts (dim 0) do not split whole")):
            fs.shard(model, mesh, policy)
        return
    plan = fs.shard(model, mesh, policy)
    assert plan.config.experts.modules == ("0.experts", "1.experts")
    assert plan.params["0.router.weight"].compute.is_replicated
    per_rank = experts // ep_size
    for path in ("0.experts.gate_up_proj", "1.experts.down_proj"):
        assert plan.params[path].compute == fs.P("ep", None, None)
        assert plan.params[path].storage == fs.P(("ep", "dp"), None, None)
        for rank in range(mesh.size):
            shape, offset = plan.local_shape_and_offset(path, rank, spec="compute")
            assert shape[0] == per_rank
            assert offset[0] == per_rank * mesh.coords(rank)["ep"]
            assert shape[1:] == plan.tensors[path].shape[1:]
