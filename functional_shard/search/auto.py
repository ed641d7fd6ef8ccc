"""Choose a plan: the fastest estimated step whose reserved peak memory fits a budget.

`search_plans` enumerates a small, explicit space (`candidates`), estimates every candidate
(`search`, sharing traces, plans and costs between alike candidates) and keeps the fastest that
fits (`report`). docs/will-it-fit.md, "Choosing a plan", lists the space.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec

from functional_shard.core.errors import PlanError, counted
from functional_shard.core.sequence import check_step_tokens
from functional_shard.core.units import format_bytes as _bytes
from functional_shard.core.units import parse_bytes
from functional_shard.core.validate import entry_point, positive_int, refuse
from functional_shard.costing.cost.cost_model import OptimizerKind
from functional_shard.costing.time.hardware import Hardware
from functional_shard.costing.time.hardware import hardware as _hardware
from functional_shard.costing.time.kernels import Kernels
from functional_shard.planning.plan.plan import Plan

from .candidates import LONG_SEQUENCE, Point, Space, context_points, model_facts, pipeline_points, points
from .report import AutoReport, Candidate
from .search import Search, SearchInputs

__all__ = ["auto", "search_plans"]

_P = ParamSpec("_P")
MOST_DEVICES = 2**24
"""The most devices a search takes: a guard against a typo, whose meshes would take hours to lay out."""


@entry_point
def search_plans(
    model: Any,
    *,
    devices: int,
    memory_budget: int | str,
    optimizer: OptimizerKind = "adamw",
    batch: int,
    seq: int,
    hardware: str | Hardware = "h100",
    kernels: Kernels | None = None,
) -> AutoReport:
    """Estimate every plan in the search space; report them and the fastest that fits.

    The space (docs/will-it-fit.md, "Choosing a plan"): meshes over ``devices`` with ``tp`` inside a
    node; DDP, ZeRO-1/2, FSDP, HSDP; tensor and sequence parallelism by the model's rules; expert
    parallelism for a mixture of experts; checkpointing of the repeated blocks; bf16 mixed precision.
    Context parallelism beside them from 32,768 tokens on; below that context parallelism, then
    pipelines, then CPU offload, only when nothing else fits. A candidate that cannot be traced keeps
    the reason in its row.

    Args:
        model: the module (meta device is enough).
        devices: number of devices.
        memory_budget: bytes per device, an int or text like ``"80GiB"``.
        optimizer: as for `cost`.
        batch: the global batch, in sequences per step, split over the data-parallel ranks.
        seq: tokens per sequence.
        hardware: a profile name or `Hardware`; ``"local"`` is measured with ``devices`` processes.
        kernels: the kernels the run will use (`fs.Kernels`), in each candidate that has what they need.

    Returns:
        An `AutoReport`; ``best`` is None when nothing fits.

    Raises:
        ShardingError: bad devices, batch, budget, hardware or kernels, no mesh the batch divides, or
            a model with no parameters.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> report = fs.search_plans(llama("tiny"), devices=1, memory_budget="1GiB", batch=2, seq=16)
        >>> report.best is not None and report.best_candidate.fits
        True
    """
    positive_int(devices, "devices")
    check_step_tokens(batch, seq)
    if devices > MOST_DEVICES:
        what = f"at most {MOST_DEVICES:,} (2**24), beyond any cluster"
        refuse(
            "devices", f"{devices:,}", what, meaning="the search lays out a mesh for each way to split them"
        )
    budget = parse_bytes(memory_budget)
    hw = _hardware(hardware, processes=devices)  # "local": measured on the devices the plans are for
    facts = model_facts(model)
    space = Space.of(facts, devices=devices, batch=batch, hardware=hw, seq=seq)
    flat = list(points(space))

    def pipelines() -> list[Point]:  # only when needed: checking a schedule builds torch's
        return list(pipeline_points(space, len(facts.units))) if facts.units else []

    pipes = [] if flat else pipelines()
    # context parallel splits sequences, not the batch: a batch below the device count may need it
    contexts = [] if flat or pipes else list(context_points(space))
    if not flat and not pipes and not contexts:
        refuse(
            "devices",
            f"{devices}, batch={batch}",
            "no data-parallel size divides the batch for any tensor-parallel size that fits a node and "
            "divides the heads, nor does context parallel split the sequence evenly",
            meaning="choose a batch that is a multiple of the device count",
        )
    search = Search(
        SearchInputs(
            facts=facts,
            hardware=hw,
            optimizer=optimizer,
            batch=batch,
            seq=seq,
            budget=budget,
            kernels=kernels,
        )
    )
    candidates = search.run(flat)
    if seq >= LONG_SEQUENCE or not any(c.fits for c in candidates):
        candidates += search.run(list(context_points(space)))
    if not any(c.fits for c in candidates):
        candidates += search.run(pipes or pipelines())
    if not any(c.fits for c in candidates):
        candidates += search.run(list(points(space, offload=True)))
    fitting = [c for c in candidates if c.fits]
    best_candidate = min(fitting, key=Candidate.key) if fitting else None
    best = search.final_plan(best_candidate) if best_candidate else None
    return AutoReport(
        tuple(candidates), best_candidate, best, budget, hw, facts.no_tensor_parallel, kernels=kernels
    )


def _arguments_of(search: Callable[_P, AutoReport]) -> Callable[[Callable[..., Plan]], Callable[_P, Plan]]:
    """A function taking ``search``'s arguments, declared once.

    Type checkers, IDEs and `entry_point` read ``search``'s signature, so the defaults cannot drift
    apart; a missing or unknown argument is refused in the function's own name, as Python would.
    """

    def adopt(function: Callable[..., Plan]) -> Callable[_P, Plan]:
        signature = inspect.signature(search).replace(
            return_annotation=inspect.signature(function).return_annotation
        )

        @functools.wraps(function)
        def taking(*args: Any, **kwargs: Any) -> Plan:
            try:
                signature.bind(*args, **kwargs)
            except TypeError as problem:
                raise TypeError(f"{function.__name__}() {problem}") from None
            return function(*args, **kwargs)

        taking.__signature__ = signature  # type: ignore[attr-defined]
        return taking

    return adopt


@entry_point
@_arguments_of(search_plans)
def auto(model: Any, **options: Any) -> Plan:
    """The plan with the least estimated step time whose reserved peak fits ``memory_budget``.

    Args:
        model: the module (meta device is enough).
        options: `search_plans`' keywords, its signature's: ``devices``, ``memory_budget``, ``batch``,
            ``seq``, and optionally ``optimizer``, ``hardware``, ``kernels``.

    Returns:
        The chosen `Plan`.

    Raises:
        PlanError: nothing fits; names the closest candidate and how much it misses by.
        ShardingError: bad devices, batch, budget or hardware, or a model with no parameters.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.auto(llama("tiny"), devices=1, memory_budget="1GiB", batch=2, seq=16)
        >>> plan.mesh.size
        1
    """
    report = search_plans(model, **options)
    devices = options["devices"]
    if report.best is None:
        estimated = [c for c in report.candidates if c.peak_bytes is not None]
        if not estimated:  # the first candidate's reason: often every one's (cp and a sliding window)
            reasons = [c.rejected for c in report.candidates if c.rejected]
            why = f"; the first: {reasons[0]}" if reasons else ""
            on = counted(devices, "device")
            raise PlanError(f"auto: no candidate could be planned for this model on {on}{why}")
        closest = min(estimated, key=lambda c: (c.peak_bytes, c.key()))
        assert closest.peak_bytes is not None
        raise PlanError(
            f"auto: nothing fits {_bytes(report.budget_bytes)} per device on {devices} "
            f"{report.hardware.name}; "
            f"the closest is {closest.mesh!r} {closest.policy_text} at {_bytes(closest.peak_bytes)}, "
            f"{_bytes(closest.peak_bytes - report.budget_bytes)} over; use more devices, a smaller batch "
            "or seq, or a larger budget"
        )
    return report.best
