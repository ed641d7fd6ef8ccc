"""The pipeline engine on real gloo process groups: pipelined training equals one process.

Each case trains a tiny untied Llama (4 blocks unless said) for 3 AdamW steps (lr 1e-2,
fp32) through ``fs.forward_backward`` and compares the losses and every stage's full
parameters with one process training on the whole global batch. Tolerances: 1e-5 on
losses (about 5), 1e-5 absolute plus 1e-4 relative on parameters (micro-batch gradients
are summed in another order than one batch's; measured differences are below 5e-6).

Also recorded per rank (`pipeline_cases.train(..., measure=True)`): the bytes each rank
sends and receives point to point in a step (c10d send/recv ops seen by a
TorchDispatchMode) and its bytes of parameters, which equal ``plan.cost()``'s prediction
for that rank.
"""

from __future__ import annotations

import re

import pytest
import torch

import functional_shard as fs

from .. import pipeline_cases as pc


@pytest.fixture(scope="module")
def world(world4):
    return world4


def assert_trains_as_one_process(results, spec):
    losses, params = pc.reference(spec, results[0]["data_parallel"])
    for result in results:
        assert result["losses"] == pytest.approx(losses, abs=1e-5)
    merged = pc.merged_params(results)
    assert merged.keys() == params.keys()  # every stage's parameters, under the model's own names
    for name, value in params.items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-4, msg=name)


def assert_costs_as_predicted(results, spec):
    """Each rank's parameter bytes and point-to-point bytes sent equal ``plan.cost()``'s."""
    mesh = fs.Mesh(**spec["mesh"])
    plan = fs.shard(pc.build(spec), mesh, pc.policy_of(spec))
    for rank, result in enumerate(results):
        cost = plan.cost(rank=rank, tokens=spec["rows"] * pc.SEQ)
        assert result["param_bytes"] == cost.params_bytes, rank
        assert result["sent"] == cost.comm_bytes.get("send_recv", {}).get("pp", 0), rank


def activation_bytes(spec):
    """Bytes of one stage boundary's hidden states for a whole per-rank batch (fp32)."""
    hidden = 32  # the zoo configs' and hf_cases' hidden size
    return spec["rows"] * pc.SEQ * hidden * 4


def test_pipeline_with_fsdp_trains_as_one_process_and_sends_the_hidden_states(world):
    spec = pc.case({"pp": 2, "dp": 2}, "1f1b", data="fsdp")
    results = world.run(pc.train, spec, True)
    assert_trains_as_one_process(results, spec)
    # each stage holds its own parameters only: stage 0 the embedding, stage 1 the head
    stage_0, stage_1 = results[0]["params"].keys(), results[2]["params"].keys()
    assert "embed_tokens.weight" in stage_0
    assert "lm_head.weight" not in stage_0
    assert "lm_head.weight" in stage_1
    assert "embed_tokens.weight" not in stage_1
    # one boundary: stage 0 sends the hidden states of its 4 micro-batches forward and
    # receives their gradients back; stage 1 the other way round
    for result in results:
        assert result["sent"] == result["received"] == activation_bytes(spec)
    assert_costs_as_predicted(results, spec)


def test_forward_backward_without_pp_is_a_plain_forward_and_backward(world):
    result = world.run(pc.plain_step)[0]
    loss, expected = result["loss"]
    assert loss == pytest.approx(expected, abs=1e-7)
    assert not result["requires_grad"]
    for got, want in result["grads"]:
        torch.testing.assert_close(got, want)


