"""Tensor parallel for any transformer: torchtitan's MoE names, fused projections, structural tp("auto")."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs

from .. import tp_any_cases
from ..unit_models import (
    ODD_RULES,
    FusedLlama,
    OddNames,
    RopeNames,
    TitanConfig,
    TitanDeepSeek,
    fused_rules,
)


def assert_sends_as_predicted(result):
    """What a step sent on rank 0 is what plan.cost(tokens=...) says, collective by collective."""
    assert result["measured"].keys() == result["predicted"].keys(), result["ops"]
    for kind, by_axis in result["predicted"].items():
        assert result["measured"][kind] == pytest.approx(by_axis), (kind, result["ops"])


def test_torchtitans_moe_names_plan_and_train_as_one_process(world4):
    model = TitanDeepSeek(TitanConfig())
    assert fs.rules.for_model(model).name == "torchtitan"
    plan = fs.shard(model, fs.Mesh(tp=4), fs.tp("auto", "tp"))
    assert plan.sharding("layers.1.moe.experts.w1").compute == fs.P(None, "tp", None)
    assert plan.sharding("layers.1.moe.experts.w2").compute == fs.P(None, None, "tp")
    assert plan.sharding("layers.1.moe.router.gate.weight").compute.is_replicated
    assert plan.sharding("layers.1.moe.shared_experts.w2.weight").compute == fs.P(None, "tp")
    result = world4.run(tp_any_cases.parity, "titan_moe", fs.rules.torchtitan)[0]
    assert result["split"] >= 14  # attention, feed-forward, experts, shared experts, embedding, head
    assert result["loss"] < 1e-5
    assert result["grad"] < 1e-5
    assert_sends_as_predicted(result)


def test_fused_projections_split_piece_by_piece_and_train_as_one_process(world4):
    config = tp_any_cases.FUSED
    rules = fused_rules(config, kv_heads=4)
    plan = fs.shard(FusedLlama(config, kv_heads=4), fs.Mesh(tp=4), fs.tp(rules, "tp"))
    assert plan.config.pieces_of("layers.0.attention.wqkv") == (32, 16, 16)
    assert plan.config.pieces_of("layers.1.mlp.gate_up_proj") == (48, 48)
    assert plan.local_shape_and_offset("layers.0.attention.wqkv.weight", 1)[0] == (16, 32)
    assert "layers.*.attention.wqkv (32, 16, 16) ×2" in plan.explain()
    assert fs.Plan.from_json(plan.to_json()) == plan
    result = world4.run(tp_any_cases.parity, "fused_gqa", rules, save=True)[0]
    assert result["loss"] < 1e-5
    assert result["grad"] < 1e-5  # each rank's share of each piece, against one process's
    assert_sends_as_predicted(result)
    # a full checkpoint holds the whole wqkv in order (no torch placement describes its
    # split: the ranks' shares are put back piece by piece), its AdamW moments too, and
    # loads back under the plan; a sharded one (torch's DCP) is refused by name both ways
    saved = result["saved"]
    assert saved["weights"] < 1e-5
    assert saved["moments"] < 1e-5
    assert saved["shards"] == 0
    refusal = "layers.0.attention.wqkv (4 layers in all) holds a packed weight"
    written, read = saved["refused"].splitlines()
    assert f"fs.checkpoint.save(full=False): {refusal}" in written
    assert "reading the sharded checkpoint" in read
    assert refusal in read
    # and under a pipeline beside tp, whose stages rank 0 gathers from their own ranks
    saved = world4.run(tp_any_cases.full_checkpoint, "fused_gqa", rules)[0]
    assert saved["weights"] < 1e-5
    assert saved["moments"] < 1e-5
    assert saved["shards"] == 0
    # a packed bias stays whole; each rank adds its slices of it, and its gradient sums theirs
    result = world4.run(tp_any_cases.parity, "fused_gqa_bias", rules)[0]
    assert result["loss"] < 1e-5
    assert result["grad"] < 1e-5
    assert_sends_as_predicted(result)


def test_pieces_the_tp_size_does_not_divide_are_refused_by_name():
    config = tp_any_cases.FUSED
    with pytest.raises(
        fs.ShardingError, match=r"layers.0.attention.wqkv packs pieces \(32, 16, 16\).*size 32"
    ):
        fs.shard(FusedLlama(config, kv_heads=4), fs.Mesh(tp=32), fs.tp(fused_rules(config, 4), "tp"))
    with pytest.raises(
        fs.ShardingError, match=r"packed\(32, 16\) sums to 48 .* layers.0.attention.wqkv.weight"
    ):
        fs.shard(FusedLlama(config, 4), fs.Mesh(tp=4), fs.tp([("*.wqkv", fs.packed((32, 16)))], "tp"))


def _auto_is_named_and_trains(world, model, name):
    # tp("auto") from the structure gives what ODD_RULES give by name, and trains as one
    # process on 4 gloo ranks; the plan returned
    mesh = fs.Mesh(tp=4)
    auto = fs.shard(model, mesh, fs.tp("auto", "tp"))
    named = fs.shard(model, mesh, fs.tp(ODD_RULES, "tp"))
    assert auto.params == named.params
    assert auto.config.tp.styles == named.config.tp.styles
    result = world.run(tp_any_cases.parity, name, "auto")[0]
    assert result["loss"] < 1e-5
    assert result["grad"] < 1e-5
    assert_sends_as_predicted(result)
    return auto


def test_auto_derives_rules_from_the_structure_when_no_named_set_fits(world4):
    auto = _auto_is_named_and_trains(world4, OddNames(TitanConfig()), "odd_names")
    assert auto.sharding("blocks.1.mix.d.weight").compute == fs.P(None, "tp")
    # named sets first: torchtitan's names still get fs.rules.torchtitan
    assert fs.rules.for_model(TitanDeepSeek(TitanConfig())).name == "torchtitan"


def test_auto_refuses_what_the_structure_cannot_classify_naming_the_modules():
    with pytest.raises(fs.ShardingError) as refused:
        fs.shard(OddNames(TitanConfig(), chain=True), fs.Mesh(tp=4), fs.tp("auto", "tp"))
    message = str(refused.value)
    assert "blocks.0.ff.mid: reads split outputs (['ff.up']) but does not write the block's output" in message
    assert "blocks.0.ff.down: reads the output of ['ff.mid']" in message


class _Cut(nn.Module):
    """A fused feed-forward whose forward cuts its ``up`` output: by slicing, after a view, or twice."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 32), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.up(self.norm(x))
        if self.how == "slice":
            gate, up = fused[..., :16], fused[..., 16:]
        elif self.how == "view":  # pieces of each of 4 heads, not of the whole output
            gate, up = fused.view(*x.shape[:-1], 4, 8).chunk(2, dim=-1)
            gate, up = gate.flatten(-2), up.flatten(-2)
        elif self.how == "twice":  # a second cut, into other pieces (what it makes goes unused)
            gate, up = fused.chunk(2, dim=-1)
            fused.chunk(4, dim=-1)
        else:  # "chunk": equal pieces of the whole output, as w13
            gate, up = fused.chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


