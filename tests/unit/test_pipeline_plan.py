"""Pipeline stages in the plan's data model: specs placed on a pp coordinate, layout, JSON,
diff, explain, cost per rank and per stage, HF pipeline plans, policy text and the CLI."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard import zoo
from functional_shard.cli import main
from functional_shard.core.layout import local_numel
from functional_shard.core.spec import Owned, ParamSharding, spec_from_json, without_axis

from ..strategies import pipelined_llamas, staged_mesh_shape_spec

# ---- the spec vocabulary -----------------------------------------------------------------


def test_a_stage_placement_is_not_a_split():
    spec = fs.P("dp", None, on=("pp", 1))
    assert spec.axes == ("dp",)
    assert spec != fs.P("dp", None)
    assert hash(spec) != hash(fs.P("dp", None))
    assert spec.unstaged == fs.P("dp", None)
    assert fs.P("dp", None).staged(("pp", 1)) == spec
    assert spec.normalized(3) == fs.P("dp", None, None, on=("pp", 1))


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (fs.P("dp", on=("pp", 2)), "is placed on pp=2, but axis 'pp' has size 2"),
        (fs.P("dp", on=("cp", 0)), "is placed on axis 'cp', which is not in Mesh(pp=2, dp=2)"),
        (
            fs.P("pp", on=("pp", 0)),
            "both splits a dim over 'pp' and places the tensor on one of its coordinates",
        ),
    ],
)
def test_bad_stage_placements_are_named(spec, problem):
    assert any(problem in p for p in spec.problems((4,), fs.Mesh(pp=2, dp=2)))


def test_bad_placement_values_and_mixed_stages_are_refused():
    with pytest.raises(fs.ShardingError, match=re.escape("a stage placement is (axis name, coordinate)")):
        fs.P("dp", on=("pp", -1))
    with pytest.raises(fs.ShardingError, match="place the tensor on different stages"):
        ParamSharding(fs.P(on=("pp", 0)), fs.P(on=("pp", 1)), fs.P(on=("pp", 0)), fs.P(on=("pp", 0)))


def test_json_keeps_old_specs_as_lists():
    assert fs.P("dp", ("tp", "cp")).to_json() == ["dp", ["tp", "cp"]]
    assert fs.P("dp", on=("pp", 3)).to_json() == {"entries": ["dp"], "on": ["pp", 3]}
    assert Owned("dp").to_json() == {"owned": "dp"}
    assert Owned("dp", on=("pp", 1)).to_json() == {"owned": "dp", "on": ["pp", 1]}


@given(staged_mesh_shape_spec(), st.integers(0, 2**31 - 1))
@settings(max_examples=40)
def test_staged_shards_round_trip_and_are_empty_off_the_stage(case, seed):
    mesh, shape, spec = case
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    shards = fs.shard_tensor(x, spec, mesh)
    assert torch.equal(fs.unshard_tensor(shards, spec, mesh), x)
    for rank, shard in enumerate(shards):
        coords = mesh.coords(rank)
        local, offset = fs.local_shape_and_offset(shape, spec, mesh, rank)
        if spec.holds(coords):
            # on the stage: exactly the split of the same spec without the placement
            assert (local, offset) == fs.local_shape_and_offset(shape, spec.unstaged, mesh, rank)
            assert tuple(shard.shape) == local
        else:
            assert local == tuple(0 for _ in shape)
            assert offset == shape
            assert shard.numel() == 0
            assert local_numel(shape, spec, mesh, rank) == 0
    for name in ("storage", "optim"):
        sharding = ParamSharding.uniform(spec)
        assert ParamSharding.from_json(json.loads(json.dumps(sharding.to_json()))) == sharding, name
    assert spec_from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_to_placements_of_a_staged_spec_is_over_the_stage_sub_mesh():
    from torch.distributed.tensor import Replicate, Shard

    mesh = fs.Mesh(pp=2, dp=2, tp=2)
    assert fs.P("dp", "tp", on=("pp", 1)).to_placements(mesh, (4, 4)) == (Shard(0), Shard(1))
    assert fs.P(None, "tp").to_placements(mesh, (4, 4)) == (Replicate(), Replicate(), Shard(1))


# ---- shard(): stages stamped into every spec ----------------------------------------------


def test_every_spec_of_a_pipelined_plan_names_its_stage_rank():
    plan = fs.shard(
        zoo.llama("tiny"),
        fs.Mesh(pp=2, dp=2),
        fs.pipeline("pp", microbatches=4, schedule="zbv", stages_per_rank=2) + fs.fsdp("dp"),
    )
    # four stages in a V over two ranks: stages 0 and 3 on pp=0, stages 1 and 2 on pp=1
    assert plan.config.pipeline.stages == (
        ("embed_tokens",),
        ("layers.0",),
        ("layers.1",),
        ("norm", "lm_head"),
    )
    expected = {"embed_tokens.weight": 0, "layers.0.mlp.up_proj.weight": 1, "layers.1.mlp.up_proj.weight": 1}
    expected["lm_head.weight"] = 0
    for path, rank in expected.items():
        sharding = plan.sharding(path)
        assert all(spec.on == ("pp", rank) for spec in sharding.specs().values()), path
    assert plan.local_shape("lm_head.weight", rank=0) == (128, 64)
    assert plan.local_shape("lm_head.weight", rank=2) == (0, 0)  # pp=1 holds stages 1 and 2 only
    assert not plan.config.fsdp.reshard_after_forward  # FSDP stays gathered across micro-batches
    assert fs.Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    ("mesh", "policy", "error", "message"),
    [
        (
            fs.Mesh(dp=2),
            fs.pipeline("pp", microbatches=2),
            fs.PlanError,
            "pipeline('pp', microbatches=2, schedule='1f1b') names axis 'pp', which is not in Mesh(dp=2)",
        ),
        (
            fs.Mesh(pp=8),
            fs.pipeline("pp", microbatches=2),
            fs.PolicyError,
            "8 stages but only 2 blocks plus the modules before and after them to share; use at most 4",
        ),
        (
            fs.Mesh(pp=2),
            "pipeline(pp, microbatches=2, schedule=pipedream)",
            fs.PolicyError,
            "pipeline(schedule='pipedream'): one of 'gpipe', '1f1b'",
        ),
        (
            fs.Mesh(pp=2),
            "pipeline(pp, microbatches=2) + fsdp(pp)",
            fs.PolicyError,
            "axis 'pp' is claimed by both pipeline('pp', microbatches=2, schedule='1f1b') and fsdp('pp')",
        ),
    ],
)
def test_bad_pipeline_input_is_refused_before_anything_runs(mesh, policy, error, message):
    with pytest.raises(error, match=re.escape(message)):
        fs.shard(zoo.llama("tiny"), mesh, fs.parse_policy(policy) if isinstance(policy, str) else policy)


@pytest.mark.parametrize(
    "split",
    [3, "embed_tokens", ["embed_tokens", "layers"], [[0], [1]]],
)
def test_a_split_not_shaped_as_stages_of_module_paths_is_refused(split):
    # a list of paths was cut into stages of one character each; an int raised a TypeError
    with pytest.raises(fs.PolicyError, match=re.escape("a list of stages, each a list of module paths")):
        fs.pipeline("pp", microbatches=2, split=split)


def test_a_split_of_another_number_of_stages_is_refused_in_words():
    # before: "1 stages listed, but the plan has 2"
    whole = [["embed_tokens", "layers", "norm", "lm_head"]]
    with pytest.raises(fs.PolicyError, match=re.escape("1 stage listed, but the plan has 2 stages; list")):
        fs.shard(zoo.llama("tiny"), fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2, split=whole))


@pytest.mark.parametrize(
    ("split", "message"),
    [
        # the forward would run layers.1 on stage 0 before layers.0 on stage 1: a wrong loss
        (
            [["embed_tokens", "layers.1"], ["layers.0", "norm", "lm_head"]],
            "'layers.1' is in stage 0, before 'layers.0' in stage 1, but the forward runs it after",
        ),
        # these three hung the step: a rank's stage ran nothing, or dropped its own modules
        (
            [["layers.1", "norm", "lm_head"], ["embed_tokens", "layers.0"]],
            "'layers.1' is in stage 0, before 'layers.0' in stage 1",
        ),
        (
            [["embed_tokens", "layers"], ["layers.1", "norm", "lm_head"]],
            "'layers.1' (stage 1) is inside 'layers' (stage 0); list the parts of 'layers' each stage runs",
        ),
        ([[""], ["layers.1"]], "'layers.1' (stage 1) is inside '' (stage 0); list the parts of the model"),
        ([["embed_tokens", "layers", "norm", "lm_head"], []], "stage 1 lists no module"),
    ],
)
def test_a_split_the_forward_cannot_run_in_stage_order_is_refused(split, message):
    with pytest.raises(fs.PolicyError, match=re.escape(message)):
        fs.shard(zoo.llama("tiny"), fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2, split=split))


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        (zoo.Llama, "checkpointing(): the root module holds modules of pipeline stages 0, 1"),
        (
            "layers",
            "checkpointing(): 'layers' holds modules of pipeline stages 0, 1, and no stage runs it whole",
        ),
    ],
)
def test_checkpointing_a_module_that_spans_stages_is_refused_not_dropped(selector, message):
    # each stage's plan left it out: the step ran with no recompute at all, unsaid
    policy = fs.pipeline("pp", microbatches=2) + fs.checkpointing(selector)
    with pytest.raises(fs.PolicyError, match=re.escape(message)):
        fs.shard(zoo.llama("tiny"), fs.Mesh(pp=2), policy)
    blocks = fs.shard(
        zoo.llama("tiny"), fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2) + fs.checkpointing("layers.*")
    )
    assert blocks.config.checkpointed == ("layers.0", "layers.1")


def test_an_fsdp_unit_that_spans_stages_is_refused_not_dropped():
    # each stage's plan left it out: its parameters went to the stage's root unit, unsaid
    with pytest.raises(
        fs.PolicyError, match=re.escape("fsdp(units=...): 'layers' holds modules of pipeline")
    ):
        fs.shard(
            zoo.llama("tiny"),
            fs.Mesh(dp=2, pp=2),
            fs.fsdp("dp", units=["layers"]) + fs.pipeline("pp", microbatches=2),
        )
    blocks = fs.shard(
        zoo.llama("tiny"),
        fs.Mesh(dp=2, pp=2),
        fs.fsdp("dp", units=["layers.*"]) + fs.pipeline("pp", microbatches=2),
    )
    assert blocks.config.fsdp.units == ("", "layers.0", "layers.1")


def test_a_tie_across_stages_is_refused_naming_both_paths_and_one_stage_is_fine():
    tied = zoo.llama("tiny-tied")
    with pytest.raises(fs.PolicyError) as raised:
        fs.shard(tied, fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2))
    assert "embed_tokens.weight in stage 0, lm_head.weight in stage 1" in str(raised.value)
    assert "tie_word_embeddings=False, then copy the loaded embedding into the head" in str(raised.value)
    # no split keeps a causal LM's embedding and head in one stage: the first and the last
    assert "or plan it without pipeline()" in str(raised.value)
    assert "split=" not in str(raised.value)
    split = [["layers.0"], ["layers.1", "embed_tokens", "norm", "lm_head"]]
    plan = fs.shard(tied, fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2, split=split))
    assert plan.sharding("lm_head.weight").on == ("pp", 1)


def test_a_hugging_face_llama_is_cut_by_its_pipeline_plan():
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        vocab_size=64,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    plan = fs.shard(model, fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2))
    assert plan.config.pipeline.stages == (
        ("model.embed_tokens", "model.layers.0", "model.layers.1"),
        ("model.layers.2", "model.norm", "lm_head"),
    )
    assert plan.config.pipeline.boundary_features == (32,)  # the config's hidden_size
    # the rotary table is in no stage: every stage's ranks keep it
    assert all(s.on is None for s in plan.buffers.values())
    assert plan.buffers


# ---- explain, diff ------------------------------------------------------------------------


def test_explain_has_a_stage_column_and_diff_reports_a_stage_move():
    model, mesh = zoo.llama("tiny"), fs.Mesh(pp=2, dp=2)
    even = fs.shard(model, mesh, fs.pipeline("pp", microbatches=2) + fs.fsdp("dp"))
    text = even.explain()
    assert "pipeline over 'pp': 2 stages, 1 per rank, schedule 1f1b, 2 micro-batches" in text
    assert re.search(r"lm_head\.weight\s+1 \(pp=1\)\s+256×64\s+float32\s+P\('dp', None\)", text)
    late = fs.shard(
        model,
        mesh,
        fs.pipeline(
            "pp", microbatches=2, split=[["embed_tokens"], ["layers.0", "layers.1", "norm", "lm_head"]]
        )
        + fs.fsdp("dp"),
    )
    moves = {str(c) for c in even.diff(late) if c.path.startswith("layers.0.")}
    assert "layers.0.self_attn.q_proj.weight: stage 0 (pp=0) -> 1 (pp=1)" in moves
    assert not any(" storage " in m for m in moves)  # one line per move, not four spec lines
    flat = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp"))
    assert "embed_tokens.weight: stage all -> 0 (pp=0)" in {str(c) for c in flat.diff(even)}


# ---- cost ----------------------------------------------------------------------------------


def test_cost_hand_checked_llama_on_two_stages():
    # tiny Llama, float32, hidden 64: stage 0 = embedding (256×64) + layer 0, stage 1 = layer 1 +
    # norm (64) + head (64×256); a layer is 2·64 + 64·64·2 + 32·64·2 + 3·176·64 = 45,184 elements
    plan = fs.shard(zoo.llama("tiny"), fs.Mesh(pp=2), fs.pipeline("pp", microbatches=4))
    layer = 2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64
    stage0, stage1 = (256 * 64 + layer) * 4, (layer + 64 + 64 * 256) * 4
    assert plan.cost("sgd", rank=0).params_bytes == stage0
    assert plan.cost("sgd", rank=1).params_bytes == stage1
    worst = plan.cost("sgd", tokens=1000)
    assert (worst.rank, worst.params_bytes) == (1, stage1)  # the norm makes the last stage heavier
    assert worst.stage_bytes == {
        0: {"params": stage0, "grads": stage0, "optimizer": 0, "gathered": 0},
        1: {"params": stage1, "grads": stage1, "optimizer": 0, "gathered": 0},
    }
    # boundary 0 -> 1: 1000 tokens × 64 features × 4 bytes, activations forward, gradients back
    assert worst.boundary_bytes == {0: 256_000.0}
    assert worst.comm_bytes == {"send_recv": {"pp": 256_000.0}}


def test_a_v_turn_sends_nothing():
    plan = fs.shard(
        zoo.Llama(zoo.LlamaConfig(num_layers=6)),
        fs.Mesh(pp=2),
        fs.pipeline("pp", microbatches=4, schedule="zbv", stages_per_rank=2),
    )
    cost = plan.cost("sgd", tokens=10)
    assert cost.boundary_bytes == {0: 2560.0, 1: 0.0, 2: 2560.0}  # stages 1 and 2 are both on pp=1
    assert [plan.cost("sgd", rank=r, tokens=10).comm_bytes["send_recv"]["pp"] for r in (0, 1)] == [5120.0] * 2


@given(pipelined_llamas())
@settings(max_examples=30)
def test_cost_per_rank_is_the_sum_over_its_stages(case):
    model, mesh, piped_policy, rest = case
    piped = fs.shard(model, mesh, piped_policy)
    flat = fs.shard(model, without_axis(mesh, "pp"), rest)
    pp, config = mesh["pp"], piped.config
    origin = dict.fromkeys(mesh.axis_names, 0)
    costs = [piped.cost("adamw", rank=mesh.rank(origin | {"pp": i}), tokens=64) for i in range(pp)]
    stage_bytes = costs[0].stage_bytes
    zero1 = config.data_parallel == "zero1"
    for i, cost in enumerate(costs):
        mine = config.pipeline.stages_at(mesh, i)
        for part in ("params", "grads", "gathered") + (() if zero1 else ("optimizer",)):
            assert getattr(cost, f"{part}_bytes") == sum(stage_bytes[s][part] for s in mine), (i, part)
    # every parameter is on exactly one pp rank: the pp ranks together hold what one rank of
    # the same plan without the pipeline holds (ZeRO-1's owners are chosen per stage: not equal)
    whole = flat.cost("adamw", rank=0)
    assert sum(c.params_bytes for c in costs) == whole.params_bytes
    assert sum(c.grads_bytes for c in costs) == whole.grads_bytes
    if not zero1:
        assert sum(c.optimizer_bytes for c in costs) == whole.optimizer_bytes
    # each boundary's bytes are sent once each way: by the stage before and the stage after
    sent = sum(c.comm_bytes.get("send_recv", {}).get("pp", 0.0) for c in costs)
    assert sent == 2 * sum(costs[0].boundary_bytes.values())
    worst = piped.cost("adamw")
    assert worst.total_bytes >= max(c.total_bytes for c in costs)
    assert fs.Plan.from_json(piped.to_json()) == piped


# ---- text and the command line -------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "pipeline(pp, microbatches=32) + fsdp(dp) + tp(llama, tp)",
        "pipeline(pp, microbatches=8, schedule=interleaved1f1b, stages_per_rank=2) + zero(1, dp)",
        "pipeline(stage, microbatches=2, split=((embed_tokens, 'layers.0'), ('layers.1', norm, lm_head)))",
        "pipeline(pp, microbatches=4, schedule=gpipe)",
    ],
)
def test_policy_text_round_trips(text):
    policy = fs.parse_policy(text)
    assert fs.format_policy(policy) == text
    assert fs.parse_policy(fs.format_policy(policy)) == policy


def test_policy_text_with_a_quoted_schedule_and_without_microbatches():
    assert fs.parse_policy("pipeline(pp, microbatches=2, schedule='1f1b')") == fs.pipeline(
        "pp", microbatches=2
    )
    with pytest.raises(fs.PolicyError, match=re.escape("pipeline() needs microbatches=N")):
        fs.parse_policy("pipeline(pp)")


def test_cli_plans_with_stages(capsys):
    policy = "pipeline(pp, microbatches=4) + fsdp(dp) + tp(llama, tp)"
    assert main(["plan", "--model", "tiny", "--mesh", "pp=2,dp=2,tp=2", "--policy", policy]) == 0
    out = capsys.readouterr().out
    assert "pipeline over 'pp': 2 stages, 1 per rank, schedule 1f1b, 4 micro-batches" in out
    assert re.search(r"lm_head\.weight\s+1 \(pp=1\)", out)
    assert "pipeline stages (each on its first rank)" in out


def test_blocks_show_the_ranks_off_the_stage_as_holding_none():
    from functional_shard.frontends.pictures.visualize import blocks

    plan = fs.shard(
        zoo.llama("tiny"), fs.Mesh(pp=2, dp=2), fs.pipeline("pp", microbatches=2) + fs.zero(1, "dp")
    )
    found, empty, _ = blocks(plan, "lm_head.weight", "optim")
    assert list(found.values()) == [[2]]  # ZeRO-1 owner along dp on pp=1: the (pp=1, dp=0) rank
    assert empty == [0, 1, 3]


def test_a_models_own_pieces_order_the_stages_not_the_definition_order():
    from torch import nn

    from functional_shard.core.tree import read_model
    from functional_shard.planning.pipeline.stages import split_stages

    class HeadFirst(nn.Module):  # defines its head before its embedding and blocks
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 8)
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    tree = read_model(HeadFirst())
    # by definition order the head comes before the blocks and would ride with stage 0
    assert split_stages(tree, 2) == (("head", "embed", "layers.0"), ("layers.1", "layers.2"))
    # the forward order, as an HF base_model_pp_plan gives it, puts it with the last stage
    pieces = ("embed", "layers", "head")
    assert split_stages(tree, 2, pieces=pieces) == (("embed", "layers.0", "layers.1"), ("layers.2", "head"))


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"])
@pytest.mark.parametrize("pp", [2, 3])
def test_send_bytes_per_rank_match_torchs_own_action_lists(schedule, pp):
    # torch builds each rank's actions, sends included, in one process (its schedule
    # visualizer mocks the stages); every SEND_F of stage s carries stage s's output for one
    # micro-batch, every SEND_B of stage s the gradient of stage s - 1's output
    import contextlib
    import io

    from torch import nn
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from functional_shard.planning.pipeline.stages import SCHEDULES

    stages, microbatches, tokens_per_microbatch = 2 * pp, 6, 5
    widths = [8 + 4 * i for i in range(stages + 1)]  # a different width at every boundary
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(widths[i], widths[i + 1]) for i in range(stages))
    policy = fs.pipeline("pp", microbatches=microbatches, schedule=schedule, stages_per_rank=2)
    plan = fs.shard(model, fs.Mesh(pp=pp), policy)
    assert plan.config.pipeline.boundary_features == tuple(widths[1:-1])
    with contextlib.redirect_stdout(io.StringIO()):  # it prints as it builds
        actions = get_schedule_ops(
            getattr(schedules, SCHEDULES[schedule]), pp, microbatches, 2, with_comms=True
        )
    for rank in range(pp):
        sent = 0
        for action in filter(None, actions[rank]):
            kind, stage = action.computation_type.name, action.stage_index
            if kind == "SEND_F":
                sent += widths[stage + 1] * tokens_per_microbatch * 4
            elif kind == "SEND_B":
                sent += widths[stage] * tokens_per_microbatch * 4
        cost = plan.cost("sgd", rank=rank, tokens=microbatches * tokens_per_microbatch)
        assert cost.comm_bytes.get("send_recv", {}).get("pp", 0) == sent, rank


def test_one_block_is_counted_as_one():
    blocks = nn.Module()
    blocks.layers = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(fs.PolicyError, match=re.escape("only 1 block to share; use at most 1 stage")):
        fs.shard(blocks, fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2))
