"""Policies as text: each form equals its Python call; printing and parsing are inverses."""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.planning.policy.builders import CHECKPOINT_POLICIES, MIXED_PRECISION_DTYPES
from functional_shard.planning.policy.parse import FORMS
from functional_shard.planning.tp.rules import Rules
from functional_shard.zoo import Block, llama

MODEL = llama("tiny")
LLAMA = fs.rules.llama

EXAMPLES = [
    ("fsdp(dp)", fs.fsdp("dp")),
    ("none", fs.Policy()),
    (
        "fsdp(dp) + tp(llama, tp) + bf16",
        fs.fsdp("dp") + fs.tp(LLAMA, "tp") + fs.mixed_precision(torch.bfloat16),
    ),
    ("zero(1, dp)", fs.zero(1, "dp")),
    ("zero(2, dp)", fs.zero(2, "dp")),
    ("fsdp(dp, reshard_after_forward=false)", fs.zero(2, "dp")),
    ("ddp(dp)", fs.replicate("dp")),
    ("replicate(dp)", fs.replicate("dp")),
    ("ddp", fs.replicate()),
    ("hsdp(node, gpu) + checkpointing(Block)", fs.hsdp("node", "gpu") + fs.checkpointing(Block)),
    ("tp(llama, tp, sequence_parallel=true)", fs.tp(LLAMA, "tp", sequence_parallel=True)),
    ("sp(llama, tp)", fs.tp(LLAMA, "tp", sequence_parallel=True)),
    ("tp(gpt2, 'model')", fs.tp(fs.rules.gpt2, "model")),
    ("tp(gpt2_hf, tp)", fs.tp(fs.rules.gpt2_hf, "tp")),
    ("tp(hf, tp)", fs.tp("hf", "tp")),
    ("sp(auto, tp)", fs.tp("auto", "tp", sequence_parallel=True)),
    ("checkpointing('layers.*')", fs.checkpointing("layers.*")),
    ("offload", fs.offload()),
    ("offload(optimizer)", fs.offload(params=False, grads=False)),
    ("mixed_precision(bf16)", fs.mixed_precision(torch.bfloat16)),
    ("mixed_precision(fp16, none)", fs.mixed_precision(torch.float16, None)),
    ("fp16", fs.mixed_precision(torch.float16, torch.float32)),
    ("fsdp((dp, cp), min_params=1000)", fs.fsdp(("dp", "cp"), min_params=1000)),
    ("cp(cp, engine=ring)", fs.cp("cp", engine="ring")),
    ("cp(seq, load_balance=false, engine=all_gather)", fs.cp("seq", load_balance=False, engine="all_gather")),
    ("fsdp(dp, units=(Block, 'lm_head'))", fs.fsdp("dp", units=(Block, "lm_head"))),
]


@pytest.mark.parametrize(("text", "expected"), EXAMPLES, ids=[t for t, _ in EXAMPLES])
def test_each_form_equals_its_python_call(text, expected):
    assert fs.parse_policy(text, MODEL) == expected


def test_printing_reads_like_the_python_api():
    policy = fs.hsdp("node", "gpu") + fs.tp(LLAMA, "tp") + fs.checkpointing(Block) + fs.offload(grads=False)
    assert (
        fs.format_policy(policy)
        == "hsdp(node, gpu) + tp(llama, tp) + offload(params, optimizer) + checkpointing(Block)"
    )


@pytest.mark.parametrize(
    ("switches", "name", "text"),
    [
        ({}, "tp(llama, 'tp')", "tp(llama, tp)"),
        # before: each of these was named "tp(llama, 'tp')", as the plain layer
        ({"sequence_parallel": True}, "tp(llama, 'tp', sequence_parallel=True)", "sp(llama, tp)"),
        ({"loss_parallel": True}, "tp(llama, 'tp', loss_parallel=True)", "tp(llama, tp, loss_parallel=true)"),
        (
            {"sequence_parallel": True, "loss_parallel": True},
            "tp(llama, 'tp', sequence_parallel=True, loss_parallel=True)",
            "sp(llama, tp, loss_parallel=true)",
        ),
    ],
)
def test_a_tp_layer_s_name_and_text_show_its_switches(switches, name, text):
    policy = fs.tp(LLAMA, "tp", **switches)
    assert policy.layers[0].name == name
    assert fs.format_policy(policy) == text
    assert fs.parse_policy(text) == policy


