"""The vocabulary every layer speaks: meshes, specs, layouts, model trees, errors, units.

Pure and framework-light: nothing here plans, costs or runs anything, and nothing here
imports from another layer. `Mesh` names the axes, `P` and `ParamSharding` say where a
tensor lives, `layout` does torch's shard arithmetic, `tree` reads a model into
`TensorSpec`s, `errors` holds the one exception family.
"""
