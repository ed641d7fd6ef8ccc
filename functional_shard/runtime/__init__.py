"""Running a plan: `apply` and the engines, checkpoints, local launches, measurements.

The only layer that touches `torch.distributed`'s process groups. Imports any layer below
it. `apply` orchestrates `engines/` (one module per parallelism, each on torch's own
engine), `checkpoint/` saves and loads across plans (Hugging Face folders in and out in
`checkpoint/hf/`), `launch` starts local gloo ranks,
`measure` counts what a running plan holds and sends, `timeouts` names the collective
and the ranks when a peer hangs or dies (under any launcher).
"""
