"""fs.materialize without ``init=``: Hugging Face models take their own initialisation, and every
buffer holds what the model built on the CPU holds, or the call is refused before any change.

Buffers are compared exactly (``torch.equal``) with the CPU build's. Parameters too, with what
materialize should draw with the seed: what the CPU build holds where they come from
``reset_parameters`` (the zoo's Llamas: init-then-shard, exactly); for a Hugging Face model, what
transformers' ``initialize_weights`` draws (`buffer_cases.initialised_by_transformers`), children
first, GPT-2's residual projections that its parent modules re-draw included; not the CPU build's
values, whose construction draws first.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import functional_shard as fs
from functional_shard.runtime.engines.buffers import buffer_problems, meta_buffers, restore_buffers, sets

from .. import buffer_cases, hf_cases
from ..dist_cases import full

pytest.importorskip("transformers")


def drawn_with_the_seed(name):
    """What materialize gives each parameter of a `buffer_cases` model, as the module docstring says."""
    if name.startswith("zoo_"):
        return dict(buffer_cases.build(name).named_parameters())
    return dict(buffer_cases.initialised_by_transformers(buffer_cases.build_on_meta(name)).named_parameters())


def assert_like_the_cpu_build(name, params, buffers, cpu, drawn, stage=False):
    """Buffers equal the CPU build's, parameters what is ``drawn`` with the seed (a pipeline
    ``stage`` holds some of each)."""
    wanted = dict(cpu.named_buffers(remove_duplicate=False))
    assert buffers.keys() <= wanted.keys() if stage else buffers.keys() == wanted.keys(), name
    for path, value in buffers.items():
        assert value.dtype == wanted[path].dtype, f"{name}: {path}"
        assert torch.equal(value, wanted[path]), f"{name}: {path} is {value}, built on the CPU {wanted[path]}"
    assert params.keys() <= drawn.keys() if stage else params.keys() == drawn.keys(), name
    for path, value in params.items():
        assert torch.equal(value, drawn[path].detach()), f"{name}: {path}"


def test_a_meta_built_hf_llama_materializes_without_init_as_built_on_the_cpu(one_rank):
    """The refused case of issue 39: LlamaRMSNorm has no reset_parameters, and the rotary inv_freq
    and original_inv_freq were left as uninitialised memory. Two plans on one rank give the same values."""
    results = []
    for mesh, policy in ((fs.Mesh(dp=1), fs.fsdp()), (fs.Mesh(tp=1), fs.tp("auto", "tp"))):
        model = buffer_cases.build_on_meta("llama")
        plan = fs.shard(model, mesh, policy)
        fs.apply(plan, model)
        assert set(meta_buffers(model)) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
        fs.materialize(plan, model, seed=buffer_cases.SEED)
        params = {k: full(v) for k, v in model.named_parameters()}
        buffers = {k: full(v) for k, v in model.named_buffers()}
        cpu, drawn = buffer_cases.build("llama"), drawn_with_the_seed("llama")
        assert_like_the_cpu_build("llama", params, buffers, cpu, drawn)
        results.append(params)
    for path, value in results[0].items():
        assert torch.equal(value, results[1][path]), path


def assert_as_transformers_draws(label, params, expected):
    """Every parameter equals the one transformers draws with the seed; GPT-2's residual
    projections, re-drawn by their parent modules, with their std of 0.02 / sqrt(2 * n_layer)."""
    wanted = dict(expected.named_parameters())
    assert params.keys() <= wanted.keys(), label
    for path, value in params.items():
        if path.endswith("c_proj.weight"):  # 0.02 would be 2.8 times as wide
            std = value.std().item()
            assert std == pytest.approx(0.02 / math.sqrt(8), rel=0.1), f"{label}: {path} has std {std:.4f}"
        assert torch.equal(value, wanted[path].detach()), f"{label}: {path}"


def test_a_gpt2_parent_s_init_of_its_child_s_weight_wins_as_in_transformers(one_rank):
    """GPT-2's _init_weights re-draws each residual projection (c_proj) on its parent module
    (GPT2Attention, GPT2MLP, with no parameters of their own), after c_proj's own draw: so does
    materialize, and every parameter equals what transformers draws, under FSDP and under tensor
    parallel (GPT-2's packed c_attn split piece by piece)."""
    expected = buffer_cases.initialised_by_transformers(buffer_cases.deep_gpt2())
    for name in ("fsdp", "tp"):
        params = buffer_cases.materialized_model(buffer_cases.deep_gpt2(), name)
        assert params.keys() == dict(expected.named_parameters()).keys()
        assert sum(path.endswith("c_proj.weight") for path in params) == 8
        assert_as_transformers_draws(name, params, expected)


def test_a_parent_s_hf_init_setting_its_child_s_parameter_is_seen_on_meta():
    """The dry run on meta stand-ins names a descendant's parameter a parent's initialiser sets
    (by its path under the parent), changes nothing, and draws no random numbers."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)

    def scale_proj(module: nn.Module) -> None:
        if isinstance(module, Block):
            nn.init.normal_(module.proj.weight, std=0.5)

    with torch.device("meta"):
        block = Block()
    before = dict(block.named_parameters())
    state = torch.get_rng_state()
    assert sets(scale_proj, block) == (frozenset(), None)
    assert sets(scale_proj, block, below=True) == (frozenset({"proj.weight"}), None)
    assert dict(block.named_parameters()) == before
    assert torch.equal(torch.get_rng_state(), state)


def test_a_parameter_the_hf_init_does_not_know_is_refused_by_name(one_rank):
    class Gain(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    model = buffer_cases.build_on_meta("llama")
    with torch.device("meta"):
        model.model.gain = Gain()
    plan = fs.shard(model, fs.Mesh(dp=1), fs.fsdp())
    fs.apply(plan, model)
    message = (
        "* model.gain (Gain): cannot initialise its parameters (gain): it has no reset_parameters, and "
        "PreTrainedModel._init_weights leaves gain unset. Pass init="
    )
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.materialize(plan, model)
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


class Rotary(nn.Module):
    """Frequencies computed when built, as rotary embeddings keep them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8), persistent=False)


