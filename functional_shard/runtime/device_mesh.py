"""The one builder of torch `DeviceMesh` objects from a `Mesh` (needs a process group).

Below `mesh` and `apply`: ``Mesh.device_mesh`` reaches it without climbing to `apply`, and
`apply` and the adapters use the same function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from functional_shard.core.errors import MeshError
from functional_shard.core.validate import device, refuse

from .timeouts import share_timeout

if TYPE_CHECKING:
    from functional_shard.core.mesh import Mesh

__all__ = ["build_device_mesh"]


def build_device_mesh(mesh: Mesh, device_type: str = "cpu") -> DeviceMesh:
    """The torch `DeviceMesh` for ``mesh`` over the current process group.

    An axis of size -1 takes what the world size leaves (`Mesh.resolve`).

    Args:
        mesh: the abstract mesh: axis names and sizes, major to minor.
        device_type: ``"cpu"``, ``"cuda"``, ... as `torch.distributed.init_device_mesh` takes it.

    Returns:
        The DeviceMesh with the mesh's axis names as its dim names.

    Raises:
        MeshError: ``device_type`` is no device type this machine has, no process group is
            initialised, or its world size differs from the mesh.

    Examples:
        >>> # with torch.distributed initialised on 8 ranks:
        >>> # build_device_mesh(Mesh(dp=2, tp=4), "cuda").mesh_dim_names
        >>> # ('dp', 'tp')
    """
    # torch takes any name here ("tpu", "meta") and fails only at the first collective, far from the cause
    meaning = 'the type of device the ranks compute on: "cpu", or "cuda" where this machine has it'
    found = device(device_type, "device_type", meaning=meaning, error=MeshError)
    if found.index is not None:  # each rank's index is its own: the mesh takes the type only
        refuse(
            "device_type",
            repr(device_type),
            "a device type, without an index",
            meaning=meaning,
            error=MeshError,
        )
    if not dist.is_initialized():
        raise MeshError(
            f"building the DeviceMesh for {mesh!r} needs torch.distributed: call "
            "dist.init_process_group(...) first (or launch with torchrun / Lightning)"
        )
    mesh = mesh.resolve(dist.get_world_size())
    built = init_device_mesh(found.type, mesh.sizes, mesh_dim_names=mesh.axis_names)
    # the groups of the mesh wait for a hung peer as long as the process group does
    share_timeout([built.get_group(axis) for axis in range(built.ndim)])
    return built
