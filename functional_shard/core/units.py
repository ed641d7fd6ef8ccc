"""Byte counts as people read them (binary units), for plans, costs and estimates.

A leaf module: the modules that print sizes import it, and it imports nothing of ours.
"""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB (powers of 1024), two decimals above bytes.

    Args:
        n: a number of bytes (may be fractional, e.g. bytes sent per step on average).

    Returns:
        The size as text: ``"512 B"``, ``"1.50 KiB"``, ``"80.00 GiB"``.

    Examples:
        >>> format_bytes(512), format_bytes(1536), format_bytes(80 * 2**30)
        ('512 B', '1.50 KiB', '80.00 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
