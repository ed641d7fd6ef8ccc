"""Checkpoints across plans: save, load, convert, their safety and checks, and Hugging Face folders."""
