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

from . import hf_cases
from .dist_cases import adamw_steps, full
from .titan_models import Llama3Model, titan_llama3

# as in hf_cases (whose AdamW eps of 1e-6 keeps the reordering noise of near-zero gradients small)
STEPS, LR, EPS = hf_cases.STEPS, hf_cases.LR, hf_cases.EPS
MICRO_BATCH, SEQ = hf_cases.MICRO_BATCH, hf_cases.SEQ
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
    return hf_cases.batches(data_parallel, VOCAB)


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def reference(changes: dict[str, Any], data_parallel: int) -> dict[str, Any]:
    """One process (built on the CPU) training on the whole global batch."""
    losses, params, grads = hf_cases.train_alone(build(changes), data_parallel, loss_fn=loss_of, vocab=VOCAB)
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
    _, data_parallel = plan.data_parallel_rank(dist.get_rank())
    losses, grads = adamw_steps(
        plan, model, loss_of, batches(data_parallel), micro_batch=MICRO_BATCH, lr=LR, eps=EPS
    )
    params = {k: full(v) for k, v in model.state_dict().items()}
    if dist.get_rank() != 0:
        return None
    styles = {path: style for path, style, _ in plan.config.tp.styles}
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
