"""Activations in flight per pipeline rank, measured on gloo ranks against the estimate.

`pipeline_memory_cases.held_for_backward` runs torch's schedule on each rank and takes,
after every forward, loss and backward action, the bytes of the storages this rank keeps
for a backward still to come (autograd's saved tensors, parameters excluded, and the
inputs and outputs torch's ``PipelineStage`` caches for its backward); its peak over the
step is compared with the estimate's activations for that rank: the schedule's
micro-batches in flight walked over the rank's action list
(`functional_shard.planning.pipeline.schedules.held_peak_parts`) with what one micro-batch keeps on each stage
(`Estimate.pipeline.stage_activation_bytes`, the last stage's logits and log-softmax
included).

They agree to the byte (`as_torch_holds`) once the token ids are counted as torch holds
them, which the estimate does not model (a few hundred bytes here), and two storages its
trace charges to other stages than torch are moved (`_trace_gaps`: a Hugging Face
model's rotary cos/sin, and under sequence parallel the embedding output's slice):

* the estimate charges one micro-batch's token ids (``micro × seq × 8`` bytes) to every
  stage per micro-batch in flight, as its trace hands them to every stage's forward;
  under pp only the first stage gets them, and there torch's split hands each micro-batch
  a view of the step's batch, so the embedding's saved ids keep the whole batch's ids
  (``rows × seq × 8``) alive while any micro-batch is in flight;
* the loss's targets likewise (views of the step's targets, which ``nll_loss`` saves) on
  the last stage, and its 4-byte ``total_weight`` per micro-batch.

Under a split backward (zero-bubble schedules, DualPipeV's ends) torch frees a little at
the input step (I), which the estimate frees at the weight step (W) with the rest; see
`check`.
"""

from __future__ import annotations

import functools
import json

import pytest

import functional_shard as fs
from functional_shard.planning.pipeline.schedules import held_peak_parts, in_flight, schedule_actions

from .. import pipeline_cases as pc
from .. import pipeline_memory_cases as pm


@pytest.fixture(scope="module")
def world(world4):
    return world4


@functools.cache
def _estimate_of(key: str) -> fs.Estimate:
    spec = json.loads(key)
    model = pc.build(spec)
    plan = fs.shard(model, fs.Mesh(**spec["mesh"]), pc.policy_of(spec))
    keep = spec.get("keep_outputs", False)
    return fs.estimate(
        model, plan, batch=spec["rows"], seq=pc.SEQ, keep_outputs=keep, hardware=pc.H100_ON_CPU
    )


def estimate_of(spec):
    """``fs.estimate`` of the case's plan for one rank's batch (the step the ranks run)."""
    return _estimate_of(json.dumps(spec, sort_keys=True))


def estimated_held(spec):
    """Per pp rank, the estimate's activation bytes (the last stage's loss included) at its peak."""
    pipeline = estimate_of(spec).pipeline
    kept = pipeline.stage_activation_bytes
    pp, per_rank = spec["mesh"]["pp"], spec["stages_per_rank"]
    to_end = [0] * (len(kept) - 1) + [pipeline.kept_output_bytes]
    during = turn_outputs(spec)
    held = held_peak_parts(
        spec["schedule"], pp, spec["microbatches"], per_rank, kept, kept_to_end=to_end, during_forward=during
    )
    return [h.activations + b for h, b in zip(held, rank_buffers(spec), strict=True)]


def turn_outputs(spec):
    """Per stage, its output if the next stage runs on its rank (a V's turn), else 0: the
    next stage's buffer holds the last step's until the new output replaces it."""
    stages = estimate_of(spec).pipeline.stages
    return [
        s.send_bytes if i + 1 < len(stages) and stages[i + 1].rank == s.rank else 0
        for i, s in enumerate(stages)
    ]


def rank_buffers(spec):
    """Per pp rank, the estimate's receive buffers (torch keeps them from step to step)."""
    out = [0] * spec["mesh"]["pp"]
    for stage in estimate_of(spec).pipeline.stages:
        out[stage.rank] += stage.buffer_bytes
    return out


