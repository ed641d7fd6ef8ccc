"""Wrong arguments to plan files, `cost`, `estimate` and `diff` are named, never half-used.

Each case used to raise from deep inside (an AttributeError on a model's config, a
TypeError on an optimizer class) or, worse, to give a number: negative bytes for negative
tokens, an estimate for a cp plan that `fs.apply` refuses, a peak for inputs of other
shapes than ``batch`` and ``seq`` say.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.core.sequence import check_sequence_length
from functional_shard.zoo import llama

MODEL = llama("tiny")
CP_PLAN = fs.shard(MODEL, fs.Mesh(dp=2, cp=2), fs.fsdp(("dp", "cp")) + fs.cp("cp"))


# ---- Plan.from_json: text, a Path, or the parsed dict ------------------------------------


def test_from_json_reads_a_path_and_says_when_a_str_is_one(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(CP_PLAN.to_json())
    assert fs.Plan.from_json(path) == CP_PLAN
    with pytest.raises(fs.ShardingError, match=re.escape(f"looks like a path; pass Path({str(path)!r})")):
        fs.Plan.from_json(str(path))
    with pytest.raises(fs.ShardingError, match=re.escape("looks like a path; pass Path('plan.json')")):
        fs.Plan.from_json("plan.json")  # not there, but named like one


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (b"{}", "Plan.from_json(bytes): pass the JSON text (a str), a pathlib.Path"),
        (pathlib.Path("/nowhere/plan.json"), "Plan.from_json('/nowhere/plan.json'): cannot read the file"),
        (42, "Plan.from_json(int): pass the JSON text"),
    ],
)
def test_from_json_refuses_other_sources_naming_what_it_takes(source, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.Plan.from_json(source)


# ---- plan.diff takes a Plan ---------------------------------------------------------------


def test_diff_with_json_text_says_to_load_it_first():
    with pytest.raises(fs.ShardingError, match=re.escape("plan.diff(str): compares two Plans; load")):
        CP_PLAN.diff(CP_PLAN.to_json())


# ---- plan files: fields the builders check are checked when read --------------------------


def _edited(plan: fs.Plan, section: str, **fields) -> dict:
    data = json.loads(plan.to_json())
    data["config"][section] = {**(data["config"][section] or {}), **fields}
    return data


PIPED = fs.shard(MODEL, fs.Mesh(pp=2), fs.pipeline("pp", microbatches=4))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            _edited(CP_PLAN, "tp", axes=["dp"], loss_parallel=True),
            "config.tp.loss_parallel: true, but no module is a tensor-parallel head",
        ),
        (_edited(PIPED, "pipeline", microbatches=0), "config.pipeline.microbatches: 0; a positive count"),
        (
            _edited(PIPED, "pipeline", stages_per_rank=0),
            "config.pipeline.stages_per_rank: 0; a positive count",
        ),
        (_edited(PIPED, "pipeline", microbatches=-1), "config.pipeline.microbatches: -1; a positive count"),
        (
            _edited(PIPED, "pipeline", microbatches=1),
            "torch's Schedule1F1B refuses 1 micro-batches over 2 stages",
        ),
    ],
    ids=[
        "loss-parallel-without-head",
        "microbatches",
        "stages-per-rank",
        "pipeline-negative",
        "pipeline-torch",
    ],
)
def test_a_hand_edited_config_the_builders_refuse_is_refused_when_read(data, message):
    with pytest.raises(fs.ShardingError, match="does not hold together") as error:
        fs.Plan.from_json(data)
    assert message in str(error.value)


# ---- cost's arguments ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: CP_PLAN.cost(torch.optim.AdamW),
            "cost(optimizer=<class 'torch.optim.adamw.AdamW'>): 'adamw'",
        ),
        (lambda: CP_PLAN.cost(-1.0), "cost(optimizer=-1.0): 'adamw', 'adam' or 'sgd'"),
        (lambda: CP_PLAN.cost("lion"), "cost(optimizer='lion'): 'adamw', 'adam' or 'sgd'"),
        (lambda: fs.cost(MODEL), "cost(plan=Llama): a Plan (make one with fs.shard"),
        (lambda: CP_PLAN.cost(rank="0"), "cost(rank='0'): a rank of Mesh(dp=2, cp=2)"),
        (lambda: CP_PLAN.cost(tokens="8k"), "cost(tokens='8k'): a positive int (that the 4 cp chunks divide"),
        (lambda: CP_PLAN.cost(tokens=-5), "cost(tokens=-5): a positive int"),
        (lambda: CP_PLAN.cost(tokens=0), "cost(tokens=0): a positive int"),
        (lambda: CP_PLAN.cost(tokens=8.5), "cost(tokens=8.5): a positive int"),
        (lambda: CP_PLAN.cost(tokens=True), "cost(tokens=True): a positive int"),
        (
            lambda: CP_PLAN.cost(tokens=6),
            "cost(tokens=6): cp=2 with load balancing cuts each sequence into 4",
        ),
    ],
)
def test_wrong_cost_arguments_are_named(call, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        call()


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(-64, 4096), balanced=st.booleans())
def test_cost_takes_the_token_counts_a_cp_run_takes_and_never_counts_negative_bytes(tokens, balanced):
    plan = (
        CP_PLAN
        if balanced
        else fs.shard(MODEL, CP_PLAN.mesh, fs.fsdp(("dp", "cp")) + fs.cp("cp", load_balance=False))
    )
    try:
        check_sequence_length(tokens, 2, load_balance=balanced)
        runs = True
    except fs.ShardingError:
        runs = False
    if not runs:
        with pytest.raises(fs.ShardingError, match=re.escape(f"cost(tokens={tokens}): ")):
            plan.cost(tokens=tokens)
        return
    sent = plan.cost(tokens=tokens).comm_bytes
    assert all(nbytes >= 0 for by_axis in sent.values() for nbytes in by_axis.values())


def test_cost_and_estimate_refuse_the_same_sequence_length():
    with pytest.raises(fs.ShardingError, match="4 does not divide"):
        fs.estimate(MODEL, CP_PLAN, batch=1, seq=6)
    with pytest.raises(fs.ShardingError, match="4 does not divide"):
        CP_PLAN.cost(tokens=6)


# ---- estimate's arguments -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: fs.estimate(CP_PLAN, MODEL, batch=1, seq=8),
            "estimate(Plan, Llama, ...): the model comes first, then its plan",
        ),
        (lambda: fs.estimate("llama", CP_PLAN, batch=1, seq=8), "estimate(model=str): the nn.Module"),
        (lambda: fs.estimate(MODEL, MODEL, batch=1, seq=8), "estimate(plan=Llama): a Plan"),
        (
            lambda: fs.trace_activations(CP_PLAN, MODEL, batch=1, seq=8),
            "trace_activations(Plan, Llama, ...): the model comes first, then its plan",
        ),
        (
            lambda: fs.trace_activations(MODEL, CP_PLAN, batch=1, seq="8"),
            "trace_activations(seq='8'): a positive",
        ),
        (lambda: fs.estimate(MODEL, CP_PLAN, batch=1, seq=8, inputs="ids"), "estimate(inputs=str): a tensor"),
        (
            lambda: fs.estimate(MODEL, CP_PLAN, batch=1, seq=6),
            "estimate(seq=6): cp=2 with load balancing cuts each sequence into 4 equal chunks",
        ),
        # a typo's length, whose tensors torch cannot count: refused, not torch's overflow
        (
            lambda: fs.estimate(MODEL, CP_PLAN, batch=2, seq=10**23),
            "estimate(seq=100000000000000000000000, batch=2): at most 4,294,967,296 (2**32) tokens a step",
        ),
        (
            lambda: fs.estimate(MODEL, CP_PLAN, batch=1, seq=8, optimizer=torch.optim.SGD),
            "estimate(optimizer=<class 'torch.optim.sgd.SGD'>): 'adamw', 'adam' or 'sgd'",
        ),
    ],
)
def test_wrong_estimate_arguments_are_named(call, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        call()


def _ids(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.long)


@pytest.mark.parametrize(
    ("batch", "seq", "inputs", "shape"),
    [
        (1, 8, _ids(1, 6), "(1, 6)"),
        (4, 8, _ids(1, 8), "(1, 8)"),
        (2, 8, (_ids(2, 4),), "(2, 4)"),
        (2, 8, _ids(2), "(2,)"),
    ],
)
def test_inputs_that_disagree_with_batch_or_seq_are_refused_naming_both(batch, seq, inputs, shape):
    message = f"estimate(inputs=...): the first input has shape {shape}, but batch={batch}, seq={seq} make it"
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.estimate(MODEL, CP_PLAN, batch=batch, seq=seq, inputs=inputs)


@pytest.mark.parametrize(
    ("plan", "batch"),
    [(CP_PLAN, 2), (fs.shard(MODEL, fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2)), 4)],
    ids=["cp", "pipeline"],
)
def test_inputs_of_the_whole_step_are_cut_as_a_run_cuts_them(plan, batch):
    # the default token ids and the same ids passed as inputs: one estimate
    given_ids = fs.estimate(MODEL, plan, batch=batch, seq=8, inputs=_ids(batch, 8))
    assert given_ids.peak_bytes == fs.estimate(MODEL, plan, batch=batch, seq=8).peak_bytes


# ---- estimate refuses the cp plans fs.apply refuses ---------------------------------------


def _sliding_window_model() -> torch.nn.Module:
    import transformers

    config = transformers.MistralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    with torch.device("meta"):
        return transformers.MistralForCausalLM(config)


class _AttentionInForward(torch.nn.Module):
    """Self-attention computed by hand (its projections left out): a softmax of the scores' product."""

    def forward(self, x: torch.Tensor, **_: object) -> torch.Tensor:
        weights = F.softmax(torch.matmul(x, x.transpose(-1, -2)), dim=-1)
        return weights @ x


