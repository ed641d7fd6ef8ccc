"""The Trainer's loops under a pipeline (or context-parallel) plan: the step helpers and the strategy's part.

A stage's forward alone is not the model's, so the LightningModule's steps call the helpers
here, the same under every plan: `training_loss`, `evaluation_loss`, `model_outputs`.
`_RunsSchedules` is the strategy's side: it builds the step functions once and hands the
schedule's gradients to Lightning's backward, scaled for gradient accumulation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.pytorch.trainer.states import TrainerFn

import functional_shard as fs

if TYPE_CHECKING:
    import lightning.pytorch as pl


class _RunsSchedules:
    """The Trainer strategy's part in running a pipeline's (or cp's) steps.

    Lightning zeroes gradients *between* ``training_step`` and ``backward``, after the
    schedule has run the backward in ``training_step``: the step's gradients are set aside
    and handed back in ``backward``, added to what earlier batches of an accumulation left.
    """

    _plan: fs.Plan | None
    _policy: fs.Policy | None
    _pipeline_step: Callable[..., torch.Tensor] | None
    _schedule_grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None
    _evaluations: dict[str, Callable[..., torch.Tensor]]
    lightning_module: Any
    precision_plugin: Any

    if TYPE_CHECKING:

        @property
        def plan(self) -> fs.Plan:
            """The strategy's plan (`_RunsAPlan.plan`)."""

    def _pipeline_axis(self) -> str | None:
        if self._plan is not None:
            pipeline = self._plan.config.pipeline
            return pipeline.axis if pipeline is not None else None
        layer = self._policy.pipeline if self._policy is not None else None
        return layer.axis if layer is not None else None

    def _pipelined(self) -> bool:
        return self._pipeline_axis() is not None

    def _context_or_loss_parallel(self) -> bool:
        # cp cuts sequences and attends over them; loss parallel runs forward and backward
        # under torch's loss_parallel(): either way fs.forward_backward runs the step
        if self._plan is not None:
            config = self._plan.config
            return config.context is not None or config.loss_parallel
        if self._policy is None:
            return False
        return self._policy.context_parallel is not None or any(
            layer.loss_parallel for layer in self._policy.tensor_parallel
        )

    def _runs_its_own_backward(self) -> bool:
        # a pipeline's schedule, or fs.forward_backward's step under cp or loss parallel
        return self._pipelined() or self._context_or_loss_parallel()

    def _module(self, who: str) -> Any:
        module = self.lightning_module
        if module is None:
            raise fs.ShardingError(f"ShardStrategy.{who} runs inside the Trainer's loops, after setup")
        return module

    def pipeline_step(
        self, inputs: torch.Tensor, targets: torch.Tensor, **packed: torch.Tensor | None
    ) -> torch.Tensor:
        """Run the plan's schedule (or cp's step) on the module's ``loss_fn``: the batch's mean loss.

        The step (`fs.forward_backward`) is built once, with the precision plugin's loss scaler;
        ``packed`` (``positions=``, ``document_ids=``) goes to it as it is, so cp cuts packed
        rows by attention work. Earlier batches' gradients stay where they are (Lightning may
        zero them next); this step's are set aside for `backward`.
        """
        module = self._module("pipeline_step")
        if self._pipeline_step is None:
            root = forward_root(module)
            scaler = getattr(self.precision_plugin, "scaler", None)
            if self._pipelined():
                self._pipeline_step = fs.forward_backward(
                    self.plan, module.get_submodule(root), module.loss_fn, scaler=scaler
                )
            else:  # cp: the plan was applied to the LightningModule, its forward is root's
                self._pipeline_step = fs.forward_backward(
                    self.plan, module, module.loss_fn, scaler=scaler, root=root
                )
        params = list(module.parameters())
        held = [param.grad for param in params]
        for param in params:
            param.grad = None
        loss = self._pipeline_step(inputs, targets, **packed)
        self._schedule_grads = [(param, param.grad) for param in params]
        for param, grad in zip(params, held, strict=True):
            param.grad = grad
        return loss

    def _hand_back_grads(self, closure_loss: torch.Tensor) -> None:
        if closure_loss.requires_grad:
            raise fs.ShardingError(
                "under a pipeline plan training_step must return training_loss(self, inputs, targets) "
                "(functional_shard.adapters.lightning), whose schedule runs the backward; it returned a "
                "loss with a graph, which would leave the stages without gradients"
            )
        if self._schedule_grads is None:
            raise fs.ShardingError(
                "under a pipeline plan training_step must return training_loss(self, inputs, targets) "
                "(functional_shard.adapters.lightning), which runs the schedule; no schedule ran this step"
            )
        module = self._module("backward")
        # Lightning divides each batch's loss by accumulate_grad_batches before its backward
        # (automatic optimization only); the schedule's gradients are of the undivided loss
        divide = module.trainer.accumulate_grad_batches if module.automatic_optimization else 1
        for param, grad in self._schedule_grads:
            if grad is None:
                continue
            if divide != 1:
                grad = grad / divide
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        self._schedule_grads = None

    def _evaluation(self, kind: str) -> Callable[..., torch.Tensor]:
        if kind not in self._evaluations:
            module = self._module(f"{kind} evaluation")
            root = forward_root(module)
            target, where = (module.get_submodule(root), "") if self._pipelined() else (module, root)
            if kind == "loss":
                self._evaluations[kind] = fs.forward_loss(self.plan, target, module.loss_fn, root=where)
            else:
                self._evaluations[kind] = fs.forward_only(self.plan, target, root=where)
        return self._evaluations[kind]


def _strategy(module: pl.LightningModule) -> _RunsSchedules | None:
    strategy = module.trainer.strategy if module._trainer is not None else None
    return strategy if isinstance(strategy, _RunsSchedules) else None


def _loss_fn(module: pl.LightningModule, helper: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    loss_fn = getattr(module, "loss_fn", None)
    if not callable(loss_fn):
        raise fs.ShardingError(
            f"{helper}: {type(module).__name__} needs a loss_fn(outputs, targets) method, a mean "
            "over the batch (under a pipeline plan the last stage calls it on each micro-batch)"
        )
    return cast(Callable[[torch.Tensor, torch.Tensor], torch.Tensor], loss_fn)


def training_loss(
    module: pl.LightningModule,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss of a training step under any strategy; return it from ``training_step``.

    Under a `ShardStrategy` with a pipeline or context-parallel plan it runs the forward and
    backward (`fs.forward_backward`) and returns the detached mean loss; Lightning's backward
    is then skipped. Otherwise it is ``module.loss_fn(child(inputs), targets)``, with
    ``child`` the module holding the parameters, for Lightning to backward as usual.

    Packed rows (`fs.pack`) pass their layout by keyword, as to `fs.forward_backward`: the
    child's forward takes them (the zoo's Llama), and under cp the rows are cut by attention
    work (docs/packed-documents.md).

    Args:
        module: the LightningModule, with a ``loss_fn(outputs, targets)`` method.
        inputs: this rank's batch of inputs (its data-parallel slice, as the sampler gives).
        targets: the matching targets (a packed batch's ``labels``).
        positions: packed rows' positions, restarting at each document (``batch.positions``).
        document_ids: packed rows' document ids (``batch.document_ids``).

    Returns:
        The mean loss of the batch.

    Raises:
        functional_shard.ShardingError: packed rows for a forward that does not take them, or that the
            plan runs none of (cp with a pipeline, a Hugging Face model under cp; from `fs.forward_backward`).

    Examples:
        >>> # def training_step(self, batch, index):
        >>> #     return training_loss(self, batch[:, :-1], batch[:, 1:])
        >>> # packed rows (a DataLoader of fs.pack(...) with collate_fn=fs.collate_packed):
        >>> #     return training_loss(self, batch.tokens, batch.labels,
        >>> #                          positions=batch.positions, document_ids=batch.document_ids)
    """
    loss_fn = _loss_fn(module, "training_loss")
    strategy = _strategy(module)
    if strategy is not None and strategy._runs_its_own_backward():
        return strategy.pipeline_step(inputs, targets, positions=positions, document_ids=document_ids)
    given = {"positions": positions, "document_ids": document_ids}
    packed = {name: value for name, value in given.items() if value is not None}
    return loss_fn(module.get_submodule(forward_root(module))(inputs, **packed), targets)


def evaluation_loss(module: pl.LightningModule, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of a validation or test step under any strategy, without gradients.

    Under a `ShardStrategy` with a pipeline plan it is `fs.forward_loss`, the same on every rank
    of the pipeline; otherwise ``module.loss_fn(child(inputs), targets)`` under ``torch.no_grad()``.

    Args:
        module: the LightningModule, with a ``loss_fn(outputs, targets)`` method.
        inputs: this rank's batch of inputs.
        targets: the matching targets.

    Returns:
        The mean loss of the batch (detached).

    Examples:
        >>> # def validation_step(self, batch, index):
        >>> #     self.log("val_loss", evaluation_loss(self, batch[:, :-1], batch[:, 1:]), sync_dist=True)
    """
    loss_fn = _loss_fn(module, "evaluation_loss")
    strategy = _strategy(module)
    if strategy is not None and not _context_parallel(strategy):
        return strategy._evaluation("loss")(inputs, targets)
    with torch.no_grad():
        return loss_fn(module.get_submodule(forward_root(module))(inputs), targets)


def model_outputs(module: pl.LightningModule, inputs: torch.Tensor) -> torch.Tensor:
    """The whole model's outputs on ``inputs`` under any strategy, without gradients (for ``predict_step``).

    Under a `ShardStrategy` with a pipeline plan it is `fs.forward_only`, whose outputs every
    rank of the pipeline gets; otherwise ``child(inputs)`` under ``torch.no_grad()``.

    Args:
        module: the LightningModule.
        inputs: this rank's batch of inputs.

    Returns:
        The model's outputs (under a pipeline one tensor: the output, or its ``logits``).

    Examples:
        >>> # def predict_step(self, batch, index):
        >>> #     return model_outputs(self, batch)
    """
    strategy = _strategy(module)
    if strategy is not None and not _context_parallel(strategy):
        return strategy._evaluation("outputs")(inputs)
    with torch.no_grad():
        return module.get_submodule(forward_root(module))(inputs)


def _context_parallel(strategy: _RunsSchedules) -> bool:
    # cp's evaluation is not built (fs.forward_loss refuses it): its ranks run the plain forward,
    # which holds the whole model; a pipeline's ranks hold their stages only, so under a
    # pipeline fs.forward_loss and fs.forward_only refuse it, on every rank alike
    return (
        strategy._plan is not None and strategy._plan.config.context is not None and not strategy._pipelined()
    )


def refuse_under_pipeline(trainer: pl.Trainer, module: torch.nn.Module, axis: str | None) -> None:
    """Refuse, before the plan is applied, what would run the stages outside the schedule."""
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    problems = []
    precision = trainer.precision_plugin
    if type(precision) not in (Precision, MixedPrecision, HalfPrecision):
        problems.append(
            f"the precision plugin {type(precision).__name__}: under a schedule only '32-true', the "
            "'*-mixed' autocast plugins and '*-true' half precision run (the schedule runs the backward, "
            "not the plugin)"
        )
    if trainer.state.fn == TrainerFn.FITTING and not callable(getattr(module, "loss_fn", None)):
        problems.append(
            f"no loss named: {type(module).__name__} needs a loss_fn(outputs, targets) method (a mean "
            "over the batch) for the schedule to call on the last stage"
        )
    refuse(f"a pipeline plan (axis {axis!r})", problems)


def refuse_under_context_parallel(trainer: pl.Trainer, module: torch.nn.Module) -> None:
    """Refuse, before the plan is applied, what cp's step cannot run."""
    # cp's step runs the backward inside training_loss (it must attend over the whole
    # sequence in the backward too, and loss parallel's backward must run under
    # loss_parallel()) and hands the gradients to Lightning's backward
    problems = []
    if trainer.accumulate_grad_batches > 1:
        problems.append(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}: each step's gradients are handed "
            "over whole; feed bigger batches instead"
        )
    if not getattr(module, "automatic_optimization", True):
        problems.append("manual optimization (automatic_optimization = False): the step runs the backward")
    if not callable(getattr(module, "loss_fn", None)):
        problems.append(
            f"no loss named: {type(module).__name__} needs a loss_fn(outputs, targets) method (a mean over "
            "its tokens), which the step calls on this rank's chunks of the sequences"
        )
    refuse("a context-parallel or loss-parallel plan", problems)


def refuse(plan: str, problems: list[str]) -> None:
    """Raise one ShardingError listing every problem, if any."""
    if problems:
        raise fs.ShardingError(
            f"ShardStrategy with {plan} cannot run this fit:\n" + "\n".join(f"* {p}" for p in problems)
        )


def forward_root(module: torch.nn.Module) -> str:
    """The name of the one child module holding the LightningModule's parameters."""
    # training_step calls the LightningModule's children, never its own forward, so the
    # engines' root hooks go on the one child that holds the parameters
    holders = [name for name, child in module.named_children() if any(True for _ in child.parameters())]
    if len(holders) != 1 or any(True for _ in module.parameters(recurse=False)):
        raise fs.ShardingError(
            f"ShardStrategy needs the LightningModule's parameters inside one child module (e.g. "
            f"self.model), whose forward training_step calls; found them in {holders or 'the module itself'}"
        )
    return holders[0]
