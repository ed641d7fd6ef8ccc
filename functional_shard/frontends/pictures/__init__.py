"""Pictures of a plan with matplotlib: memory per device, blocks, pipelines, sequences."""
