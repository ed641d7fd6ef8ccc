"""`forward_backward`: one training step's forward and backward for any plan, pipeline or not."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from functional_shard.core.document_attention import PackedForward, packed_forward
from functional_shard.core.document_masks import check_pipelined_documents, values_checked
from functional_shard.core.errors import ShardingError
from functional_shard.core.packing import IGNORE_INDEX, share_weighted
from functional_shard.core.validate import entry_point, instance_of, refuse
from functional_shard.planning.plan.plan import Plan

from .applied import Applied, applied_with
from .context.sharded_step import context_parallel_step
from .pipeline import Pipelined, pipeline_of, scheduled_loss
from .tensor_parallel import loss_context, plain_loss, vocabulary_split_loss

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Step = Callable[..., torch.Tensor]
"""``step(inputs, targets, *, positions=None, document_ids=None) -> loss``."""


@entry_point
def forward_backward(
    plan: Plan,
    module: nn.Module,
    loss_fn: LossFn,
    *,
    scaler: torch.amp.GradScaler | None = None,
    root: str = "",
) -> Step:
    """A step function ``step(inputs, targets) -> loss`` that runs forward and backward under ``plan``.

    Under a pipeline plan it runs the plan's schedule over its micro-batches; under context
    parallel it cuts each sequence into this rank's chunks (`fs.context_chunks`) and passes
    ``position_ids=`` when the forward takes them; otherwise it is
    ``loss_fn(module(inputs), targets).backward()``. Every rank passes its data-parallel slice
    of the batch. Gradients are scaled as one process's would be for the same batch and add to
    those already there, so steps without ``zero_grad`` between them accumulate.

    Packed rows (`fs.pack`) go in by keyword, ``step(batch.tokens, batch.labels,
    positions=batch.positions, document_ids=batch.document_ids)``, to a forward that takes them (the
    zoo's Llama) or to a Hugging Face causal LM, given them as `fs.packed_inputs` gives them
    (``position_ids=``, ``use_cache=False``). Under context parallel the rows are then cut by attention
    work, not by tokens (docs/packed-documents.md), and the loss, a mean over the targets that are not
    ``-100``, is weighted by each rank's share of them. Under a pipeline every stage is given its
    micro-batch's rows of them, and each micro-batch's loss is weighted by its share of the targets alike.

    Args:
        plan: the plan `apply` ran.
        module: the module `apply` returned.
        loss_fn: ``loss_fn(outputs, targets)``, a mean over the (micro-)batch, as ``F.cross_entropy``.
        scaler: a loss scaler (`grad_scaler`) for float16; unscale and step through it as usual.
        root: the submodule whose forward runs the model (a LightningModule's ``model``); "" under a pipeline.

    Returns:
        ``step(inputs, targets, *, positions=None, document_ids=None)``, returning the batch's mean
        loss (detached), the same on every rank of a pipeline or cp group.

    Raises:
        ShardingError: ``module`` was not applied with ``plan``, ``loss_fn`` is no function, or
            ``scaler`` no ``GradScaler``; from ``step``, a batch the micro-batch count does not divide
            (under a pipeline: or no tensor of rows), a ``loss_fn`` that returns no scalar or one no
            gradient flows back from (or that fails on a loss-parallel plan's vocabulary-split logits),
            packed rows given to a model whose attention would cross documents (`fs.packed_inputs` refuses
            alike), to a Hugging Face model under context parallel or to context parallel under a
            pipeline, or, under a pipeline, a packed document that straddles two micro-batches, inputs
            its first stage cannot run, a later stage whose forward fails on the first step of a batch
            layout, or a ``loss_fn`` that fails on its last stage (on every pp rank).

    Examples:
        >>> plan = fs.shard(nn.Linear(4, 2), fs.Mesh(dp=1), fs.replicate())
        >>> # on every rank, after fs.apply(plan, model):
        >>> # step = fs.forward_backward(plan, model, torch.nn.functional.mse_loss)
        >>> # loss = step(inputs, targets); optimizer.step(); optimizer.zero_grad()
    """
    applied = applied_with(plan, module, "fs.forward_backward")
    loss_fn = vocabulary_split_loss(plan, loss_function(loss_fn))
    if scaler is not None:
        instance_of(scaler, torch.amp.GradScaler, "scaler", meaning="fs.grad_scaler(...), or None")
    pipelined = pipeline_of(module)
    if root and pipelined is not None:
        refuse(
            "root", repr(root), "'' under a pipeline plan", meaning="a stage runs the module's own forward"
        )
    try:
        forward = module.get_submodule(root)
    except AttributeError:
        refuse("root", repr(root), "a submodule of the module", meaning="'' for the module itself")
    if pipelined is not None:
        return _pipelined_step(plan, applied, pipelined, loss_fn, scaler)
    packing = packed_forward(forward)
    if plan.config.context is not None:
        return _context_parallel_step(plan, applied, forward, packing, loss_fn, scaler)

    def step(inputs: torch.Tensor, targets: torch.Tensor, **packed: torch.Tensor) -> torch.Tensor:
        keywords = forward_keywords(packing, inputs, packed, "fs.forward_backward")
        with loss_context(plan):
            loss = scalar_loss(loss_fn(forward(inputs, **keywords), targets))
            (loss if scaler is None else scaler.scale(loss)).backward()
        return plain_loss(loss)

    return taking_packed(step, packing)


def _context_parallel_step(
    plan: Plan,
    applied: Applied,
    forward: nn.Module,
    packing: PackedForward,
    loss_fn: LossFn,
    scaler: torch.amp.GradScaler | None,
) -> Step:
    """`forward_backward`'s step under cp without a pipeline: ``forward`` on this rank's chunks."""

    def run(
        inputs: torch.Tensor,
        targets: torch.Tensor,
        positions: torch.Tensor,
        packed: dict[str, torch.Tensor],
        weight: float,
        counted: torch.Tensor,  # unused: this share's loss is weighted as a whole (``weight``)
    ) -> torch.Tensor:
        extra = (
            {"position_ids": positions.expand(inputs.shape[0], -1)}
            if "position_ids" in packing.takes and not packed
            else packed
        )
        with loss_context(plan):
            loss = scalar_loss(loss_fn(forward(inputs, **extra), targets))
            weighted = loss if weight == 1.0 else loss * weight
            (weighted if scaler is None else scaler.scale(weighted)).backward()
        return plain_loss(loss)

    return taking_packed(
        context_parallel_step(plan, applied.device_mesh, run),
        packing,
        refusal=""
        if not packing.attention
        else "a Hugging Face model's packed rows do not run under context parallel: the context "
        "engine keeps each document's attention apart by the mask of a forward that takes "
        "document_ids= (the zoo's Llama), and it would have to read the mask a Hugging Face model "
        "builds from position_ids inside its forward, which it does not; train the model's packed "
        "rows under fsdp, tp or a pipeline, or the zoo's Llama under cp",
    )


def _pipelined_step(
    plan: Plan, applied: Applied, pipelined: Pipelined, loss_fn: LossFn, scaler: torch.amp.GradScaler | None
) -> Step:
    """`forward_backward`'s step under a pipeline: the plan's schedule over the micro-batches."""

    def scaled(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = scalar_loss(loss_fn(outputs, targets))
        return loss if scaler is None else scaler.scale(loss)

    def pipeline(inputs: torch.Tensor, targets: torch.Tensor, **packed: torch.Tensor) -> torch.Tensor:
        return scheduled(
            inputs, targets, packed, packed_microbatch_loss(plan, scaled, targets) if packed else scaled
        )

    def scheduled(
        inputs: torch.Tensor, targets: torch.Tensor, packed: dict[str, torch.Tensor], loss_of: LossFn
    ) -> torch.Tensor:
        check_microbatches(plan, "fs.forward_backward", inputs=inputs, targets=targets, **packed)
        with checked_pipelined_rows(plan, inputs, packed, "fs.forward_backward under a pipeline"):
            if scaler is not None:
                # only the last stage's ranks scale a loss; the others' scalers must have a
                # scale too, to unscale their gradients and step
                scaler.scale(torch.zeros((), device=inputs.device))
            with loss_context(plan):
                loss = scheduled_loss(pipelined, loss_of, inputs, targets, keywords=packed)
        if scaler is not None:
            loss = loss / scaler.get_scale()
        return loss

    # read from the whole model, before this rank's stages were cut from it
    packing = pipelined.packing
    context = plan.config.context
    if context is not None:  # each stage attends over the whole sequences from its rank's chunks
        # each micro-batch's chunk loss, a mean over its counted targets, weighted by its share of
        # the step's (over every cp rank's chunks): the mean over micro-batches and cp ranks is
        # the rows' mean, as in one process (a chunk of ignored targets alone adds nothing)
        parts = _microbatches(plan) * context.size(plan.mesh)

        def chunks(
            inputs: torch.Tensor,
            targets: torch.Tensor,
            positions: torch.Tensor,
            packed: dict[str, torch.Tensor],
            weight: float,
            counted: torch.Tensor,
        ) -> torch.Tensor:
            return scheduled(inputs, targets, {}, counted_share_loss(scaled, counted, parts))

        staged = context_parallel_step(
            plan, applied.device_mesh, chunks, stages=pipelined.group, weighs=False
        )
        return taking_packed(
            staged,
            packing,
            refusal="packed rows do not run under context parallel and a pipeline together (the context "
            "engine's document masks would cover the step's rows, not a micro-batch's); train them under "
            "a pipeline without cp, or under cp without a pipeline",
        )
    return taking_packed(pipeline, packing)


def forward_keywords(
    packing: PackedForward, inputs: torch.Tensor, packed: dict[str, torch.Tensor], who: str
) -> dict[str, object]:
    """What the forward is given beside ``inputs`` for the ``packed`` rows' keywords (none: nothing)."""
    if not packed:
        return {}
    return packing.keywords(inputs, packed.get("positions"), packed.get("document_ids"), who=who)


@contextmanager
def checked_pipelined_rows(
    plan: Plan, inputs: torch.Tensor, packed: dict[str, torch.Tensor], who: str
) -> Iterator[None]:
    """Refuse packed rows a pipeline cannot run, checked whole on every rank before the schedule runs.

    A stage's forward refusing on one rank would leave the others waiting for its hidden states.
    Within, each stage's forward checks its micro-batch's shapes alone (`values_checked`): the
    step reads the device once for the rows, not once a micro-batch and a stage.
    """
    if not packed:
        yield
        return
    microbatches = _microbatches(plan)
    positions, document_ids = packed.get("positions"), packed.get("document_ids")
    check_pipelined_documents(
        inputs, positions=positions, document_ids=document_ids, microbatches=microbatches, who=who
    )
    with values_checked():
        yield


def packed_microbatch_loss(plan: Plan, loss_fn: LossFn, targets: torch.Tensor) -> LossFn:
    """``loss_fn`` on a micro-batch of packed rows, weighted by its share of the step's ``targets``."""
    return counted_share_loss(loss_fn, (targets != IGNORE_INDEX).sum(), _microbatches(plan))


def counted_share_loss(loss_fn: LossFn, counted: torch.Tensor, parts: int) -> LossFn:
    """``loss_fn`` on one of a step's ``parts`` parts, weighted by its share of the ``counted`` targets.

    Each part's loss (a pipeline's micro-batch, under cp a rank's chunks of one), a mean over its
    counted targets, is weighted by its share of them: the mean over the parts is then the rows'
    mean, as in one process. The weights stay on the device (`share_weighted`): no micro-batch
    waits for a read of its count.
    """

    def weighted(outputs: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        return share_weighted(loss_fn(outputs, part), part, counted, parts)

    return weighted


def _microbatches(plan: Plan) -> int:
    """Micro-batches a step's rows are cut into (1 without a pipeline)."""
    return plan.config.pipeline.microbatches if plan.config.pipeline else 1


def taking_packed(
    step: Step, packing: PackedForward, who: str = "fs.forward_backward", refusal: str = ""
) -> Step:
    """``step(inputs, targets, **packed)`` taking packed rows' ``positions=`` and ``document_ids=``.

    They are refused before anything runs, on every rank alike, where the model's attention would
    cross documents (``packing``, read from the whole model; a pipeline's stages run its own
    forward) or ``refusal`` says why the plan runs no packed rows for it, and what instead.
    """

    def packed_step(
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return step(inputs, targets, **packing.taken(who, positions, document_ids, refusal=refusal))

    return packed_step


def loss_function(loss_fn: object) -> LossFn:
    """``loss_fn`` if it can be called as ``loss_fn(outputs, targets)``; refused before any step runs.

    Examples:
        >>> loss_function("mse")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: loss_fn='mse': a function loss_fn(outputs, targets) (as ...)
    """
    if not callable(loss_fn):
        refuse("loss_fn", repr(loss_fn), "a function loss_fn(outputs, targets)", meaning="as F.cross_entropy")
    return loss_fn  # type: ignore[no-any-return]  # callable, the signature is the caller's to keep


def scalar_loss(loss: object) -> torch.Tensor:
    """``loss`` if it is one number to run a backward from; refused otherwise, with the fix.

    Examples:
        >>> scalar_loss(torch.ones(3)).item()
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: fs.forward_backward: loss_fn returned a tensor of shape (3,), ...
    """
    loss = one_number(loss, "fs.forward_backward", "the step runs the backward from one number")
    if not loss.requires_grad:
        raise ShardingError(
            "fs.forward_backward: loss_fn returned a loss that no gradient flows back from: the "
            "module's parameters are all frozen (requires_grad=False), the step ran under "
            "torch.no_grad(), or loss_fn detached the loss; train some parameter, call the step "
            "outside no_grad, or evaluate with fs.forward_loss"
        )
    return loss


def one_number(loss: object, caller: str, needs: str) -> torch.Tensor:
    """``loss`` if it is a tensor of one number; refused otherwise, naming ``caller`` and what ``needs`` one.

    Examples:
        >>> one_number(torch.ones(()), "fs.forward_loss", "it returns the batch's mean").item()
        1.0
    """
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    raise ShardingError(
        f"{caller}: loss_fn returned {got}, but {needs}; return a scalar loss: a mean over the batch "
        "(reduction='mean', or loss.mean()) or a sum"
    )


def check_microbatches(plan: Plan, caller: str, **batches: torch.Tensor) -> None:
    """Refuse a batch that is no tensor of rows, or that the plan's micro-batch count does not divide.

    Under a pipeline every rank checks alike, before the schedule runs: a stage that refused
    alone would leave the others waiting for what it sends.
    """
    microbatches = _microbatches(plan)
    for name, batch in batches.items():
        meaning = f"{caller} cuts its rows into {microbatches} micro-batch(es)"
        instance_of(batch, torch.Tensor, name, meaning=meaning)
        if batch.ndim == 0:
            refuse(name, "a scalar tensor", "a tensor whose first dim is the batch's rows", meaning=meaning)
        if not batch.shape[0]:
            raise ShardingError(
                f"{caller}: the {name}' batch has no rows; pass at least {microbatches} (one a micro-batch)"
            )
        if batch.shape[0] % microbatches:
            raise ShardingError(
                f"{caller}: the {name}' batch of {batch.shape[0]} does not split into the "
                f"plan's {microbatches} micro-batches ({batch.shape[0]} % {microbatches} != 0); pass a "
                f"batch that is a multiple of {microbatches}, or plan pipeline(microbatches=...) again"
            )