AXES = st.sampled_from(["dp", "tp", "cp", "node", "gpu", "data parallel", "true", "full", "pp", "ep"])
DTYPES = st.sampled_from(MIXED_PRECISION_DTYPES)


@st.composite
def text_policies(draw: st.DrawFn) -> fs.Policy:
    """Every policy the text can say: each builder's layers and options, every dtype the builders take."""
    axes = draw(st.lists(AXES, min_size=6, max_size=6, unique=True))
    units = st.none() | st.lists(
        st.sampled_from([Block, "layers.*", "lm_head"]), min_size=1, max_size=2, unique=True
    )
    parts = []
    kind = draw(st.sampled_from(["none", "ddp", "ddp-all", "zero", "fsdp", "hsdp"]))
    if kind == "ddp":
        parts.append(fs.replicate(axes[0]))
    elif kind == "ddp-all":
        parts.append(fs.replicate())
    elif kind == "zero":
        parts.append(fs.zero(draw(st.sampled_from([1, 2, 3])), axes[0]))
    elif kind in ("fsdp", "hsdp"):
        chosen = draw(units)
        options = {
            "reshard_after_forward": draw(st.booleans()),
            "units": chosen,
            # units or a size threshold, not both
            "min_params": None if chosen is not None else draw(st.none() | st.integers(1, 10**9)),
        }
        if kind == "fsdp":
            shard_axes = axes[: draw(st.integers(1, 2))]
            parts.append(fs.fsdp(shard_axes[0] if len(shard_axes) == 1 else shard_axes, **options))
        else:
            parts.append(fs.hsdp(axes[0], axes[1], **options))
    if draw(st.booleans()):
        name = draw(st.sampled_from(["llama", "torchtitan", "gpt2", "gpt2_hf", "mlp", "hf", "auto"]))
        rules = name if name in ("hf", "auto") else getattr(fs.rules, name)
        parallel = {"sequence_parallel": draw(st.booleans()), "loss_parallel": draw(st.booleans())}
        parts.append(fs.tp(rules, axes[3], **parallel))
    if draw(st.booleans()):
        experts = st.none() | st.lists(
            st.sampled_from(["*.experts.*", "layers.0.*"]), min_size=1, unique=True
        )
        parts.append(fs.ep(axes[4], experts=draw(experts)))
    if draw(st.booleans()):
        schedule, per_rank = draw(
            st.sampled_from([("1f1b", 1), ("gpipe", 1), ("interleaved1f1b", 2), ("zbv", 2)])
        )
        split = st.none() | st.just([["embed", "layers.0"], ["layers.1", "head"]])
        parts.append(
            fs.pipeline(
                axes[5],
                microbatches=draw(st.integers(1, 64)),
                schedule=schedule,
                stages_per_rank=per_rank,
                split=draw(split),
            )
        )
    if draw(st.booleans()):
        engine = draw(st.sampled_from(["auto", "ring", "all_gather"]))
        parts.append(fs.cp(axes[2], load_balance=draw(st.booleans()), engine=engine))
    if draw(st.booleans()):
        parts.append(fs.mixed_precision(draw(DTYPES), draw(st.none() | DTYPES)))
    if draw(st.booleans()):
        flags = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
        parts.append(fs.offload(params=flags[0], grads=flags[1], optimizer=flags[2]))
    if draw(st.booleans()):
        selectors = draw(
            st.lists(st.sampled_from([Block, "layers.*", "lm_head"]), min_size=1, max_size=2, unique=True)
        )
        parts.append(fs.checkpointing(*selectors, policy=draw(st.sampled_from(CHECKPOINT_POLICIES))))
    policy = fs.Policy()
    for part in draw(st.permutations(parts)):
        policy = policy + part
    return policy


@given(text_policies())
def test_parse_inverts_format(policy):
    text = fs.format_policy(policy)
    parsed = fs.parse_policy(text, MODEL)
    # options print in one fixed order; layers keep theirs
    assert parsed.layers == policy.layers
    assert parsed.options == policy.options
    assert fs.format_policy(parsed) == text


