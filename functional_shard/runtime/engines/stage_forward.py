"""How a pipeline stage runs the model's own forward: what goes in, what comes out, and when.

A stage's module keeps the model's forward; only its input (the hidden states, on every stage
but the first) and its output (one tensor) change, and it runs only while a schedule does.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from functional_shard.core.document_attention import PackedForward
from functional_shard.core.errors import ShardingError


class ScheduleGate:
    """Whether a schedule runs this rank's stages now.

    Called by anyone else, a stage's forward would run this rank's stages of the model alone:
    on the first stage the hidden states come back as if they were the model's output.
    """

    def __init__(self) -> None:
        self.open = False
        # while a step runs a batch layout not checked yet: what the forward of a stage after the
        # first raised (the stage, the error), kept for every pp rank to raise after the step
        self.catching = False
        self.failure: tuple[int, BaseException] | None = None

    @contextlib.contextmanager
    def running(self, catching: bool = False) -> Iterator[None]:
        """Let the stages' forwards run within; ``catching``: keep a later stage's failure (`failure`)."""
        self.open, self.catching, self.failure = True, catching, None
        try:
            yield
        finally:
            self.open = self.catching = False


def _called_directly(who: str) -> ShardingError:
    return ShardingError(
        f"{who}: the pipelined model was called directly, which runs this rank's stages alone, not "
        "the model; run it through fs.forward_backward, fs.forward_loss or fs.forward_only"
    )


def refuse_direct_calls(module: nn.Module, stages: Sequence[int]) -> None:
    """Refuse ``module``'s own forward where this rank runs several ``stages``, each through a view of it.

    Called, it would run those stages' modules in one pass, the other ranks' passed through.
    """

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise _called_directly(f"pipeline stages {', '.join(map(str, stages))}")

    module.forward = refused  # type: ignore[method-assign]


def _keywords(module: nn.Module) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _tensor_of(output: Any, stage: int) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ShardingError(
        f"pipeline stage {stage}: the model's forward returned a {type(output).__name__}; a pipelined "
        "model returns a tensor, a tuple starting with one, or an output with .logits"
    )


def run_as_stage(
    stage_module: nn.Module, stage: int, first: bool, packing: PackedForward, gate: ScheduleGate
) -> None:
    """Make ``stage_module``'s forward the model's forward of pipeline stage ``stage``, run under ``gate``."""
    # The stage's module runs the model's own forward; only what goes in and what comes out
    # change: a later stage's input is the hidden states (inputs_embeds= for Hugging Face).
    # Packed rows' positions= and document_ids= reach every stage: torch's schedule splits the
    # step's keyword tensors into micro-batches and hands them to each stage it runs, which turns
    # its micro-batch's into what the forward takes (a Hugging Face model's position_ids=,
    # use_cache=False: no value but a tensor goes through the schedule's keywords)
    forward = stage_module.forward
    embeds = not first and "inputs_embeds" in _keywords(stage_module)
    who = f"pipeline stage {stage}"

    # the shape and dtype of this stage's last output: a stand-in's, once a forward failed
    produced: list[tuple[torch.Size, torch.dtype]] = []

    def stage_forward(hidden: torch.Tensor, **packed: torch.Tensor) -> torch.Tensor:
        if not gate.open:
            raise _called_directly(who)
        if first or not gate.catching:
            return run(hidden, packed)
        if gate.failure is None:
            try:
                output = run(hidden, packed)
            except Exception as error:  # any: every pp rank raises it after the step
                gate.failure = (stage, error)
            else:
                produced[:] = [(output.shape, output.dtype)]
                return output
        return _stand_in(hidden, produced[0] if produced else None)

    def run(hidden: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
        keywords = (
            packing.keywords(hidden, packed.get("positions"), packed.get("document_ids"), who=who)
            if packed
            else {}
        )
        given = forward(inputs_embeds=hidden, **keywords) if embeds else forward(hidden, **keywords)
        output = _tensor_of(given, stage)
        # a view (Hugging Face slices the hidden states for its head) would lose FSDP2's
        # pre-backward hook to any in-place op, and FSDP2 warns: hand on a tensor of its own
        return output.clone() if output._is_view() else output

    stage_module.forward = stage_forward  # type: ignore[method-assign]


def _stand_in(hidden: torch.Tensor, produced: tuple[torch.Size, torch.dtype] | None) -> torch.Tensor:
    """Zeros for a failed stage to hand on, so that the schedule runs to its end on every pp rank.

    Shaped as the stage's last output (a micro-batch that failed after one that ran), else as its
    input; the gradient flows back through it, to the stage before (zeros), as torch's schedule
    waits for one.
    """
    if produced is None or (produced[0] == hidden.shape and produced[1] == hidden.dtype):
        return hidden * 0
    shape, dtype = produced
    return hidden.new_zeros(shape, dtype=dtype) + (hidden.sum() * 0).to(dtype)
