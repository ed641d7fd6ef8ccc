"""torch's engines, one module each, as `functional_shard.apply` runs them.

`checks` says, without a process group, what the engines cannot run. `tensor_parallel`
(DTensor styles, Hugging Face's Conv1D; packed projections in `packed_pieces`), `experts`
(mixture-of-experts layers), `activation_checkpointing` and `data_parallel` (FSDP2, DDP)
parallelize a module, or a pipeline stage, in that order. `pipeline` keeps a rank's stages,
runs those on each and wraps it in torch's ``PipelineStage``; `step` holds `forward_backward`,
one training step for any plan, `evaluation` its forward-only counterparts, and `context/`
context parallel's cut, attention and step. `materialize` fills meta parameters shard by
shard, and `buffers` gives meta buffers the values construction gives them (or refuses them by
path); `optimizer` builds the optimizer and the clipping and loss-scaling helpers; `applied`
remembers which plan each module runs. `runtime/apply.py` orchestrates them; the façade
re-exports the public names.
"""