def _refused(text: str, model=MODEL) -> str:
    with pytest.raises(fs.PolicyError) as caught:
        fs.parse_policy(text, model)
    message = str(caught.value)
    assert message.endswith(f"Accepted: {FORMS}")
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("fsdp(dp", "policy 'fsdp(dp' is not an expression at column 5"),
        ("fsdp:dp+tp:tp", "the old name:axis form is gone: write fsdp(dp) + tp(llama, tp)"),
        ("fsdp(dp) - bf16", "terms are joined by + only"),
        ("foo(dp)", "unknown name 'foo'"),
        (
            "fsdp(dp) + tp(lama, tp)",
            "in 'tp(lama, tp)': unknown rule set 'lama'; use one of llama, torchtitan, gpt2, gpt2_hf, mlp, "
            "hf, auto",
        ),
        ("zero(2.5, dp)", "in '2.5': arguments are bare names, 'strings', integers, true/false"),
        ("zero(4, dp)", "zero(stage=4): one of 1, 2, 3"),
        ("zero1(dp)", "write zero(1, AXIS)"),
        ("fsdp(dp, reshard=false)", "fsdp() takes no keyword 'reshard'"),
        ("tp(tp)", "tp() takes a rule set and an axis, e.g. tp(llama, tp)"),
        ("mixed_precision(bf8)", "unknown dtype 'bf8'"),
        ("cp(cp, engine=flash)", "cp(engine='flash'): one of 'auto', 'ring', 'all_gather'"),
        ("offload(weights)", "offload part 'weights': use any of params, grads, optimizer"),
        ("fsdp(dp) + zero(1, dp)", "axis 'dp' is claimed by both fsdp('dp') and zero1('dp')"),
        ("fsdp(dp) + fsdp(dp)", "Give each layer its own mesh axes. Accepted: "),  # one period
        ("bf16 + fp16", "option 'param_dtype' is set twice"),
        ("", "write one, e.g. 'fsdp(dp) + tp(llama, tp)'"),
        # was "got (_Name(text='pp'), _Name(text='dp'))"
        ("pipeline((pp, dp), microbatches=4)", "the axis is a name, got (pp, dp)"),
    ],
)
def test_every_error_names_the_bad_part_and_shows_the_forms(text, says):
    assert says in _refused(text)


def test_code_is_never_run():
    assert """in "__import__('os')": arguments are""" in _refused("fsdp(__import__('os'))")
    assert "each term is a name like bf16 or a call like fsdp(dp)" in _refused("fsdp(dp).__class__")
    assert "each term is a name like bf16" in _refused("(lambda: 1)()")


def test_class_names_resolve_against_the_model():
    message = _refused("checkpointing(LlamaDecoderLayer)")
    assert re.search(
        r"checkpointing 'LlamaDecoderLayer' is not a module class of the model; its classes are "
        r"Attention, Block, Embedding, Linear, Llama, MLP, ModuleList, RMSNorm\.",
        message,
    )
    assert "needs the model to resolve (pass model=...)" in _refused("checkpointing(Block)", model=None)
    # a quoted pattern needs no model
    assert fs.parse_policy("checkpointing('layers.*')") == fs.checkpointing("layers.*")


def test_functions_and_custom_rules_have_no_text_form():
    with pytest.raises(fs.PolicyError, match=re.escape("tp rules 'llama+rules' have no text form")):
        fs.format_policy(fs.tp(LLAMA + Rules([("head", fs.P())]), "tp"))
    with pytest.raises(fs.PolicyError, match="is a function and has no text form"):
        fs.format_policy(fs.fsdp() + (lambda path, tensor, mesh: None))


def test_the_forms_every_error_shows_name_each_checkpointing_policy_the_text_takes():
    for policy in CHECKPOINT_POLICIES:
        parsed = fs.parse_policy(f"checkpointing('layers.*', {policy})")
        assert parsed == fs.checkpointing("layers.*", policy=policy)
    # was "full|selective": torchtitan's per-op policy parsed but no error listed it
    assert "checkpointing(CLASS or 'path.*', full|selective|torchtitan)" in FORMS
