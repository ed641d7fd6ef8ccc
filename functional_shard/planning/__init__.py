"""From a model and a mesh to a `Plan`: policies, rules, stages, schedules, the planner.

Pure: builds data, touches no parameter and no process group. Imports only `core`.
`policy` and `policy_text` say what the user asked for, `rules` (and `hf`, the rules a
Hugging Face model carries) say which projections split how, `stages` and `schedules`
cut and order pipelines, `planner.shard` resolves all of it into a `plan.Plan`.
"""
