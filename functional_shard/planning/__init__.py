"""From a model and a mesh to a `Plan`: policies, rules, stages, schedules, the planner.

Pure: builds data, touches no parameter and no process group; imports only `core`. `policy/` is
what the user asked for, `tp/` which projections split how, `pipeline/` cuts and orders pipelines,
`fsdp/` finds the FSDP units, `plan/` holds the `Plan`; `planner.shard` resolves it all into a plan.
"""
