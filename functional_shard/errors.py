"""The one exception family of functional_shard.

Every problem a caller can fix is a `ShardingError`: it says what failed, where (the
parameter path or option), the values involved, the mesh, and how to fix it. Problems
found while checking a whole plan are collected and raised once, one bullet each.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MeshError", "PlanError", "PolicyError", "ShardingError", "SpecError"]


class ShardingError(ValueError):
    """A plan, policy, mesh or spec that cannot work, with the reason and a fix."""


class MeshError(ShardingError):
    """A mesh that is malformed or does not fit the processes at hand."""


class SpecError(ShardingError):
    """A PartitionSpec that is malformed or cannot be expressed by the engine."""


class PolicyError(ShardingError):
    """Policies that cannot be combined, or a rule that is malformed."""


class PlanError(ShardingError):
    """A plan that does not fit the model: one bullet per offending parameter."""


def bullets(header: str, problems: Iterable[str], fix: str) -> str:
    """Format several problems as one message: a header, one bullet each, a fix."""
    lines = [header]
    lines.extend(f"* {problem}" for problem in problems)
    lines.append(fix)
    return "\n".join(lines)
