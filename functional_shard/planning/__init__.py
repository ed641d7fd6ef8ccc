"""From a model and a mesh to a `Plan`: policies, rules, stages, schedules, the planner.

Pure: builds data, touches no parameter and no process group. Imports only `core`.
`policy/` says what the user asked for (the layer types, their constructors, their text
form), `tp/` which projections split how (rule sets, torch's styles, the plans a Hugging
Face model carries, rules from a model's structure, sequence parallel), `pipeline/` cuts
and orders pipelines, `fsdp/` finds the FSDP units, and `plan/` holds the `Plan` and its
config, JSON form and cost record. `planner.shard` resolves all of it into a plan
(`placement` merges the layers' answers, `config_builder` writes the config, `assemble`
places the tensors, `block_reuse` plans each kind of repeated block once).
"""
