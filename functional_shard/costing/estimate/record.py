"""What `fs.estimate` returns: `Estimate`, and under a pipeline its `PipelineEstimate`.

Records only: the numbers and their readable forms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from functional_shard.core.sequence import ENGINE_LABELS
from functional_shard.core.units import format_bytes as _bytes
from functional_shard.core.units import parse_bytes
from functional_shard.costing.time.documents import RowDocuments
from functional_shard.costing.time.hardware import Hardware
from functional_shard.costing.time.kernel_time import FLOAT8_PART, IDLE_PART
from functional_shard.costing.time.kernels import Kernels
from functional_shard.planning.pipeline.schedules import Timeline
from functional_shard.planning.plan.cost_record import Cost

from .reserved import MODEL as RESERVED_MODEL

__all__ = ["Estimate", "PipelineEstimate", "StageEstimate", "duration"]


def duration(seconds: float) -> str:
    """Milliseconds to two decimals; a tiny model's steps in microseconds, not "0.00 ms"."""
    if 0 < seconds < 1e-5:
        return f"{seconds * 1e6:.2f} us"
    return f"{seconds * 1e3:.2f} ms"


@dataclass(frozen=True)
class Estimate:
    """Peak device memory and step time of one training step, on one rank.

    ``memory`` holds the parts of the peak in bytes (``params``, ``grads``, ``optimizer``, ``buffers``,
    ``gathered``, ``activations``, ``loss_workspace``, and ``ring_workspace``, ``recompute`` or
    ``optimizer_step`` where they add to it; docs/will-it-fit.md says what each counts). ``flops``
    is per device per step, recompute included; ``model_flops`` without it (what MFU counts). Under
    a pipeline ``batch`` is the step's batch, the parts are the worst pp rank's and
    ``compute_seconds`` is the schedule's makespan.
    """

    rank: int
    batch: int
    seq: int
    hardware: Hardware
    dtype: str
    memory: Mapping[str, int]
    host_bytes: int
    flops: float
    model_flops: float
    compute_seconds: float
    exposed_seconds: Mapping[str, float]
    """Communication that compute does not hide, by reason."""
    comm_seconds: Mapping[str, float]
    """Every collective's time at its link's bandwidth, ``"kind over axes (link)"`` -> s."""
    tensor_parallel: int = 1
    context_parallel: int = 1
    """The cp size: its ranks share each sequence's tokens, as a tensor-parallel group shares them."""
    context_engine: str | None = None
    """The cp engine counted, ``"ring"`` (torch's) or ``"all_gather"`` (ours); ``None`` without cp."""
    cost: Cost | None = field(default=None, compare=False, repr=False)
    pipeline: PipelineEstimate | None = field(default=None, compare=False, repr=False)
    peak_at: str = "the start of backward"
    """When in the step the peak falls."""
    kernels: Kernels = field(default_factory=Kernels)
    """The kernels counted beyond eager bf16 (``estimate(kernels=...)``)."""
    compute_parts: Mapping[str, float] = field(default_factory=dict)
    """``compute_seconds`` by kind of kernel where the hardware has `KernelRates`; else empty. With Float8,
    ``"float8"``: what its GEMMs save net of their casts (negative); under a pipeline, ``"pipeline idle"``:
    the rank's wait in the schedule. They sum to ``compute_seconds``."""
    reserved: Mapping[str, int] = field(default_factory=dict)
    """What the CUDA caching allocator holds at the peak beyond ``memory``, by stream."""
    reserved_model: str = RESERVED_MODEL
    """How ``reserved`` was counted (``estimate(reserved=...)``), as `explain` states it."""
    documents: RowDocuments | None = None
    """The packed rows whose documents attention was counted for (``estimate(documents=...)``)."""
    activations: int | None = None
    """What the forward keeps, where the peak falls after backward freed it; ``None``: the part's."""

    @property
    def activation_bytes(self) -> int:
        """Bytes autograd keeps for backward during the model call, wherever the peak falls."""
        return self.memory["activations"] if self.activations is None else self.activations

    @property
    def peak_bytes(self) -> int:
        """Device memory at the step's peak (`peak_at`): every part together."""
        return sum(self.memory.values())

    @property
    def reserved_peak_bytes(self) -> int:
        """The peak as ``torch.cuda.max_memory_reserved`` counts it: the caching allocator's segments.

        ``peak_bytes`` plus ``reserved``; docs/will-it-fit.md states the model and holds it
        to an H200's rows.
        """
        return self.peak_bytes + sum(self.reserved.values())

    @property
    def step_seconds(self) -> float:
        """Compute at the achievable rate plus exposed communication."""
        return self.compute_seconds + sum(self.exposed_seconds.values())

    @property
    def tokens_per_second(self) -> float:
        """Tokens per second per device (tensor-parallel and cp groups and a pipeline share tokens)."""
        pp = self.pipeline.pp if self.pipeline is not None else 1
        shared = self.tensor_parallel * self.context_parallel * pp
        return self.batch * self.seq / shared / self.step_seconds

    @property
    def useful_tokens_per_second(self) -> float:
        """`tokens_per_second` of the documents' tokens alone, padding left out (``estimate(documents=...)``).

        Without ``documents`` every token counts: `tokens_per_second`.
        """
        if self.documents is None:
            return self.tokens_per_second
        return self.tokens_per_second * (1 - self.documents.padding_share)

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recompute) per second over the datasheet's peak in the compute dtype."""
        return self.model_flops / self.step_seconds / self.hardware.peak_flops(self.dtype)

    def fits(self, budget: int | str) -> bool:
        """Whether the reserved peak fits in ``budget`` (bytes or text, see `parse_bytes`).

        The reserved peak, not the allocated one: torch runs out of memory when its
        allocator cannot reserve a segment, cached blocks of other streams counted.
        """
        return self.reserved_peak_bytes <= parse_bytes(budget)

    def explain(self) -> str:
        """A readable breakdown of memory and time."""
        hw = self.hardware
        batch = "batch" if self.pipeline is not None else "micro-batch"
        lines = [
            f"estimate on rank {self.rank}, {hw.name}, {batch} {self.batch} x {self.seq} tokens, "
            f"compute in {self.dtype}",
            *([self.documents.describe()] if self.documents is not None else []),
            f"peak memory {_bytes(self.peak_bytes)} (at {self.peak_at})"
            + (f"; host {_bytes(self.host_bytes)}" if self.host_bytes else ""),
        ]
        lines += [f"  {part:<15} {_bytes(nbytes)}" for part, nbytes in self.memory.items()]
        lines.append(f"reserved peak {_bytes(self.reserved_peak_bytes)}: {self.reserved_model}")
        width = max([15, *(len(part) for part in self.reserved)])
        lines += [f"  {part:<{width}} {_bytes(nbytes)}" for part, nbytes in self.reserved.items()]
        if self.context_engine is not None:
            lines.append(
                f"context parallel {self.context_parallel}: attention by "
                f"{ENGINE_LABELS.get(self.context_engine, self.context_engine)}"
            )
        if self.compute_parts:
            rates = hw.kernel_rates
            rate_of = (
                {
                    "matmul": f"at {rates.matmul / 1e12:.0f} TFLOP/s",
                    "attention": f"at {rates.attention / 1e12:.0f} TFLOP/s",
                    "memory-bound": f"at {rates.bandwidth / 1e12:.2f} TB/s",
                    FLOAT8_PART: "(float8 GEMMs and their casts less bf16 GEMMs: negative where they save)",
                    IDLE_PART: "(the schedule's bubble and waits)",
                }
                if rates
                else {}
            )
            lines.append(
                f"step {duration(self.step_seconds)}: compute {duration(self.compute_seconds)} by kernel kind"
                + (f" (with {', '.join(self.kernels.names)})" if self.kernels.names else "")
                + f"; MFU {self.mfu:.1%} ({self.model_flops / 1e12:.3f} model TFLOP)"
            )
            lines += [
                f"  {kind:<15} {duration(s)} {rate_of.get(kind, '')}"
                for kind, s in self.compute_parts.items()
            ]
        else:
            lines.append(
                f"step {duration(self.step_seconds)}: compute {duration(self.compute_seconds)} "
                f"({self.flops / 1e12:.3f} TFLOP at {hw.achievable_flops(self.dtype) / 1e12:.1f} TFLOP/s"
                + (f"; with {', '.join(self.kernels.names)}" if self.kernels.names else "")
                + ")"
            )
        why_width = max([22, *(len(why) for why in self.exposed_seconds)])
        what_width = max([34, *(len(what) for what in self.comm_seconds)])
        lines += [f"  exposed {why:<{why_width}} {duration(s)}" for why, s in self.exposed_seconds.items()]
        lines += [f"  collective {what:<{what_width}} {duration(s)}" for what, s in self.comm_seconds.items()]
        useful = (
            f" ({self.useful_tokens_per_second:,.0f} of documents, padding left out)"
            if self.documents is not None and self.documents.padding_share
            else ""
        )
        lines.append(f"tokens/s per device {self.tokens_per_second:,.0f}{useful}, MFU {self.mfu:.1%}")
        if self.pipeline is not None:
            lines.append(self.pipeline.explain())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def to_dict(self) -> dict[str, Any]:
        """The numbers as JSON-ready data."""
        return {
            "rank": self.rank,
            "hardware": self.hardware.name,
            "batch": self.batch,
            "seq": self.seq,
            "dtype": self.dtype,
            "memory": dict(self.memory),
            "peak_bytes": self.peak_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            **({"reserved": dict(self.reserved)} if self.reserved else {}),
            "reserved_model": self.reserved_model,
            "host_bytes": self.host_bytes,
            "flops": self.flops,
            "model_flops": self.model_flops,
            "compute_seconds": self.compute_seconds,
            "exposed_seconds": dict(self.exposed_seconds),
            "comm_seconds": dict(self.comm_seconds),
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_second,
            **(
                {"useful_tokens_per_second": self.useful_tokens_per_second}
                if self.documents is not None
                else {}
            ),
            "mfu": self.mfu,
            **({"context_engine": self.context_engine} if self.context_engine is not None else {}),
            **(
                {"documents": [list(row) for row in self.documents.rows]}
                if self.documents is not None
                else {}
            ),
            **({"kernels": dataclasses.asdict(self.kernels)} if self.kernels.names else {}),
            **({"compute_parts": dict(self.compute_parts)} if self.compute_parts else {}),
            **({"pipeline": self._pipeline_dict()} if self.pipeline is not None else {}),
        }

    def _pipeline_dict(self) -> dict[str, Any]:
        pipe = self.pipeline
        assert pipe is not None
        return {
            "schedule": pipe.schedule,
            "microbatches": pipe.microbatches,
            "microbatch": pipe.microbatch,
            "bubble": pipe.bubble,
            "makespan": pipe.timeline.makespan,
            "rank_peak_bytes": list(pipe.rank_peak_bytes),
            "stages": [dataclasses.asdict(stage) for stage in pipe.stages],
        }


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage: where it runs, what one micro-batch keeps and costs there.

    Attributes:
        stage: its index.
        rank: the pp coordinate that runs it.
        modules: its module paths.
        activation_bytes: what it keeps for backward of one micro-batch, its output and loss included.
        in_flight: the most micro-batches it holds at once under the schedule.
        forward_seconds: one micro-batch's forward.
        backward_seconds: one micro-batch's backward (recompute included).
        send_bytes: the activation it sends the next stage per micro-batch (0 for the last).
        buffer_bytes: torch's receive buffers (activation in, output's gradient), one per micro-batch.
        whole_grad_bytes: its gradients as FSDP2 keeps them whole across micro-batches (0 without FSDP).
    """

    stage: int
    rank: int
    modules: tuple[str, ...]
    activation_bytes: int
    in_flight: int
    forward_seconds: float
    backward_seconds: float
    send_bytes: int
    buffer_bytes: int = 0
    whole_grad_bytes: int = 0


@dataclass(frozen=True)
class PipelineEstimate:
    """The pipeline side of an `functional_shard.estimate.Estimate`.

    Attributes:
        schedule: the schedule's name.
        microbatches: micro-batches per step.
        microbatch: sequences per micro-batch.
        stages: each stage's `StageEstimate`.
        rank_peak_bytes: per pp coordinate, its peak memory (the estimate reports the worst).
        timeline: the schedule run on the clock.
        kept_output_bytes: the last stage's output per micro-batch kept to the step's end, else 0.
        rank_memory: per pp coordinate, its peak by part, as `Estimate.memory` is the chosen one's.
    """

    schedule: str
    microbatches: int
    microbatch: int
    stages: tuple[StageEstimate, ...]
    rank_peak_bytes: tuple[int, ...]
    timeline: Timeline
    kept_output_bytes: int = 0
    rank_memory: tuple[Mapping[str, int], ...] = field(default=(), compare=False, repr=False)

    @property
    def pp(self) -> int:
        """Ranks along the pipeline axis."""
        return self.timeline.pp

    @property
    def bubble(self) -> float:
        """The share of the ranks' time the schedule leaves idle."""
        return self.timeline.bubble

    @property
    def stage_activation_bytes(self) -> tuple[int, ...]:
        """Per stage, the activation bytes of one micro-batch."""
        return tuple(stage.activation_bytes for stage in self.stages)

    def explain(self) -> str:
        """Lines on the schedule and each stage."""
        lines = [
            f"pipeline {self.schedule}: {self.pp} ranks, {len(self.stages)} stages, {self.microbatches} "
            f"micro-batches of {self.microbatch}; bubble {self.bubble:.1%} of "
            f"{duration(self.timeline.makespan)}"
        ]
        for s in self.stages:
            lines.append(
                f"  stage {s.stage} on pp rank {s.rank}: activations {_bytes(s.activation_bytes)} x "
                f"{s.in_flight} in flight, forward {duration(s.forward_seconds)}, backward "
                f"{duration(s.backward_seconds)}, sends {_bytes(s.send_bytes)}, receive buffers "
                f"{_bytes(s.buffer_bytes)}"
                + (
                    f", gradients whole from its first backward {_bytes(s.whole_grad_bytes)}"
                    if s.whole_grad_bytes
                    else ""
                )
            )
        if self.kept_output_bytes:
            lines.append(
                f"  the last stage keeps each micro-batch's output ({_bytes(self.kept_output_bytes)}) "
                "to the step's end, and concatenates them"
            )
        lines += [f"  pp rank {r} peak {_bytes(b)}" for r, b in enumerate(self.rank_peak_bytes)]
        return "\n".join(lines)
