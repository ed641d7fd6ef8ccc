"""Packed rows under every plan: fsdp, fsdp × tp, pp × fsdp and cp × tp train as one process.

Context parallel alone and beside fsdp: tests/dist/test_context_parallel.py. Each case trains the
zoo Llama (or a Hugging Face model, given position_ids= by the step) on
`cp_cases.packed_batches` (one long document among short ones in each row, so the ranks and
micro-batches hold uneven counts of targets) and compares the losses, the first gradients and
the last parameters with one process (`cp_cases.reference_packed`).
"""

from __future__ import annotations

import pytest

from .. import cp_cases

# a pipeline does not keep a tie between stages in step: the pipelined cases' model is untied
PIPELINE = ({"pp": 2, "dp": 2}, "pipeline(pp, microbatches=2) + fsdp(dp)", "zoo_untied")
# a Hugging Face model's forward takes position_ids=, which the step makes of the rows' positions
HF = ({"dp": 2, "tp": 2}, "fsdp(dp) + tp(hf, tp)", "hf_qwen2")
SLOW = [
    ({"dp": 4}, "fsdp(dp)", "zoo"),
    ({"dp": 2, "tp": 2}, "fsdp(dp) + tp(llama, tp)", "zoo"),
    ({"cp": 2, "tp": 2}, "fsdp(cp) + sp(llama, tp) + cp(cp)", "zoo"),
    # sequence parallel's hidden states go between stages split over tp
    ({"pp": 2, "tp": 2}, "pipeline(pp, microbatches=2) + sp(llama, tp)", "zoo_untied"),
    # four stages of one unit each (embedding, two blocks, head), two a rank, looped
    (
        {"pp": 2, "dp": 2},
        "pipeline(pp, microbatches=2, schedule=interleaved1f1b, stages_per_rank=2) + fsdp(dp)",
        "zoo_untied",
    ),
    # every stage is given its micro-batch's position_ids (a later one beside inputs_embeds=)
    ({"pp": 2, "dp": 2}, "pipeline(pp, microbatches=2) + fsdp(dp)", "hf_llama"),
]


def _id(case: tuple[dict[str, int], str, str]) -> str:
    mesh, policy, kind = case
    looped = "-v2" if "stages_per_rank=2" in policy else ""
    hf = f"{kind}-" if kind.startswith("hf_") else ""
    return hf + "x".join(f"{axis}{size}" for axis, size in mesh.items()) + looped


def test_packed_rows_train_under_a_pipeline_as_one_process(world4):
    # every stage's forward is given its micro-batch's positions and document ids, and each
    # micro-batch's loss (one row here) is weighted by its share of the targets
    mesh, policy, kind = PIPELINE
    cp_cases.assert_packed_as_one_process(world4.run(cp_cases.train_packed, mesh, policy, kind), kind)


def test_packed_rows_train_a_hugging_face_model_as_one_process(world4):
    mesh, policy, kind = HF
    cp_cases.assert_packed_as_one_process(world4.run(cp_cases.train_packed, mesh, policy, kind), kind)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=_id)
def test_packed_rows_train_under_every_plan_as_one_process(world4, case):
    mesh, policy, kind = case
    cp_cases.assert_packed_as_one_process(world4.run(cp_cases.train_packed, mesh, policy, kind), kind)


def test_a_document_straddling_two_micro_batches_is_refused_on_every_rank(world4):
    mesh, policy, kind = PIPELINE
    errors = world4.run(cp_cases.refused_packed, mesh, policy, kind, "straddling")
    assert len(set(errors)) == 1
    assert errors[0].startswith(
        "fs.forward_backward under a pipeline: a document straddles two pipeline micro-batches in 1 row:\n"
        "* row 1, micro-batch 1's first, starts at position 3: its document goes on from row 0, "
        "in micro-batch 0"
    )


@pytest.mark.parametrize(
    ("mesh", "policy", "kind", "says"),
    [
        (
            {"dp": 2, "cp": 2},
            "fsdp(dp, cp) + cp(cp)",
            "hf_llama",
            "but a Hugging Face model's packed rows do not run under context parallel: the context engine",
        ),
        (
            {"pp": 2, "cp": 2},
            "pipeline(pp, microbatches=2) + fsdp(cp) + cp(cp)",
            "zoo_untied",
            "but packed rows do not run under context parallel and a pipeline together",
        ),
    ],
    ids=["hf-dp2xcp2", "zoo-pp2xcp2"],
)
def test_packed_rows_a_plan_cannot_run_are_refused_on_every_rank(world4, mesh, policy, kind, says):
    errors = world4.run(cp_cases.refused_packed, mesh, policy, kind, "rows")
    assert len(set(errors)) == 1
    assert says in errors[0]
