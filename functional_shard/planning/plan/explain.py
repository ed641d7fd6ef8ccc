"""What `Plan.explain` says beside its table: the FSDP units, context parallel, packed projections.

Each unit is listed with what it gathers and why it is one (alike blocks folded).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from functional_shard.core.mesh import Mesh
from functional_shard.core.units import format_bytes

from .config import ContextConfig, FsdpConfig, TpConfig

__all__ = ["context_parallel_line", "packed_lines", "units_section", "where_at_rest"]

_ROOT_ALONE = (
    "the model has no repeated blocks (elements of a ModuleList or ModuleDict, alike blocks of a "
    "Sequential), so every parameter is gathered at once; fsdp(axis, units=[...]) or "
    "fsdp(axis, min_params=...) cuts it into smaller units"
)


def units_section(config: FsdpConfig, gathered: Mapping[str, int]) -> list[str]:
    """Lines for ``explain``: one per unit (alike blocks folded), its gathered bytes and why.

    ``gathered``: each unit's bytes while all-gathered on the first rank (`cost_model.unit_gathered`).

    Examples:
        >>> config = FsdpConfig("fsdp", units=("", "layers.0", "layers.1"),
        ...     unit_reasons=(("", "the root"), ("layers.0", "a block"), ("layers.1", "a block")))
        >>> for line in units_section(config, {"": 4096, "layers.0": 2048, "layers.1": 2048}):
        ...     print(line)
        FSDP units: 3, each gathered whole for its forward and backward (bytes on one device):
          (root)      4.00 KiB       the root
          layers.* ×2 2.00 KiB each  a block
    """
    names = config.unit_names
    if not names:
        return []
    why = dict(config.unit_reasons)
    folded: dict[tuple[str, int, str], int] = {}
    for name in names:
        key = (
            re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name) if name else "(root)",
            gathered.get(name, 0),
            why.get(name, ""),
        )
        folded[key] = folded.get(key, 0) + 1
    rows = [
        (
            f"{shown} ×{count}" if count > 1 else shown,
            format_bytes(size) + (" each" if count > 1 else ""),
            reason,
        )
        for (shown, size, reason), count in folded.items()
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    head = "each gathered whole for its forward and backward (bytes on one device)"
    lines = [f"FSDP units: {len(names)}, {head}:"]
    lines += [f"  {name:<{widths[0]}} {size:<{widths[1]}}  {reason}".rstrip() for name, size, reason in rows]
    if names == ("",):
        lines.append(f"  One unit: {_ROOT_ALONE}.")
    return lines


def context_parallel_line(context: ContextConfig, mesh: Mesh, *, pipelined: bool = False) -> str:
    """The line that says how a context-parallel plan cuts sequences, and who holds which chunk.

    ``pipelined``: the plan has a pipeline too, which packed rows do not run under with cp.
    """
    from functional_shard.core.sequence import ENGINE_LABELS, chunk_count, sequence_chunks

    axis, size, balanced = context.axis, context.size(mesh), context.load_balance
    chunks = sequence_chunks(size, load_balance=balanced)
    held = "; ".join(f"rank {r}: {', '.join(map(str, held))}" for r, held in enumerate(chunks))
    # torch's ring masks causally over the whole sequence only, not inside documents
    packed = (
        "" if context.engine == "all_gather" else ", by the all-gather engine (the ring has no document mask)"
    )
    # the engine's document masks are built for a step's rows, and a stage runs a micro-batch's
    rows = (
        "packed rows (document_ids=) are refused: under a pipeline the engine's document masks "
        "would cover the step's rows, not a micro-batch's"
        if pipelined
        else "packed rows (document_ids=) are cut by attention work instead, each row its own way, "
        f"and attend inside documents{packed}"
    )
    return (
        f"context parallel over {axis!r}: activations split on the sequence dim into "
        f"{chunk_count(size, load_balance=balanced)} chunks "
        f"({'load-balanced' if balanced else 'in order'}; {axis} {held}); "
        f"attention by {ENGINE_LABELS[context.engine]}; {rows}"
    )


def packed_lines(tp: TpConfig | None) -> list[str]:
    """Lines for ``explain``: each sized packed projection and its pieces (alike blocks folded).

    Examples:
        >>> pieces = (("layers.0.wqkv", (8, 4, 4)), ("layers.1.wqkv", (8, 4, 4)))
        >>> packed_lines(TpConfig(("tp",), pieces=pieces))
        ['packed projections (each piece split on its own over tp): layers.*.wqkv (8, 4, 4) ×2']
    """
    if tp is None or not tp.pieces:
        return []
    folded: dict[tuple[str, tuple[int, ...]], int] = {}
    for module, pieces in tp.pieces:
        key = (re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", module), tuple(pieces))
        folded[key] = folded.get(key, 0) + 1
    shown = ", ".join(
        f"{module} {pieces}" + (f" ×{count}" if count > 1 else "")
        for (module, pieces), count in folded.items()
    )
    axes = ", ".join(tp.axes)
    return [f"packed projections (each piece split on its own over {axes}): {shown}"]


def where_at_rest(offloaded: bool, rank: int) -> tuple[str, str]:
    """The bytes column's name, and the words for where ``rank``'s tensors rest.

    Offloaded parameters rest in host memory (FSDP2's CPUOffloadPolicy), the buffers on the device.

    Examples:
        >>> where_at_rest(False, 0)
        ('bytes/device', 'device (rank 0)')
        >>> where_at_rest(True, 0)[1]
        'rank (rank 0), its parameters offloaded to host memory'
    """
    if offloaded:
        return "bytes/rank", f"rank (rank {rank}), its parameters offloaded to host memory"
    return "bytes/device", f"device (rank {rank})"
