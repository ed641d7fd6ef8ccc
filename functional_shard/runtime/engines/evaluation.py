"""`forward_only` and `forward_loss`: evaluation's forward (no gradients) for any plan, pipeline or not."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import entry_point, refuse
from functional_shard.planning.plan.plan import Plan

from .applied import applied_with
from .pipeline import Pipelined, pipeline_eval_loss, pipeline_eval_outputs, pipeline_of
from .step import LossFn, check_microbatches
from .tensor_parallel import loss_context, plain_loss


def _evaluated(plan: Plan, module: nn.Module, root: str, caller: str) -> tuple[nn.Module, Pipelined | None]:
    applied_with(plan, module, caller)
    pipelined = pipeline_of(module)
    if root and pipelined is not None:
        refuse(
            "root", repr(root), "'' under a pipeline plan", meaning="a stage runs the module's own forward"
        )
    if plan.config.context is not None:
        raise ShardingError(
            f"{caller} under a context-parallel plan is not built: each rank holds chunks of the "
            "sequences; evaluate under a plan without cp (a checkpoint loads under any plan)"
        )
    try:
        return module.get_submodule(root), pipelined
    except AttributeError:
        refuse("root", repr(root), "a submodule of the module", meaning="'' for the module itself")


@contextmanager
def _no_grad() -> Iterator[None]:
    # no_grad, and out of inference mode (Lightning evaluates in it on NCCL): FSDP2 keeps
    # the buffers it all-gathers into, and one made in inference mode cannot be written
    # by the next training step (torch refuses an in-place update of an inference tensor)
    with torch.inference_mode(False), torch.no_grad():
        yield


@entry_point
def forward_only(plan: Plan, module: nn.Module, *, root: str = "") -> Callable[[torch.Tensor], torch.Tensor]:
    """A function ``forward(inputs) -> outputs``: the model's forward under ``plan``, without gradients.

    Under a pipeline plan the schedule runs forward only and the last stage's outputs are
    sent to every rank of the pipeline; otherwise it is ``module(inputs)`` under
    ``torch.no_grad()``. Every rank passes its data-parallel slice of the batch.

    Args:
        plan: the plan `apply` ran.
        module: the module `apply` returned.
        root: the submodule whose forward runs the model, as `apply` took it; "" under a pipeline.

    Returns:
        ``forward(inputs)``, returning the model's outputs (detached; under a pipeline one tensor).

    Raises:
        ShardingError: ``module`` was not applied with ``plan``, or the plan has context parallel;
            from ``forward``, a batch the micro-batch count does not divide.

    Examples:
        >>> plan = fs.shard(nn.Linear(4, 2), fs.Mesh(dp=1), fs.replicate())
        >>> # on every rank, after fs.apply(plan, model):
        >>> # forward = fs.forward_only(plan, model); logits = forward(inputs)
    """
    forward, pipelined = _evaluated(plan, module, root, "fs.forward_only")

    def run(inputs: torch.Tensor) -> torch.Tensor:
        with _no_grad():
            if pipelined is not None:
                check_microbatches(plan, "fs.forward_only", inputs=inputs)
                return pipeline_eval_outputs(pipelined, inputs)
            return forward(inputs)

    return run


@entry_point
def forward_loss(
    plan: Plan, module: nn.Module, loss_fn: LossFn, *, root: str = ""
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A function ``loss(inputs, targets) -> loss``: ``loss_fn`` evaluated under ``plan``, without gradients.

    The evaluation counterpart of `forward_backward`: under a pipeline plan the last stage
    computes the loss per micro-batch and only the mean is sent to every rank of the pipeline.

    Args:
        plan: the plan `apply` ran.
        module: the module `apply` returned.
        loss_fn: ``loss_fn(outputs, targets)``, a mean over the (micro-)batch.
        root: the submodule whose forward runs the model, as `apply` took it.

    Returns:
        ``loss(inputs, targets)``, returning the batch's mean loss (detached), the same on every pp rank.

    Raises:
        ShardingError: as `forward_only`; later, from ``loss``, a batch the micro-batch
            count does not divide.

    Examples:
        >>> plan = fs.shard(nn.Linear(4, 2), fs.Mesh(dp=1), fs.replicate())
        >>> # on every rank, after fs.apply(plan, model):
        >>> # evaluate = fs.forward_loss(plan, model, torch.nn.functional.mse_loss)
        >>> # loss = evaluate(inputs, targets)
    """
    forward, pipelined = _evaluated(plan, module, root, "fs.forward_loss")

    def run(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with _no_grad(), loss_context(plan):
            if pipelined is not None:
                check_microbatches(plan, "fs.forward_loss", inputs=inputs, targets=targets)
                return pipeline_eval_loss(pipelined, loss_fn, inputs, targets)
            return plain_loss(loss_fn(forward(inputs), targets))

    return run
