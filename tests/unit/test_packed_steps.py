"""Packed rows through fs.forward_backward, fs.forward_only and fs.forward_loss on one rank.

The zoo Llama takes them as they are; a Hugging Face model is given them as `fs.packed_inputs`
gives them (position_ids=, use_cache=False). Either trains and evaluates as the model called by
hand in one process. Pipelines and 4 ranks: tests/dist/test_packed_plans.py and
tests/dist/test_evaluation.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import functional_shard as fs

from .. import cp_cases
from ..dist_cases import full

KINDS = ["zoo", "hf_qwen2"]


def _applied(kind: str, policy: fs.Policy | None = None) -> tuple[nn.Module, fs.Plan]:
    model = cp_cases.build(kind)
    plan = fs.shard(model, fs.Mesh(dp=1), policy or fs.fsdp())
    return fs.apply(plan, model), plan


def _rows() -> dict[str, torch.Tensor]:
    return cp_cases.packed_batches(1)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_packed_rows_train_and_evaluate_as_the_model_called_by_hand(one_rank, kind):
    if kind.startswith("hf_"):
        pytest.importorskip("transformers")
    rows = _rows()
    packed = {"positions": rows["positions"], "document_ids": rows["document_ids"]}
    reference = cp_cases.build(kind)
    logits = cp_cases.logits_of(cp_cases.run_packed(reference, rows))
    expected = cp_cases.loss_fn(logits, rows["labels"])
    expected.backward()

    model, plan = _applied(kind)
    loss = fs.forward_backward(plan, model, cp_cases.loss_fn)(rows["tokens"], rows["labels"], **packed)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    for name, parameter in model.named_parameters():
        wanted = reference.get_parameter(name).grad
        torch.testing.assert_close(full(parameter.grad), wanted, atol=1e-6, rtol=1e-5, msg=name)
    evaluated = fs.forward_loss(plan, model, cp_cases.loss_fn)(rows["tokens"], rows["labels"], **packed)
    assert evaluated.item() == pytest.approx(expected.item(), abs=1e-6)
    outputs = fs.forward_only(plan, model)(rows["tokens"], **packed)
    torch.testing.assert_close(cp_cases.logits_of(outputs), logits.detach(), atol=1e-6, rtol=1e-5)


def test_a_hugging_face_models_packed_rows_are_refused_under_context_parallel(one_rank):
    pytest.importorskip("transformers")
    model = cp_cases.build("hf_qwen2")
    plan = fs.shard(model, fs.Mesh(cp=1), fs.replicate("cp") + fs.cp("cp"))
    model = fs.apply(plan, model)
    rows = _rows()
    step = fs.forward_backward(plan, model, cp_cases.loss_fn)
    with pytest.raises(fs.ShardingError, match="a Hugging Face model's packed rows do not run under context"):
        step(rows["tokens"], rows["labels"], positions=rows["positions"], document_ids=rows["document_ids"])


@pytest.mark.parametrize("evaluation", ["fs.forward_only", "fs.forward_loss"])
def test_evaluating_packed_rows_with_a_forward_without_them_is_refused(one_rank, evaluation):
    model = nn.Sequential(nn.Embedding(128, 8), nn.Linear(8, 128))
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
    model = fs.apply(plan, model)
    rows = _rows()
    if evaluation == "fs.forward_only":
        run = fs.forward_only(plan, model)
    else:
        run = lambda tokens, **packed: fs.forward_loss(plan, model, cp_cases.loss_fn)(  # noqa: E731
            tokens, rows["labels"], **packed
        )
    message = f"{evaluation}(Sequential): its forward takes no document boundaries (no document_ids="
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        run(rows["tokens"], document_ids=rows["document_ids"])


def test_a_packed_pipeline_step_reads_the_device_as_often_whatever_its_micro_batches(one_rank):
    # the rows are checked once, up front, and each micro-batch's loss weighted on the device: on
    # a GPU every read waits for it, so a read a micro-batch (or a stage) would cost a wait each
    two, four = (cp_cases.host_reads_of_packed_pipeline_steps(count) for count in (2, 4))
    assert two == four
    # one look at the device's answer to the rows' checks; evaluation's forward alike
    assert two["fs.forward_backward"] == {"aten._local_scalar_dense": 1}
    assert two["fs.forward_only"] == {"aten._local_scalar_dense": 1}