class RotaryThatResets(Rotary):
    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.freqs.copy_(1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))


class Net(nn.Module):
    def __init__(self, rotary: type[Rotary]) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.rotary = rotary()
        self.register_buffer("mask", torch.ones(8))


def applied_on_meta(rotary, real_mask=False):
    with torch.device("meta"):
        net = Net(rotary)
    if real_mask:  # a buffer on a real device among meta ones
        net.mask = torch.full((8,), 3.0)
    plan = fs.shard(net, fs.Mesh(dp=1), fs.fsdp(min_params=1))
    fs.apply(plan, net)
    return net, plan


def test_a_computed_buffer_nothing_recomputes_is_refused_before_any_change(one_rank):
    net, plan = applied_on_meta(Rotary)
    message = (
        "fs.materialize cannot give every parameter and buffer a value; nothing changed:\n"
        "* mask: Net computes this buffer when it is built, but it has no reset_parameters, "
        "so after the meta device it would hold uninitialised memory. Give Net a reset_parameters that "
        "sets it, or build the model with its buffers on a real device (only its parameters on meta)\n"
        "* rotary.freqs: Rotary computes this buffer"
    )
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.materialize(plan, net)
    assert all(t.is_meta for t in (*net.parameters(), *net.buffers()))


def test_buffers_come_from_reset_parameters_init_or_stay_as_they_were(one_rank):
    """A module's reset_parameters that sets a buffer restores it; so does an init= that does; a
    buffer on a real device keeps its value through to_empty."""
    net, plan = applied_on_meta(RotaryThatResets, real_mask=True)
    fs.materialize(plan, net, seed=0)
    assert torch.equal(net.rotary.freqs, Rotary().freqs)
    assert torch.equal(net.mask, torch.full((8,), 3.0))

    def init(module):
        if isinstance(module, Rotary):
            module.freqs.copy_(Rotary().freqs)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    net, plan = applied_on_meta(Rotary, real_mask=True)
    fs.materialize(plan, net, seed=0, init=init)
    assert torch.equal(net.rotary.freqs, Rotary().freqs)


def test_buffer_functions_name_what_they_cannot_restore():
    """What checkpoint loaders call: the paths before to_empty, the problems, the restore."""
    with torch.device("meta"):
        net = nn.Sequential(Rotary(), nn.BatchNorm1d(4))
    paths = meta_buffers(net)
    assert paths == ("0.freqs", "1.running_mean", "1.running_var", "1.num_batches_tracked")
    problems = buffer_problems(net, paths)
    assert [p.split(":")[0] for p in problems] == ["0.freqs"]
    with pytest.raises(fs.ShardingError, match=re.escape("* 0.freqs: Rotary computes this buffer")):
        restore_buffers(net, paths, "cpu")
    net.to_empty(device="cpu")
    net[1].running_mean.fill_(7.0)  # loaded from a file, say: not among the paths restored
    restore_buffers(net, ("1.running_var", "1.num_batches_tracked"), "cpu")
    assert torch.equal(net[1].running_var, torch.ones(4))
    assert torch.equal(net[1].num_batches_tracked, torch.tensor(0))
    assert torch.equal(net[1].running_mean, torch.full((4,), 7.0))


@pytest.fixture(scope="module")
def world(worlds):
    return worlds(2)


