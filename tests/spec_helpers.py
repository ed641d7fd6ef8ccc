"""Shared knowledge about torch's placements, for tests."""


def torch_describes(mesh, shape, spec):
    """Whether every axis named against mesh order nests in an evenly divided dim."""
    order = mesh.axis_names.index
    for size, axes in zip(shape, spec.dim_axes(len(shape)), strict=True):
        for position, axis in enumerate(axes):
            outer = axes[:position]
            if any(order(a) > order(axis) for a in outer) and size % mesh.axes_size(outer):
                return False
    return True


def torch_distributes(mesh, shape, spec):
    """Whether torch's distribute_tensor can build the layout: it describes it, and every
    split against mesh order divides its dim evenly by all the axes it nests in and its own.

    torch 2.13's distribute_tensor scatters a _StridedShard's padded chunks and asserts
    they are alike (placement_types.py, _shard_tensor): an uneven inner split is described
    (local shapes and offsets agree with torch's) but cannot be built by scattering."""
    if not torch_describes(mesh, shape, spec):
        return False
    order = mesh.axis_names.index
    for size, axes in zip(shape, spec.dim_axes(len(shape)), strict=True):
        for position, axis in enumerate(axes):
            outer = axes[:position]
            strided = mesh.axes_size(tuple(a for a in outer if order(a) > order(axis))) > 1
            if strided and size % mesh.axes_size((*outer, axis)):
                return False
    return True
