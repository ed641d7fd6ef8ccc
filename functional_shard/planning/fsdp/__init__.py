"""FSDP units: which modules a plan gathers as one, found from a model's repeated blocks."""
