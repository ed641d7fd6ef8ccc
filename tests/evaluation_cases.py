"""fs.forward_only and fs.forward_loss between accumulating fs.forward_backward steps (LocalWorld ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import functional_shard as fs

from . import pipeline_cases
from .dist_cases import full

SPEC = pipeline_cases.case({"pp": 2, "dp": 2}, data="fsdp")


def halves() -> tuple[torch.Tensor, torch.Tensor]:
    """Two global batches (two data-parallel slices of 4 rows each)."""
    first, second, *_ = pipeline_cases.batches(2)
    return first, second


def accumulate_around_evaluation() -> dict[str, Any]:
    """Two forward_backward steps without zeroing between, an evaluation of the second batch
    in the middle: this rank's data-parallel index, the loss, the outputs and its stages'
    whole gradients."""
    model = pipeline_cases.build(SPEC)
    plan = fs.shard(model, fs.Mesh(pp=2, dp=2), pipeline_cases.policy_of(SPEC))
    fs.apply(plan, model)
    step = fs.forward_backward(plan, model, pipeline_cases.lm_loss)
    evaluate = fs.forward_loss(plan, model, pipeline_cases.lm_loss)
    forward = fs.forward_only(plan, model)
    index, _ = plan.data_parallel_rank(dist.get_rank())
    first, second = (batch[index * 4 : (index + 1) * 4] for batch in halves())
    step(first[:, :-1], first[:, 1:])
    loss = evaluate(second[:, :-1], second[:, 1:])
    outputs = forward(second[:, :-1])
    step(second[:, :-1], second[:, 1:])
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return {"index": index, "loss": float(loss), "outputs": outputs, "params": grads}


def reference() -> tuple[list[float], list[torch.Tensor], dict[str, torch.Tensor]]:
    """One process: each data-parallel slice's loss and outputs on the second batch, and the
    gradients of the two global batches' losses summed."""
    model = pipeline_cases.build(SPEC)
    first, second = halves()
    with torch.no_grad():
        slices = [second[d * 4 : (d + 1) * 4] for d in (0, 1)]
        losses = [pipeline_cases.lm_loss(model(x[:, :-1]), x[:, 1:]).item() for x in slices]
        outputs = [model(x[:, :-1]) for x in slices]
    total = sum(pipeline_cases.lm_loss(model(b[:, :-1]), b[:, 1:]) for b in (first, second))
    assert isinstance(total, torch.Tensor)
    total.backward()
    return losses, outputs, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def evaluate_on_a_v(schedule: str) -> dict[str, Any]:
    """forward_loss and forward_only on pp=2 under a V-shaped ``schedule``, then a training step and
    forward_loss again: the two losses and the outputs (this rank's ends of the V are stages 0 and 3)."""
    spec = pipeline_cases.case({"pp": 2}, schedule, stages_per_rank=2)
    model = pipeline_cases.build(spec)
    plan = fs.shard(model, fs.Mesh(pp=2), pipeline_cases.policy_of(spec))
    fs.apply(plan, model)
    evaluate = fs.forward_loss(plan, model, pipeline_cases.lm_loss)
    tokens = pipeline_cases.batches(1)[0]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    before = float(evaluate(inputs, targets))
    outputs = fs.forward_only(plan, model)(inputs)
    trained = float(fs.forward_backward(plan, model, pipeline_cases.lm_loss)(inputs, targets))
    return {
        "before": before,
        "outputs": outputs,
        "trained": trained,
        "after": float(evaluate(inputs, targets)),
    }


def one_process_evaluation() -> tuple[float, torch.Tensor]:
    """`evaluate_on_a_v`'s loss and outputs in one process."""
    model = pipeline_cases.build(pipeline_cases.case({"pp": 2}))
    tokens = pipeline_cases.batches(1)[0]
    with torch.no_grad():
        outputs = model(tokens[:, :-1])
    return pipeline_cases.lm_loss(outputs, tokens[:, 1:]).item(), outputs
