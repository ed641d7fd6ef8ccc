"""What a plan costs, before it runs: memory and traffic, traced activations, step time.

Pure (traces run on fake tensors; no process group); imports `core` and `planning`. `cost/` is the
static cost, `trace/` what a model saves for backward, `time/` the hardware and step time,
`estimate/` puts them together into `fs.estimate`.
"""
