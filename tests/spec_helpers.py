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
