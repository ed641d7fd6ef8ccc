"""Activation traces: a model's forward and backward on fake tensors at one rank's local shapes."""
