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

from . import dist_cases, titan_models, unit_models

SEQ = 8
BATCH = 2
FUSED = unit_models.TitanConfig(heads=8)  # head_dim 4: q 8 heads, k and v 4 each (32, 16, 16)


def build(name: str) -> torch.nn.Module:
    """A model of `unit_models` by name, seeded alike on every rank."""
    torch.manual_seed(0)
    config = unit_models.TitanConfig()
    builders = {
        "titan_moe": lambda: unit_models.TitanDeepSeek(config),
        "titan_moe_today": lambda: titan_models.titan_moe("tiny", n_kv_heads=4),
        "titan_qk_norm": lambda: titan_models.titan_llama3("tiny", n_kv_heads=4, qk_norm=True),
        "fused_gqa": lambda: unit_models.FusedLlama(FUSED, kv_heads=4),
        "fused_gqa_bias": lambda: unit_models.FusedLlama(FUSED, kv_heads=4, bias=True),
        "odd_names": lambda: unit_models.OddNames(config),
        "rope_names": lambda: unit_models.RopeNames(config),
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

    from functional_shard.runtime.engines.packed_pieces import rank_share

    param = model.get_parameter(path)
    if not isinstance(param, DTensor):
        return whole
    mesh = param.device_mesh
    packed = getattr(model.get_submodule(path.rpartition(".")[0]), "_fs_packed", None)
    if packed and path.endswith(".weight"):
        return rank_share(whole, packed[0], packed[1], mesh.size(), mesh.get_local_rank())
    replicated = DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
    return replicated.redistribute(mesh, param.placements).to_local()


def _checkpoints(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    alone: torch.nn.Module,
    reference: torch.optim.Optimizer,
) -> dict[str, object]:
    """A full save, checked against one process's model and optimizer (``alone``, trained alike):
    the largest difference of a parameter and of an AdamW moment as the file holds them; the
    largest difference of this rank's shards after loading the file back into ``model`` with
    its values scrambled; and why a sharded save and a sharded read were refused."""
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    target = os.path.join(str(folder[0]), "full.pt")
    fs.checkpoint.save(target, model, optimizer, full=True)
    # the file, read into a plain copy (every rank reads it whole), is one process's weights
    plain = copy.deepcopy(alone)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    fs.checkpoint.load(target, plain, plain_optimizer)
    mine = dict(plain.named_parameters())
    weights = max((mine[k] - v).abs().max().item() for k, v in alone.named_parameters())
    names = {p: k for k, p in plain.named_parameters()}
    theirs = {k: reference.state[p] for k, p in alone.named_parameters()}
    moments = max(
        (plain_optimizer.state[p][m] - theirs[names[p]][m]).abs().max().item()
        for p in plain.parameters()
        for m in ("exp_avg", "exp_avg_sq")
    )
    # loaded back under the plan, each rank gets its share of each piece again
    before = {k: _held(v).detach().clone() for k, v in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            _held(param).normal_()
    fs.checkpoint.load(target, model, optimizer)
    shards = max((_held(v) - before[k]).abs().max().item() for k, v in model.named_parameters())
    refused = ""
    for action in ("save", "load"):
        try:
            getattr(fs.checkpoint, action)(str(folder[0]), model)
        except fs.ShardingError as error:
            refused += str(error) + "\n"
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(str(folder[0]))
    return {"weights": weights, "moments": moments, "shards": shards, "refused": refused}


def parity(name: str, rules: object, steps: int = 2, save: bool = False) -> dict[str, object] | None:
    """Train ``name`` split over every rank (``fs.tp(rules)``) beside one process's copy;
    rank 0 returns the largest loss and gradient differences over ``steps`` AdamW steps, the
    count of split parameters, (with ``save``) what `_checkpoints` found, and the bytes a
    further step sends, measured and as `plan.cost` predicts them."""
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
    # before the step that measures the sends, which only ``model`` takes
    theirs = dict(alone.named_buffers())
    buffers = max((abs(b - theirs[k]).max().item() for k, b in model.named_buffers()), default=0.0)
    saved = _checkpoints(model, optimizer, alone, reference) if save else {}
    comm = dist_cases.steady_state_comm(
        model, optimizer, plan, lambda: _loss(model, tokens), tokens, warmups=0
    )
    split = sum(isinstance(p, DTensor) and not p.placements[0].is_replicate() for p in model.parameters())
    result = {"loss": loss_diff, "grad": grad_diff, "split": split, "buffers": buffers, "saved": saved}
    result.update(comm)
    return result if dist.get_rank() == 0 else None


def full_checkpoint(name: str, rules: object) -> dict[str, object] | None:
    """`_checkpoints` under a pipeline of two stages beside tp=2 (rank 0 gathers the other
    stage's whole tensors, each put in order by its own ranks), after one AdamW step on the
    same batch on every rank, which one process's step on that batch matches; rank 0's findings."""
    model = build(name)
    alone = copy.deepcopy(model)
    plan = fs.shard(model, fs.Mesh(pp=2, tp=2), fs.pipeline("pp", microbatches=2) + fs.tp(rules, "tp"))
    fs.apply(plan, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = torch.optim.AdamW(alone.parameters(), lr=1e-2)
    tokens = torch.randint(0, unit_models.TitanConfig().vocab, (BATCH, SEQ + 1), generator=torch.Generator())

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    fs.forward_backward(plan, model, loss_fn)(tokens[:, :-1], tokens[:, 1:])
    optimizer.step()
    _loss(alone, tokens).backward()
    reference.step()
    saved = _checkpoints(model, optimizer, alone, reference)
    return saved if dist.get_rank() == 0 else None
