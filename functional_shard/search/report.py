"""What a search found: each `Candidate` it estimated, the `AutoReport` of them all, and their text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from functional_shard.core.mesh import Mesh
from functional_shard.core.units import format_bytes as _bytes
from functional_shard.core.validate import positive_int
from functional_shard.costing.estimate.record import Estimate
from functional_shard.costing.estimate.record import duration as _duration
from functional_shard.costing.estimate.reserved import SIMULATED
from functional_shard.costing.time.hardware import Hardware
from functional_shard.costing.time.kernels import Kernels
from functional_shard.planning.plan.plan import Plan

__all__ = ["AutoReport", "Candidate", "step_text"]


@dataclass(frozen=True)
class Candidate:
    """One point of the search space and what the estimate said of it."""

    mesh: Mesh
    family: str
    tensor_parallel: int
    sequence_parallel: bool
    checkpointing: str
    offload: bool
    policy_text: str
    peak_bytes: int | None = None
    """The estimate's reserved peak (`Estimate.reserved_peak_bytes`), which the budget holds."""
    step_seconds: float | None = None
    rejected: str | None = None
    """Why it was not chosen for fitting: None if it fits."""
    estimate: Estimate | None = field(default=None, compare=False, repr=False)
    pipeline: tuple[str, int, int] | None = None
    """(schedule, stages per rank, micro-batches) under pipeline parallelism."""
    expert_parallel: int = 1
    """Ranks the experts are split over by expert index (the ``ep`` axis); 1: none."""
    context_parallel: int = 1
    """Ranks each sequence is cut over (the ``cp`` axis); 1: none."""

    @property
    def fits(self) -> bool:
        """Whether it was estimated and its peak fits the budget."""
        return self.rejected is None

    def key(self) -> tuple[Any, ...]:
        """Sort key: fastest first, ties broken by smaller peak then by text (deterministic).

        Steps equal to 12 significant digits tie: the estimate sums the same parts of a step in
        another order for each plan, which leaves equal steps a rounding error apart.
        """
        return (
            float(f"{self.step_seconds:.12g}") if self.step_seconds is not None else float("inf"),
            self.peak_bytes if self.peak_bytes is not None else 1 << 80,
            self.policy_text,
            repr(self.mesh),
        )


def _ranked(candidates: tuple[Candidate, ...]) -> list[Candidate]:
    # the order of every table: those that fit first, then fastest first
    return sorted(candidates, key=lambda c: (not c.fits, c.key()))


@dataclass(frozen=True)
class AutoReport:
    """Every candidate `search_plans` looked at, and the chosen plan."""

    candidates: tuple[Candidate, ...]
    best_candidate: Candidate | None
    best: Plan | None
    budget_bytes: int
    hardware: Hardware
    no_tensor_parallel: str | None = None
    """Why tensor parallelism was left out of the search (None when it was searched)."""
    kernels: Kernels | None = None
    """The kernels the candidates were estimated with (None: eager)."""

    @property
    def expert_parallel_candidates(self) -> tuple[Candidate, ...]:
        """For each expert-parallel size searched, its best candidate (fitting first, then fastest).

        Examples:
            >>> from functional_shard.zoo import llama
            >>> report = fs.search_plans(llama("tiny"), devices=1, memory_budget="1GiB", batch=2, seq=16)
            >>> report.expert_parallel_candidates  # a dense model: none
            ()
        """
        best: dict[int, Candidate] = {}
        for c in _ranked(self.candidates):
            if c.expert_parallel > 1:
                best.setdefault(c.expert_parallel, c)
        return tuple(best[size] for size in sorted(best))

    def table(self, top: int | None = 10, candidates: tuple[Candidate, ...] | None = None) -> str:
        """The candidates (by default all) as a table, fitting ones first, fastest first; the first ``top``.

        Raises:
            ShardingError: ``top`` is not a positive int or None (None lists every row).
        """
        rows = _ranked(self.candidates if candidates is None else candidates)
        if top is not None:  # a slice would take -1 as "all but the last" and 0 as none
            rows = rows[: positive_int(top, "table(top)", meaning="the rows to list, or None for all")]
        mesh_width = max([4, *(len(repr(c.mesh)) for c in rows)])
        policy_width = max([6, *(len(c.policy_text) for c in rows)])
        header = f"{'mesh':<{mesh_width}} {'policy':<{policy_width}} {'peak':>11} {'step':>10}  verdict"
        lines = [header, "-" * len(header)]
        for c in rows:
            peak = _bytes(c.peak_bytes) if c.peak_bytes is not None else "-"
            step = step_text(c.step_seconds) if c.step_seconds is not None else "-"
            verdict = "chosen" if c is self.best_candidate else (c.rejected or "fits")
            lines.append(
                f"{c.mesh!r:<{mesh_width}} {c.policy_text:<{policy_width}} {peak:>11} {step:>10}  {verdict}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        fits = sum(c.fits for c in self.candidates)
        kernels = self.kernels.names if self.kernels is not None else ()
        head = (
            f"{len(self.candidates)} candidates on {self.hardware.name}"
            + (f" with {', '.join(kernels)}" if kernels else "")
            + f", budget {_bytes(self.budget_bytes)}: {fits} fit"
        )
        if self.no_tensor_parallel:
            head += f"\nno tensor parallelism: {self.no_tensor_parallel}"
        traced = sum(getattr(c.estimate, "reserved_model", None) == SIMULATED for c in self.candidates)
        if traced:  # docs/will-it-fit.md, "Choosing a plan"
            head += f"\n{traced} reserved peaks traced through the caching allocator where the fast model fit"
        text = head + "\n" + self.table()
        if self.expert_parallel_candidates:
            text += "\nexpert parallel, the best of each ep size:\n" + self.table(
                None, self.expert_parallel_candidates
            )
        return text


def step_text(seconds: float) -> str:
    """A step time for the tables: milliseconds to one decimal, a tiny model's in microseconds.

    Examples:
        >>> step_text(11.3171), step_text(0.00000099)
        ('11317.1 ms', '0.99 us')
    """
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else _duration(seconds)
