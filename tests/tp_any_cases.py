"""Functions run on every rank of a LocalWorld: models with any naming split by tensor parallel."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.distributed.tensor import DTensor

import functional_shard as fs

from . import unit_models

SEQ = 8
BATCH = 2


def build(name: str) -> torch.nn.Module:
    """A model of `unit_models` by name, seeded alike on every rank."""
    torch.manual_seed(0)
    config = unit_models.TitanConfig()
    builders = {
        "titan_moe": lambda: unit_models.TitanDeepSeek(config),
    }
    return builders[name]()


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def parity(name: str, rules: object, steps: int = 2) -> dict[str, float] | None:
    """Train ``name`` split over every rank (``fs.tp(rules)``) beside one process's copy;
    rank 0 returns the largest loss and gradient differences over ``steps`` AdamW steps."""
    model = build(name)
    alone = copy.deepcopy(model)
    plan = fs.shard(model, fs.Mesh(tp=dist.get_world_size()), fs.tp(rules, "tp"))
    fs.apply(plan, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = torch.optim.AdamW(alone.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(7)
    loss_diff = grad_diff = 0.0
    for _ in range(steps):
        tokens = torch.randint(0, unit_models.TitanConfig().vocab, (BATCH, SEQ + 1), generator=generator)
        losses = []
        for module, optim in ((model, optimizer), (alone, reference)):
            optim.zero_grad()
            loss = _loss(module, tokens)
            loss.backward()
            losses.append(loss.detach())
        loss_diff = max(loss_diff, (losses[0] - losses[1]).abs().item())
        mine = dict(model.named_parameters())
        for path, param in alone.named_parameters():
            grad = mine[path].grad
            assert grad is not None, path
            assert param.grad is not None, path
            whole = grad.full_tensor() if isinstance(grad, DTensor) else grad
            grad_diff = max(grad_diff, (whole - param.grad).abs().max().item())
        optimizer.step()
        reference.step()
    split = sum(isinstance(p, DTensor) and not p.placements[0].is_replicate() for p in model.parameters())
    result = {"loss": loss_diff, "grad": grad_diff, "split": float(split)}
    return result if dist.get_rank() == 0 else None