def test_a_batch_the_micro_batches_do_not_divide_is_refused_naming_both(world):
    message = world.run(pc.refused, pc.case({"pp": 2, "dp": 2}, data="fsdp"), pc.odd_batch)[0]
    assert "batch of 3 does not split into the plan's 4 micro-batches" in message


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ("list", "inputs=list: a Tensor (fs.forward_backward cuts its rows into 4 micro-batch(es))"),
        ("scalar", "inputs=a scalar tensor: a tensor whose first dim is the batch's rows"),
        ("empty", "fs.forward_backward: the inputs' batch has no rows; pass at least 4 (one a micro-batch)"),
    ],
)
def test_a_batch_that_is_no_tensor_of_rows_is_refused_on_every_rank(worlds, batch, message):
    # an AttributeError (a list), an IndexError (a scalar), or torch's errors deep in the schedule
    # (no rows), before
    messages = worlds(2).run(pc.refused, pc.case({"pp": 2}), pc.odd_step(batch))
    assert all(message in m for m in messages), messages


@pytest.mark.parametrize(
    "spec",
    [pc.case({"pp": 2}, microbatches=2), pc.case({"pp": 2}, "zbv", stages_per_rank=2, microbatches=2)],
    ids=["1f1b", "zbv"],
)
def test_batches_of_other_rows_and_lengths_step_and_evaluate_as_one_process(worlds, spec):
    # torch's schedule sized its stages' buffers from the first step's micro-batches: a batch
    # of fewer rows or shorter ones then hung the step, or gloo aborted the ranks
    expected = pc.steps_of_other_shapes_in_one_process(spec)
    results = worlds(2).run(pc.steps_of_other_shapes, spec)
    for result in results:
        assert result["losses"] == pytest.approx(expected["losses"], abs=1e-5)
    merged = pc.merged_params(results)
    assert merged.keys() == expected["params"].keys()
    for name, value in expected["params"].items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-4, msg=name)


LOSS_FAILED = "the pipeline's last stage (pp rank 1) ran loss_fn on a micro-batch, and it failed"
INPUTS_FAILED = "the pipeline's first stage cannot run a micro-batch of inputs of shape "


@pytest.mark.parametrize(
    ("what", "messages"),
    [
        (
            "per_token",
            (LOSS_FAILED, "fs.forward_backward: loss_fn returned a tensor of shape (24,), but the step runs"),
        ),
        ("short", (LOSS_FAILED, "Expected input batch_size (24) to match target batch_size (20)")),
        ("evaluation", (LOSS_FAILED, "Expected input batch_size (24) to match target batch_size (20)")),
        # no backward fails on it: the micro-batches' vectors were averaged and returned
        (
            "evaluation_per_token",
            (LOSS_FAILED, "fs.forward_loss: loss_fn returned a tensor of shape (24,), but it returns"),
        ),
        (
            "float_ids",
            (INPUTS_FAILED + "(4, 12) and dtype torch.float32; every pp rank stops here: Expected",),
        ),
        (
            "flat",
            (INPUTS_FAILED + "(4,) and dtype torch.int64; every pp rank stops here: not enough values",),
        ),
        # torch's schedule ran the block on the hidden states of a micro-batch, on pp rank 1 alone
        (
            "later_stage",
            (
                "the pipeline's stage 1 (pp rank 1) ran its forward on a micro-batch, and it failed; every "
                "pp rank stops here: layers.2 failed (a stand-in). Fix: the forward of its modules "
                "(layers.2 … lm_head)",
            ),
        ),
        (
            "later_stage_outputs",
            ("the pipeline's stage 1 (pp rank 1) ran its forward on a micro-batch, and it failed; every",),
        ),
        # no step: the first stage returned its hidden states as the model's output, the last raised alone
        ("direct", ("the pipelined model was called directly, which runs this rank's stages alone",)),
    ],
)
def test_a_step_failing_on_one_stage_is_raised_on_every_rank(worlds, what, messages):
    # the last stage's loss_fn, or the first stage's forward on inputs it cannot take, raised
    # alone inside the schedule; the other ranks waited for what it sends until the timeout
    spec = pc.case({"pp": 2}, microbatches=2)
    tokens = pc.batches(1)[0]
    model = pc.build(spec)
    one_process = pc.lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).item()
    for result in worlds(2).run(pc.failing_loss_then_a_step, spec, what):
        assert all(message in result["refusal"] for message in messages), result["refusal"]
        assert result["loss"] == pytest.approx(one_process, abs=1e-5)  # the pipeline runs on


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        (pc.case({"pp": 4}, microbatches=4), "stage 1 (pp rank 1)"),
        (pc.case({"pp": 2}, "zbv", stages_per_rank=2, microbatches=2), "stage 1 (pp rank 1)"),
    ],
    ids=["middle_of_four", "v_shaped"],
)
def test_a_failing_stage_before_others_is_raised_on_every_rank(worlds, spec, said):
    # the stages after it wait for its hidden states, the ones before for its gradients: every
    # rank but the failing one hung; the stages after run on the zeros it hands on instead
    tokens = pc.batches(1)[0]
    one_process = pc.lm_loss(pc.build(spec)(tokens[:, :-1]), tokens[:, 1:]).item()
    size = 4 if spec["mesh"]["pp"] == 4 else 2
    for result in worlds(size).run(pc.failing_loss_then_a_step, spec, "later_stage"):
        assert result["refusal"].startswith(f"the pipeline's {said} ran its forward on a micro-batch"), result
        assert "every pp rank stops here: layers.2 failed (a stand-in)" in result["refusal"]
        assert result["loss"] == pytest.approx(one_process, abs=1e-5)  # the pipeline runs on


