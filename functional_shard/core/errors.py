"""The one exception family of functional_shard.

Every problem a caller can fix is a `ShardingError` saying what failed, where, the values, the mesh
and the fix; a whole plan's problems are raised once, one bullet each.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "MeshError",
    "PlanError",
    "PolicyError",
    "ShardingError",
    "SpecError",
    "bullets",
    "counted",
    "one_line",
]


class ShardingError(ValueError):
    """A plan, policy, mesh or spec that cannot work, with the reason and a fix."""

    # ``name=value`` when a check of core/validate.py refused one argument: the public entry
    # point that took it names itself in front (`core.validate.entry_point`), then clears it
    argument: str | None = None
    # (that entry point, ``name=value``) once it has: a front end that took the value under
    # another name (a command line's flag) can name it its own way
    named: tuple[str, str] | None = None


class MeshError(ShardingError):
    """A mesh that is malformed or does not fit the processes at hand."""


class SpecError(ShardingError):
    """A PartitionSpec that is malformed or cannot be expressed by the engine."""


class PolicyError(ShardingError):
    """Policies that cannot be combined, or a rule that is malformed."""


class PlanError(ShardingError):
    """A plan that does not fit the model: one bullet per offending parameter."""


# tracebacks and pickles name the path users import from (`fs.ShardingError`), not the
# module that happens to define the family
for _error in (ShardingError, MeshError, SpecError, PolicyError, PlanError):
    _error.__module__ = "functional_shard"


def bullets(header: str, problems: Iterable[str], fix: str) -> str:
    """Format several problems as one message: a header, one bullet each, a fix."""
    lines = [header]
    lines.extend(f"* {problem}" for problem in problems)
    lines.append(fix)
    return "\n".join(lines)


def counted(number: int, noun: str) -> str:
    """``number`` and ``noun``, plural unless it is one, for a message.

    Examples:
        >>> counted(1, "device"), counted(8, "device")
        ('1 device', '8 devices')
    """
    return f"{number} {noun}{'' if number == 1 else 's'}"


def one_line(error: BaseException | str, limit: int | None = None) -> str:
    r"""An error's message on one line: its header, bullets and fix joined by ``"; "``.

    For a table cell or a prefix of another message; past ``limit`` characters, cut at a word with ``" …"``.

    Examples:
        >>> one_line(ShardingError(bullets("2 problems:", ["a is odd", "b is odd"], "Fix both.")))
        '2 problems; a is odd; b is odd; Fix both.'
        >>> one_line("a message   spread over\n  two lines", limit=16)
        'a message …'
    """
    lines = (line.strip().removeprefix("* ").rstrip(":") for line in str(error).splitlines())
    text = "; ".join(" ".join(line.split()) for line in lines if line)
    if limit is None or len(text) <= limit:
        return text
    return text[: limit - 1].rpartition(" ")[0] + " …"