def test_auto_finds_a_fused_projections_pieces_from_the_split_in_its_forward():
    # wqkv split [32, 16, 16] (grouped-query: unequal), w13 and gate_up_proj chunk(2): each a
    # packed colwise of the pieces its forward cuts, as fs.packed rules by hand give
    from functional_shard.planning.tp.structural_rules import trace_block

    config = tp_any_cases.FUSED
    model = FusedLlama(config, kv_heads=4)
    assert fs.rules.for_model(model).name == "structure"
    auto = fs.shard(model, fs.Mesh(tp=4), fs.tp("auto", "tp"))
    named = fs.shard(model, fs.Mesh(tp=4), fs.tp([*fused_rules(config, 4), ("*norm", "sequence")], "tp"))
    assert auto.params == named.params
    assert auto.config.tp.styles == named.config.tp.styles
    assert auto.config.pieces_of("layers.0.attention.wqkv") == (32, 16, 16)
    assert auto.config.pieces_of("layers.1.mlp.gate_up_proj") == (48, 48)
    assert trace_block(_Cut("chunk")).styles == (("up", fs.packed((16, 16))), ("down", "rowwise"))


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("slice", "its output passes through ['__getitem__'], which mix or cut its features"),
        ("view", "its output (32 features) is cut into (4, 4) of 8 features; a fused projection's"),
        ("twice", "its output (32 features) is cut into (8, 8, 8, 8) of 32 features, (16, 16) of 32"),
    ],
)
def test_auto_refuses_a_fused_output_cut_other_than_into_pieces_of_its_whole_width(how, why):
    from functional_shard.planning.tp.structural_rules import trace_block

    problems = dict(trace_block(_Cut(how)).problems)
    assert why in problems["up"], problems