def test_the_first_stage_running_out_of_memory_is_raised_as_it_is_on_every_rank(worlds):
    # it was refused as inputs the first stage cannot run (a ShardingError): a caller that
    # handles running out of memory (a smaller batch) never saw it
    spec = pc.case({"pp": 2}, microbatches=2)
    tokens = pc.batches(1)[0]
    one_process = pc.lm_loss(pc.build(spec)(tokens[:, :-1]), tokens[:, 1:]).item()
    first, last = worlds(2).run(pc.failing_loss_then_a_step, spec, "out_of_memory")
    assert first["refusal"] == "OutOfMemoryError: out of memory (a stand-in)"
    assert last["refusal"] == (
        "OutOfMemoryError: the pipeline's first stage (pp rank 0) ran out of memory on a micro-batch of "
        "inputs of shape (4, 12); every pp rank stops here: out of memory (a stand-in)"
    )
    assert first["loss"] == last["loss"] == pytest.approx(one_process, abs=1e-5)  # the pipeline runs on


def test_a_rank_of_two_stages_refuses_the_model_called_directly(worlds):
    # the module itself ran both of the rank's stages in one pass, the other rank's skipped:
    # logits of half the model on pp rank 0, torch's raw shape error on pp rank 1
    spec = pc.case({"pp": 2}, "zbv", stages_per_rank=2, microbatches=2)
    refusals = [result["refusal"] for result in worlds(2).run(pc.failing_loss_then_a_step, spec, "direct")]
    assert [refusal.split(":")[0] for refusal in refusals] == ["pipeline stages 0, 3", "pipeline stages 1, 2"]
    assert all("the pipelined model was called directly" in refusal for refusal in refusals), refusals


def test_tied_embeddings_split_across_stages_are_refused_before_running():
    spec = pc.case({"pp": 2, "dp": 2}, data="fsdp", config="tied")
    model = pc.build(spec)
    # refused when planning, before any process group exists
    with pytest.raises(
        fs.ShardingError,
        match=re.escape("embed_tokens.weight in stage 0, lm_head.weight in stage 1 are one tied"),
    ) as raised:
        fs.shard(model, fs.Mesh(pp=2, dp=2), pc.policy_of(spec))
    assert "Fix: untie it, each module with its own copy of the weight" in str(raised.value)
    assert "or plan it without pipeline()" in str(raised.value)


