"""Policies: the layer types, their constructors, and their text form (read and written)."""
