"""The static cost model: bytes each device holds and sends per step, from the plan alone."""
