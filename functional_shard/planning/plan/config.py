"""`PlanConfig` (everything in a plan that is not per tensor) and `Change` (one plan difference).

One small frozen dataclass per parallelism, ``None`` when unused (torchtitan's ``parallel_dims``),
each answering its own questions (its size, its ranks) so no reader works them out again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from functional_shard.core.mesh import Mesh

__all__ = [
    "FLAT_FIELDS",
    "Change",
    "ContextConfig",
    "ExpertConfig",
    "FsdpConfig",
    "PipelineConfig",
    "SECTIONS",
    "PlanConfig",
    "TpConfig",
    "first_rank",
    "group_name",
]


def group_name(members: tuple[str, ...]) -> str:
    """The name of an FSDP unit of several modules: their paths joined with ``+``.

    Examples:
        >>> group_name(("norm", "output"))
        'norm+output'
    """
    return "+".join(members)


def first_rank(mesh: Mesh, axis: str, coordinate: int) -> int:
    """The lowest rank at ``coordinate`` along ``axis``: every other axis at 0.

    Examples:
        >>> from functional_shard.core.mesh import Mesh
        >>> first_rank(Mesh(pp=2, dp=2), "pp", 1)
        2
    """
    return mesh.rank(dict.fromkeys(mesh.axis_names, 0) | {axis: coordinate})


@dataclass(frozen=True, slots=True)
class FsdpConfig:
    """Data parallelism: DDP, ZeRO or FSDP over the data axes, and FSDP's units.

    Each engine is FSDP with choices fixed: DDP shards nothing, ZeRO-1 only the optimizer state.
    """

    kind: str = "fsdp"
    """``ddp``, ``zero1``, ``zero2``, ``zero3``, ``fsdp`` or ``hsdp``."""
    replicate_axes: tuple[str, ...] = ()
    shard_axes: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    units: tuple[str, ...] = ()
    """FSDP units as module paths ("" is the root), outermost first."""
    unit_groups: tuple[tuple[str, ...], ...] = ()
    """FSDP units of several modules each (``fsdp(units=[("norm", "output")])``): their module
    paths. A group is named by its paths joined with ``+`` (`group_name`)."""
    unit_reasons: tuple[tuple[str, str], ...] = ()
    """(unit name, why it is a unit) for each FSDP unit, groups and the root included."""

    @property
    def axes(self) -> tuple[str, ...]:
        """Axes whose ranks see different tokens: gradients are reduced over them."""
        return self.replicate_axes + self.shard_axes

    @property
    def unit_names(self) -> tuple[str, ...]:
        """Every FSDP unit: the module paths of `units`, then each group's `group_name`."""
        return self.units + tuple(group_name(group) for group in self.unit_groups)


