"""`Mesh`: named axes with sizes, major to minor. Pure: no processes needed."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import functional_shard as fs

from .errors import MeshError
from .validate import entry_point

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Mesh", "as_mesh", "checked_coords"]


@dataclass(frozen=True, slots=True, init=False)
class Mesh:
    """An abstract device mesh: ordered axis names and their sizes.

    Axes are major to minor, as in `torch.distributed.init_device_mesh` (the last varies fastest).
    One axis may have size ``-1``, "the rest of the world"; `resolve` fills it in.

    Examples:
        >>> mesh = Mesh(dp=2, tp=4)
        >>> mesh.axis_names, mesh.size
        (('dp', 'tp'), 8)
        >>> mesh.coords(5)
        {'dp': 1, 'tp': 1}
        >>> Mesh(dp=-1, tp=2).resolve(8)
        Mesh(dp=4, tp=2)
    """

    axes: tuple[tuple[str, int], ...]

    def __init__(self, axes: Mapping[str, int] | None = None, /, **sizes: int) -> None:
        if axes is not None and not isinstance(axes, Mapping):
            raise MeshError(
                f"Mesh({axes!r}): axes are given as name=size, or as one mapping of names to "
                f"sizes; got {type(axes).__name__}. Write e.g. Mesh(dp=2, tp=4) or Mesh({{'dp': 2}})"
            )
        items = list((axes or {}).items()) + list(sizes.items())
        problems = []
        names = [name for name, _ in items]
        for name in {n for n in names if names.count(n) > 1}:
            problems.append(f"axis {name!r} is named twice")
        for name, size in items:
            if not isinstance(name, str) or not name.isidentifier():
                problems.append(f"axis name {name!r} is not a Python identifier")
            if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
                problems.append(f"axis {name!r} has size {size!r}; sizes are ints >= 1, or -1")
        if sum(size == -1 for _, size in items) > 1:
            problems.append("more than one axis has size -1; at most one may take the rest")
        if not items:
            problems.append("a mesh needs at least one axis, e.g. Mesh(dp=8)")
        if problems:
            raise MeshError("invalid mesh: " + "; ".join(sorted(problems)) + ". Fix the axis names or sizes.")
        object.__setattr__(self, "axes", tuple((name, int(size)) for name, size in items))

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, major to minor."""
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name to size, in mesh order (like JAX's ``Mesh.shape``)."""
        return dict(self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The axis sizes, major to minor."""
        return tuple(size for _, size in self.axes)

    @property
    def size(self) -> int:
        """The number of devices; an error while an axis is still -1."""
        self.require_resolved("Mesh.size")
        return math.prod(self.sizes)

    @property
    def is_resolved(self) -> bool:
        """Whether every axis has a concrete size."""
        return all(size >= 1 for size in self.sizes)

    def __len__(self) -> int:
        return len(self.axes)

    def __iter__(self) -> Iterator[str]:
        return iter(self.axis_names)

    def __contains__(self, axis: object) -> bool:
        return axis in self.shape

    def __getitem__(self, axis: str) -> int:
        try:
            return self.shape[axis]
        except KeyError:
            raise MeshError(f"axis {axis!r} is not in {self!r}; its axes are {self.axis_names}") from None

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{name}={size}" for name, size in self.axes) + ")"

    def require_resolved(self, what: str) -> None:
        """Raise unless every axis has a concrete size."""
        if not self.is_resolved:
            raise MeshError(
                f"{what} needs a resolved mesh, but {self!r} has an axis of size -1. "
                "Call mesh.resolve(world_size) first."
            )

    def resolve(self, world_size: int) -> Mesh:
        """Fill in the axis of size -1 so that the mesh has ``world_size`` devices.

        Raises:
            MeshError: the known axes do not divide ``world_size``, or a resolved mesh has another size.

        Examples:
            >>> Mesh(dp=-1, tp=4).resolve(32)
            Mesh(dp=8, tp=4)
        """
        known = math.prod(size for size in self.sizes if size != -1)
        if self.is_resolved:
            if known != world_size:
                raise MeshError(
                    f"{self!r} has {known} devices but the world size is {world_size}. "
                    "Change the mesh, or give one axis size -1 to take the rest."
                )
            return self
        if world_size % known:
            raise MeshError(
                f"cannot resolve {self!r} for world size {world_size}: the other axes hold "
                f"{known} devices, which does not divide {world_size}. Change the axis sizes."
            )
        return Mesh({name: world_size // known if size == -1 else size for name, size in self.axes})

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank`` (row-major, as ``init_device_mesh`` numbers ranks).

        Raises:
            MeshError: ``rank`` is outside the mesh.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise MeshError(f"rank {rank!r} is outside {self!r}, which has ranks 0..{self.size - 1}")
        coords = {}
        for name, size in reversed(self.axes):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in self.axis_names}

    def rank(self, coords: Mapping[str, int]) -> int:
        """The rank at ``coords``, the inverse of `coords`.

        Raises:
            MeshError: ``coords`` lacks an axis, names one the mesh has not, or is off its end.

        Examples:
            >>> Mesh(dp=2, tp=4).rank({"dp": 1, "tp": 1})
            5
        """
        checked_coords(self, coords, "coords")
        rank = 0
        for name, size in self.axes:
            rank = rank * size + coords[name]
        return rank

    def axes_size(self, axes: tuple[str, ...]) -> int:
        """The number of devices along several axes together."""
        return math.prod(self[axis] for axis in axes)

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> Mesh:
        """Read a torch `DeviceMesh` as its axis names and sizes.

        Raises:
            MeshError: the device mesh has unnamed dims.

        Examples:
            >>> # dm = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
            >>> # Mesh.from_device_mesh(dm) == Mesh(dp=2, tp=4)
        """
        names = device_mesh.mesh_dim_names
        if names is None:
            raise MeshError(
                "the DeviceMesh has no dim names; build it with "
                "init_device_mesh(..., mesh_dim_names=(...)) so plans can name its axes"
            )
        return cls(dict(zip(names, tuple(device_mesh.mesh.shape), strict=True)))

    @entry_point
    def device_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Build the real torch `DeviceMesh` (needs an initialised process group).

        Args:
            device_type: ``"cpu"``, or ``"cuda"`` where this machine has it.

        Raises:
            MeshError: ``device_type`` is no device type this machine has, no process group is
                initialised, or its world size differs from the mesh.

        Examples:
            >>> # inside torch.distributed with 8 processes:
            >>> # Mesh(dp=2, tp=4).device_mesh("cuda")
        """
        # the runtime builds it, reached through the façade (docs/architecture.md): the pure
        # core never loads torch.distributed's device meshes itself
        return fs._build_device_mesh(self, device_type)

    def to_json(self) -> dict[str, Any]:
        """The mesh as a JSON-ready dict."""
        return {"axes": [[name, size] for name, size in self.axes]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> Mesh:
        """The inverse of `to_json`; also reads that dict as JSON text.

        Raises:
            MeshError: ``data`` is not what `to_json` writes.

        Examples:
            >>> Mesh.from_json(Mesh(dp=2, tp=4).to_json())
            Mesh(dp=2, tp=4)
            >>> Mesh.from_json('{"axes": [["dp", 2]]}')
            Mesh(dp=2)
        """
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as error:
                raise MeshError(
                    f"Mesh.from_json({data!r}): not JSON ({error}); it reads what Mesh.to_json writes, "
                    'e.g. {"axes": [["dp", 2]]}. For "dp=2" text write Mesh(dp=2)'
                ) from None
        axes = data.get("axes") if isinstance(data, Mapping) else None
        if not isinstance(axes, list) or not all(isinstance(a, list | tuple) and len(a) == 2 for a in axes):
            raise MeshError(
                f"Mesh.from_json({data!r}): expected what Mesh.to_json writes, a dict with "
                '"axes": a list of [name, size] pairs, e.g. {"axes": [["dp", 2]]}'
            )
        return cls({name: size for name, size in axes})


def checked_coords(mesh: Mesh, coords: Any, argument: str) -> Mapping[str, int]:
    """``coords`` if it is one place on ``mesh`` (an index on every axis), else an error.

    The error names what is off: a rank worked out from a wrong place would be another's, or none.

    ``argument`` names the argument in the message, e.g. ``"rank"``.

    Raises:
        MeshError: ``coords`` is not a mapping, lacks an axis, names one the mesh has not, or an
            index is not an int inside its axis.
    """
    example = mesh.coords(0)
    if not isinstance(coords, Mapping):
        raise MeshError(f"{argument}={coords!r}: expected coordinates by axis, e.g. {example}, on {mesh!r}")
    problems = [f"axis {axis!r} is missing" for axis in mesh.axis_names if axis not in coords]
    problems += [f"{axis!r} is not an axis" for axis in coords if axis not in mesh]
    for axis, index in coords.items():
        if axis in mesh and not (
            isinstance(index, int) and not isinstance(index, bool) and 0 <= index < mesh[axis]
        ):
            problems.append(f"{axis}={index!r} is outside 0..{mesh[axis] - 1}")
    if problems:
        raise MeshError(
            f"{argument}={dict(coords)!r} is not a place on {mesh!r}: "
            + "; ".join(problems)
            + f". Give every axis an index, e.g. {example}"
        )
    return coords


def as_mesh(mesh: Any, where: str) -> Mesh:
    """``mesh`` as a `Mesh` (a torch ``DeviceMesh`` is read), else an error saying what to write.

    ``where`` names the argument in the message, e.g. ``"shard(mesh=...)"``.

    Raises:
        MeshError: ``mesh`` is neither.

    Examples:
        >>> as_mesh(Mesh(dp=2), "shard(mesh=...)")
        Mesh(dp=2)
        >>> as_mesh({"dp": 2, "tp": 4}, "shard(mesh=...)")
        Traceback (most recent call last):
        ...
        functional_shard.MeshError: shard(mesh=...): ... got dict; write fs.Mesh(dp=2, tp=4)
    """
    if isinstance(mesh, Mesh):
        return mesh
    # duck-typed so that the pure core never imports torch.distributed
    if hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "mesh"):
        return Mesh.from_device_mesh(mesh)
    example = "fs.Mesh(dp=2)"
    if (
        isinstance(mesh, Mapping)
        and mesh
        and all(isinstance(name, str) and name.isidentifier() for name in mesh)
    ):
        example = "fs.Mesh(" + ", ".join(f"{name}={size!r}" for name, size in mesh.items()) + ")"
    raise MeshError(
        f"{where}: expected an fs.Mesh (or a torch DeviceMesh), got {type(mesh).__name__}; write {example}"
    )
