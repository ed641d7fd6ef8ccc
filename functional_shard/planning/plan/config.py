"""`PlanConfig` (everything in a plan that is not per tensor) and `Change` (one plan difference)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Change", "PlanConfig", "group_name"]


def group_name(members: tuple[str, ...]) -> str:
    """The name of an FSDP unit of several modules: their paths joined with ``+``.

    Examples:
        >>> group_name(("norm", "output"))
        'norm+output'
    """
    return "+".join(members)


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """Everything in a plan that is not per tensor: engines, units, options."""

    data_parallel: str = "none"
    """``none``, ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``fsdp`` or ``hsdp``."""
    replicate_axes: tuple[str, ...] = ()
    shard_axes: tuple[str, ...] = ()
    tensor_parallel_axes: tuple[str, ...] = ()
    sequence_parallel: bool = False
    tp_styles: tuple[tuple[str, str, str], ...] = ()
    """(module path, style, layout) for every module a tensor-parallel rule gave a style."""
    tp_pieces: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(module path, output features of each packed piece) of the packed projections whose
    pieces a rule sized (``fs.packed((q, k, v))``); each piece splits on its own over tp."""
    reshard_after_forward: bool = True
    units: tuple[str, ...] = ()
    """FSDP units as module paths ("" is the root), outermost first."""
    unit_groups: tuple[tuple[str, ...], ...] = ()
    """FSDP units of several modules each (``fsdp(units=[("norm", "output")])``): their module
    paths. A group is named by its paths joined with ``+`` (`group_name`)."""
    unit_reasons: tuple[tuple[str, str], ...] = ()
    """(unit name, why it is a unit) for each FSDP unit, groups and the root included."""
    checkpointed: tuple[str, ...] = ()
    """Module paths whose activations are recomputed in backward."""
    checkpoint_policy: str = "full"
    """``full`` (keep the inputs only) or ``selective`` (also keep matmul/attention outputs)."""
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    offload_params: bool = False
    offload_grads: bool = False
    offload_optimizer: bool = False
    pipeline_axis: str | None = None
    """The mesh axis whose ranks hold successive pipeline stages (``None``: no pipeline)."""
    pipeline_stages: tuple[tuple[str, ...], ...] = ()
    """Module paths of each stage, in stage order (see `functional_shard.planning.pipeline.stages`)."""
    pipeline_schedule: str = "1f1b"
    microbatches: int = 1
    stages_per_rank: int = 1
    boundary_features: tuple[int, ...] = ()
    """Per token, the features of the activation stage ``s`` sends to ``s + 1`` (one per boundary)."""
    expert_axis: str | None = None
    """The mesh axis whose ranks hold different experts (``None``: no expert parallelism)."""
    expert_modules: tuple[str, ...] = ()
    """Module paths holding the expert tensors split over ``expert_axis``, in module order."""
    expert_top_k: int = 0
    """Experts each token visits in the model's mixture-of-experts layers (0: none, or unknown)."""
    context_parallel_axis: str | None = None
    """The data axis whose ranks hold different chunks of every sequence (``None``: no context parallel)."""
    loss_parallel: bool = False
    """The head's logits stay split on the vocabulary over tp; the loss runs under ``loss_parallel()``."""
    context_load_balance: bool = True
    """Each cp rank holds chunks ``i`` and ``2·cp − 1 − i`` of ``2·cp`` (else chunk ``i`` of ``cp``)."""
    context_engine: str = "auto"
    """How cp attention sees the whole sequence (`functional_shard.core.sequence.CONTEXT_ENGINES`)."""

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Axes whose ranks see different tokens: gradients are reduced over them."""
        return self.replicate_axes + self.shard_axes

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The data axes that split the batch: all but the context-parallel axis, which splits sequences."""
        return tuple(axis for axis in self.data_axes if axis != self.context_parallel_axis)

    @property
    def unit_names(self) -> tuple[str, ...]:
        """Every FSDP unit: the module paths of `units`, then each group's `group_name`."""
        return self.units + tuple(group_name(group) for group in self.unit_groups)

    def group_of(self) -> dict[str, str]:
        """Module path of a grouped module -> its group's name (empty without groups)."""
        return {member: group_name(group) for group in self.unit_groups for member in group}

    def pieces_of(self, path: str) -> tuple[int, ...] | None:
        """The packed piece sizes of the module at ``path``, if a rule sized them."""
        return next((pieces for module, pieces in self.tp_pieces if module == path), None)

    @property
    def tensor_parallel_experts(self) -> tuple[str, ...]:
        """Experts modules tensor parallel splits inside (style kind ``experts``), in plan order."""
        return tuple(path for path, _, kind in self.tp_styles if kind == "experts")

    def to_json(self) -> dict[str, Any]:
        """The config as JSON."""

        def lists(value: Any) -> Any:
            return [lists(v) for v in value] if isinstance(value, tuple) else value

        return {f.name: lists(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlanConfig:
        """The inverse of `to_json`."""

        def tuples(value: Any) -> Any:
            return tuple(tuples(v) for v in value) if isinstance(value, list) else value

        values: dict[str, Any] = {k: tuples(v) for k, v in data.items()}
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Change:
    """One difference between two plans (see `Plan.diff`)."""

    path: str
    what: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.path}: {self.what} {self.before} -> {self.after}"
