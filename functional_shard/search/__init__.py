"""Choosing a plan: `fs.auto` and `fs.search_plans`, the fastest estimated plan that fits.

Pure. Imports `core`, `planning` and `costing`: candidates are plans, judged by the
estimate. `candidates` reads the model and lists the points tried (meshes, families, tp,
sp, ep, pipelines) and their policies; `search` estimates them, each search with its own
`traces`; `report` holds what was found; `auto` is the public entry.
"""
