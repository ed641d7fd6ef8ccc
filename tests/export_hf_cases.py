"""Hugging Face exports on every rank of a LocalWorld (importable, so spawn can send the functions)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import functional_shard as fs

from . import hf_cases, pipeline_cases, pipeline_checkpoint_cases
from .dist_cases import full

STEPS = 2


def _written_by_this_rank() -> tuple[list[dict[str, Any]], Any]:
    """Record every safetensors file this rank writes (its name, keys and bytes); and the undo."""
    import safetensors.torch

    written: list[dict[str, Any]] = []
    save_file = safetensors.torch.save_file

    def recording(tensors: dict[str, torch.Tensor], filename: str, metadata: Any = None) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        written.append({"file": filename.rsplit("/", 1)[-1], "keys": sorted(tensors), "bytes": size})
        save_file(tensors, filename, metadata=metadata)

    safetensors.torch.save_file = recording

    def undo() -> None:
        safetensors.torch.save_file = save_file

    return written, undo


def _exported(model: torch.nn.Module, folder: str) -> list[dict[str, Any]]:
    written, undo = _written_by_this_rank()
    try:
        fs.checkpoint.export_hf(folder, model)
    finally:
        undo()
    return written


def train_and_export(model_name: str, strategy: str, folder: str, checkpoint: str | None) -> dict[str, Any]:
    """Train ``STEPS`` under a strategy, save a sharded checkpoint (if ``checkpoint``), export
    to ``folder``: the files this rank wrote, and (rank 0) the trained model's full state."""
    model, optimizer, plan = hf_cases._built(model_name, strategy)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    rows = hf_cases.MICRO_BATCH
    for tokens in hf_cases.batches(data_parallel)[:STEPS]:
        optimizer.zero_grad()
        hf_cases.loss_of(model, tokens[index * rows : (index + 1) * rows]).backward()
        optimizer.step()
    if checkpoint is not None:
        fs.checkpoint.save(checkpoint, model, optimizer)
    written = _exported(model, folder)
    state = {k: full(v) for k, v in model.state_dict().items()}
    return {"written": written, "state": state if dist.get_rank() == 0 else None}


def train_and_export_all(cases: list[tuple[str, str, str, str | None]]) -> list[dict[str, Any]]:
    """`train_and_export` of each (model, strategy, folder, checkpoint) in turn: one world run."""
    return [train_and_export(*case) for case in cases]


def pipeline_export(folder: str) -> dict[str, Any]:
    """A tiny HF Llama under pp=2 x fsdp(dp=2), trained a step and exported."""
    spec = pipeline_cases.case({"pp": 2, "dp": 2}, data="fsdp", config="llama", model="hf")
    model = pipeline_cases.build(spec)
    plan = fs.shard(model, fs.Mesh(**spec["mesh"]), pipeline_cases.policy_of(spec))
    fs.apply(plan, model)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=pipeline_cases.LR, eps=pipeline_cases.EPS)
    pipeline_checkpoint_cases.train(model, optimizer, plan, range(1))
    written = _exported(model, folder)
    state = fs.checkpoint.model_state(model, full=True)  # every stage's, on rank 0
    return {"written": written, "state": state if dist.get_rank() == 0 else None}