def _trace_gaps(spec):
    """Per micro-batch, what the trace charges to other stages than torch's: (rotary, slice).

    ``rotary``: a Hugging Face model's cos and sin (``2 × seq × head_dim × 4`` bytes), made
    outside every stage and viewed in each block's attention, which the trace charges to
    the last stage that views them, while under pp each stage makes and keeps its own.
    ``slice``: under sequence parallel, the embedding output's sequence slice, made in a
    hook outside every stage module and so charged to every stage, which only the first
    stage makes.
    """
    rotary = 0
    if spec["model"] == "hf":
        config = pc.build(spec).config
        rotary = 2 * pc.SEQ * (config.hidden_size // config.num_attention_heads) * 4
    sliced = hidden_bytes(spec) // spec["mesh"]["tp"] if spec["tp"] == "sp" else 0
    return rotary, sliced


def hidden_bytes(spec):
    """One micro-batch's hidden states, fp32."""
    config = pc.build(spec).config
    return spec["rows"] // spec["microbatches"] * pc.SEQ * config.hidden_size * 4


def as_torch_holds(spec):
    """The estimate's held bytes per pp rank with what torch holds otherwise put right.

    `held_peak_parts`' walk over each rank's actions, with the ids moved: no stage holds one
    micro-batch's token ids per micro-batch; the first stage holds the step's ids, and the
    last the step's targets, while any of its micro-batches is in flight. And the trace's
    two misplaced storages (`_trace_gaps`) put where torch keeps them.
    """
    pp, per_rank, m = spec["mesh"]["pp"], spec["stages_per_rank"], spec["microbatches"]
    schedule = spec["schedule"]
    n = pp * per_rank
    micro_ids = spec["rows"] // m * pc.SEQ * 8
    batch_ids = spec["rows"] * pc.SEQ * 8
    rotary, sliced = _trace_gaps(spec)
    kept = [b - micro_ids for b in estimate_of(spec).pipeline.stage_activation_bytes]
    kept = [b + (rotary if s < n - 1 else 0) - (sliced if s else 0) for s, b in enumerate(kept)]
    kept[-1] += 4  # the loss's total_weight
    outputs = estimate_of(spec).pipeline.kept_output_bytes
    during = turn_outputs(spec)
    out = []
    for steps in schedule_actions(schedule, pp, m, per_rank):
        count = [0] * n
        ended = best = 0  # ended: the last stage's forwards done, whose outputs stay
        for action in (action for step in steps for action in step):
            extra = 0
            if action.kind == "F":
                count[action.stage] += 1
                ended += action.stage == n - 1
                extra = during[action.stage]
            elif action.kind in ("B", "W"):
                count[action.stage] -= 1
            held = sum(c * b for c, b in zip(count, kept, strict=True)) + ended * outputs
            best = max(best, held + extra + batch_ids * ((count[0] > 0) + (count[n - 1] > 0)))
        out.append(best)
    return [held + buffers for held, buffers in zip(out, rank_buffers(spec), strict=True)]


SPLIT_BACKWARD = {"interleaved_zb", "zbv", "dualpipev"}


def check(spec, results):
    """Each rank's measured peak: exactly `as_torch_holds`, and the estimate's within a bound."""
    estimated = estimated_held(spec)
    exact = as_torch_holds(spec)
    ids = spec["rows"] * pc.SEQ * 8
    # the estimate itself is off by token ids and targets (at most the step's ids and
    # targets once more, and each stage's share of the ids less; 4 bytes a loss) and by
    # the trace's gaps, for each micro-batch a rank's stages hold
    bound = (2 + spec["stages_per_rank"]) * ids + 4 * spec["microbatches"]
    bound += spec["microbatches"] * spec["stages_per_rank"] * sum(_trace_gaps(spec))
    slack = 0
    if spec["schedule"] in SPLIT_BACKWARD:
        # torch's input step (I) frees a little before the weight step (W) frees the rest,
        # where the estimate frees it all at W: the stage's output, which
        # stage_backward_input detaches, and what only the inputs' gradient needed (one
        # hidden-state tensor more here), for a micro-batch between its I and its W
        slack = spec["stages_per_rank"] * 2 * hidden_bytes(spec)
    buffers = rank_buffers(spec)
    for result in results:
        c = result["pp_rank"]
        assert result["buffers"] == buffers[c], (result["mesh_rank"], result["buffers"], buffers[c])
        measured = result["peak"]["both"]
        assert exact[c] - slack <= measured <= exact[c], (result["mesh_rank"], measured, exact[c])
        assert abs(measured - estimated[c]) <= bound + slack, (measured, estimated[c], bound + slack)
    # the measured step trained as one process does (the hooks changed nothing)
    model = pc.build(spec)
    tokens = pc.batches(results[0]["data_parallel"], spec["rows"])[1]
    expected = pc.lm_loss(pc._logits(model(tokens[:, :-1])), tokens[:, 1:]).item()
    for result in results:
        assert result["loss"] == pytest.approx(expected, abs=1e-5)


DEFAULT = [pc.case({"pp": 2, "dp": 2}, schedule, data="fsdp") for schedule in ("gpipe", "1f1b")]
# torch's default step (return_outputs=True): the last stage keeps every output to the end
KEPT = {**DEFAULT[1], "keep_outputs": True}


def test_activations_in_flight_on_each_rank_are_the_estimates(world):
    each = world.run(pm.held_for_backward_each, [*DEFAULT, KEPT])
    for index, spec in enumerate([*DEFAULT, KEPT]):
        check(spec, [ranks[index] for ranks in each])
    # GPipe's last stage holds every micro-batch's logits and log-softmax (1 x 12 x 128
    # fp32 each) until its backward, 1F1B one micro-batch's
    gpipe, one_f_one_b, kept = each[-1]
    assert gpipe["stages"] == one_f_one_b["stages"] == kept["stages"] == [1]
    logits = 12 * 128 * 4
    assert gpipe["peak"]["loss"] - one_f_one_b["peak"]["loss"] == 3 * (logits + 4)
    assert gpipe["peak"]["stages"] - one_f_one_b["peak"]["stages"] == 3 * (
        estimate_of(DEFAULT[0]).pipeline.stage_activation_bytes[1] - logits - 96
    )
    # and 1F1B keeping its outputs holds the three earlier micro-batches' logits at the last
    assert estimate_of(KEPT).pipeline.kept_output_bytes == logits
    assert kept["peak"]["stages"] - one_f_one_b["peak"]["stages"] == 3 * logits
    # and when the step returns, the four and their concatenation, as the estimate's end
    assert kept["ended"] == 2 * 4 * logits
    assert one_f_one_b["ended"] == 0


SLOW = [
    pc.case({"pp": 2, "dp": 2}, "interleaved1f1b", stages_per_rank=2, data="fsdp"),
    *[pc.case({"pp": 4}, schedule) for schedule in ("gpipe", "1f1b")],
    *[
        pc.case({"pp": 2, "dp": 2}, schedule, stages_per_rank=2, data="fsdp")
        for schedule in ("looped_bfs", "interleaved_zb", "zbv")
    ],
    pc.case({"pp": 4}, "interleaved1f1b", stages_per_rank=2, config="deep", microbatches=8, rows=8),
    pc.case({"pp": 4}, "dualpipev", stages_per_rank=2, config="deep", microbatches=8, rows=8),
    pc.case({"pp": 4}, config="uneven"),
    pc.case({"pp": 2, "dp": 2}, data="fsdp", config="llama", model="hf"),
    pc.case({"pp": 2, "dp": 2}, "gpipe", data="fsdp", config="llama", model="hf"),
    pc.case({"pp": 2, "tp": 2}, "gpipe", tp=True),
    pc.case({"pp": 2, "tp": 2}, "gpipe", tp="sp"),
    pc.case({"pp": 2, "tp": 2}, "gpipe", tp="sp", config="llama", model="hf"),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SLOW, ids=[pc.name_of(s) for s in SLOW])
def test_activations_in_flight_for_every_schedule(world, spec):
    check(spec, world.run(pm.held_for_backward, spec))


def test_dualpipev_frees_at_its_full_backwards_and_peaks_inside_overlapped_steps():
    # measured on gloo (pp4-dualpipev-v2-deep-zoo above): pp ranks 1 and 2 hold 9 block
    # micro-batches at once, right after the forward half of an overlapped forward+backward
    # step; a walk that freed only at W (B never freeing) or looked after whole steps only
    # would not say 9
    assert [held.activations for held in held_peak_parts("dualpipev", 4, 8, 2, [1] * 8)] == [9, 9, 9, 9]
    assert in_flight("dualpipev", 4, 8, 2) == (8, 7, 6, 5, 4, 3, 2, 1)


@pytest.mark.parametrize(
    ("spec", "mixed"),
    [
        (pc.case({"pp": 2, "dp": 2}, data="fsdp"), True),
        pytest.param(pc.case({"pp": 2, "dp": 2}, data="fsdp"), False, marks=pytest.mark.slow),
        pytest.param(
            pc.case({"pp": 2, "dp": 2}, "interleaved1f1b", stages_per_rank=2, data="fsdp"),
            True,
            marks=pytest.mark.slow,
        ),
    ],
    ids=["1f1b-bf16-fp32", "1f1b-fp32", "interleaved-bf16-fp32"],
)
def test_whole_gradients_held_across_micro_batches_equal_the_estimate(world, spec, mixed):
    # torch's PipelineStage turns FSDP2's gradient sync off for every micro-batch's backward and
    # reduce-scatters once after the last: until then each stage's gradients stay whole, in the
    # reduce dtype (FSDP2's unsharded_accumulated_grad). Measured on every rank, both pp coordinates.
    for result in world.run(pm.accumulated_grad_bytes, spec, mixed):
        assert result["measured"] == result["estimated"] > 0
        # and a stage holds none before its first backward, all of them after it: the
        # estimate's peak counts only the stages that ran one (held_peak_parts)
        for before, after, estimated in result["firsts"].values():
            assert before == 0
            assert after == estimated > 0, result