def test_ddp_under_a_pipeline_is_refused_for_fsdp():
    spec = pc.case({"pp": 2, "dp": 2}, data="ddp")
    model = pc.build(spec)
    plan = fs.shard(model, fs.Mesh(pp=2, dp=2), pc.policy_of(spec))
    with pytest.raises(fs.ShardingError, match=re.escape("ddp under pipeline parallel")):
        fs.check_runnable(plan, model)


SLOW_CASES = [
    *[pc.case({"pp": 4}, schedule) for schedule in ("gpipe", "1f1b")],
    *[pc.case({"pp": 2, "dp": 2}, schedule, data="fsdp") for schedule in ("gpipe", "1f1b")],
    *[
        pc.case({"pp": 2, "dp": 2}, schedule, stages_per_rank=2, data="fsdp")
        for schedule in ("interleaved1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
    ],
    # 8 stages: DualPipeV needs at least as many micro-batches
    *[
        pc.case({"pp": 4}, schedule, stages_per_rank=2, config="deep", microbatches=8, rows=8)
        for schedule in ("interleaved1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
    ],
    pc.case({"pp": 4}, config="uneven"),
    pc.case({"pp": 2, "dp": 2}, "interleaved1f1b", stages_per_rank=2, data="fsdp", config="uneven"),
    pc.case({"pp": 2, "dp": 2}, data="zero2"),
    pc.case({"pp": 2, "tp": 2}, tp=True),
    pc.case({"pp": 2, "tp": 2}, tp="lp"),  # the last stage's loss under torch's loss_parallel()
    pc.case({"pp": 2, "dp": 2}, data="fsdp", config="llama", model="hf"),
    pc.case({"pp": 2, "tp": 2}, tp=True, config="llama", model="hf"),
    pc.case({"pp": 2, "tp": 2}, tp="sp"),
    pc.case({"pp": 2, "tp": 2}, tp="sp", config="llama", model="hf"),
    pc.case({"pp": 2, "dp": 2}, data="fsdp", meta=True),
    pc.case({"pp": 2, "dp": 2}, "interleaved1f1b", stages_per_rank=2, data="fsdp", meta=True),
    pc.case({"pp": 2, "dp": 2}, data="fsdp", clip=0.5),
    pc.case({"pp": 2, "dp": 2}, data="fsdp", scaler=True),
    pc.case({"pp": 2, "dp": 2}, "interleaved1f1b", stages_per_rank=2, data="fsdp", checkpointing=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SLOW_CASES, ids=[pc.name_of(s) for s in SLOW_CASES])
def test_every_schedule_and_composition_trains_as_one_process(world, spec):
    results = world.run(pc.train, spec, True)
    assert_trains_as_one_process(results, spec)
    pp = spec["mesh"]["pp"]
    boundaries = pp * spec["stages_per_rank"] - 1
    # every boundary's hidden states go forward once and their gradients back once per
    # micro-batch; a boundary between two stages of one rank (a V's turn) sends nothing
    sent = sum(r["sent"] for r in results)
    replicas = len(results) // pp
    local_turns = 1 if spec["schedule"] in ("zbv", "dualpipev") else 0
    # under sequence parallel each tensor-parallel rank sends its slice of the sequence
    split = spec["mesh"]["tp"] if spec["tp"] == "sp" else 1
    assert sent == 2 * replicas * (boundaries - local_turns) * activation_bytes(spec) // split
    assert_costs_as_predicted(results, spec)


@pytest.mark.slow
def test_the_global_norm_is_clipped_across_stages(world):
    spec = pc.case({"pp": 2, "dp": 2}, data="fsdp", clip=0.5)
    results = world.run(pc.train, spec)
    norms = {tuple(r["norms"]) for r in results}
    assert len(norms) == 1  # every rank clips by the same norm: the whole model's
    assert min(next(iter(norms))) > 0.5  # and clipping did act (parity is in the matrix)


@pytest.mark.slow
def test_a_schedule_torch_cannot_run_is_a_sharding_error_with_torchs_reason(world):
    spec = pc.case({"pp": 4}, "dualpipev", stages_per_rank=2, config="deep")
    message = world.run(pc.refused, spec, pc.one_step)[0]
    assert "ScheduleDualPipeV refuses 4 micro-batches over 8 stages" in message
    assert "at least as many microbatches as stages" in message  # torch's own words


@pytest.mark.slow
def test_an_overflow_on_one_stage_skips_the_step_on_every_rank(world):
    spec = pc.case({"pp": 2, "dp": 2}, data="fsdp")
    results = world.run(pc.overflow_on_one_stage, spec, 3)  # rank 3 holds stage 1
    assert [r["moved"] for r in results] == [False] * 4
    assert len({r["scale"] for r in results}) == 1  # every rank halved its scale alike
    assert results[0]["scale"] == 2.0**15


@pytest.mark.slow
@pytest.mark.parametrize("saved_under_pp", [True, False], ids=["pp-to-fsdp", "fsdp-to-pp"])
@pytest.mark.parametrize("stages_per_rank", [1, 2])
def test_a_sharded_checkpoint_moves_between_a_pipeline_and_a_plan_without_one(
    world, tmp_path, saved_under_pp, stages_per_rank
):
    schedule = "1f1b" if stages_per_rank == 1 else "interleaved1f1b"
    spec = pc.case({"pp": 2, "dp": 2}, schedule, stages_per_rank=stages_per_rank, data="fsdp")
    results = world.run(pc.checkpoint_across, spec, str(tmp_path / "ckpt"), saved_under_pp)
    for kind in ("params", "moments"):
        saved = pc.merged_params([{"params": r["saved"][kind]} for r in results])
        loaded = pc.merged_params([{"params": r["loaded"][kind]} for r in results])
        assert saved.keys() == loaded.keys()
        assert len(saved) == 39  # every parameter of the model, under its own name
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.slow
def test_a_full_file_loads_into_a_pipeline_and_the_pipeline_saves_one_again(world, tmp_path):
    spec = pc.case({"pp": 2, "dp": 2}, data="fsdp")
    results = world.run(pc.full_file_into_pipeline, spec, str(tmp_path / "model.pt"))
    for kind in ("params", "moments"):
        saved = pc.merged_params([{"params": r["saved"][kind]} for r in results])
        loaded = pc.merged_params([{"params": r["loaded"][kind]} for r in results])
        assert saved.keys() == loaded.keys()
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, atol=0, rtol=0, msg=name)
    # a full save under the pipeline gathers every stage on rank 0 (tests/dist/test_pipeline_checkpoint.py
    # checks its values); it is no longer refused
    assert all(r["refusal"] == "" for r in results)


def test_a_stage_plan_holds_its_stages_parameters_units_and_styles_only():
    from functional_shard.planning.pipeline.stage_plans import stage_plan, without_pipeline
    from functional_shard.zoo import llama

    policy = fs.pipeline("pp", microbatches=4) + fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")
    plan = fs.shard(llama("tiny"), fs.Mesh(pp=2, dp=2, tp=2), policy)
    # what the engines run per stage (the cost model keeps the pipeline fields)
    first, last = (without_pipeline(stage_plan(plan, stages)) for stages in ((0,), (1,)))
    assert set(first.params) | set(last.params) == set(plan.params)
    assert not set(first.params) & set(last.params)
    assert "embed_tokens.weight" in first.params
    assert "lm_head.weight" in last.params
    assert all(p.startswith("layers.1.") for p in last.params if p.startswith("layers."))
    assert {u for u in first.config.fsdp.units if u} == {"layers.0"}
    assert {path.split(".")[1] for path, _, _ in last.config.tp.styles if path.startswith("layers.")} == {"1"}
    for local in (first, last):
        assert local.config.pipeline is None
        assert local.config.fsdp.reshard_after_forward is False  # as torchtitan runs FSDP under PP
