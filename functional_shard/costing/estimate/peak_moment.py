"""When in a step a rank's memory peaks: at backward's start or end, or in the optimizer's step. Pure.

Gradients are made during backward and used by the step after it; ``zero_grad()`` sets them to
``None``. The optimizer's ``step()`` holds every gradient and what it allocates itself, the
activations, the loss's workspace and the gathered units freed: on a short or checkpointed sequence
that is the step's peak (bench/data/h200/memory-llama-1b_4k_full.json.gz), shown as the part
``optimizer_step``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from functional_shard.costing.cost.cost_model import OptimizerKind

__all__ = ["peak_moment", "step_held", "step_temporaries", "with_optimizer_step"]

_STATES = ("params", "grads", "optimizer", "buffers")


def step_temporaries(optimizer_bytes: int, optimizer: OptimizerKind) -> int:
    """Bytes the optimizer's ``step()`` allocates beside its state, alive to the step's end.

    torch's foreach Adam and AdamW (``_multi_tensor_adam``) take ``_foreach_sqrt`` of every
    ``exp_avg_sq`` at once: a temporary the size of one of the two states for each parameter,
    half the state. SGD steps in place; of an optimizer given as state bytes per element,
    nothing is known.

    Examples:
        >>> step_temporaries(800, "adamw"), step_temporaries(800, "sgd"), step_temporaries(800, 8.0)
        (400, 0, 0)
    """
    return optimizer_bytes // 2 if optimizer in ("adam", "adamw") else 0


def step_held(memory: Mapping[str, int], optimizer: OptimizerKind) -> int:
    """Bytes a rank holds in the optimizer's step: its states, every gradient, and `step_temporaries`.

    Examples:
        >>> step_held({"params": 4, "grads": 4, "optimizer": 8, "activations": 2}, "adamw")
        20
    """
    return _states(memory) + step_temporaries(memory.get("optimizer", 0), optimizer)


def _states(memory: Mapping[str, int]) -> int:
    return sum(memory.get(part, 0) for part in _STATES)


def with_optimizer_step(parts: dict[str, int], peak_at: str, held: int) -> tuple[dict[str, int], str]:
    """``parts`` and ``peak_at``, or the optimizer step's where its ``held`` bytes are more.

    Then ``optimizer_step`` is the part that says how much more.

    Examples:
        >>> parts = {"params": 4, "grads": 4, "activations": 2}
        >>> with_optimizer_step(parts, "backward", held=9)
        ({'params': 4, 'grads': 4, 'activations': 2}, 'backward')
        >>> found, peak_at = with_optimizer_step(parts, "backward", held=11)
        >>> found["optimizer_step"], peak_at
        (1, 'the optimizer step, every gradient made')
    """
    beyond = held - sum(parts.values())
    if beyond > 0:
        return parts | {"optimizer_step": beyond}, "the optimizer step, every gradient made"
    return parts, peak_at


def peak_moment(memory: dict[str, int], optimizer: OptimizerKind) -> tuple[dict[str, int], str]:
    """A rank's peak by part, and when it falls, for a step without a pipeline.

    The start of backward, without gradients, or its end where that holds more: every gradient,
    and of the rest only the states and the gathered units (the activation-side parts are 0);
    then the optimizer step (`with_optimizer_step`).

    Examples:
        >>> parts = {"params": 4, "grads": 4, "optimizer": 8, "gathered": 1}
        >>> parts |= {"activations": 1, "loss_workspace": 5}
        >>> peak_moment(parts, "sgd")[1]
        'the start of backward, before any gradient is made'
        >>> ended, peak_at = peak_moment(parts | {"grads": 9}, "sgd")
        >>> ended["activations"], sum(ended.values()), peak_at
        (0, 22, 'the end of backward, every gradient made')
        >>> found, peak_at = peak_moment(parts, "adamw")
        >>> found["optimizer_step"], sum(found.values()), peak_at
        (1, 20, 'the optimizer step, every gradient made')
    """
    held = step_held(memory, optimizer)
    if sum(memory.values()) - memory.get("grads", 0) < _states(memory) + memory.get("gathered", 0):
        at = "the end of backward, every gradient made"
        if held >= sum(memory.values()):  # the step outweighs every part: they keep their sizes
            return with_optimizer_step(memory, at, held)
        # backward has freed what the forward kept: the states and the units still gathered
        ended = {part: n if part in (*_STATES, "gathered") else 0 for part, n in memory.items()}
        return with_optimizer_step(ended, at, held)
    return with_optimizer_step(
        memory | {"grads": 0}, "the start of backward, before any gradient is made", held
    )
