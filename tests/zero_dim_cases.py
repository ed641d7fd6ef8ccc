"""Rank functions for 0-d parameters and buffers (importable, so spawn can send them)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

import functional_shard as fs
from functional_shard.zoo import Llama, LlamaConfig

from . import dist_cases
from .dist_cases import LR, MICRO_BATCH, STEPS, batches, full, loss_of

CONFIG = LlamaConfig(128, 32, 64, num_layers=2, num_heads=4, num_kv_heads=4, tie_embeddings=True)


class ScaledLlama(Llama):
    """A Llama whose logits a learned 0-d scale multiplies (CLIP's ``logit_scale``), and a
    fixed 0-d buffer too (Gemma's ``embed_scale``)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.logit_scale = nn.Parameter(torch.tensor(0.75))
        self.register_buffer("embed_scale", torch.tensor(1.25))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Llama's logits, scaled."""
        return super().forward(tokens) * self.logit_scale * self.embed_scale

    def reset_parameters(self) -> None:
        """The scale's initial value (materialize replays it), and the buffer's (it restores it)."""
        with torch.no_grad():
            self.logit_scale.fill_(0.75)
            self.embed_scale.fill_(1.25)


def reference(data_parallel: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process training on the whole global batch."""
    return dist_cases.reference(CONFIG, data_parallel, model_type=ScaledLlama)


def strategy(name: str, world: int) -> tuple[fs.Mesh, fs.Policy]:
    """dist_cases' strategies, and plain ``fsdp`` (fs.fsdp() over every rank)."""
    if name == "fsdp":
        return fs.Mesh(dp=-1).resolve(world), fs.fsdp()
    return dist_cases.strategy(name, world)


def _built(
    name: str, model_type: type[Llama] = ScaledLlama
) -> tuple[nn.Module, torch.optim.Optimizer, fs.Plan]:
    mesh, policy = strategy(name, dist.get_world_size())
    torch.manual_seed(0)
    model = model_type(CONFIG)
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    return model, fs.optimizer(plan, model, torch.optim.AdamW, lr=LR), plan


def train_and_measure(name: str, model_type: type[Llama] = ScaledLlama) -> dict[str, object]:
    """Train a ``model_type`` under a plan, logging the collectives of a steady-state step (the
    third): rank 0's losses and full parameters, and every rank's measured and predicted
    collective bytes and resident bytes."""
    model, optimizer, plan = _built(name, model_type)
    rank = dist.get_rank()
    index, data_parallel = plan.data_parallel_rank(rank)
    losses = []
    for step, tokens in enumerate(batches(CONFIG, data_parallel)):
        log = fs.measure.CollectiveLog(plan.mesh)
        with log if step == 2 else contextlib.nullcontext():
            optimizer.zero_grad()
            loss = loss_of(model, tokens[index * MICRO_BATCH : (index + 1) * MICRO_BATCH])
            loss.backward()
            optimizer.step()
        if step == 2:
            sent = log.sent
        losses.append(dist_cases.mean_over_ranks(loss).item())
    cost = plan.cost("adamw", tokens=MICRO_BATCH * dist_cases.SEQ, rank=rank)
    params = {k: full(v) for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "params": params if rank == 0 else None,
        "data_parallel": data_parallel,
        "comm": (sent, {k: dict(v) for k, v in cost.comm_bytes.items()}),
        "memory": (
            fs.measure.resident_bytes(model, optimizer),
            {"params": cost.params_bytes, "grads": cost.grads_bytes, "optimizer": cost.optimizer_bytes},
        ),
    }


def meta_init(name: str) -> dict[str, torch.Tensor] | None:
    """Built on meta, applied, materialized with seed 0, trained: rank 0's full parameters."""
    mesh, policy = strategy(name, dist.get_world_size())
    with torch.device("meta"):
        model = ScaledLlama(CONFIG)
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    fs.materialize(plan, model, seed=0)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR)
    dist_cases.train_steps(model, optimizer, CONFIG, plan, range(STEPS))
    params = {k: full(v) for k, v in model.state_dict().items()}
    return params if dist.get_rank() == 0 else None


class FrozenScaleLlama(ScaledLlama):
    """ScaledLlama fine-tuned with parts frozen: its 0-d scale and a query projection (as LoRA
    leaves a base weight)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.logit_scale.requires_grad_(False)
        self.layers[0].self_attn.q_proj.weight.requires_grad_(False)

    def unfreeze(self) -> None:
        """Train the parameters frozen so far, as gradual unfreezing does."""
        self.logit_scale.requires_grad_(True)
        self.layers[0].self_attn.q_proj.weight.requires_grad_(True)


class CountingLlama(FrozenScaleLlama):
    """FrozenScaleLlama beside an integer 0-d parameter (a counter, never differentiable)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.count = nn.Parameter(torch.tensor(3), requires_grad=False)


FROZEN_STEPS, UNFROZEN_STEPS = 1, 2  # steps with parts frozen, then with them unfrozen


def unfreezing_reference(data_parallel: int) -> dict[str, torch.Tensor]:
    """One process: FROZEN_STEPS steps with parts frozen, then the rest with them unfrozen."""
    torch.manual_seed(0)
    model = CountingLlama(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step, tokens in enumerate(batches(CONFIG, data_parallel)[: FROZEN_STEPS + UNFROZEN_STEPS]):
        if step == FROZEN_STEPS:
            model.unfreeze()
        optimizer.zero_grad()
        loss_of(model, tokens).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_unfreezing(name: str) -> dict[str, object]:
    """As `unfreezing_reference`, under a plan: rank 0's full parameters and the data-parallel size."""
    mesh, policy = strategy(name, dist.get_world_size())
    torch.manual_seed(0)
    model = CountingLlama(CONFIG)
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR)
    dist_cases.train_steps(model, optimizer, CONFIG, plan, range(FROZEN_STEPS))
    model.unfreeze()
    dist_cases.train_steps(model, optimizer, CONFIG, plan, range(FROZEN_STEPS, FROZEN_STEPS + UNFROZEN_STEPS))
    params = {k: full(v) for k, v in model.state_dict().items()}
    data_parallel = plan.data_parallel_rank(0)[1]
    return {"params": params if dist.get_rank() == 0 else None, "data_parallel": data_parallel}
