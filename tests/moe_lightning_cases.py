"""A Mixture-of-experts LightningModule (tiny transformers 5 Mixtral) fit by a real Trainer on each
rank of a LocalWorld, under expert-parallel plans with or without a pipeline."""

from __future__ import annotations

from typing import Any

import lightning as L  # noqa: N812 (the name Lightning documents)
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

import functional_shard as fs
from functional_shard.adapters.lightning import ShardStrategy, training_loss

from . import hf_cases, moe_cases
from .dist_cases import full, mean_over_ranks
from .lightning_cases import quiet_trainer

FAMILY, EXPERTS = "mixtral", 8


def lm_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a Hugging Face output (or a pipeline stage's logits)."""
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class MoeLanguageModel(L.LightningModule):
    """A tiny Mixtral whose training_step runs under any plan (pipelined or not)."""

    def __init__(self, family: str = FAMILY, experts: int = EXPERTS, layers: int = 2) -> None:
        super().__init__()
        self.model = moe_cases.build(family, experts, layers=layers)
        self.losses: list[torch.Tensor] = []

    def loss_fn(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(outputs, targets)

    def training_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        loss = training_loss(self, batch[:, :-1], batch[:, 1:])
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=hf_cases.LR, eps=hf_cases.EPS)


class Validates(MoeLanguageModel):
    """Also validates: every rank's forward dispatches tokens, under no_grad."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.validation_losses: list[torch.Tensor] = []

    def validation_step(self, batch: torch.Tensor, batch_index: int) -> None:
        self.validation_losses.append(self.loss_fn(self.model(batch[:, :-1]), batch[:, 1:]).detach())


def tokens(data_parallel: int) -> torch.Tensor:
    return torch.cat(hf_cases.batches(data_parallel))


def reference(
    data_parallel: int,
    layers: int = 2,
    clip: float | None = None,
    autocast: torch.dtype | None = None,
    accumulate: int = 1,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the global batches Lightning's DistributedSampler makes (shuffled with
    seed 0; rank r takes perm[r::n], so step s's batches together are one block of perm),
    under ``autocast`` when given; with ``accumulate``, a step's block holds its micro-batches."""
    every = tokens(data_parallel * accumulate)
    perm = torch.randperm(len(every), generator=torch.Generator().manual_seed(0))
    model = moe_cases.build(FAMILY, EXPERTS, layers=layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=hf_cases.LR, eps=hf_cases.EPS)
    losses = []
    for batch in every[perm].split(hf_cases.MICRO_BATCH * data_parallel * accumulate):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit(
    policy: fs.Policy,
    mesh: fs.Mesh,
    layers: int = 2,
    rows: int = hf_cases.MICRO_BATCH,
    validate: bool = False,
    accumulate: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """Trainer.fit of the MoE module on this rank: the global losses (a step's: the mean of its
    micro-batches'), this rank's whole parameters (its stages' under a pipeline), the experts'
    placements and the validation losses."""
    trainer = quiet_trainer(
        ShardStrategy(policy, mesh=mesh),
        max_steps=hf_cases.STEPS,
        limit_val_batches=1 if validate else 0,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate,
        **options,
    )
    data_parallel = mesh.axes_size(tuple(a for a, _ in mesh.axes if a in ("dp", "ep")))
    loader = torch.utils.data.DataLoader(tokens(data_parallel * accumulate), batch_size=rows)
    module = (Validates if validate else MoeLanguageModel)(layers=layers)
    trainer.fit(module, loader, loader if validate else None)
    losses = mean_over_ranks(torch.stack(module.losses).view(-1, accumulate).mean(dim=1))
    params = {k.removeprefix("model."): full(v) for k, v in module.state_dict().items()}
    placements = {
        k: str(getattr(v, "placements", None)) for k, v in module.named_parameters() if "experts" in k
    }
    validation = getattr(module, "validation_losses", [])
    return {
        "losses": losses.tolist(),
        "params": params,
        "placements": placements,
        "validation": [mean_over_ranks(v).item() for v in validation],
        "rank": dist.get_rank(),
    }


def fit_refused(policy: fs.Policy, mesh: fs.Mesh, **options: Any) -> str:
    """The ShardingError a fit raises before training (or '')."""
    try:
        fit(policy, mesh, **options)
    except fs.ShardingError as error:
        return str(error)
    return ""


def assert_matches_one_process(
    results: list[dict[str, Any]],
    reference: tuple[list[float], dict[str, torch.Tensor]],
    validated: bool = False,
    loss_tolerance: float = 1e-5,
) -> None:
    """Every rank's global losses as one process's, the ranks' whole parameters together equal
    to its parameters (5e-4 absolute plus 1e-4 relative, as in test_moe_parallel), and the
    experts split by expert index on every rank."""
    import pytest

    losses, params = reference
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        assert result["losses"] == pytest.approx(losses, abs=loss_tolerance)
        merged.update(result["params"])
        assert result["placements"], "no expert tensor on this rank"
        assert all("Shard(dim=0)" in p for p in result["placements"].values()), result["placements"]
        if validated:
            assert len(result["validation"]) == 1
    assert merged.keys() == params.keys()
    if loss_tolerance > 1e-5:  # autocast: the losses say it; bfloat16's rounding moves the parameters
        return
    for name, value in params.items():
        torch.testing.assert_close(merged[name], value, atol=5e-4, rtol=1e-4, msg=name)