@dataclass(frozen=True, slots=True)
class TpConfig:
    """Tensor parallelism: its axes and the style a rule gave each module."""

    axes: tuple[str, ...]
    styles: tuple[tuple[str, str, str], ...] = ()
    """(module path, style, layout) for every module a tensor-parallel rule gave a style."""
    pieces: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(module path, output features of each packed piece) of the packed projections whose
    pieces a rule sized (``fs.packed((q, k, v))``); each piece splits on its own over tp."""
    sequence_parallel: bool = False
    loss_parallel: bool = False
    """The head's logits stay split on the vocabulary over tp; the loss runs under ``loss_parallel()``."""

    def size(self, mesh: Mesh) -> int:
        """How many ranks split each tensor-parallel tensor."""
        return mesh.axes_size(self.axes)

    def pieces_of(self, path: str) -> tuple[int, ...] | None:
        """The packed piece sizes of the module at ``path``, if a rule sized them."""
        return next((pieces for module, pieces in self.pieces if module == path), None)

    @property
    def experts(self) -> tuple[str, ...]:
        """Experts modules tensor parallel splits inside (layout ``experts``), in plan order."""
        return tuple(path for path, _, layout in self.styles if layout == "experts")


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Pipeline parallelism: the axis whose ranks hold successive stages, and the schedule."""

    axis: str
    stages: tuple[tuple[str, ...], ...] = ()
    """Module paths of each stage, in stage order (see `functional_shard.planning.pipeline.stages`)."""
    schedule: str = "1f1b"
    microbatches: int = 1
    stages_per_rank: int = 1
    boundary_features: tuple[int, ...] = ()
    """Per token, the features of the activation stage ``s`` sends to ``s + 1`` (one per boundary)."""

    def size(self, mesh: Mesh) -> int:
        """The pipeline's ranks along its axis (pp)."""
        return mesh[self.axis]

    def coordinate_of(self, stage: int, mesh: Mesh) -> int:
        """The pp coordinate of the ranks that run ``stage``.

        Raises:
            PolicyError: no such stage.
        """
        from functional_shard.planning.pipeline.stages import stage_rank

        return stage_rank(stage, mesh[self.axis], self.stages_per_rank, self.schedule)

    def stages_at(self, mesh: Mesh, coordinate: int) -> tuple[int, ...]:
        """The stages the ranks at pp ``coordinate`` run, in increasing order."""
        from functional_shard.planning.pipeline.stages import rank_stages

        return rank_stages(coordinate, mesh[self.axis], self.stages_per_rank, self.schedule)

    def first_rank(self, mesh: Mesh, coordinate: int) -> int:
        """The lowest rank at pp ``coordinate``, which the plan's tables speak for."""
        return first_rank(mesh, self.axis, coordinate)

    def first_coords(self, mesh: Mesh, coordinate: int) -> dict[str, int]:
        """The coordinates of `first_rank`: pp ``coordinate``, every other axis at 0."""
        return dict.fromkeys(mesh.axis_names, 0) | {self.axis: coordinate}

    def ranks(self, mesh: Mesh, coordinate: int) -> tuple[int, ...]:
        """Every rank at pp ``coordinate``."""
        return tuple(r for r in range(mesh.size) if mesh.coords(r)[self.axis] == coordinate)

    def moved(self, mesh: Mesh, rank: int, coordinate: int) -> int:
        """The rank with ``rank``'s coordinates but pp ``coordinate``."""
        return mesh.rank(mesh.coords(rank) | {self.axis: coordinate})


@dataclass(frozen=True, slots=True)
class ExpertConfig:
    """The model's mixture-of-experts layers as the plan splits them (over ep, inside tp, or both)."""

    axis: str | None = None
    """The mesh axis whose ranks hold different experts (``None``: experts split by tp only)."""
    modules: tuple[str, ...] = ()
    """Module paths holding the expert tensors split over ``axis``, in module order."""
    top_k: int = 0
    """Experts each token visits (0: unknown, as for a plan made from a state dict)."""

    def size(self, mesh: Mesh) -> int:
        """How many ranks split the experts of a module (1 without an expert axis)."""
        return mesh[self.axis] if self.axis is not None else 1


@dataclass(frozen=True, slots=True)
class ContextConfig:
    """Context parallelism: the data axis whose ranks hold different chunks of every sequence."""

    axis: str
    load_balance: bool = True
    """Each cp rank holds chunks ``i`` and ``2·cp − 1 − i`` of ``2·cp`` (else chunk ``i`` of ``cp``)."""
    engine: str = "auto"
    """How cp attention sees the whole sequence (`functional_shard.core.sequence.CONTEXT_ENGINES`)."""

    def size(self, mesh: Mesh) -> int:
        """How many ranks share each sequence's tokens."""
        return mesh[self.axis]


SECTIONS: dict[str, type] = {
    "fsdp": FsdpConfig,
    "tp": TpConfig,
    "pipeline": PipelineConfig,
    "experts": ExpertConfig,
    "context": ContextConfig,
}
"""`PlanConfig`'s field -> the config of that parallelism, as the JSON form names them."""