def test_gpt2_materializes_as_transformers_draws_it_under_fsdp_tp_and_a_pipeline(world):
    """On 2 ranks, each rank of 2 pipeline stages too: it draws the other stage's random numbers,
    its parent modules' re-draws of c_proj included, so each stage holds what transformers draws."""
    strategies = ("fsdp", "tp", "pp")
    results = world.run(buffer_cases.run_deep_gpt2, strategies)
    expected = buffer_cases.initialised_by_transformers(buffer_cases.deep_gpt2())
    for index, name in enumerate(strategies):
        merged = {}
        for rank, per_rank in enumerate(results):
            assert_as_transformers_draws(f"{name}, rank {rank}", per_rank[index], expected)
            merged.update(per_rank[index])
        assert merged.keys() == dict(expected.named_parameters()).keys(), name


@pytest.mark.slow
def test_every_model_family_materializes_without_init_as_built_on_the_cpu(world):
    """Every family of the HF matrix, Mixtral and the zoo's Llamas on 2 ranks, under FSDP and
    tensor parallel (and Llama in 2 pipeline stages): buffers as built on the CPU, parameters as
    drawn with the seed (the zoo's as built on the CPU, the others as transformers draws them),
    equal across the plans."""
    plans = ("fsdp", "tp")
    cases = (*((m, s) for m in buffer_cases.MODELS for s in plans), ("llama", "pp"))
    results = world.run(buffer_cases.run_cases, cases)
    by_case = {case: [per_rank[i] for per_rank in results] for i, case in enumerate(cases)}
    for (name, strategy), ranks in by_case.items():
        cpu, drawn = buffer_cases.build(name), drawn_with_the_seed(name)
        for rank, result in enumerate(ranks):
            label = f"{name} under {strategy}, rank {rank}"
            assert_like_the_cpu_build(label, **result, cpu=cpu, drawn=drawn, stage=strategy == "pp")
        merged = {k: v for result in ranks for k, v in result["params"].items()}
        under_fsdp = by_case[(name, "fsdp")][0]["params"]
        assert merged.keys() == under_fsdp.keys()
        for path, value in merged.items():
            assert torch.equal(value, under_fsdp[path]), f"{name}: {path} under {strategy} and fsdp"
    assert set(hf_cases.CONFIGS) < set(buffer_cases.MODELS)


@pytest.mark.slow  # 28 s: 2 ranks start Lightning and transformers
def test_a_trainer_fits_a_hf_model_built_on_meta_in_configure_model(world):
    """ShardStrategy(fs.fsdp("dp")) on 2 CPU devices materializes a tiny HF Llama built on the
    meta device in configure_model (refused before: no init= to pass), with its rotary
    frequencies as built on the CPU, and trains it as one process does from the same values."""
    from .. import lightning_cases

    results = world.run(lightning_cases.fit_hf_built_on_meta)
    cpu = buffer_cases.build("llama")
    rotary = cpu.model.rotary_emb
    for result in results:
        assert torch.equal(result["buffers"]["inv_freq"], rotary.inv_freq)
        assert torch.equal(result["buffers"]["original_inv_freq"], rotary.original_inv_freq)
    first = results[0]["first"]
    assert first.keys() == dict(cpu.named_parameters()).keys()
    assert results[0]["losses"] == pytest.approx(lightning_cases.hf_reference(first, 2), abs=1e-5)


def test_real_parameters_keep_their_values_and_only_meta_buffers_are_filled(one_rank):
    """Parameters already real (loaded or trained) are never drawn again: only the meta buffers
    get their values, and a mix of real and meta parameters is refused before any change."""
    net, plan = applied_on_meta(RotaryThatResets, real_mask=True)
    fs.materialize(plan, net, seed=0)
    weights = {path: p.full_tensor().clone() for path, p in net.named_parameters()}
    net.rotary.freqs = torch.empty(4, device="meta")
    net.mask = torch.empty(8, device="meta")
    with pytest.raises(fs.ShardingError, match=re.escape("* mask: Net computes this buffer")):
        fs.materialize(plan, net, seed=1)
    net.register_buffer("mask", torch.full((8,), 3.0))
    fs.materialize(plan, net, seed=1)
    assert torch.equal(net.rotary.freqs, Rotary().freqs)
    assert torch.equal(net.mask, torch.full((8,), 3.0))
    for path, param in net.named_parameters():
        assert torch.equal(param.full_tensor(), weights[path]), path

    net, plan = applied_on_meta(Rotary, real_mask=True)
    net.proj.bias = nn.Parameter(torch.zeros(8))
    with pytest.raises(fs.ShardingError, match=re.escape("fs.materialize: proj.bias already holds values")):
        fs.materialize(plan, net)
    assert net.proj.weight.is_meta
    assert not net.proj.bias.is_meta
