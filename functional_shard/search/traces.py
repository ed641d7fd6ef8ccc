"""The search's activation traces: one per what a trace reads of the plans, a failure kept as its error."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from functional_shard.costing.estimate import estimate as _estimate

if TYPE_CHECKING:
    from functional_shard.costing.trace.activations import ActivationTrace
    from functional_shard.planning.plan.plan import Plan

__all__ = ["TraceCache", "TraceKey"]

_BACKWARD = (
    "backward_flops",
    "backward_weight_flops",
    "attention_backward_flops",
    "attention_kernel_backward_flops",
    "memory_bound_backward_bytes",
)
_STAGE_BACKWARD = ("stage_backward_flops", "stage_backward_weight_flops")


@dataclass(frozen=True)
class TraceKey:
    """What a trace of one of the search's plans depends on, besides what the whole search shares.

    Neither the data-parallel family (tests/unit/test_auto.py checks it) nor the ep size is in it:
    under balanced routing every ep size runs the same local work (`trace.rank_experts`).
    """

    tensor_parallel: int
    sequence_parallel: bool
    checkpointing: str
    """"none", "selective" or "full", of the repeated blocks."""
    micro_batch: int
    expert_parallel: bool = False
    by_unit: bool = False
    """Each unit of work traced as its own stage: one trace serves every cut into stages."""
    context_parallel: int = 1
    """The cp size: a rank runs a cp-th of each sequence, its attention over all of it."""


class TraceCache:
    """The traces of one search: each key traced once, from the first plan that asks for it.

    A trace that raised is kept as its exception, which the candidate's row reports.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate("dp"))
        >>> traces = TraceCache(model, seq=16)
        >>> key = TraceKey(1, False, "none", 2)
        >>> traces.trace(plan, key) is traces.trace(plan, key)
        True
    """

    def __init__(
        self,
        model: Any,
        *,
        seq: int,
        checkpointed: tuple[str, ...] = (),
        units: tuple[tuple[str, ...], ...] = (),
        cuda: bool = False,
    ) -> None:
        self.model = model
        self.seq = seq
        self.checkpointed = checkpointed  # the modules fs.checkpointing(block) selects
        self.units = units  # the units of work a key by_unit traces as stages
        self.cuda = cuda  # trace torch's CUDA kernel choices (the hardware's, as fs.estimate does)
        self._traces: dict[TraceKey, ActivationTrace | Exception] = {}

    def trace(self, plan: Plan, key: TraceKey) -> ActivationTrace | Exception:
        """The trace of ``key``: ``plan`` (with the key's checkpointing) traced the first time."""
        if key not in self._traces:
            self._traces[key] = self._traced(plan, key)
        return self._traces[key]

    def with_checkpointing(self, plan: Plan, how: str) -> Plan:
        """``plan`` with ``how`` checkpointing of the repeated blocks, as fs.checkpointing adds it."""
        if how == "none":
            return plan
        config = dataclasses.replace(plan.config, checkpointed=self.checkpointed, checkpoint_policy=how)
        return dataclasses.replace(plan, config=config)

    def _traced(self, plan: Plan, key: TraceKey) -> ActivationTrace | Exception:
        trace = _estimate._trace  # looked up per call: tests substitute the tracer
        plain = None if key.checkpointing == "none" else self.trace(plan, _plain(key))
        checkpointed = self.with_checkpointing(plan, key.checkpointing)
        try:
            if plain is None or isinstance(plain, Exception):
                return self._run(trace, checkpointed, key)
            return self._checkpointed(checkpointed, key, plain, trace)
        except Exception as error:  # reported in the candidate's row, never silently dropped
            return error.with_traceback(None)  # its text is all the row needs, not the frames

    def _run(self, trace: Any, plan: Plan, key: TraceKey, **options: Any) -> ActivationTrace:
        stages = {"stages": self.units} if key.by_unit else {}
        return trace(
            self.model, plan, batch=key.micro_batch, seq=self.seq, cuda=self.cuda, **stages, **options
        )

    def _checkpointed(self, plan: Plan, key: TraceKey, plain: ActivationTrace, trace: Any) -> ActivationTrace:
        # checkpointing leaves the backward's own kernels as they are, and a forward-only trace
        # counts the recompute (selective: none when the kept ops hold every flop), so the
        # backward's flops are the plan's without checkpointing, unless the forward differs
        forward = self._run(trace, plan, key, backward=False)
        if (
            (key.checkpointing == "selective" and forward.recompute_flops)
            or forward.forward_flops != plain.forward_flops
            or forward.stage_forward_flops != plain.stage_forward_flops
        ):
            return self._run(trace, plan, key)
        backward = _BACKWARD + _STAGE_BACKWARD if key.by_unit else _BACKWARD
        return dataclasses.replace(forward, **{name: getattr(plain, name) for name in backward})


def _plain(key: TraceKey) -> TraceKey:
    return dataclasses.replace(key, checkpointing="none")
