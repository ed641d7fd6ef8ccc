"""Step time: hardware profiles, flops, kernels, and the step model that times a trace."""
