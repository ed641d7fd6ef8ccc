"""Functions that run on every rank of a LocalWorld (importable, so spawn can send them)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.distributed.tensor import DTensor

import functional_shard as fs
from functional_shard.zoo import Block, Llama, LlamaConfig

STEPS = 5
LR = 1e-2
MICRO_BATCH = 2
SEQ = 12  # divides 2, 3 and 4: sequence parallel splits it evenly, as torch requires

# tied embedding in every case
EVEN = LlamaConfig(128, 32, 64, num_layers=2, num_heads=4, num_kv_heads=4, tie_embeddings=True)
# on 3 ranks: FSDP pads the vocabulary (127) and the MLP (50); TP splits the vocabulary
# unevenly, and the MLP width divides (51) because torch's RowwiseParallel needs it to
UNEVEN = LlamaConfig(127, 30, 50, num_layers=2, num_heads=3, num_kv_heads=3, tie_embeddings=True)
UNEVEN_TP = LlamaConfig(127, 30, 51, num_layers=2, num_heads=3, num_kv_heads=3, tie_embeddings=True)


def strategy(name: str, world: int) -> tuple[fs.Mesh, fs.Policy]:
    """Mesh (resolved for ``world``: -1 takes the rest) and policy of each strategy."""
    rules = fs.rules.llama
    mesh, policy = {
        "ddp": (fs.Mesh(dp=-1), fs.replicate()),
        "zero1": (fs.Mesh(dp=-1), fs.zero(1)),
        "zero2": (fs.Mesh(dp=-1), fs.zero(2)),
        "zero3": (fs.Mesh(dp=-1), fs.zero(3)),
        "hsdp": (fs.Mesh(node=2, gpu=-1), fs.hsdp("node", "gpu")),
        "tp": (fs.Mesh(tp=-1), fs.tp(rules, "tp")),
        "tp_sp": (fs.Mesh(tp=-1), fs.tp(rules, "tp", sequence_parallel=True)),
        "fsdp_tp": (fs.Mesh(dp=2, tp=-1), fs.fsdp("dp") + fs.tp(rules, "tp")),
        "fsdp_tp_sp": (fs.Mesh(dp=2, tp=-1), fs.fsdp("dp") + fs.tp(rules, "tp", sequence_parallel=True)),
        "hsdp_tp": (fs.Mesh(node=2, gpu=-1, tp=2), fs.hsdp("node", "gpu") + fs.tp(rules, "tp")),
        "fsdp_checkpointing": (fs.Mesh(dp=-1), fs.fsdp() + fs.checkpointing(Block)),
        "fsdp_offload": (fs.Mesh(dp=-1), fs.fsdp() + fs.offload()),
        "fsdp_bf16": (fs.Mesh(dp=-1), fs.fsdp() + fs.mixed_precision(torch.bfloat16, torch.float32)),
        # no reduce dtype: FSDP2 reduces in the compute dtype
        "fsdp_bf16_no_reduce_dtype": (fs.Mesh(dp=-1), fs.fsdp() + fs.mixed_precision(torch.bfloat16, None)),
    }[name]
    return mesh.resolve(world), policy


def batches(config: LlamaConfig, data_parallel: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [
        torch.randint(0, config.vocab_size, (MICRO_BATCH * data_parallel, SEQ + 1), generator=generator)
        for _ in range(STEPS)
    ]


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


def device() -> torch.device:
    """This rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reference(
    config: LlamaConfig, data_parallel: int, eps: float = 1e-8, model_type: type[Llama] = Llama
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training of a ``model_type`` on the whole global batch (AdamW with this `eps`)."""
    torch.manual_seed(0)
    model = model_type(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
    losses = []
    for tokens in batches(config, data_parallel):
        optimizer.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _built(name: str, config: LlamaConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer, fs.Plan]:
    """The tiny Llama (seed 0, on this rank's device) under a strategy, with its optimizer."""
    mesh, policy = strategy(name, dist.get_world_size())
    torch.manual_seed(0)
    model = Llama(config).to(device())  # initialised on the CPU, as the reference is
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    return model, fs.optimizer(plan, model, torch.optim.AdamW, lr=LR), plan


def train(name: str, config: LlamaConfig) -> dict[str, object]:
    """Train under a plan on this rank; rank 0 returns losses and full parameters."""
    model, optimizer, plan = _built(name, config)
    data_parallel = plan.data_parallel_rank(dist.get_rank())[1]
    losses = train_steps(model, optimizer, config, plan, range(STEPS))
    params = {k: full(v) for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "params": params if dist.get_rank() == 0 else None,
        "data_parallel": data_parallel,
    }


def measure_memory(name: str, config: LlamaConfig) -> dict[str, object]:
    """After one step: this rank's bytes of params, grads, optimizer state, and the prediction."""
    model, optimizer, plan = _built(name, config)
    tokens = batches(config, 1)[0][:MICRO_BATCH]
    loss_of(model, tokens).backward()
    optimizer.step()
    cost = plan.cost("adamw", rank=dist.get_rank())
    return {
        "measured": fs.measure.resident_bytes(model, optimizer),
        "predicted": {
            "params": cost.params_bytes,
            "grads": cost.grads_bytes,
            "optimizer": cost.optimizer_bytes,
        },
    }


def measure_comm(name: str, config: LlamaConfig) -> dict[str, object]:
    """Bytes this rank sends in one steady-state training step, and the prediction."""
    model, optimizer, plan = _built(name, config)
    tokens = batches(config, 1)[0][:MICRO_BATCH]
    # two warm-up steps: the first builds lazy state, the second DDP's rebuilt buckets,
    # whose layout it broadcasts once
    return steady_state_comm(model, optimizer, plan, lambda: loss_of(model, tokens), tokens, warmups=2)


def steady_state_comm(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: fs.Plan,
    loss: Callable[[], torch.Tensor],
    tokens: torch.Tensor,
    warmups: int,
) -> dict[str, object]:
    """Bytes this rank sends in the training step after ``warmups`` steps of ``loss()``,
    beside `plan.cost`'s prediction for the step's ``tokens`` (inputs and next-token labels)."""
    for step in range(warmups + 1):
        log = fs.measure.CollectiveLog(plan.mesh)
        with log if step == warmups else contextlib.nullcontext():
            optimizer.zero_grad()
            loss().backward()
            optimizer.step()
    cost = plan.cost("adamw", tokens=tokens[:, :-1].numel())
    return {
        "measured": log.sent,
        "predicted": {k: dict(v) for k, v in cost.comm_bytes.items()},
        "ops": log.ops,
    }


_DEVICE_MESHES: dict[fs.Mesh, object] = {}


def _device_mesh(mesh: fs.Mesh):
    # every rank runs the same calls in the same order, so building (collectively) once
    # per mesh and reusing it keeps hypothesis examples from creating groups endlessly
    if mesh not in _DEVICE_MESHES:
        _DEVICE_MESHES[mesh] = mesh.device_mesh("cpu")
    return _DEVICE_MESHES[mesh]


def check_layout(mesh: fs.Mesh, shape: tuple[int, ...], spec: fs.P, seed: int) -> tuple[bool, bool]:
    """distribute_tensor's local shard equals the core's virtual shard; gathering gives x back."""
    from torch.distributed.tensor import distribute_tensor

    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    dtensor = distribute_tensor(x, _device_mesh(mesh), spec.to_placements(mesh, shape))
    local = torch.equal(dtensor.to_local(), fs.shard_tensor(x, spec, mesh)[dist.get_rank()])
    return local, torch.equal(dtensor.full_tensor(), x)


def check_reduce_scatter_all_gather(mesh: fs.Mesh, axis: str, chunk: int, seed: int) -> float:
    """Max difference between all-reduce and reduce-scatter followed by all-gather on ``axis``."""
    group = _device_mesh(mesh)[axis].get_group()
    n = group.size()
    x = torch.randn(n * chunk, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    reduced = x.clone()
    dist.all_reduce(reduced, group=group)
    shard = torch.empty(chunk)
    dist.reduce_scatter_tensor(shard, x, group=group)
    gathered = torch.empty(n * chunk)
    dist.all_gather_into_tensor(gathered, shard, group=group)
    return (gathered - reduced).abs().max().item() if x.numel() else 0.0


def mlp(sizes: tuple[int, int, int], seed: int) -> torch.nn.Module:
    from collections import OrderedDict

    torch.manual_seed(seed)
    d_in, hidden, d_out = sizes
    return torch.nn.Sequential(
        OrderedDict(
            fc1=torch.nn.Linear(d_in, hidden), act=torch.nn.ReLU(), fc2=torch.nn.Linear(hidden, d_out)
        )
    )


def mlp_grads(
    mesh: fs.Mesh, policy: fs.Policy, sizes: tuple[int, int, int], seed: int
) -> dict[str, torch.Tensor]:
    """Full gradients of an MLP under a plan, on this rank's slice of one global batch."""
    model = mlp(sizes, seed)
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model, _device_mesh(mesh))
    index, n = plan.data_parallel_rank(dist.get_rank())
    x = torch.randn(2 * n, sizes[0], generator=torch.Generator().manual_seed(seed))
    model(x[2 * index : 2 * index + 2]).square().mean().backward()
    return {name: full(p.grad) for name, p in model.named_parameters()}


def reference_mlp_grads(
    sizes: tuple[int, int, int], seed: int, data_parallel: int
) -> dict[str, torch.Tensor]:
    model = mlp(sizes, seed)
    x = torch.randn(2 * data_parallel, sizes[0], generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def mixed_precision_grads(config: LlamaConfig) -> dict[str, torch.Tensor]:
    """One step under FSDP with bf16 compute and fp32 reduction; the full fp32 gradients."""
    mesh, policy = strategy("fsdp_bf16", dist.get_world_size())
    torch.manual_seed(0)
    model = Llama(config).to(device())
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    rank = dist.get_rank()
    tokens = batches(config, mesh.size)[0][rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH]
    loss_of(model, tokens.to(device())).backward()
    return {name: full(p.grad) for name, p in model.named_parameters()}


def emulated_mixed_precision_grads(config: LlamaConfig, data_parallel: int) -> dict[str, torch.Tensor]:
    """The same casts in one process: bf16 copies compute each micro-batch, their bf16
    gradients are cast to fp32 and averaged (FSDP2's reduce_dtype), as a reference."""
    import copy

    torch.manual_seed(0)
    model = Llama(config)
    total: dict[str, torch.Tensor] = {}
    tokens = batches(config, data_parallel)[0]
    for index in range(data_parallel):
        replica = copy.deepcopy(model).to(torch.bfloat16)
        loss_of(replica, tokens[index * MICRO_BATCH : (index + 1) * MICRO_BATCH]).backward()
        for name, p in replica.named_parameters():
            total[name] = total.get(name, 0) + p.grad.float() / data_parallel
    return total


def meta_init(name: str, config: LlamaConfig) -> dict[str, torch.Tensor] | None:
    """Build on meta, apply, materialize with seed 0: rank 0 returns the full parameters."""
    mesh, policy = strategy(name, dist.get_world_size())
    with torch.device("meta"):
        model = Llama(config)
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    fs.materialize(plan, model, seed=0)
    params = {k: full(v) for k, v in model.state_dict().items()}
    return params if dist.get_rank() == 0 else None


def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """The mean over every rank: tensor-parallel ranks hold the same loss, data ranks their own
    (equal slices), so this is the loss of the global batch."""
    total = full(values).to(device())  # NCCL reduces device tensors only
    dist.all_reduce(total)
    return total / dist.get_world_size()


def train_steps(
    model, optimizer, config: LlamaConfig, plan: fs.Plan, steps: range, backward=torch.Tensor.backward
) -> list[float]:
    """Train ``steps`` (indices into the fixed batches) on this rank's data slice; the
    global-batch loss of each step."""
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    all_batches = batches(config, data_parallel)
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = loss_of(model, all_batches[step][index * MICRO_BATCH : (index + 1) * MICRO_BATCH].to(device()))
        backward(loss)
        optimizer.step()
        losses.append(mean_over_ranks(loss).item())
    return losses


def train_float16(name: str, config: LlamaConfig, overflow_on: int | None = None) -> dict[str, object]:
    """float16 autocast with fs.grad_scaler; rank ``overflow_on`` (if any) finds an inf in
    its own gradient shard at the first step. Each rank returns the scale it ended with,
    whether its parameters moved, and the losses."""
    model, optimizer, plan = _built(name, config)
    scaler = fs.grad_scaler(device().type)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    all_batches = batches(config, data_parallel)
    before = [full(p) for p in model.parameters()]
    losses = []
    for step in range(1 if overflow_on is not None else STEPS):
        optimizer.zero_grad()
        with torch.autocast(device().type, dtype=torch.float16):
            loss = loss_of(model, all_batches[step][index * MICRO_BATCH : (index + 1) * MICRO_BATCH])
        scaler.scale(loss).backward()
        if dist.get_rank() == overflow_on:
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        losses.append(mean_over_ranks(loss.float()).item())
    moved = any(not torch.equal(full(p), b) for p, b in zip(model.parameters(), before, strict=True))
    return {"scale": scaler.get_scale(), "moved": moved, "losses": losses}


def full_state(model, optimizer) -> dict[str, object]:
    """Whole parameters and optimizer state by parameter path, under any plan (rank 0)."""
    optim_state = fs.checkpoint.optimizer_state(model, optimizer, full=True)
    # empty off rank 0
    return {"model": fs.checkpoint.model_state(model, full=True), "optimizer": optim_state.get("state", {})}


def save_after(
    name: str, config: LlamaConfig, path: str, steps: int, full_file: bool
) -> dict[str, object] | None:
    """Train ``steps`` under a plan, save, return the full state (rank 0)."""
    model, optimizer, plan = _built(name, config)
    train_steps(model, optimizer, config, plan, range(steps))
    fs.checkpoint.save(path, model, optimizer, full=full_file, extra={"step": steps})
    state = full_state(model, optimizer)
    return state if dist.get_rank() == 0 else None


def load_under(name: str, config: LlamaConfig, path: str, more_steps: int) -> dict[str, object] | None:
    """Load under a (maybe other) plan; return the loaded full state and the losses of more steps."""
    model, optimizer, plan = _built(name, config)
    extra = fs.checkpoint.load(path, model, optimizer)
    state = full_state(model, optimizer)
    start = extra["step"]
    losses = train_steps(model, optimizer, config, plan, range(start, start + more_steps))
    return {"state": state, "losses": losses, "step": start} if dist.get_rank() == 0 else None


def save_crashing(name: str, config: LlamaConfig, path: str) -> None:
    """Train a step and save, but rank 1 dies once its shard file is written (before the
    others finish and before the rename)."""
    import os

    from torch.distributed.checkpoint import FileSystemWriter

    model, optimizer, plan = _built(name, config)
    train_steps(model, optimizer, config, plan, range(1))
    write_data = FileSystemWriter.write_data

    def write_then_die(self, *args, **kwargs):
        written = write_data(self, *args, **kwargs)
        if dist.get_rank() == 1:
            written.wait()
            os._exit(3)
        return written

    FileSystemWriter.write_data = write_then_die
    fs.checkpoint.save(path, model, optimizer)


def load_refused(name: str, config: LlamaConfig, path: str) -> dict[str, object] | None:
    """After a step under a plan, load a checkpoint that cannot load; rank 0 returns every
    rank's error and the full state before and after (which must be the same)."""
    model, optimizer, plan = _built(name, config)
    train_steps(model, optimizer, config, plan, range(1))
    before = full_state(model, optimizer)
    error = None
    try:
        fs.checkpoint.load(path, model, optimizer)
    except fs.ShardingError as refused:
        error = str(refused)
    errors: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    after = full_state(model, optimizer)
    return {"errors": errors, "before": before, "after": after} if dist.get_rank() == 0 else None


def save_asynchronously(name: str, config: LlamaConfig, path: str, steps: int) -> dict[str, object] | None:
    """Train ``steps``, save asynchronously, train a step while it writes, save again (which
    waits for the first), wait: rank 0 returns the full state at the first save and whether
    the first was in place only once finished."""
    from pathlib import Path

    model, optimizer, plan = _built(name, config)
    train_steps(model, optimizer, config, plan, range(steps))
    # a copy: the full state shares the optimizer's 0-d step counters, which the next step bumps
    state = copy.deepcopy(full_state(model, optimizer))
    pending = fs.checkpoint.save(path, model, optimizer, extra={"step": steps}, asynchronous=True)
    in_place_early = Path(path).exists()
    train_steps(model, optimizer, config, plan, range(steps, steps + 1))  # training goes on
    again = fs.checkpoint.save(f"{path}-next", model, optimizer, extra={"step": steps + 1}, asynchronous=True)
    first_done = Path(path).exists() and pending.done()
    again.wait()
    result = {"state": state, "in_place_early": in_place_early, "first_done": first_done}
    return result if dist.get_rank() == 0 else None


def adamw_steps(
    plan: fs.Plan,
    model: torch.nn.Module,
    loss_of: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    batches: list[torch.Tensor],
    *,
    micro_batch: int,
    lr: float,
    eps: float,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """AdamW steps under ``plan``, this rank on its data-parallel rows of each global batch.

    Returns the losses (each the mean over ranks) and the first step's gradients, whole.
    """
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=lr, eps=eps)
    index, _ = plan.data_parallel_rank(dist.get_rank())
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for tokens in batches:
        optimizer.zero_grad()
        loss = loss_of(model, tokens[index * micro_batch : (index + 1) * micro_batch])
        loss.backward()
        if not grads:
            grads = {k: full(v.grad) for k, v in model.named_parameters() if v.grad is not None}
        optimizer.step()
        losses.append(mean_over_ranks(loss).item())
    return losses, grads


def save_with_extra_plain_on_rank_0_only(name: str, config: LlamaConfig, path: str) -> list[str]:
    """Save with an extra no safe load rebuilds on every rank but 0, then save again: the refusals."""
    model, _, _ = _built(name, config)
    extra = {"best": 1.0} if dist.get_rank() == 0 else {"best": object()}
    refusals = []
    for attempt in (extra, {"best": 1.0}):
        try:
            fs.checkpoint.save(path, model, extra=attempt)
        except fs.ShardingError as error:
            refusals.append(str(error))
    return refusals


def save_where_nothing_may_be_written(name: str, config: LlamaConfig, path: str, full_file: bool) -> str:
    """Save to ``path``, which no process may write: the refusal each rank raised."""
    model, _, _ = _built(name, config)
    try:
        fs.checkpoint.save(path, model, full=full_file)
    except fs.ShardingError as error:
        return str(error)
    return ""
