"""PartitionSpec (`P`), whole-tensor ownership (`Owned`) and `ParamSharding`.

A `P` has one entry per tensor dim: ``None``, an axis name, or a tuple of axis names splitting it in
turn, major to minor, as ``torch.chunk`` does (``P(("tp", "dp"))``: FSDP inside a tensor-parallel shard).
``on=("pp", 1)`` keeps a whole tensor on the ranks whose ``pp`` coordinate is 1 (its stage's); it
never splits a dim.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from .errors import SpecError
from .mesh import Mesh

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

__all__ = ["Entry", "On", "Owned", "P", "ParamSharding", "PartitionSpec", "Spec", "without_axis"]

Entry: TypeAlias = str | tuple[str, ...] | None
On: TypeAlias = tuple[str, int] | None
"""A stage placement: (axis, coordinate) of the ranks that hold the tensor, or None (every rank)."""


def _canonical_on(on: object) -> On:
    if on is None:
        return None
    if (
        isinstance(on, list | tuple)
        and len(on) == 2
        and isinstance(on[0], str)
        and isinstance(on[1], int)
        and not isinstance(on[1], bool)
        and on[1] >= 0
    ):
        return (on[0], on[1])
    raise SpecError(
        f"a stage placement is (axis name, coordinate), got on={on!r}. Write e.g. P('dp', on=('pp', 1))."
    )


def _canonical_entry(entry: object) -> Entry:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list | tuple) and all(isinstance(axis, str) for axis in entry):
        if len(entry) == 0:
            return None
        return entry[0] if len(entry) == 1 else tuple(entry)
    raise SpecError(
        f"a PartitionSpec entry must be None, an axis name or a tuple of axis names, "
        f"got {entry!r}. Write e.g. P('dp', None) or P(('tp', 'dp'), None)."
    )


def entry_axes(entry: Entry) -> tuple[str, ...]:
    """The axes of one dim entry, major to minor."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return entry


