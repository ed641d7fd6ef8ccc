"""Running a plan: `apply` and the engines, checkpoints, local launches, measurements.

The only layer that touches `torch.distributed`'s process groups. `apply` orchestrates
`engines/` (one module per parallelism), `checkpoint/` saves and loads across plans (Hugging
Face folders in `checkpoint/hf/`), `launch` starts local gloo ranks, `measure` counts what a
running plan holds and sends, `timeouts` names the collective and ranks when a peer hangs.
"""
