"""The vocabulary every layer speaks: meshes, specs, layouts, model trees, errors, units.

Pure: nothing here plans, costs or runs anything, nor imports from another layer.
"""
