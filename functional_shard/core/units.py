"""Byte counts as people read them (binary units), for plans, costs and estimates.

A leaf module: the modules that print sizes import it, and it imports nothing of ours.
"""

from __future__ import annotations

import numbers
import re

from .errors import ShardingError
from .validate import refuse

__all__ = ["format_bytes", "parse_bytes"]


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB (powers of 1024), two decimals above bytes.

    Args:
        n: a number of bytes (may be fractional).

    Examples:
        >>> format_bytes(512), format_bytes(1536), format_bytes(80 * 2**30)
        ('512 B', '1.50 KiB', '80.00 GiB')
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        refuse("n", repr(n), "a number of bytes", meaning="format_bytes' argument")
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | str) -> int:
    """A memory size from an int or text: ``"80GiB"``, ``"80 GB"``, ``"1.5TiB"``, ``"512"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB ... TiB) of 1024.

    Raises:
        ShardingError: not a size.

    Examples:
        >>> parse_bytes("80GiB"), parse_bytes("80 GB"), parse_bytes(1024)
        (85899345920, 80000000000, 1024)
        >>> parse_bytes("80 parsecs")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: memory size '80 parsecs': a positive number of bytes or text ...
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ShardingError(f"memory size {value!r}: an int of bytes or text like '80GiB'")
    if isinstance(value, int):
        if value <= 0:
            raise ShardingError(f"memory size {value!r}: a positive number of bytes")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    # 0.4 (bytes) rounds to none at all, as 0 does
    size = round(float(match.group(1)) * _UNITS[unit]) if match and unit in _UNITS else 0
    if size < 1:
        raise ShardingError(
            f"memory size {value!r}: a positive number of bytes or text like '80GiB', '80GB', '512MiB' "
            "(units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return size
