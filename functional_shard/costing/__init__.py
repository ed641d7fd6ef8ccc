"""What a plan costs, before it runs: memory and traffic, traced activations, step time.

Pure (traces run on fake tensors; no process group). Imports `core` and `planning`.
`cost/` is the static cost of a plan (bytes held per device, bytes sent per step),
`trace/` traces what a model saves for backward at one rank's local shapes, `time/`
names accelerators and turns a trace into step time, and `estimate/` puts them
together into `fs.estimate` (a pipeline stage by stage).
"""
