"""Lightning runs where rank 1 hangs, for tests/e2e/test_crash.py.

``python -m tests.lightning_hang SECONDS``: a Trainer.fit on 4 CPU processes (Lightning
launches them) where rank 1 hangs in its second step; the strategy's ``timeout`` is SECONDS.
The other ranks wait that long in the step's first collective, then end with the
strategy's `functional_shard.CollectiveTimeoutError`. `fabric_barrier_while_rank_1_sleeps`:
the same through Fabric, on the ranks of a LocalWorld.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import lightning as L  # noqa: N812 (the name Lightning documents)
import torch

import functional_shard as fs
from functional_shard.adapters.lightning import ShardStrategy
from functional_shard.runtime.timeouts import set_timeout

from . import dist_cases
from .lightning_cases import LanguageModel, join_as_lightning_rank


class HangingModel(LanguageModel):
    """Rank 1 sleeps (for an hour) at the start of its second step, as a hung peer."""

    def training_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        if batch_index == 1 and self.global_rank == 1:
            time.sleep(3600)
        return super().training_step(batch, batch_index)


def fabric_barrier_while_rank_1_sleeps() -> None:
    """Fabric's barrier (the strategy's) on every rank but 1, which sleeps past the timeout."""
    from functional_shard.adapters.lightning import FabricShardStrategy

    rank, world = join_as_lightning_rank()
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=FabricShardStrategy(fs.fsdp()))
    fabric.launch()
    # the world joined with a long timeout (its ranks start slowly: lightning's imports);
    # its collectives from here on wait 3 s, as a strategy's ``timeout`` makes them
    set_timeout(3)
    if rank == 1:
        time.sleep(20)
        return
    fabric.barrier()


def main(seconds: float) -> None:
    strategy = ShardStrategy(fs.fsdp(), timeout=timedelta(seconds=seconds))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=dist_cases.STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    tokens = torch.cat(dist_cases.batches(dist_cases.EVEN, 4))
    loader = torch.utils.data.DataLoader(tokens, batch_size=dist_cases.MICRO_BATCH, shuffle=False)
    trainer.fit(HangingModel(dist_cases.EVEN), loader)


if __name__ == "__main__":
    main(float(sys.argv[1]))