@pytest.mark.slow
def test_fused_pieces_found_by_auto_train_as_one_process(world4):
    result = world4.run(tp_any_cases.parity, "fused_gqa", "auto")[0]
    assert result["loss"] < 1e-5
    assert result["grad"] < 1e-5  # each rank's share of each piece, against one process's
    assert_sends_as_predicted(result)


def test_auto_traces_each_block_with_the_inputs_the_model_passes_it(world4):
    # blocks called as block(h, frequencies) (rotary positions made once, as torchtitan's
    # freqs_cis): the whole model runs once on meta token ids to see each block's inputs,
    # and the trace follows the hidden states through them
    _auto_is_named_and_trains(world4, RopeNames(TitanConfig()), "rope_names")


@given(
    ranks=st.integers(1, 4),
    units=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    rows=st.integers(1, 3),
    bias=st.booleans(),
)
def test_packed_pieces_plan_a_colwise_local_shape_and_apply_splits_each_piece(ranks, units, rows, bias):
    # invariant: the plan keeps the pieces and gives each rank out/ranks rows; the runtime's
    # split gives each rank its share of every piece, and the ranks' shares, put back piece
    # by piece, are the whole weight
    from functional_shard.runtime.engines.packed_pieces import rank_share

    pieces = tuple(unit * ranks for unit in units)
    model = nn.Sequential(nn.Linear(rows, sum(pieces), bias=bias), nn.Linear(sum(pieces), rows))
    plan = fs.shard(model, fs.Mesh(tp=ranks), fs.tp([("0", fs.packed(pieces)), ("1", "rowwise")], "tp"))
    assert plan.config.pieces_of("0") == pieces
    assert fs.Plan.from_json(plan.to_json()).config.tp.pieces == (("0", pieces),)
    full = torch.randn(sum(pieces), rows)
    local = [rank_share(full, 0, pieces, ranks, rank) for rank in range(ranks)]
    for rank, part in enumerate(local):
        assert tuple(part.shape) == plan.local_shape_and_offset("0.weight", rank)[0]
    shares = [part.split([n // ranks for n in pieces]) for part in local]
    rebuilt = torch.cat([torch.cat([share[i] for share in shares]) for i in range(len(pieces))])
    assert torch.equal(rebuilt, full)


@given(
    ranks=st.integers(1, 4),
    units=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    other=st.integers(1, 3),
    dim=st.integers(0, 1),
)
def test_rank_major_cuts_into_each_ranks_share_and_piece_major_undoes_it(ranks, units, other, dim):
    # invariant: a whole value put in the ranks' order is cut by a plain Shard into each
    # rank's share of every piece; gathering those shares end to end and putting them back
    # piece by piece gives the whole value (what full checkpoints rely on)
    from functional_shard.runtime.engines.packed_pieces import piece_major, rank_major, rank_share

    pieces = tuple(unit * ranks for unit in units)
    shape = [other, other]
    shape[dim] = sum(pieces)
    full = torch.randn(shape)
    ordered = rank_major(full, dim, pieces, ranks)
    for rank, block in enumerate(ordered.chunk(ranks, dim)):
        assert torch.equal(block, rank_share(full, dim, pieces, ranks, rank))
    assert torch.equal(piece_major(ordered, dim, pieces, ranks), full)


@settings(max_examples=10)
@given(layers=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]), hidden=st.sampled_from([16, 48]))
def test_the_structure_gives_what_named_rules_give_whatever_the_sizes(layers, heads, hidden):
    model = OddNames(TitanConfig(layers=layers, heads=heads, hidden=hidden))
    auto = fs.shard(model, fs.Mesh(tp=2), fs.tp("auto", "tp"))
    named = fs.shard(model, fs.Mesh(tp=2), fs.tp(ODD_RULES, "tp"))
    assert fs.rules.for_model(model).name == "structure"
    assert auto.params == named.params
    assert auto.config.tp.styles == named.config.tp.styles
