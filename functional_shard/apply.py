"""The only module that talks to torch.distributed process groups.

Today it builds device meshes; running a whole plan with FSDP2 / DTensor / DDP
(``apply``) is the next step of the project (issue #3).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import MeshError
from .mesh import Mesh

__all__ = ["build_device_mesh"]


def build_device_mesh(mesh: Mesh, device_type: str = "cpu") -> DeviceMesh:
    """The torch `DeviceMesh` for ``mesh`` over the current process group.

    Raises:
        MeshError: no process group is initialised, or its world size differs from the mesh.

    Examples:
        >>> # with torch.distributed initialised on 8 ranks:
        >>> # build_device_mesh(Mesh(dp=2, tp=4), "cuda").mesh_dim_names
        >>> # ('dp', 'tp')
    """
    if not dist.is_initialized():
        raise MeshError(
            f"building the DeviceMesh for {mesh!r} needs torch.distributed: call "
            "dist.init_process_group(...) first (or launch with torchrun / Lightning)"
        )
    mesh = mesh.resolve(dist.get_world_size())
    return init_device_mesh(device_type, mesh.sizes, mesh_dim_names=mesh.axis_names)
