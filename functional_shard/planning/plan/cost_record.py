"""`Cost`: what `Plan.cost` returns, memory per device and bytes sent per step.

The cost model that fills it in is `functional_shard.costing.cost.cost_model`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from functional_shard.core.units import format_bytes as _bytes

__all__ = ["Cost", "OptimizerKind"]

OptimizerKind: TypeAlias = Literal["adamw", "adam", "sgd"] | float

# the fields of `Cost` that add up to a device's memory
_DEVICE_PARTS = ("params_bytes", "grads_bytes", "optimizer_bytes", "buffers_bytes", "gathered_bytes")


@dataclass(frozen=True, slots=True)
class Cost:
    """Predicted memory (bytes, on one device) and communication (bytes sent per step).

    Memory fields are ``rank``'s; ``host_bytes`` is what offloading keeps in host memory instead.
    """

    rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    buffers_bytes: int
    gathered_bytes: int
    host_bytes: int
    comm_bytes: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Collective kind → mesh axis (several joined by ``,``) → bytes sent per step (``send_recv``: to
    neighbour stages)."""
    activation_comm_included: bool = False
    boundary_bytes: Mapping[int, float] = field(default_factory=dict)
    """Pipeline boundary ``s`` (stage ``s`` → ``s + 1``) → bytes crossing it per step each way (0 at a
    V's turn); empty without a pipeline or ``tokens=``."""
    stage_bytes: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    """Pipeline stage → its ``params``, ``grads``, ``optimizer`` and ``gathered`` bytes on its first rank
    (the largest chunks); empty without a pipeline."""

    @property
    def total_bytes(self) -> int:
        """Device memory: params, grads, optimizer state, buffers and gathered copies."""
        return sum(getattr(self, name) for name in _DEVICE_PARTS)

    @property
    def comm_total_bytes(self) -> float:
        """Bytes sent per step, all collectives together."""
        return sum(b for by_axis in self.comm_bytes.values() for b in by_axis.values())

    def to_dict(self) -> dict[str, Any]:
        """All fields, the derived totals included."""
        return {
            "rank": self.rank,
            **{name: getattr(self, name) for name in (*_DEVICE_PARTS, "host_bytes")},
            "total_bytes": self.total_bytes,
            "comm_bytes": {k: dict(v) for k, v in self.comm_bytes.items()},
            "comm_total_bytes": self.comm_total_bytes,
            "activation_comm_included": self.activation_comm_included,
            "boundary_bytes": dict(self.boundary_bytes),
            "stage_bytes": {k: dict(v) for k, v in self.stage_bytes.items()},
        }

    def __str__(self) -> str:
        lines = [
            f"memory on rank {self.rank}: {_bytes(self.total_bytes)}"
            f" (params {_bytes(self.params_bytes)}, grads {_bytes(self.grads_bytes)}, "
            f"optimizer {_bytes(self.optimizer_bytes)}, buffers {_bytes(self.buffers_bytes)}, "
            f"gathered {_bytes(self.gathered_bytes)})"
            + (f"; host {_bytes(self.host_bytes)}" if self.host_bytes else ""),
            f"sent per step: {_bytes(self.comm_total_bytes)}"
            + (
                ""
                if self.activation_comm_included
                else " (parameters and gradients; pass tokens= for activations)"
            ),
        ]
        for kind, by_axis in self.comm_bytes.items():
            for axis, nbytes in by_axis.items():
                lines.append(f"  {kind:<15} over {axis:<10} {_bytes(nbytes)}")
        for stage, by_kind in self.stage_bytes.items():
            lines.append(
                f"  stage {stage}: params {_bytes(by_kind['params'])}, grads {_bytes(by_kind['grads'])}, "
                f"optimizer {_bytes(by_kind['optimizer'])}, gathered {_bytes(by_kind['gathered'])}"
            )
        for boundary, nbytes in self.boundary_bytes.items():
            lines.append(f"  boundary {boundary}->{boundary + 1}: {_bytes(nbytes)} each way")
        return "\n".join(lines)
