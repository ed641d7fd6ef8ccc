"""Functions run on every rank of a LocalWorld: FSDP units of a model with no rules, measured."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.distributed.tensor import DTensor

import functional_shard as fs
from functional_shard.costing.cost.cost_model import unit_gathered

from . import dist_cases
from .unit_models import TitanConfig, TitanLlama, TransformerBlock

STEPS = 2
BATCH_PER_RANK = 2
SEQ = 8


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _gathered_by_fsdp(model: torch.nn.Module, plan: fs.Plan) -> dict[str, int]:
    """What FSDP2 holds while each unit is gathered: the storages its unsharded parameters
    live in (padding included), by the plan's unit name."""
    from torch.distributed.fsdp import FSDPModule

    storages: dict[
        str, dict[int, int]
    ] = {}  # unit -> its gathered storages (a group's modules share one unit)
    for path, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        module.unshard()
        for name, param in module.named_parameters():
            if not isinstance(param, DTensor):  # an inner unit's stays sharded
                unit = plan.unit_of(f"{path}.{name}" if path else name)
                storages.setdefault(unit, {})[param.untyped_storage().data_ptr()] = (
                    param.untyped_storage().nbytes()
                )
        module.reshard()
    return {unit: sum(held.values()) for unit, held in storages.items()}


def _planned(name: str) -> tuple[fs.Mesh, fs.Policy]:
    world = dist.get_world_size()
    return {
        "blocks": (fs.Mesh(dp=world), fs.fsdp("dp")),
        "blocks+group": (fs.Mesh(dp=world), fs.fsdp("dp", units=(TransformerBlock, ("norm", "output")))),
        "fsdp+tp": (fs.Mesh(dp=2, tp=world // 2), fs.fsdp("dp") + fs.tp(fs.rules.torchtitan, "tp")),
    }[name]


def titan_runs(name: str) -> dict[str, object] | None:
    """A torchtitan-shaped Llama under a plan on this world (its blocks found in a
    ModuleDict; ``blocks+group``: the final norm and the head one unit; ``fsdp+tp``: split by
    `fs.rules.torchtitan`): rank 0 returns the gathered bytes of every unit as FSDP2 holds
    them and as the plan predicts (without tp), the resident memory measured and
    predicted, and the losses beside one process's."""
    torch.manual_seed(0)
    model = TitanLlama(TitanConfig())
    alone = copy.deepcopy(model)
    mesh, policy = _planned(name)
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-2)
    reference = torch.optim.AdamW(alone.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(7)
    rank = dist.get_rank()
    index, count = plan.data_parallel_rank(rank)  # a tp group's ranks read one batch
    losses, alone_losses = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, TitanConfig().vocab, (BATCH_PER_RANK * count, SEQ + 1), generator=generator)
        for module, optim, kept, batch in (
            (model, optimizer, losses, tokens[index * BATCH_PER_RANK : (index + 1) * BATCH_PER_RANK]),
            (alone, reference, alone_losses, tokens),
        ):
            optim.zero_grad()
            loss = _loss(module, batch)
            loss.backward()
            optim.step()
            kept.append(loss.detach())
    cost = plan.cost("adamw", rank=rank)
    result = {
        # under tp a gathered parameter is still a DTensor (split over tp): not compared here
        "gathered": _gathered_by_fsdp(model, plan) if name != "fsdp+tp" else None,
        "predicted_gathered": unit_gathered(plan),
        "resident": fs.measure.resident_bytes(model, optimizer),
        "predicted": {
            "params": cost.params_bytes,
            "grads": cost.grads_bytes,
            "optimizer": cost.optimizer_bytes,
        },
        "gathered_bytes": cost.gathered_bytes,
        "losses": [dist_cases.mean_over_ranks(loss).item() for loss in losses],
        "alone": [loss.item() for loss in alone_losses],
        "units": plan.config.unit_names,
    }
    return result if rank == 0 else None