FLAT_FIELDS: tuple[tuple[str, str | None, str], ...] = (
    ("data_parallel", "fsdp", "kind"),
    ("replicate_axes", "fsdp", "replicate_axes"),
    ("shard_axes", "fsdp", "shard_axes"),
    ("tensor_parallel_axes", "tp", "axes"),
    ("sequence_parallel", "tp", "sequence_parallel"),
    ("tp_styles", "tp", "styles"),
    ("tp_pieces", "tp", "pieces"),
    ("reshard_after_forward", "fsdp", "reshard_after_forward"),
    ("units", "fsdp", "units"),
    ("unit_groups", "fsdp", "unit_groups"),
    ("unit_reasons", "fsdp", "unit_reasons"),
    ("checkpointed", None, "checkpointed"),
    ("checkpoint_policy", None, "checkpoint_policy"),
    ("param_dtype", None, "param_dtype"),
    ("reduce_dtype", None, "reduce_dtype"),
    ("offload_params", None, "offload_params"),
    ("offload_grads", None, "offload_grads"),
    ("offload_optimizer", None, "offload_optimizer"),
    ("pipeline_axis", "pipeline", "axis"),
    ("pipeline_stages", "pipeline", "stages"),
    ("pipeline_schedule", "pipeline", "schedule"),
    ("microbatches", "pipeline", "microbatches"),
    ("stages_per_rank", "pipeline", "stages_per_rank"),
    ("boundary_features", "pipeline", "boundary_features"),
    ("expert_axis", "experts", "axis"),
    ("expert_modules", "experts", "modules"),
    ("expert_top_k", "experts", "top_k"),
    ("context_parallel_axis", "context", "axis"),
    ("loss_parallel", "tp", "loss_parallel"),
    ("context_load_balance", "context", "load_balance"),
    ("context_engine", "context", "engine"),
)
"""The flat config of plan format version 1, in its order: (its name, the parallelism's config
holding it now or ``None`` for a plan-wide field, its name there). `Plan.diff` names changes so."""

