"""Hugging Face folders in and out: their files, their tensors read in slices, name maps."""
