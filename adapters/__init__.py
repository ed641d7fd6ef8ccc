"""Adapters from plans to training frameworks (installed as ``functional_shard.adapters``).

The only place that imports Lightning, and the top layer: it imports the library, never
the other way round. ``functional_shard.adapters.lightning`` holds the strategies
(`ShardStrategy` for the Trainer, `FabricShardStrategy` for Fabric) and the translation of
Lightning's own strategies into plans; importing this package alone loads no Lightning.
"""