# what a flat field read where its parallelism is unused; the others read their default
_UNUSED = {"kind": "none", "axes": (), "axis": None}
_DEFAULTS = {key: {f.name: f.default for f in fields(section)} for key, section in SECTIONS.items()}


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """Everything in a plan that is not per tensor: a config per parallelism, and options."""

    fsdp: FsdpConfig | None = None
    """Data parallelism (``None``: every rank reads the same batch)."""
    tp: TpConfig | None = None
    pipeline: PipelineConfig | None = None
    experts: ExpertConfig | None = None
    context: ContextConfig | None = None
    checkpointed: tuple[str, ...] = ()
    """Module paths whose activations are recomputed in backward."""
    checkpoint_policy: str = "full"
    """``full`` (keep the inputs only) or ``selective`` (also keep matmul/attention outputs)."""
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    offload_params: bool = False
    offload_grads: bool = False
    offload_optimizer: bool = False

    @property
    def data_parallel(self) -> str:
        """``none``, ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``fsdp`` or ``hsdp``."""
        return self.fsdp.kind if self.fsdp is not None else "none"

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Axes whose ranks see different tokens: gradients are reduced over them."""
        return self.fsdp.axes if self.fsdp is not None else ()

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The data axes that split the batch: all but the context-parallel axis, which splits sequences."""
        cp_axis = self.context.axis if self.context is not None else None
        return tuple(axis for axis in self.data_axes if axis != cp_axis)

    @property
    def unit_names(self) -> tuple[str, ...]:
        """Every FSDP unit: the module paths of `units`, then each group's `group_name`."""
        return self.fsdp.unit_names if self.fsdp is not None else ()

    def group_of(self) -> dict[str, str]:
        """Module path of a grouped module -> its group's name (empty without groups)."""
        groups = self.fsdp.unit_groups if self.fsdp is not None else ()
        return {member: group_name(group) for group in groups for member in group}

    def pieces_of(self, path: str) -> tuple[int, ...] | None:
        """The packed piece sizes of the module at ``path``, if a rule sized them."""
        return self.tp.pieces_of(path) if self.tp is not None else None

    @property
    def reshard_after_forward(self) -> bool:
        """Whether FSDP frees each unit's gathered parameters after forward (ZeRO-2 and pipelines: no)."""
        return self.fsdp is None or self.fsdp.reshard_after_forward

    # the properties below are alike in shape on purpose: each is one public question of the
    # plan, answered by its parallelism's config, with the answer when that parallelism is unused
    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The data axes FSDP shards over (none without data parallelism)."""
        return self.fsdp.shard_axes if self.fsdp is not None else ()

    @property
    def tensor_parallel_axes(self) -> tuple[str, ...]:
        """The tensor-parallel axes (none without tensor parallel)."""
        return self.tp.axes if self.tp is not None else ()

    @property
    def tp_styles(self) -> tuple[tuple[str, str, str], ...]:
        """(module path, style, layout) of each styled module (none without tensor parallel)."""
        return self.tp.styles if self.tp is not None else ()

    @property
    def sequence_parallel(self) -> bool:
        """Whether tensor parallel also splits the sequence between its layers."""
        return self.tp is not None and self.tp.sequence_parallel

    @property
    def loss_parallel(self) -> bool:
        """Whether the loss runs on vocabulary-split logits under torch's ``loss_parallel()``."""
        return self.tp is not None and self.tp.loss_parallel

    @property
    def expert_modules(self) -> tuple[str, ...]:
        """Experts modules split over the expert axis (none without expert parallelism)."""
        return self.experts.modules if self.experts is not None else ()

    @property
    def tensor_parallel_experts(self) -> tuple[str, ...]:
        """Experts modules tensor parallel splits inside (style kind ``experts``), in plan order."""
        return self.tp.experts if self.tp is not None else ()

    def tp_size(self, mesh: Mesh) -> int:
        """How many ranks split each tensor-parallel tensor (1 without tensor parallel)."""
        return self.tp.size(mesh) if self.tp is not None else 1

    def cp_size(self, mesh: Mesh) -> int:
        """How many ranks share each sequence's tokens (1 without context parallel)."""
        return self.context.size(mesh) if self.context is not None else 1

    def pp_size(self, mesh: Mesh) -> int:
        """How many pp coordinates hold stages (1 without a pipeline)."""
        return self.pipeline.size(mesh) if self.pipeline is not None else 1

    def flat(self) -> dict[str, Any]:
        """Every field by its version-1 name (`FLAT_FIELDS`), in that order.

        Examples:
            >>> ddp = PlanConfig(fsdp=FsdpConfig("ddp"))
            >>> ddp.flat()["data_parallel"], ddp.flat()["microbatches"]
            ('ddp', 1)
        """
        found = {}
        for flat_name, key, name in FLAT_FIELDS:
            if key is None:
                found[flat_name] = getattr(self, name)
                continue
            section = getattr(self, key)
            if section is not None:
                found[flat_name] = getattr(section, name)
            else:
                found[flat_name] = _UNUSED[name] if name in _UNUSED else _DEFAULTS[key][name]
        return found

    def to_json(self) -> dict[str, Any]:
        """The config as JSON: each parallelism's config an object, or null when unused."""

        def lists(value: Any) -> Any:
            if is_dataclass(value):
                return {f.name: lists(getattr(value, f.name)) for f in fields(value)}
            return [lists(v) for v in value] if isinstance(value, tuple) else value

        return {f.name: lists(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlanConfig:
        """The inverse of `to_json`."""

        def tuples(value: Any) -> Any:
            return tuple(tuples(v) for v in value) if isinstance(value, list) else value

        values: dict[str, Any] = {}
        for key, value in data.items():
            section = SECTIONS.get(key)
            if section is not None and value is not None:
                values[key] = section(**{name: tuples(v) for name, v in value.items()})
            else:
                values[key] = tuples(value)
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