def _half_by_hand_model() -> torch.nn.Module:
    # cp splits layer 0's SDPA call only: layer 1's queries would attend within their rank's
    # chunks, silently (the runtime counts split calls, and layer 0's made it nonzero)
    model = llama("tiny")
    model.layers[1].self_attn = _AttentionInForward()
    return model


@pytest.mark.parametrize(
    ("build", "problem"),
    [
        (_sliding_window_model, "attends within a sliding window"),
        (lambda: torch.nn.Sequential(torch.nn.MultiheadAttention(8, 2)), "0 (MultiheadAttention)"),
        (
            _half_by_hand_model,
            "layers.1.self_attn (_AttentionInForward): computes attention by hand in its forward (a softmax "
            "of a matmul), which cp cannot reach: its queries would attend within their rank's chunks only; "
            "call F.scaled_dot_product_attention instead",
        ),
    ],
    ids=["sliding-window", "multihead-attention", "attention-by-hand"],
)
def test_estimate_refuses_cp_over_attention_that_apply_refuses(build, problem):
    model = build()
    plan = fs.shard(model, fs.Mesh(dp=2, cp=2), fs.fsdp(("dp", "cp")) + fs.cp("cp"))
    with pytest.raises(fs.PlanError) as refused:
        fs.check_runnable(plan, model)
    line = next(line for line in str(refused.value).splitlines() if problem in line)
    with pytest.raises(fs.PlanError, match="context parallel cannot split") as estimated:
        fs.estimate(model, plan, batch=1, seq=16)
    assert line in str(estimated.value)  # the same words as check_runnable's


class _SoftmaxOfWeights(torch.nn.Module):
    """A softmax of a product with the module's own weight (a router, a classifier): no attention."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x @ self.weight
        return torch.softmax(logits, dim=-1) @ self.weight.t()


@pytest.mark.parametrize(
    "build",
    [lambda: llama("tiny"), _SoftmaxOfWeights, lambda: torch.nn.Sequential(torch.nn.Linear(8, 8))],
    ids=["zoo", "softmax-of-weights", "torch-modules"],
)
def test_attention_through_sdpa_or_no_attention_is_not_refused(build):
    model = build()
    fs.check_runnable(fs.shard(model, fs.Mesh(cp=2), fs.fsdp("cp") + fs.cp("cp")), model)


def test_auto_names_the_sliding_window_when_only_cp_could_split_the_work():
    with pytest.raises(fs.PlanError, match="attends within a sliding window"):
        fs.auto(_sliding_window_model(), devices=8, memory_budget="80GiB", batch=1, seq=65536)


def test_auto_tries_cp_when_the_batch_is_below_the_device_count():
    plan = fs.auto(MODEL, devices=8, memory_budget="80GiB", batch=1, seq=65536)
    assert plan.config.context is not None
