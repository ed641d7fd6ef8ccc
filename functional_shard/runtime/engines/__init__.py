"""torch's engines, one module each, as `functional_shard.apply` runs them.

`checks` says, without a process group, what the engines cannot run. `tensor_parallel`
(DTensor styles, Hugging Face's Conv1D and packed projections), `activation_checkpointing`
and `data_parallel` (FSDP2, DDP) parallelize a module, or a pipeline stage, in that order.
`pipeline` keeps a rank's stages, runs those three on each and wraps it in torch's
``PipelineStage``; `step` holds `forward_backward`, one training step for any plan.
`materialize` fills meta parameters shard by shard, and `buffers` gives meta buffers the
values construction gives them (or refuses them by path); `optimizer` builds the optimizer and
the clipping and loss-scaling helpers; `applied` remembers which plan each module runs.
`functional_shard.apply` orchestrates them and re-exports the public names.
"""
