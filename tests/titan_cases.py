"""torchtitan's Llama 3 (`tests.titan_models`) trained on every rank of a LocalWorld, and alone.

Importable so that spawn can send the functions. Each run trains ``STEPS`` AdamW steps on
fixed batches; rank 0 returns the global-batch losses, the whole parameters after the last
step and the whole gradients of the first (AdamW's steps are scale-free: a gradient off by
a factor shows only in the gradients).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

import functional_shard as fs

from .dist_cases import full, mean_over_ranks
from .titan_models import Llama3Model, titan_llama3

STEPS = 3
LR = 1e-2
# as in hf_cases: AdamW's eps of 1e-6 keeps the reordering noise of near-zero gradients small
EPS = 1e-6
MICRO_BATCH = 2
SEQ = 8
VOCAB = 256  # the "tiny" size's


def build(changes: dict[str, Any], device: str | None = None) -> Llama3Model:
    """The tiny model with ``changes`` to its config, initialised with seed 0 (on the meta device: not)."""
    torch.manual_seed(0)
    return titan_llama3("tiny", device=device, **changes)


def strategy(name: str, world: int) -> tuple[fs.Mesh, fs.Policy]:
    """Mesh (resolved for ``world``) and policy by name."""
    mesh, policy = {
        "fsdp_tp": (fs.Mesh(dp=2, tp=-1), fs.fsdp("dp") + fs.tp("auto", "tp")),
        "fsdp_tp_names": (fs.Mesh(dp=2, tp=-1), fs.fsdp("dp") + fs.tp(fs.rules.torchtitan, "tp")),
        "tp": (fs.Mesh(tp=-1), fs.tp("auto", "tp")),
        "fsdp_sp": (fs.Mesh(dp=2, tp=-1), fs.fsdp("dp") + fs.tp("auto", "tp", sequence_parallel=True)),
    }[name]
    return mesh.resolve(world), policy


def batches(data_parallel: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [
        torch.randint(0, VOCAB, (MICRO_BATCH * data_parallel, SEQ + 1), generator=generator)
        for _ in range(STEPS)
    ]


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def reference(changes: dict[str, Any], data_parallel: int) -> dict[str, Any]:
    """One process (built on the CPU) training on the whole global batch."""
    model = build(changes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for tokens in batches(data_parallel):
        optimizer.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        if not grads:
            grads = {k: v.grad.clone() for k, v in model.named_parameters() if v.grad is not None}
        optimizer.step()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "grads": grads}


def train(changes: dict[str, Any], strategy_name: str, meta: bool = False) -> dict[str, Any] | None:
    """Train under a strategy on this rank; rank 0 returns what `reference` returns, the
    data-parallel size and the plan's tensor-parallel rule set.

    With ``meta`` the model is built on the meta device, applied, given values by
    ``fs.materialize`` (seed 0: what the CPU build draws) and its rotary tables computed
    again (`Llama3Model.init_buffers`), then trained.
    """
    mesh, policy = strategy(strategy_name, dist.get_world_size())
    model = build(changes, device="meta" if meta else None)
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    if meta:
        fs.materialize(plan, model, seed=0)
        model.init_buffers("cpu")
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR, eps=EPS)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for tokens in batches(data_parallel):
        optimizer.zero_grad()
        loss = loss_of(model, tokens[index * MICRO_BATCH : (index + 1) * MICRO_BATCH])
        loss.backward()
        if not grads:
            grads = {k: full(v.grad) for k, v in model.named_parameters() if v.grad is not None}
        optimizer.step()
        losses.append(mean_over_ranks(loss).item())
    params = {k: full(v) for k, v in model.state_dict().items()}
    if dist.get_rank() != 0:
        return None
    styles = {path: style for path, style, _ in plan.config.tp_styles}
    return {
        "losses": losses,
        "params": params,
        "grads": grads,
        "data_parallel": data_parallel,
        "styles": styles,
    }


def train_all(cases: tuple[tuple[dict[str, Any], str, bool], ...]) -> list[dict[str, Any] | None]:
    """`train` for each ``(changes, strategy, meta)`` in turn (one world run for many cases)."""
    return [train(*case) for case in cases]
