"""What a plan costs, before it runs: memory and traffic, traced activations, step time.

Pure (traces run on fake tensors; no process group). Imports `core` and `planning`.
`cost` is the static cost of a plan (bytes held per device, bytes sent per step),
`activations` and the `trace_*` modules trace what a model saves for backward at one
rank's local shapes, `hardware` names accelerators, `step_model` and
`pipeline_estimate` turn a trace into step time, `estimate` puts them together.
"""
