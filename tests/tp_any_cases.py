"""Functions run on every rank of a LocalWorld: models with any naming split by tensor parallel."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.distributed.tensor import DTensor

import functional_shard as fs

from . import dist_cases, unit_models

SEQ = 8
BATCH = 2
FUSED = unit_models.TitanConfig(heads=8)  # head_dim 4: q 8 heads, k and v 4 each (32, 16, 16)


def build(name: str) -> torch.nn.Module:
    """A model of `unit_models` by name, seeded alike on every rank."""
    torch.manual_seed(0)
    config = unit_models.TitanConfig()
    builders = {
        "titan_moe": lambda: unit_models.TitanDeepSeek(config),
        "fused_gqa": lambda: unit_models.FusedLlama(FUSED, kv_heads=4),
        "fused_gqa_bias": lambda: unit_models.FusedLlama(FUSED, kv_heads=4, bias=True),
        "odd_names": lambda: unit_models.OddNames(config),
    }
    return builders[name]()


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _held(grad: torch.Tensor) -> torch.Tensor:
    """The part of a gradient this rank holds (placed as its parameter)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _expected(model: torch.nn.Module, path: str, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of one process's ``whole`` gradient, as ``model`` holds ``path``
    (a packed weight: this rank's share of each piece, as apply splits it)."""
    from torch.distributed.tensor import Replicate

    from functional_shard.runtime.engines.tensor_parallel import _packed_local

    param = model.get_parameter(path)
    if not isinstance(param, DTensor):
        return whole
    mesh = param.device_mesh
    packed = getattr(model.get_submodule(path.rpartition(".")[0]), "_fs_packed", None)
    if packed and path.endswith(".weight"):
        return _packed_local(whole, packed[0], packed[1], mesh.size(), mesh.get_local_rank())
    replicated = DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
    return replicated.redistribute(mesh, param.placements).to_local()


def _full_save_refused(model: torch.nn.Module) -> str:
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    target = os.path.join(str(folder[0]), "full.pt")
    try:
        fs.checkpoint.save(target, model, full=True)
        refused = ""
    except fs.ShardingError as error:
        refused = str(error)
    dist.barrier()
    if dist.get_rank() == 0 and not os.path.exists(target):
        open(target, "wb").close()  # something to load: the refusal comes before any reading
    dist.barrier()
    try:
        fs.checkpoint.load(target, model)
    except fs.ShardingError as error:
        refused += "\n" + str(error)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(str(folder[0]))
    return refused


def parity(name: str, rules: object, steps: int = 2, save: bool = False) -> dict[str, object] | None:
    """Train ``name`` split over every rank (``fs.tp(rules)``) beside one process's copy;
    rank 0 returns the largest loss and gradient differences over ``steps`` AdamW steps, the
    count of split parameters, (with ``save``) why a full checkpoint was refused ("" if it
    was not), and the bytes a further step sends, measured and as `plan.cost` predicts them."""
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
            grad_diff = max(grad_diff, (_held(grad) - _expected(model, path, param.grad)).abs().max().item())
        optimizer.step()
        reference.step()
    refused = _full_save_refused(model) if save else ""
    comm = dist_cases.steady_state_comm(
        model, optimizer, plan, lambda: _loss(model, tokens), tokens, warmups=0
    )
    split = sum(isinstance(p, DTensor) and not p.placements[0].is_replicate() for p in model.parameters())
    result = {"loss": loss_diff, "grad": grad_diff, "split": split, "refused": refused, **comm}
    return result if dist.get_rank() == 0 else None
