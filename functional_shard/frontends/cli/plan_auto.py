"""``functional-shard plan --auto``: search meshes and policies, list the candidates, take the best."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from functional_shard.core.errors import counted
from functional_shard.core.units import format_bytes as _bytes

from .inputs import InputError
from .output import Out

if TYPE_CHECKING:
    from torch import nn

    from functional_shard.costing.estimate.estimate import Estimate
    from functional_shard.costing.time.hardware import Hardware
    from functional_shard.planning.plan.plan import Plan
    from functional_shard.search.report import AutoReport, Candidate

__all__ = ["search"]


def search(
    model: nn.Module, args: argparse.Namespace, *, budget: int, hardware: Hardware, say: Out
) -> tuple[Plan, Estimate | None]:
    """Search plans for ``model`` as ``args`` ask, print the candidates; the best plan and its estimate.

    Args:
        model: the model, on the meta device.
        args: the plan command's arguments (``devices``, ``optimizer``, ``batch``, ``seq``, ``top``,
            ``kernels``).
        budget: memory per device, bytes.
        hardware: the accelerator the step times are for.
        say: where the candidates table goes.

    Returns:
        The fastest plan that fits, and the estimate the search made of it.

    Raises:
        ShardingError: no plan fits; the message names the closest and by how much it is over.

    Examples:
        >>> from functional_shard.frontends.cli import main
        >>> argv = ["--auto", "--devices", "2", "--budget", "1GiB", "--seq", "16", "--top", "1"]
        >>> main(["plan", "--model", "tiny", *argv])  # doctest: +ELLIPSIS
        14 candidates on h100, budget 1.00 GiB: 12 fit; the first 1, those that fit first, fastest first:
        mesh ...
        chosen: Mesh(...) ...; its plan and estimate:
        ...
        0
    """
    from functional_shard.search.auto import search_plans

    from .inputs import read_kernels

    report = search_plans(
        model,
        devices=args.devices,
        memory_budget=budget,
        optimizer=args.optimizer,
        batch=args.batch,
        seq=args.seq,
        hardware=hardware,
        kernels=read_kernels(args.kernels) if args.kernels else None,
    )
    _candidates_table(say, report, 10 if args.top is None else args.top)
    say.text()
    if report.best is None or report.best_candidate is None:
        raise InputError(_nothing_fits(report, args.devices))
    chosen = report.best_candidate
    say.text(f"chosen: {chosen.mesh!r} {chosen.policy_text}; its plan and estimate:")
    say.text()
    return report.best, chosen.estimate  # the search estimated it already


def _candidates_table(out: Out, report: AutoReport, top: int) -> None:
    """The search's candidates, those that fit first, fastest first (as ``AutoReport.table``)."""
    from functional_shard.search.report import step_text

    def rows(candidates: tuple[Candidate, ...]) -> list[tuple[str, ...]]:
        return [
            (
                repr(c.mesh),
                c.policy_text,
                _bytes(c.peak_bytes) if c.peak_bytes is not None else "-",
                step_text(c.step_seconds) if c.step_seconds is not None else "-",
                "chosen" if c is report.best_candidate else (c.rejected or "fits"),
            )
            for c in candidates
        ]

    ranked = rows(tuple(sorted(report.candidates, key=lambda c: (not c.fits, c.key()))[:top]))
    shown = f"the first {len(ranked)}" if len(ranked) < len(report.candidates) else "all"
    if report.no_tensor_parallel:
        out.text(f"no tensor parallelism: {report.no_tensor_parallel}")
    out.table(
        f"{str(report).splitlines()[0]}; {shown}, those that fit first, fastest first:",
        ("mesh", "policy", "peak", "step", "verdict"),
        ranked,
        numbers=(2, 3),
    )
    experts = report.expert_parallel_candidates
    if experts:
        out.text()
        out.table(
            "expert parallel (experts split by index over ep), the best of each ep size:",
            ("mesh", "policy", "peak", "step", "verdict"),
            rows(experts),
            numbers=(2, 3),
        )


def _nothing_fits(report: AutoReport, devices: int) -> str:
    estimated = [(c.peak_bytes, c) for c in report.candidates if c.peak_bytes is not None]
    on = counted(devices, "device")
    head = f"--budget: no plan fits {_bytes(report.budget_bytes)} per device on {on}"
    if not estimated:
        return head + "; no candidate could be planned for this model"
    peak, closest = min(estimated, key=lambda pair: pair[0])
    return (
        f"{head}; the closest, {closest.mesh!r} {closest.policy_text}, peaks at {_bytes(peak)} "
        f"({_bytes(peak - report.budget_bytes)} over): use more devices, a smaller --batch or "
        "--seq, or a larger --budget"
    )
