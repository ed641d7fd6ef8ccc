"""Plans as Lightning strategies: ``Trainer(strategy=ShardStrategy(plan_or_policy))``.

Thin by design: the plan is made by `functional_shard.shard`, run by `functional_shard.apply`
and `functional_shard.materialize`; this package only tells Lightning when to call them.
Importing it registers the ``fs_*`` strategy names (``Trainer(strategy="fs_fsdp")``).

* `trainer`: `ShardStrategy`, for ``lightning.Trainer``, and the registered names;
* `pipeline_loop`: `training_loss`, `evaluation_loss` and `model_outputs` (one
  ``training_step``, ``validation_step`` and ``predict_step`` for every plan, pipelines
  included) and the strategy's part in running a schedule;
* `fabric`: `FabricShardStrategy`, for ``lightning.Fabric``;
* `native`: `to_lightning` and `deepspeed_config`, Lightning's own strategies for a plan;
* `_common`: what the two strategies share (planning, applying, joining the process group).
"""

from .fabric import FabricShardStrategy as FabricShardStrategy
from .native import deepspeed_config as deepspeed_config
from .native import to_lightning as to_lightning
from .pipeline_loop import evaluation_loss as evaluation_loss
from .pipeline_loop import model_outputs as model_outputs
from .pipeline_loop import training_loss as training_loss
from .trainer import ShardStrategy as ShardStrategy

__all__ = [
    "FabricShardStrategy",
    "ShardStrategy",
    "deepspeed_config",
    "evaluation_loss",
    "model_outputs",
    "to_lightning",
    "training_loss",
]
