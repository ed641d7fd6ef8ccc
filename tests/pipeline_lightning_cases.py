"""Pipeline plans trained by Lightning's Fabric and Trainer on each rank of a LocalWorld."""

from __future__ import annotations

from typing import Any

import lightning as L  # noqa: N812 (the name Lightning documents)
import torch
import torch.distributed as dist

import functional_shard as fs
from functional_shard.adapters.lightning import FabricShardStrategy, ShardStrategy, training_loss

from . import pipeline_cases
from .dist_cases import full, mean_over_ranks
from .lightning_cases import join_as_lightning_rank, quiet_trainer

# pp=2 stages, each sharded by FSDP over dp=2: the representative pipeline plan
SPEC = pipeline_cases.case({"pp": 2, "dp": 2}, data="fsdp")
MESH = fs.Mesh(pp=2, dp=2)


class PipelinedLanguageModel(L.LightningModule):
    """A tiny Llama whose training_step runs under any plan; it names its loss for the schedule."""

    def __init__(self, spec: dict[str, Any] = SPEC) -> None:
        super().__init__()
        self.model = pipeline_cases.build(spec)
        self.losses: list[torch.Tensor] = []

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return pipeline_cases.lm_loss(outputs, targets)

    def training_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        loss = training_loss(self, batch[:, :-1], batch[:, 1:])
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=pipeline_cases.LR, eps=pipeline_cases.EPS)


class Validates(PipelinedLanguageModel):
    """Asks for a validation loop, which no pipeline stage can run alone."""

    def validation_step(self, batch: torch.Tensor, batch_index: int) -> None:
        training_loss(self, batch[:, :-1], batch[:, 1:])


def tokens(data_parallel: int) -> torch.Tensor:
    return torch.cat(pipeline_cases.batches(data_parallel))


def reference(data_parallel: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the global batches Lightning's DistributedSampler makes (shuffled with
    seed 0; rank r takes perm[r::n], so step s's batches together are one block of perm)."""
    every = tokens(data_parallel)
    perm = torch.randperm(len(every), generator=torch.Generator().manual_seed(0))
    model = pipeline_cases.build(SPEC)
    optimizer = torch.optim.AdamW(model.parameters(), lr=pipeline_cases.LR, eps=pipeline_cases.EPS)
    losses = []
    for batch in every[perm].split(pipeline_cases.BATCH * data_parallel):
        optimizer.zero_grad()
        loss = pipeline_cases.lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit(
    policy_or_plan: Any = None, module: L.LightningModule | None = None, **options: Any
) -> dict[str, Any]:
    """Trainer.fit of the pipelined Llama on this rank; every rank returns the global losses and
    its own stage's whole parameters."""
    save_to = options.pop("save_to", None)
    policy = policy_or_plan or pipeline_cases.policy_of(SPEC)
    strategy = ShardStrategy(policy, mesh=MESH)
    trainer = quiet_trainer(strategy, max_steps=pipeline_cases.STEPS, **options)
    loader = torch.utils.data.DataLoader(tokens(2), batch_size=pipeline_cases.BATCH)
    module = module or PipelinedLanguageModel()
    trainer.fit(module, loader)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    losses = mean_over_ranks(torch.stack(module.losses))
    params = {k.removeprefix("model."): full(v) for k, v in module.state_dict().items()}
    return {"losses": losses.tolist(), "params": params}


def resume_without_pp(path: str) -> dict[str, torch.Tensor]:
    """Resume a pipelined fit's checkpoint under FSDP over every rank (the fit is already at
    max_steps, so nothing trains): the loaded whole parameters, by path (every rank)."""
    strategy = ShardStrategy(fs.fsdp("dp"), mesh=fs.Mesh(dp=dist.get_world_size()))
    trainer = quiet_trainer(strategy, max_steps=pipeline_cases.STEPS)
    loader = torch.utils.data.DataLoader(tokens(4), batch_size=pipeline_cases.BATCH)
    module = PipelinedLanguageModel()
    trainer.fit(module, loader, ckpt_path=path)
    assert not module.losses, "a fit resumed at max_steps trains no more"
    return {k.removeprefix("model."): full(v) for k, v in module.state_dict().items()}


def fit_refused(**options: Any) -> str:
    """The ShardingError a pipelined fit raises before training (or '')."""
    validate, manual = options.pop("validate", False), options.pop("manual", False)
    module = Validates() if validate else PipelinedLanguageModel()
    module.automatic_optimization = not manual
    try:
        fit(module=module, **options)
    except fs.ShardingError as error:
        return str(error)
    return ""


def fabric_loop() -> dict[str, Any]:
    """A Fabric loop with strategy.forward_backward under the pp x fsdp plan; every rank returns
    the global losses and its own stage's whole parameters."""
    rank, world = join_as_lightning_rank()
    strategy = FabricShardStrategy(pipeline_cases.policy_of(SPEC), mesh=MESH)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(pipeline_cases.build(SPEC))
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=pipeline_cases.LR, eps=pipeline_cases.EPS)
    )
    step = strategy.forward_backward(model, pipeline_cases.lm_loss)
    index, data_parallel = strategy.plan.data_parallel_rank(rank)
    rows = pipeline_cases.BATCH
    losses = []
    for batch in pipeline_cases.batches(data_parallel):
        mine = batch[index * rows : (index + 1) * rows]
        optimizer.zero_grad()
        loss = step(mine[:, :-1], mine[:, 1:])
        optimizer.step()
        losses.append(mean_over_ranks(loss).item())
    refused = ""
    try:
        fabric.backward(loss)
    except fs.ShardingError as error:
        refused = str(error)
    params = {k.removeprefix("_forward_module."): full(v) for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "backward_refused": refused, "rank": dist.get_rank()}
