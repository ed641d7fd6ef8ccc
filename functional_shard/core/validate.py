"""The checks of one argument that every public entry point shares: a positive int, one of, a type.

A check says in one short line what is wrong with the argument (``tokens=0: a positive int``); the
public function wrapped in `entry_point` names itself in front (``cost(tokens=0): ...``), as einops
does in ``reduce``. Each check raises the class its caller names (`ShardingError` by default) and
returns the value, so it is also the line that reads the argument.

Examples:
    >>> @entry_point
    ... def grow(size):
    ...     return positive_int(size, "size", meaning="a count of blocks")
    >>> grow(3)
    3
    >>> grow(0)
    Traceback (most recent call last):
    ...
    functional_shard.ShardingError: grow(size=0): a positive int (a count of blocks)
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
import os
import pathlib
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, NoReturn, ParamSpec, TypedDict, TypeVar

from .errors import ShardingError

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack  # typing's from Python 3.11

__all__ = [
    "device",
    "entry_point",
    "instance_of",
    "non_negative_int",
    "one_of",
    "path",
    "positive_int",
    "positive_number",
    "refuse",
    "torch_seed",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")


def refuse(
    name: str, shown: str, what: str, *, meaning: str = "", error: type[ShardingError] = ShardingError
) -> NoReturn:
    """Raise ``error``: ``name=shown: what (meaning)``, which `entry_point` prefixes with its name.

    Args:
        name: the argument, as its caller writes it.
        shown: its value as the message shows it (a repr, or a type's name).
        what: what the argument must be.
        meaning: what the argument is for, in brackets after ``what``; may say the fix.
        error: the exception class, a `ShardingError`.

    Raises:
        ShardingError: always (``error``).

    Examples:
        >>> refuse("axis", "3", "one mesh axis name")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: axis=3: one mesh axis name
    """
    argument = f"{name}={shown}"
    problem = error(f"{argument}: {what}{f' ({meaning})' if meaning else ''}")
    problem.argument = argument
    raise problem


class Refusal(TypedDict, total=False):
    """How a check words and raises its refusal: `refuse`'s keywords, which every check passes on."""

    meaning: str
    error: type[ShardingError]


def positive_int(value: Any, name: str, **refusal: Unpack[Refusal]) -> int:
    """``value`` if it is an int of at least 1 (not a bool, not a float), else refused.

    Examples:
        >>> positive_int(4, "microbatches")
        4
        >>> positive_int(2.0, "microbatches")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: microbatches=2.0: a positive int
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        refuse(name, repr(value), "a positive int", **refusal)
    return value


def non_negative_int(value: Any, name: str, **refusal: Unpack[Refusal]) -> int:
    """``value`` if it is an int of at least 0 (not a bool, not a float), else refused.

    Examples:
        >>> non_negative_int(0, "pad_id")
        0
        >>> non_negative_int(-1, "pad_id")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: pad_id=-1: an int of at least 0
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        refuse(name, repr(value), "an int of at least 0", **refusal)
    return value


TORCH_SEEDS = (-(2**63), 2**64 - 1)
"""The least and the greatest seed ``torch.manual_seed`` and ``torch.Generator.manual_seed`` take."""


def torch_seed(value: Any, name: str, **refusal: Unpack[Refusal]) -> int:
    """``value`` if it is a whole number torch takes as a seed (not a bool, not a float), else refused.

    Examples:
        >>> torch_seed(0, "seed")
        0
        >>> torch_seed(1.5, "seed")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: seed=1.5: a whole number from ... to ... (a torch seed)
    """
    if isinstance(value, bool) or not isinstance(value, int) or not TORCH_SEEDS[0] <= value <= TORCH_SEEDS[1]:
        what = f"a whole number from {TORCH_SEEDS[0]} to {TORCH_SEEDS[1]} (a torch seed)"
        refuse(name, repr(value), what, **refusal)
    return value


def positive_number(value: Any, name: str, **refusal: Unpack[Refusal]) -> float:
    """``value`` if it is a finite int or float above 0 (not a bool), else refused.

    Examples:
        >>> positive_number(0.5, "timeout")
        0.5
        >>> positive_number(float("nan"), "timeout")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: timeout=nan: a positive number
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not value > 0
    ):
        refuse(name, repr(value), "a positive number", **refusal)
    return value


def one_of(value: Any, choices: Collection[_T], name: str, **refusal: Unpack[Refusal]) -> _T:
    """``value`` if it is one of ``choices``, of the same type (``2.0`` and ``True`` are not ``2``, ``1``).

    Examples:
        >>> one_of("ring", ("allgather", "ring"), "engine")
        'ring'
        >>> one_of("tree", ("allgather", "ring"), "engine")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: engine='tree': one of 'allgather', 'ring'
    """
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        refuse(name, repr(value), f"one of {', '.join(map(repr, choices))}", **refusal)
    return value  # type: ignore[no-any-return]  # it is one of choices


def instance_of(value: Any, kind: type[_T], name: str, **refusal: Unpack[Refusal]) -> _T:
    """``value`` if it is a ``kind``, else refused, naming the type it is (not its repr: a model's is long).

    Examples:
        >>> instance_of("dp", str, "axis", meaning="one mesh axis name")
        'dp'
        >>> instance_of(None, str, "axis", meaning="one mesh axis name")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: axis=NoneType: a str (one mesh axis name)
    """
    if not isinstance(value, kind):
        article = "an" if kind.__name__[:1] in tuple("AEIOUaeiou") else "a"
        refuse(name, type(value).__name__, f"{article} {kind.__name__}", **refusal)
    return value


def path(value: Any, name: str, *, error: type[ShardingError] = ShardingError) -> pathlib.Path:
    """``value`` as a `pathlib.Path` if it is a ``str`` or ``os.PathLike`` naming one, else refused.

    Examples:
        >>> path("out/step-10", "path")
        PosixPath('out/step-10')
        >>> path(10, "path")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: path=10: a path (a str or os.PathLike)
    """
    if not isinstance(value, str | os.PathLike) or value == "":
        shown = repr(value) if isinstance(value, str | int | float | None) else type(value).__name__
        refuse(name, shown, "a path (a str or os.PathLike)", error=error)
    return pathlib.Path(value)


def device(value: Any, name: str, **refusal: Unpack[Refusal]) -> torch.device:
    """``value`` as a ``torch.device`` this machine has (``"cpu"``, ``"cuda:1"``, a device), else refused.

    Examples:
        >>> device("cpu", "device")
        device(type='cpu')
        >>> device("meta", "device")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: device='meta': a device this machine has
    """
    import torch  # lazily: the other checks, and the plans that use them, need no torch

    try:
        found = torch.device(value)
    except (RuntimeError, TypeError):
        refuse(name, repr(value), "a torch device", **refusal)
    available = getattr(getattr(torch, found.type, None), "is_available", None)
    if found.type == "meta" or (callable(available) and not available()):
        refuse(name, repr(value), "a device this machine has", **refusal)
    return found


def entry_point(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function`` naming itself in front of what its checks refuse: ``cost(tokens=0): ...``.

    Only a `refuse` of one of ``function``'s own parameters is renamed, once, by the outermost entry
    point running that takes it: the function the user called (``auto`` searching through
    ``search_plans`` names itself); the traceback into the check is dropped.

    Examples:
        >>> @entry_point
        ... def pipeline(microbatches):
        ...     positive_int(microbatches, "microbatches")
        >>> pipeline(-1)
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: pipeline(microbatches=-1): a positive int
    """
    who = function.__name__
    parameters = frozenset(inspect.signature(function).parameters)

    @functools.wraps(function)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        outer = _running.get()
        token = _running.set((*outer, parameters))
        try:
            return function(*args, **kwargs)
        except ShardingError as problem:
            argument = problem.argument
            taken = "" if argument is None else argument.partition("=")[0]
            if argument is None or taken not in parameters or any(taken in taking for taking in outer):
                raise
            message = str(problem)
            renamed = type(problem)(f"{who}({argument}){message[len(argument) :]}")
            renamed.named = (who, argument)
            raise renamed from None
        finally:
            _running.reset(token)

    return checked


# the parameters of each entry point running, outermost first: an inner one leaves a refusal of an
# argument an outer one also takes to the outer one, which the user called
_running: contextvars.ContextVar[tuple[frozenset[str], ...]] = contextvars.ContextVar(
    "functional_shard_entry_points", default=()
)
