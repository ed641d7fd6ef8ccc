"""Plans as Lightning strategies: ``Trainer(strategy=ShardStrategy(plan_or_policy))``.

Thin by design: the plan is made by `functional_shard.shard`, run by `functional_shard.apply`
and `functional_shard.materialize`; this package only tells Lightning when to call them.
Importing it registers the ``fs_*`` strategy names (``Trainer(strategy="fs_fsdp")``).

* `trainer`: `ShardStrategy`, for ``lightning.Trainer``, the registered names, and
  `training_loss` (one ``training_step`` for every plan, pipelines included);
* `fabric`: `FabricShardStrategy`, for ``lightning.Fabric``;
* `native`: `to_lightning` and `deepspeed_config`, Lightning's own strategies for a plan;
* `_common`: what the two strategies share (planning, applying, joining the process group).
"""

from .fabric import FabricShardStrategy as FabricShardStrategy
from .native import deepspeed_config as deepspeed_config
from .native import to_lightning as to_lightning
from .trainer import ShardStrategy as ShardStrategy
from .trainer import training_loss as training_loss

__all__ = ["FabricShardStrategy", "ShardStrategy", "deepspeed_config", "to_lightning", "training_loss"]