@dataclass(frozen=True, slots=True, init=False)
class P:
    """A PartitionSpec: for each tensor dim, which mesh axes split it.

    A pytree leaf (optree does not look inside it), hashable, with a short repr.
    ``P()`` is fully replicated; trailing dims not named are not split.

    ``on=(axis, coordinate)`` keeps the tensor on the ranks with that coordinate only
    (a pipeline stage's ranks); the entries then say how it is split among them.

    Examples:
        >>> spec = P(("tp", "dp"), None)
        >>> spec, len(spec), spec[0], spec.axes
        (P(('tp', 'dp'), None), 2, ('tp', 'dp'), ('tp', 'dp'))
        >>> P("dp").dim_axes(2)
        (('dp',), ())
        >>> staged = P("dp", None, on=("pp", 1))
        >>> staged, staged.axes, staged.holds({"pp": 0, "dp": 1}), staged.unstaged
        (P('dp', None, on=('pp', 1)), ('dp',), False, P('dp', None))
    """

    entries: tuple[Entry, ...]
    on: On
    _axes: tuple[str, ...] = field(compare=False, repr=False)
    _hash: int = field(compare=False, repr=False)

    def __init__(self, *entries: object, on: object = None) -> None:
        canonical = tuple(_canonical_entry(e) for e in entries)
        placed = _canonical_on(on)
        object.__setattr__(self, "entries", canonical)
        object.__setattr__(self, "on", placed)
        object.__setattr__(self, "_axes", tuple(axis for entry in canonical for axis in entry_axes(entry)))
        object.__setattr__(self, "_hash", hash((canonical, placed)) if placed else hash(canonical))

    def __hash__(self) -> int:  # specs key many caches; hash them once
        return self._hash

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def __getitem__(self, dim: int) -> Entry:
        return self.entries[dim]

    def __repr__(self) -> str:
        parts = [repr(entry) for entry in self.entries]
        if self.on is not None:
            parts.append(f"on={self.on!r}")
        return "P(" + ", ".join(parts) + ")"

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis that splits a dim, in entry order (an axis named twice appears twice).

        The ``on`` axis is not among them: it places the whole tensor, it splits nothing.
        """
        return self._axes

    @property
    def unstaged(self) -> P:
        """The same split without the stage placement (how the stage's ranks share it)."""
        return self if self.on is None else P(*self.entries)

    def staged(self, on: On) -> P:
        """The same split, held only by the ranks at ``on`` (``None``: by every rank)."""
        return self if on == self.on else P(*self.entries, on=on)

    def holds(self, coords: Mapping[str, int]) -> bool:
        """Whether the rank at ``coords`` holds (a shard of) the tensor."""
        return self.on is None or coords[self.on[0]] == self.on[1]

    @property
    def is_replicated(self) -> bool:
        """True when no dim is split."""
        return not self.axes

    def dim_axes(self, ndim: int) -> tuple[tuple[str, ...], ...]:
        """The axes of each of ``ndim`` dims (missing trailing entries are unsplit)."""
        padded = self.entries + (None,) * (ndim - len(self.entries))
        return tuple(entry_axes(entry) for entry in padded[:ndim])

    def normalized(self, ndim: int) -> P:
        """The same spec with exactly ``ndim`` entries (for comparing specs)."""
        return _normalized(self, ndim)

    def problems(self, shape: Sequence[int], mesh: Mesh) -> list[str]:
        """What is wrong with this spec for a tensor of ``shape`` on ``mesh``."""
        return list(spec_problems(self, tuple(shape), mesh))

    def _problems(self, shape: tuple[int, ...], mesh: Mesh) -> list[str]:
        found = []
        if len(self.entries) > len(shape):
            found.append(
                f"spec {self!r} has {len(self.entries)} entries but the tensor has "
                f"{len(shape)} dims {tuple(shape)}"
            )
        for axis in dict.fromkeys(self.axes):
            if axis not in mesh:
                found.append(f"spec {self!r} names axis {axis!r}, which is not in {mesh!r}")
            elif self.axes.count(axis) > 1:
                found.append(f"spec {self!r} uses axis {axis!r} more than once")
        found += _on_problems(self, self.on, mesh)
        return found

    def to_json(self) -> list[Any] | dict[str, Any]:
        """The entries as JSON (tuples become lists); with a stage, ``{"entries", "on"}``."""
        entries = [list(e) if isinstance(e, tuple) else e for e in self.entries]
        if self.on is None:
            return entries  # a plan without stages keeps the plain list form
        return {"entries": entries, "on": list(self.on)}

    @classmethod
    def from_json(cls, data: Sequence[Any] | Mapping[str, Any]) -> P:
        """The inverse of `to_json`."""
        if isinstance(data, Mapping):
            return cls(*data["entries"], on=data.get("on"))
        return cls(*data)

    def to_placements(self, mesh: Mesh, shape: Sequence[int]) -> tuple[Placement, ...]:
        """The DTensor placements (one per mesh axis) that lay a tensor out as this spec.

        An axis named after one later in the mesh (FSDP inside a TP shard) maps to ``_StridedShard``,
        which matches nested ``torch.chunk`` only for even splits: others raise. A staged spec gives
        placements over the stage's sub-mesh (``mesh`` without the ``on`` axis).

        Raises:
            SpecError: the spec is malformed for ``mesh``/``shape``, or an uneven nested split.

        Examples:
            >>> P(("tp", "dp"), None).to_placements(Mesh(dp=2, tp=4), (16, 8))
            (_StridedShard(dim=0, sf=4), Shard(dim=0))
            >>> P("dp", on=("pp", 0)).to_placements(Mesh(pp=2, dp=2), (4,))
            (Shard(dim=0),)
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        if found := self.problems(shape, mesh):
            raise SpecError("; ".join(found))
        if self.on is not None:
            mesh = without_axis(mesh, self.on[0])
        order = {axis: index for index, axis in enumerate(mesh.axis_names)}
        placements: list[Placement] = [Replicate() for _ in mesh.axis_names]
        for dim, axes in enumerate(self.dim_axes(len(shape))):
            for position, axis in enumerate(axes):
                outer = axes[:position]
                split_factor = math.prod(mesh[a] for a in outer if order[a] > order[axis])
                if split_factor == 1:
                    placements[order[axis]] = Shard(dim)
                    continue
                if shape[dim] % mesh.axes_size(outer):
                    raise SpecError(
                        f"spec {self!r}: dim {dim} (size {shape[dim]}) is split by {axis!r} "
                        f"inside {outer}, against mesh order {mesh.axis_names}; torch's "
                        f"_StridedShard describes that layout only when {shape[dim]} % "
                        f"{mesh.axes_size(outer)} == 0. Pad the dim or order the axes as the mesh."
                    )
                placements[order[axis]] = _StridedShard(dim, split_factor=split_factor)
        return tuple(placements)

    @classmethod
    def from_placements(cls, placements: Sequence[Placement], mesh: Mesh, shape: Sequence[int]) -> P:
        """The spec of DTensor ``placements`` on ``mesh`` (the inverse of `to_placements`).

        Raises:
            SpecError: a placement has no spec equivalent (``Partial`` at rest, say).

        Examples:
            >>> from torch.distributed.tensor import Replicate, Shard
            >>> P.from_placements((Replicate(), Shard(1)), Mesh(dp=2, tp=4), (8, 8))
            P(None, 'tp')
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        if len(placements) != len(mesh):
            raise SpecError(f"{len(placements)} placements for the {len(mesh)} axes of {mesh!r}")
        by_dim: dict[int, list[str]] = {}
        for axis, placement in zip(mesh.axis_names, placements, strict=True):
            if isinstance(placement, Replicate):
                continue
            if not isinstance(placement, Shard | _StridedShard):
                raise SpecError(
                    f"placement {placement!r} on axis {axis!r} has no PartitionSpec equivalent; "
                    "only Replicate, Shard and _StridedShard describe a tensor at rest"
                )
            by_dim.setdefault(placement.dim % len(shape), []).append(axis)
        # Few axes share a dim, so trying each order is cheap and exact.
        for orders in itertools.product(*(itertools.permutations(a) for a in by_dim.values())):
            entries: list[Entry] = [None] * len(shape)
            for dim, axes in zip(by_dim, orders, strict=True):
                entries[dim] = tuple(axes)
            candidate = cls(*entries)
            try:
                if candidate.to_placements(mesh, shape) == tuple(placements):
                    return candidate
            except SpecError:
                continue
        raise SpecError(f"placements {tuple(placements)!r} match no PartitionSpec on {mesh!r}")


PartitionSpec = P


def without_axis(mesh: Mesh, axis: str) -> Mesh:
    """``mesh`` less one axis: a pipeline stage's own sub-mesh.

    Examples:
        >>> without_axis(Mesh(pp=2, dp=4), "pp")
        Mesh(dp=4)
    """
    return Mesh({name: size for name, size in mesh.axes if name != axis})


def _on_problems(spec: object, on: On, mesh: Mesh) -> list[str]:
    if on is None:
        return []
    axis, index = on
    if axis not in mesh:
        return [f"spec {spec!r} is placed on axis {axis!r}, which is not in {mesh!r}"]
    found = []
    if index >= mesh[axis]:
        found.append(f"spec {spec!r} is placed on {axis}={index}, but axis {axis!r} has size {mesh[axis]}")
    if axis in getattr(spec, "axes", ()) and not isinstance(spec, Owned):
        found.append(
            f"spec {spec!r} both splits a dim over {axis!r} and places the tensor on one of its "
            "coordinates; a stage axis holds whole tensors"
        )
    return found


# Models repeat a few (shape, spec) pairs thousands of times (80 identical blocks), so
# the pure checks and layout arithmetic are cached on these hashable inputs.


@functools.lru_cache(maxsize=8192)
def spec_problems(spec: P, shape: tuple[int, ...], mesh: Mesh) -> tuple[str, ...]:
    """What is wrong with ``spec`` for a tensor of ``shape`` on ``mesh`` (cached)."""
    return tuple(spec._problems(shape, mesh))


@functools.lru_cache(maxsize=8192)
def _normalized(spec: P, ndim: int) -> P:
    return P(*spec.dim_axes(ndim), on=spec.on)


@dataclass(frozen=True, slots=True)
class Owned:
    """A whole tensor kept on one rank along ``axis``, as ZeRO-1 places optimizer state.

    ZeroRedundancyOptimizer hands each parameter's state whole to one rank, which a `P` cannot say.
    ``on`` places it on a pipeline stage's ranks, as for a `P`.

    Examples:
        >>> Owned("dp"), Owned("dp", on=("pp", 1))
        (Owned('dp'), Owned('dp', on=('pp', 1)))
    """

    axis: str
    on: On = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "on", _canonical_on(self.on))

    def __repr__(self) -> str:
        return f"Owned({self.axis!r}" + ("" if self.on is None else f", on={self.on!r}") + ")"

    @property
    def axes(self) -> tuple[str, ...]:
        """The one axis that the owners are spread over."""
        return (self.axis,)

    @property
    def unstaged(self) -> Owned:
        """The same ownership without the stage placement."""
        return self if self.on is None else Owned(self.axis)

    def staged(self, on: On) -> Owned:
        """The same ownership, held only by the ranks at ``on``."""
        return self if on == self.on else Owned(self.axis, on)

    def holds(self, coords: Mapping[str, int]) -> bool:
        """Whether the rank at ``coords`` is on the tensor's stage (ownership aside)."""
        return self.on is None or coords[self.on[0]] == self.on[1]

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON."""
        return {"owned": self.axis} if self.on is None else {"owned": self.axis, "on": list(self.on)}


Spec: TypeAlias = P | Owned


def spec_from_json(data: Any) -> Spec:
    """Read a `P` or an `Owned` back from JSON."""
    if isinstance(data, dict) and "owned" in data:
        return Owned(data["owned"], data.get("on"))
    return P.from_json(data)


REPLICATED = P()


@dataclass(frozen=True, slots=True)
class ParamSharding:
    """Where one parameter lives at rest, is computed on, gets its gradient, keeps its state.

    DDP is all ``P()``, FSDP ``P('dp')`` but ``compute=P()``, tensor parallel one split in all four.

    Examples:
        >>> fsdp = ParamSharding(storage=P("dp"), compute=P(), grad=P("dp"), optim=P("dp"))
        >>> ParamSharding.replicated()
        ParamSharding(storage=P(), compute=P(), grad=P(), optim=P())
        >>> ParamSharding.uniform(P("tp", None)).grad
        P('tp', None)
    """

    storage: P = field(default=REPLICATED)
    compute: P = field(default=REPLICATED)
    grad: P = field(default=REPLICATED)
    optim: Spec = field(default=REPLICATED)

    def __post_init__(self) -> None:
        for name in ("storage", "compute", "grad"):
            if not isinstance(getattr(self, name), P):
                raise SpecError(
                    f"ParamSharding.{name} must be a P, got {getattr(self, name)!r}; write P() for replicated"
                )
        if not isinstance(self.optim, P | Owned):
            raise SpecError(f"ParamSharding.optim must be a P or Owned, got {self.optim!r}")
        if not self.storage.on == self.compute.on == self.grad.on == self.optim.on:
            raise SpecError(
                f"the four specs of a ParamSharding place the tensor on different stages ({self!r}); "
                "a tensor, its gradient and its state live on one stage: use staged(on)"
            )

    @classmethod
    def replicated(cls) -> ParamSharding:
        """All four specs replicated (plain data parallel)."""
        return cls()

    @classmethod
    def uniform(cls, spec: P) -> ParamSharding:
        """The same spec for all four (tensor parallel)."""
        return cls(spec, spec, spec, spec)

    @property
    def on(self) -> On:
        """The stage placement shared by the four specs (``None``: every rank holds it)."""
        return self.storage.on

    def staged(self, on: On) -> ParamSharding:
        """All four specs placed on the ranks at ``on``.

        Examples:
            >>> ParamSharding.uniform(P("tp")).staged(("pp", 1)).grad
            P('tp', on=('pp', 1))
        """
        if on == self.storage.on:
            return self
        return ParamSharding(
            self.storage.staged(on), self.compute.staged(on), self.grad.staged(on), self.optim.staged(on)
        )

    @property
    def at_rest_axes(self) -> frozenset[str]:
        """Axes that split the parameter at rest but not for compute (FSDP's; padded by FSDP2)."""
        return frozenset(self.storage.axes) - frozenset(self.compute.axes)

    def specs(self) -> dict[str, Spec]:
        """The four specs by name."""
        return {
            "storage": self.storage,
            "compute": self.compute,
            "grad": self.grad,
            "optim": self.optim,
        }

    def normalized(self, ndim: int) -> ParamSharding:
        """Each `P` padded or trimmed to ``ndim`` entries, for exact comparison."""
        return _normalized_sharding(self, ndim)

    def _normalized(self, ndim: int) -> ParamSharding:
        optim = self.optim.normalized(ndim) if isinstance(self.optim, P) else self.optim
        return ParamSharding(
            self.storage.normalized(ndim),
            self.compute.normalized(ndim),
            self.grad.normalized(ndim),
            optim,
        )

    def to_json(self) -> dict[str, Any]:
        """The four specs as JSON."""
        return {name: spec.to_json() for name, spec in self.specs().items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParamSharding:
        """The inverse of `to_json`."""
        return cls(
            P.from_json(data["storage"]),
            P.from_json(data["compute"]),
            P.from_json(data["grad"]),
            spec_from_json(data["optim"]),
        )


@functools.lru_cache(maxsize=8192)
def _normalized_sharding(sharding: ParamSharding, ndim: int) -> ParamSharding:
    return sharding._normalized(ndim)
