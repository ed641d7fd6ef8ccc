"""Keep torch's and transformers' own logging and warnings off the user's stderr while we trace.

A failing fake-tensor kernel makes torch log its whole traceback before raising, which our own error
already says. `captured` hands such records and warnings to the ``functional_shard.trace`` logger at
DEBUG level.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

__all__ = ["captured"]

_LOGGERS = ("torch", "transformers")
_DEBUG = logging.getLogger("functional_shard.trace")


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _loggers() -> list[logging.Logger]:
    # torch gives many of its loggers a stderr handler of their own and stops them
    # propagating: each of those is held back, and the roots catch the rest
    out = [logging.getLogger(name) for name in _LOGGERS]
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (
            isinstance(logger, logging.Logger)
            and name.partition(".")[0] in _LOGGERS
            and name not in _LOGGERS
            and (logger.handlers or not logger.propagate)
        ):
            out.append(logger)
    return out


@contextlib.contextmanager
def captured() -> Iterator[list[str]]:
    """Hold back the log records and warnings of torch and transformers raised in the block.

    Yields the list of held-back messages, filled when the block ends.

    Examples:
        >>> import logging, sys
        >>> with captured() as held:
        ...     logging.getLogger("torch.fx").error("a fake-tensor kernel failed")
        >>> held
        ['torch.fx: a fake-tensor kernel failed']
    """
    keep = _Keep()
    saved = []
    held: list[str] = []
    for logger in _loggers():
        saved.append((logger, logger.handlers[:], logger.propagate))
        logger.handlers = [keep]
        logger.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield held
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers = handlers
            logger.propagate = propagate
        for record in keep.records:
            held.append(f"{record.name}: {record.getMessage()}")
        held.extend(f"{w.category.__name__}: {w.message}" for w in caught)
        for line in held:
            _DEBUG.debug("held back while tracing: %s", line)
