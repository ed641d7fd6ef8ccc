"""Runs that stop, save, and resume under another plan and world size, with the data order.

Importable, so spawn can send the functions. The model is `pipeline_cases`' even tiny
Llama (seed 0), so one table of plans holds flat ones and a pipeline one.
"""

from __future__ import annotations

from typing import Any

import lightning as L  # noqa: N812 (the name Lightning documents)
import torch
import torch.distributed as dist

import functional_shard as fs
from functional_shard.adapters.lightning import ShardStrategy, training_loss

from . import pipeline_cases
from .dist_cases import full
from .lightning_cases import join_as_lightning_rank

DATASET = 24
GLOBAL_BATCH = 8  # three steps an epoch: a resume at step 2 goes on into the next epoch
STOP = 2  # steps before the save (ModelCheckpoint saves every STOP steps)
SEED = 7
SPECS = {
    "fsdp4": (fs.Mesh(dp=4), fs.fsdp("dp")),
    "fsdp2": (fs.Mesh(dp=2), fs.fsdp("dp")),
    "fsdp2_tp2": (fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")),
    "pp2_fsdp2": (fs.Mesh(pp=2, dp=2), fs.pipeline("pp", microbatches=4) + fs.fsdp("dp")),
    "tp2": (fs.Mesh(tp=2), fs.tp(fs.rules.llama, "tp")),
}


def tokens() -> torch.Tensor:
    """The dataset: ``DATASET`` sequences of the tiny Llama's tokens."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, 128, (DATASET, pipeline_cases.SEQ + 1), generator=generator)


def reference(steps: int) -> list[float]:
    """One process, uninterrupted, reading the global batches of the data order."""
    model = pipeline_cases.build(pipeline_cases.case({"dp": 1}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=pipeline_cases.LR, eps=pipeline_cases.EPS)
    data = tokens()
    loader = fs.ResumableSampler(DATASET, batch_size=GLOBAL_BATCH, seed=SEED).loader(data)
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            optimizer.zero_grad()
            loss = pipeline_cases.lm_loss(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses


def train_and_save(plan_name: str, path: str, steps: int, resume: bool) -> dict[str, Any] | None:
    """Under ``plan_name``: load ``path`` with its data order (``resume``) or start anew,
    train ``steps`` steps, and (not ``resume``) save model, optimizer and data order.
    Rank 0 returns the global losses and where the data order stands."""
    model = pipeline_cases.build(pipeline_cases.case({"dp": 1}))
    plan = fs.shard(model, *SPECS[plan_name])
    fs.apply(plan, model)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=pipeline_cases.LR, eps=pipeline_cases.EPS)
    sampler = fs.ResumableSampler(
        DATASET, plan=plan, rank=dist.get_rank(), batch_size=GLOBAL_BATCH, seed=SEED
    )
    loader = sampler.loader(tokens())
    refused = None
    if resume:
        refused = _refused_before_loading(plan, model, optimizer, path)
        fs.checkpoint.load(path, model, optimizer, data=loader)
    step = fs.forward_backward(plan, model, pipeline_cases.lm_loss)
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            optimizer.zero_grad()
            loss = step(batch[:, :-1], batch[:, 1:])
            optimizer.step()
            # ranks of one data-parallel slice hold the same loss: the mean over all is the global one
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
            if len(losses) == steps:
                break
    if not resume:
        fs.checkpoint.save(path, model, optimizer, data=loader)
    result = {"losses": losses, "state": loader.state_dict(), "refused": refused}
    return result if dist.get_rank() == 0 else None


def _refused_before_loading(
    plan: fs.Plan, model: torch.nn.Module, optimizer: Any, path: str
) -> dict[str, Any]:
    """Load with a sampler of another global batch: the refusal, and whether the module stayed."""
    other = fs.ResumableSampler(DATASET, plan=plan, rank=dist.get_rank(), batch_size=2 * GLOBAL_BATCH)
    before = [full(param) for param in model.parameters()]
    try:
        fs.checkpoint.load(path, model, optimizer, data=other)
        message = None
    except fs.ShardingError as error:
        message = str(error)
    after = [full(param) for param in model.parameters()]
    unchanged = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    return {"message": message, "unchanged": unchanged, "position": other.state_dict()["consumed"]}


# ---- Lightning ------------------------------------------------------------------------


class _LossLog(L.Callback):
    """Each step's loss, as Lightning hands it to the callbacks."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, index: int
    ) -> None:
        self.losses.append(full(outputs["loss"]))


class _ResumableModel(L.LightningModule):
    """The tiny Llama with AdamW; its train loader walks the global data order of its plan."""

    def __init__(self) -> None:
        super().__init__()
        self.model = pipeline_cases.build(pipeline_cases.case({"dp": 1}))

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return pipeline_cases.lm_loss(logits, targets)

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        return training_loss(self, batch[:, :-1], batch[:, 1:])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=pipeline_cases.LR, eps=pipeline_cases.EPS)

    def train_dataloader(self) -> fs.ResumableLoader:
        strategy = self.trainer.strategy
        sampler = fs.ResumableSampler(
            DATASET, plan=strategy.plan, rank=self.trainer.global_rank, batch_size=GLOBAL_BATCH, seed=SEED
        )
        return sampler.loader(tokens())


def fit(plan_name: str, folder: str, max_steps: int, resume_from: str | None) -> dict[str, Any] | None:
    """Trainer.fit under ``plan_name`` to ``max_steps``: from the start, with a
    ModelCheckpoint every STOP steps into ``folder``, or resumed from ``resume_from``. Rank 0
    returns the losses of this fit's steps (logged by a callback) and the files written."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _, world = join_as_lightning_rank()
    mesh, policy = SPECS[plan_name]
    log = _LossLog()
    callbacks: list[L.Callback] = [log]
    if resume_from is None:
        callbacks.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=STOP, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ShardStrategy(policy, mesh=mesh),
        max_steps=max_steps,
        callbacks=callbacks,
        enable_checkpointing=resume_from is None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_ResumableModel(), ckpt_path=resume_from)
    losses = [t.item() for t in _mean_over_ranks(torch.stack(log.losses))]
    import os

    held = sorted(os.listdir(folder)) if resume_from is None else []
    return {"losses": losses, "held": held, "step": trainer.global_step} if dist.get_rank() == 0 else None


def _mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    total = values.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()
