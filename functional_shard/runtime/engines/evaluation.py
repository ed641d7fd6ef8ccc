"""`forward_only` and `forward_loss`: evaluation's forward (no gradients) for any plan, pipeline or not."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from functional_shard.core.document_attention import PackedForward, packed_forward
from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import entry_point, refuse
from functional_shard.planning.plan.plan import Plan

from .applied import applied_with
from .pipeline import Pipelined, pipeline_eval_outputs, pipeline_of, scheduled_loss
from .step import (
    LossFn,
    check_microbatches,
    checked_pipelined_rows,
    forward_keywords,
    loss_function,
    one_number,
    packed_microbatch_loss,
    taking_packed,
)
from .tensor_parallel import loss_context, plain_loss, vocabulary_split_loss


def _evaluated(
    plan: Plan, module: nn.Module, root: str, caller: str
) -> tuple[nn.Module, Pipelined | None, PackedForward]:
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
        forward = module.get_submodule(root)
    except AttributeError:
        refuse("root", repr(root), "a submodule of the module", meaning="'' for the module itself")
    # read from the whole model: under a pipeline, before this rank's stages were cut from it
    return forward, pipelined, pipelined.packing if pipelined is not None else packed_forward(forward)


@contextmanager
def _no_grad() -> Iterator[None]:
    # no_grad, and out of inference mode (Lightning evaluates in it on NCCL): FSDP2 keeps
    # the buffers it all-gathers into, and one made in inference mode cannot be written
    # by the next training step (torch refuses an in-place update of an inference tensor)
    with torch.inference_mode(False), torch.no_grad():
        yield


@entry_point
def forward_only(plan: Plan, module: nn.Module, *, root: str = "") -> Callable[..., torch.Tensor]:
    """A function ``forward(inputs) -> outputs``: the model's forward under ``plan``, without gradients.

    Under a pipeline plan the schedule runs forward only and the last stage's outputs are
    sent to every rank of the pipeline; otherwise it is ``module(inputs)`` under
    ``torch.no_grad()``. Every rank passes its data-parallel slice of the batch.

    Packed rows (`fs.pack`) go in by keyword, ``forward(batch.tokens, positions=batch.positions,
    document_ids=batch.document_ids)``, as to `forward_backward`: to the zoo's Llama as they are, to a
    Hugging Face causal LM as `fs.packed_inputs` gives them; under a pipeline every stage is given
    its micro-batch's rows of them.

    Args:
        plan: the plan `apply` ran.
        module: the module `apply` returned.
        root: the submodule whose forward runs the model, as `apply` took it; "" under a pipeline.

    Returns:
        ``forward(inputs, *, positions=None, document_ids=None)``, returning the model's outputs
        (detached; under a pipeline one tensor). Its arguments:

        - ``inputs``: this rank's data-parallel slice of the batch (packed rows' ``tokens``).
        - ``positions``: packed rows' positions, each document's from 0 (`PackedBatch.positions`).
        - ``document_ids``: packed rows' document ids (`PackedBatch.document_ids`).

    Raises:
        ShardingError: ``module`` was not applied with ``plan``, or the plan has context parallel;
            from ``forward``, a batch the micro-batch count does not divide (under a pipeline: or no
            tensor of rows), packed rows given to a
            model whose attention would cross documents, or (under a pipeline) a packed document
            that straddles two micro-batches or inputs its first stage cannot run (on every pp rank).

    Examples:
        >>> plan = fs.shard(nn.Linear(4, 2), fs.Mesh(dp=1), fs.replicate())
        >>> # on every rank, after fs.apply(plan, model):
        >>> # forward = fs.forward_only(plan, model); logits = forward(inputs)
    """
    caller = "fs.forward_only"
    forward, pipelined, packing = _evaluated(plan, module, root, caller)

    def run(
        inputs: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        packed = packing.taken(caller, positions, document_ids)
        with _no_grad():
            if pipelined is not None:
                check_microbatches(plan, caller, inputs=inputs, **packed)
                with checked_pipelined_rows(plan, inputs, packed, f"{caller} under a pipeline"):
                    return pipeline_eval_outputs(pipelined, inputs, packed)
            return forward(inputs, **forward_keywords(packing, inputs, packed, caller))

    return run


@entry_point
def forward_loss(
    plan: Plan, module: nn.Module, loss_fn: LossFn, *, root: str = ""
) -> Callable[..., torch.Tensor]:
    """A function ``loss(inputs, targets) -> loss``: ``loss_fn`` evaluated under ``plan``, without gradients.

    The evaluation counterpart of `forward_backward`: under a pipeline plan the last stage
    computes the loss per micro-batch and only the mean is sent to every rank of the pipeline.
    Packed rows go in by keyword as to `forward_only`; under a pipeline each micro-batch's loss, a
    mean over its targets that are not ``-100``, is weighted by its share of them, as in training.

    Args:
        plan: the plan `apply` ran.
        module: the module `apply` returned.
        loss_fn: ``loss_fn(outputs, targets)``, a mean over the (micro-)batch.
        root: the submodule whose forward runs the model, as `apply` took it.

    Returns:
        ``loss(inputs, targets, *, positions=None, document_ids=None)``, returning the batch's mean
        loss (detached), the same on every pp rank. Its arguments:

        - ``inputs``: this rank's data-parallel slice of the batch (packed rows' ``tokens``).
        - ``targets``: the slice's targets (packed rows' ``labels``).
        - ``positions``: packed rows' positions, each document's from 0 (`PackedBatch.positions`).
        - ``document_ids``: packed rows' document ids (`PackedBatch.document_ids`).

    Raises:
        ShardingError: as `forward_only`, or a ``loss_fn`` that is no function; later, from ``loss``, as
            ``forward`` of `forward_only`, a ``loss_fn`` that returns no single number, or one that
            fails on a loss-parallel plan's vocabulary-split logits.

    Examples:
        >>> plan = fs.shard(nn.Linear(4, 2), fs.Mesh(dp=1), fs.replicate())
        >>> # on every rank, after fs.apply(plan, model):
        >>> # evaluate = fs.forward_loss(plan, model, torch.nn.functional.mse_loss)
        >>> # loss = evaluate(inputs, targets)
    """
    caller = "fs.forward_loss"
    forward, pipelined, packing = _evaluated(plan, module, root, caller)
    given = vocabulary_split_loss(plan, loss_function(loss_fn))

    def one_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        # a vector of losses would come back as it is, or averaged over a pipeline's micro-batches
        return one_number(given(outputs, targets), caller, "it returns the batch's mean loss, one number")

    def run(inputs: torch.Tensor, targets: torch.Tensor, **packed: torch.Tensor) -> torch.Tensor:
        with _no_grad(), loss_context(plan):
            if pipelined is not None:
                check_microbatches(plan, caller, inputs=inputs, targets=targets, **packed)
                with checked_pipelined_rows(plan, inputs, packed, f"{caller} under a pipeline"):
                    loss_of = packed_microbatch_loss(plan, one_loss, targets) if packed else one_loss
                    return scheduled_loss(
                        pipelined, loss_of, inputs, targets, forward_only=True, keywords=packed
                    )
            keywords = forward_keywords(packing, inputs, packed, caller)
            return plain_loss(one_loss(forward(inputs, **keywords), targets))

    return taking_packed(run, packing, caller)
