"""Adapters from plans to training frameworks (installed as ``functional_shard.adapters``).

The only place that imports Lightning. The Lightning strategy lands with issue #4; until
then this package holds nothing but this note.
"""
