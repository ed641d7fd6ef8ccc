"""Checkpoints saved and loaded under pipeline plans, on every rank of a LocalWorld.

Importable, so spawn can send the functions. A plan is named by a pipeline case of
`pipeline_cases` (``pp=2 x fsdp(dp=2)``) or, without pp, by the same data-parallel layer alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import functional_shard as fs

from . import pipeline_cases
from .dist_cases import full

PLANS: dict[str, dict[str, Any]] = {
    "pp2_fsdp2": pipeline_cases.case({"pp": 2, "dp": 2}, data="fsdp"),
    "pp4": pipeline_cases.case({"pp": 4}, "gpipe"),
}
FLAT = {"fsdp4": (fs.Mesh(dp=4), fs.fsdp("dp")), "ddp1": (fs.Mesh(dp=1), fs.replicate())}


def built(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, fs.Plan]:
    """The even tiny Llama (seed 0) under the named plan, with AdamW, applied on this rank."""
    spec = PLANS.get(name) or pipeline_cases.case({"dp": 1})
    model = pipeline_cases.build(spec)
    if name in PLANS:
        plan = fs.shard(model, fs.Mesh(**spec["mesh"]), pipeline_cases.policy_of(spec))
    else:
        plan = fs.shard(model, *FLAT[name])
    fs.apply(plan, model)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=pipeline_cases.LR, eps=pipeline_cases.EPS)
    return model, optimizer, plan


def train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: fs.Plan, steps: range
) -> list[float]:
    """``steps`` of `pipeline_cases`' batches on this rank's data slice; the global losses."""
    step = fs.forward_backward(plan, model, pipeline_cases.lm_loss)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    every = pipeline_cases.batches(data_parallel)
    rows = pipeline_cases.BATCH
    losses = []
    for number in steps:
        mine = every[number][index * rows : (index + 1) * rows]
        optimizer.zero_grad()
        loss = step(mine[:, :-1], mine[:, 1:])
        optimizer.step()
        # pipeline ranks of a dp slice hold the same loss, so the mean over ranks is the global one
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def whole_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's parameters and optimizer state as whole tensors, by parameter path."""
    params = {k: full(v) for k, v in model.state_dict().items()}
    state = fs.checkpoint.optimizer_state(model, optimizer)["state"]
    optim = {name: {k: full(v) for k, v in values.items()} for name, values in state.items()}
    # each rank's hyperparameters and how many parameters its groups hold
    # torch's full-state loading hands tuples (AdamW's betas) back as lists
    groups = [
        {k: list(v) if isinstance(v, tuple) else len(v) if k == "params" else v for k, v in group.items()}
        for group in optimizer.param_groups
    ]
    return {"model": params, "optimizer": optim, "groups": groups}


def save_after(name: str, path: str, steps: int, full_file: bool) -> dict[str, Any]:
    """Train ``steps`` under the named plan, save; every rank returns its whole state."""
    model, optimizer, plan = built(name)
    train(model, optimizer, plan, range(steps))
    fs.checkpoint.save(path, model, optimizer, full=full_file, extra={"step": steps})
    return whole_state(model, optimizer)


def load_under(name: str, path: str, more_steps: int) -> dict[str, Any]:
    """Load under the named plan; every rank returns its whole state and the losses of more steps."""
    model, optimizer, plan = built(name)
    extra = fs.checkpoint.load(path, model, optimizer)
    state = whole_state(model, optimizer)
    start = extra["step"]
    return {**state, "losses": train(model, optimizer, plan, range(start, start + more_steps))}


def merged(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's whole state in one (each stage's ranks hold their own part)."""
    out: dict[str, Any] = {"model": {}, "optimizer": {}}
    for result in results:
        out["model"].update(result["model"])
        out["optimizer"].update(result["optimizer"])
    return out
