"""Pipelines as data: stages, what the ranks of some stages hold, and torch's schedules."""
