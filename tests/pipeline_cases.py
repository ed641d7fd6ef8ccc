"""Pipeline plans trained on every rank of a LocalWorld (importable, so spawn can send them).

A case is a dict of picklable values: the mesh's axes, the schedule, stages per rank,
micro-batches, the data-parallel and tensor-parallel layers and the model config's name.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.utils._python_dispatch import TorchDispatchMode

import functional_shard as fs
from functional_shard.zoo import Block, Llama, LlamaConfig

from .dist_cases import full, mean_over_ranks

STEPS = 3
# the h100 profile with the CPU's kernels (`trace.cuda_kernels`): what the gloo runs here keep
H100_ON_CPU = dataclasses.replace(fs.hardware("h100"), cuda=False)
LR = 1e-2
# AdamW's eps: with 1e-8 a near-zero gradient, its micro-batch sum reordered, turns rounding
# noise into a full-size step (as in hf_cases); 1e-6 keeps that noise small
EPS = 1e-6
BATCH = 4  # rows per data-parallel rank per step (a case may ask for more): 4 micro-batches of 1
SEQ = 12

CONFIGS = {
    # four blocks: two stages of (embedding + 2 blocks | 2 blocks + norm/head) ... as torchtitan cuts
    "even": LlamaConfig(128, 32, 64, num_layers=4, num_heads=4, num_kv_heads=4),
    # five blocks and the two outer units: 7 units that 2 or 4 stages do not divide
    "uneven": LlamaConfig(128, 32, 64, num_layers=5, num_heads=4, num_kv_heads=4),
    # six blocks and the two outer units: 8 stages of one unit (pp=4, two stages per rank)
    "deep": LlamaConfig(128, 32, 64, num_layers=6, num_heads=4, num_kv_heads=4),
    "tied": LlamaConfig(128, 32, 64, num_layers=4, num_heads=4, num_kv_heads=4, tie_embeddings=True),
}


def case(
    mesh: dict[str, int],
    schedule: str = "1f1b",
    *,
    stages_per_rank: int = 1,
    microbatches: int = 4,
    data: str | None = None,
    tp: bool | str = False,
    config: str = "even",
    model: str = "zoo",
    meta: bool = False,
    clip: float | None = None,
    rows: int = 4,
    scaler: bool = False,
    checkpointing: bool = False,
) -> dict[str, Any]:
    """A pipeline case as plain data (``meta``: built on the meta device, then materialized;
    ``clip``: gradients clipped to this global norm before each step)."""
    return {
        "meta": meta,
        "clip": clip,
        "rows": rows,
        "scaler": scaler,
        "checkpointing": checkpointing,
        "mesh": mesh,
        "schedule": schedule,
        "stages_per_rank": stages_per_rank,
        "microbatches": microbatches,
        "data": data,
        "tp": tp,
        "config": config,
        "model": model,
    }


def name_of(spec: dict[str, Any]) -> str:
    """A short test id."""
    axes = "x".join(f"{a}{n}" for a, n in spec["mesh"].items())
    tensor_parallel = {True: "tp", "sp": "tp_sp", "lp": "tp_loss_parallel"}.get(spec["tp"], "")
    extra = [spec["data"] or "", tensor_parallel, spec["config"], spec["model"]]
    extra += ["meta" if spec["meta"] else "", f"clip{spec['clip']}" if spec["clip"] else ""]
    extra += ["scaler" if spec["scaler"] else "", "checkpointing" if spec["checkpointing"] else ""]
    return "-".join(filter(None, [axes, spec["schedule"], f"v{spec['stages_per_rank']}", *extra]))


def policy_of(spec: dict[str, Any]) -> fs.Policy:
    """The case's policy: pipeline, then data parallel, then tensor parallel."""
    policy = fs.pipeline(
        "pp",
        microbatches=spec["microbatches"],
        schedule=spec["schedule"],
        stages_per_rank=spec["stages_per_rank"],
    )
    if spec["data"] == "fsdp":
        policy = policy + fs.fsdp("dp")
    elif spec["data"] is not None:
        others = {"ddp": fs.replicate, "zero2": lambda: fs.zero(2)}
        others["hsdp"] = lambda: fs.hsdp("replicate", "dp")  # over a mesh with a replicate axis
        policy = policy + others[spec["data"]]()
    if spec["tp"]:
        rules = fs.rules.llama if spec["model"] == "zoo" else "auto"
        policy = policy + fs.tp(
            rules, "tp", sequence_parallel=spec["tp"] == "sp", loss_parallel=spec["tp"] == "lp"
        )
    if spec["checkpointing"]:
        policy = policy + fs.checkpointing(Block)
    return policy


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, a mean over the (micro-)batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(spec: dict[str, Any]) -> torch.nn.Module:
    """The model of the case, initialised on the CPU with seed 0."""
    if spec["model"] == "hf":
        from . import hf_cases

        return hf_cases.build(spec["config"])
    torch.manual_seed(0)
    return Llama(CONFIGS[spec["config"]])


def batches(data_parallel: int, rows: int = BATCH) -> list[torch.Tensor]:
    """The global batches of the run: ``rows`` per data-parallel rank."""
    generator = torch.Generator().manual_seed(1234)
    shape = (rows * data_parallel, SEQ + 1)
    return [torch.randint(0, 128, shape, generator=generator) for _ in range(STEPS)]


def reference(spec: dict[str, Any], data_parallel: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the whole global batch: the losses and the final parameters."""
    model = build(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for tokens in batches(data_parallel, spec["rows"]):
        optimizer.zero_grad()
        loss = lm_loss(_logits(model(tokens[:, :-1])), tokens[:, 1:])
        loss.backward()
        if spec["clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _logits(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


class _PointToPoint(TorchDispatchMode):
    """Bytes of the c10d send ops issued under it (the activations and gradients a stage sends)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self.received = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__
        if name.startswith(("send", "recv_")) and func.namespace == "c10d":
            nbytes = sum(t.numel() * t.element_size() for t in args[0])
            if name.startswith("send"):
                self.sent += nbytes
            else:
                self.received += nbytes
        return func(*args, **(kwargs or {}))


def train(spec: dict[str, Any], measure: bool = False) -> dict[str, Any]:
    """Train the case on this rank; every rank returns its losses and full local parameters.

    With ``measure``, also the bytes this rank sent and received point to point in the
    last step (the first infers shapes) and its bytes of parameters.
    """
    mesh = fs.Mesh(**spec["mesh"])
    if spec["meta"]:
        with torch.device("meta"):
            model = build(spec)
    else:
        model = build(spec)
    plan = fs.shard(model, mesh, policy_of(spec))
    fs.apply(plan, model)
    if spec["meta"]:
        fs.materialize(plan, model, seed=0)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR, eps=EPS)
    scaler = fs.grad_scaler("cpu") if spec["scaler"] else None
    step = fs.forward_backward(plan, model, lm_loss, scaler=scaler)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    losses, norms, sent, received = [], [], 0, 0
    rows = spec["rows"]
    for number, tokens in enumerate(batches(data_parallel, rows)):
        mine = tokens[index * rows : (index + 1) * rows]
        optimizer.zero_grad()
        counter = _PointToPoint()
        if measure and number == STEPS - 1:
            with counter:
                loss = step(mine[:, :-1], mine[:, 1:])
            sent, received = counter.sent, counter.received
        else:
            loss = step(mine[:, :-1], mine[:, 1:])
        if spec["clip"]:
            norms.append(float(fs.clip_grad_norm_(model.parameters(), spec["clip"])))
        if scaler is not None:  # fp32 scaled by a power of two: the same steps exactly
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        losses.append(mean_over_ranks(loss).item())
    local_bytes = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    return {
        "losses": losses,
        "norms": norms,
        "params": {k: full(v) for k, v in model.state_dict().items()},
        "data_parallel": data_parallel,
        "sent": sent,
        "received": received,
        "param_bytes": local_bytes,
    }


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def merged_params(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every rank's full parameters in one dict (each stage's ranks hold its own)."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        merged.update(result["params"])
    return merged


def refused(spec: dict[str, Any], call: Callable[..., Any] | None = None) -> str:
    """Apply the case on this rank and return the ShardingError's message ('' if none)."""
    mesh = fs.Mesh(**spec["mesh"])
    model = build(spec)
    try:
        plan = fs.shard(model, mesh, policy_of(spec))
        fs.apply(plan, model)
        if call is not None:
            call(plan, model)
    except fs.ShardingError as error:
        return str(error)
    return ""


def odd_batch(plan: fs.Plan, model: torch.nn.Module) -> None:
    """One step on a batch of 3 rows, which the plan's micro-batches do not divide."""
    tokens = torch.randint(0, 128, (3, SEQ + 1))
    fs.forward_backward(plan, model, lm_loss)(tokens[:, :-1], tokens[:, 1:])


def _odd_step(batch: str, plan: fs.Plan, model: torch.nn.Module) -> None:
    tokens = torch.randint(0, 128, (BATCH, SEQ + 1))
    inputs: Any = {"list": tokens.tolist(), "scalar": torch.tensor(3), "empty": tokens[:0]}[batch]
    fs.forward_backward(plan, model, lm_loss)(inputs, tokens[:, 1:])


def odd_step(batch: str) -> Callable[[fs.Plan, torch.nn.Module], None]:
    """One step whose inputs are a list of rows (``"list"``), a scalar tensor or no rows (``"empty"``)."""
    return functools.partial(_odd_step, batch)


def per_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`lm_loss` without its mean: one loss a token, no scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")


def failing_loss_then_a_step(spec: dict[str, Any], what: str) -> dict[str, Any]:
    """A step whose loss_fn fails on the last stage (``what``: ``"per_token"`` loss, ``"short"``
    targets, ``"evaluation"`` of short targets) or whose inputs the first stage cannot run
    (``"float_ids"``, ``"flat"`` rows, ``"out_of_memory"``), whose block ``layers.2`` fails in a later
    stage (``"later_stage"``; ``"later_stage_outputs"`` in fs.forward_only), or the model called
    outside a schedule (``"direct"``), then a good step: the refusal and that loss."""
    model = build(spec)
    plan = fs.shard(model, fs.Mesh(**spec["mesh"]), policy_of(spec))
    fs.apply(plan, model)
    tokens = batches(1)[0]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    failing = {
        "per_token": lambda: fs.forward_backward(plan, model, per_token_loss)(inputs, targets),
        "short": lambda: fs.forward_backward(plan, model, lm_loss)(inputs, targets[:, :-2]),
        "evaluation": lambda: fs.forward_loss(plan, model, lm_loss)(inputs, targets[:, :-2]),
        "evaluation_per_token": lambda: fs.forward_loss(plan, model, per_token_loss)(inputs, targets),
        "float_ids": lambda: fs.forward_backward(plan, model, lm_loss)(inputs.float(), targets),
        "flat": lambda: fs.forward_loss(plan, model, lm_loss)(inputs[:, 0], targets),
        "direct": lambda: model(inputs),
        "out_of_memory": lambda: _out_of_memory_once(model, plan, inputs, targets),
        "later_stage": lambda: _later_stage_failing_once(
            model, lambda: fs.forward_backward(plan, model, lm_loss)(inputs, targets)
        ),
        "later_stage_outputs": lambda: _later_stage_failing_once(
            model, lambda: fs.forward_only(plan, model)(inputs)
        ),
    }[what]
    try:
        failing()
        refusal = ""
    except fs.ShardingError as error:
        refusal = str(error)
    except torch.OutOfMemoryError as error:  # raised as it is, never refused
        refusal = f"{type(error).__name__}: {error}"
    model.zero_grad()
    return {"refusal": refusal, "loss": float(fs.forward_backward(plan, model, lm_loss)(inputs, targets))}


def _out_of_memory_once(
    model: torch.nn.Module, plan: fs.Plan, inputs: torch.Tensor, targets: torch.Tensor
) -> None:
    """A step whose embedding runs out of device memory (where this rank holds it)."""

    def out_of_memory(*args: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("out of memory (a stand-in)")

    model.embed_tokens.forward = out_of_memory
    try:
        fs.forward_backward(plan, model, lm_loss)(inputs, targets)
    finally:
        del model.embed_tokens.forward


def _later_stage_failing_once(model: torch.nn.Module, run: Callable[[], Any]) -> None:
    """``run`` (a step, an evaluation) while block ``layers.2`` raises in its forward (where held)."""

    def failing(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise ValueError("layers.2 failed (a stand-in)")

    block = model.layers[2]
    held = any(True for _ in block.parameters())  # not a pass-through for another rank's stage
    if held:
        block.forward = failing
    try:
        run()
    finally:
        if held:
            del block.forward


def plain_step() -> dict[str, Any]:
    """fs.forward_backward under a plan without pp (FSDP over every rank) against a plain backward."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    plan = fs.shard(model, fs.Mesh(dp=dist.get_world_size()), fs.fsdp())
    fs.apply(plan, model)
    generator = torch.Generator().manual_seed(dist.get_rank())
    inputs, targets = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
    loss = fs.forward_backward(plan, model, F.mse_loss)(inputs, targets)
    grads = {k: full(v.grad) for k, v in model.named_parameters()}
    model.zero_grad()
    expected = F.mse_loss(model(inputs), targets)
    expected.backward()
    return {
        "loss": (float(loss), float(expected)),
        "grads": [(grads[k], full(v.grad)) for k, v in model.named_parameters()],
        "requires_grad": loss.requires_grad,
    }


def one_step(plan: fs.Plan, model: torch.nn.Module) -> None:
    """One step on a batch of BATCH rows."""
    tokens = torch.randint(0, 128, (BATCH, SEQ + 1))
    fs.forward_backward(plan, model, lm_loss)(tokens[:, :-1], tokens[:, 1:])


def overflow_on_one_stage(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """One scaled step in which ``rank`` finds an inf in its own gradients: every rank should skip it."""
    from torch.distributed.tensor import DTensor

    model = build(spec)
    plan = fs.shard(model, fs.Mesh(**spec["mesh"]), policy_of(spec))
    fs.apply(plan, model)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR, eps=EPS)
    scaler = fs.grad_scaler("cpu")
    step = fs.forward_backward(plan, model, lm_loss, scaler=scaler)
    before = [_local(p).detach().clone() for p in model.parameters()]
    tokens = batches(1)[0][:BATCH]
    step(tokens[:, :-1], tokens[:, 1:])
    if dist.get_rank() == rank:
        grad = next(p.grad for p in model.parameters() if p.grad is not None)
        (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    moved = any(not torch.equal(_local(p), b) for p, b in zip(model.parameters(), before, strict=True))
    return {"scale": scaler.get_scale(), "moved": moved}


def _plain_fsdp(spec: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build(spec)
    plan = fs.shard(model, fs.Mesh(dp=dist.get_world_size()), fs.fsdp())
    fs.apply(plan, model)
    return model, fs.optimizer(plan, model, torch.optim.AdamW, lr=LR, eps=EPS)


def _pipelined(spec: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer, fs.Plan]:
    model = build(spec)
    plan = fs.shard(model, fs.Mesh(**spec["mesh"]), policy_of(spec))
    fs.apply(plan, model)
    return model, fs.optimizer(plan, model, torch.optim.AdamW, lr=LR, eps=EPS), plan


def _one_pipelined_step(model, optimizer, plan) -> None:
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    tokens = batches(data_parallel)[0][index * BATCH : (index + 1) * BATCH]
    fs.forward_backward(plan, model, lm_loss)(tokens[:, :-1], tokens[:, 1:])
    optimizer.step()


def _states(model, optimizer) -> dict[str, Any]:
    # this rank's whole parameters and AdamW moments, by parameter path
    state = fs.checkpoint.optimizer_state(model, optimizer)["state"]
    return {
        "params": {k: full(v) for k, v in model.state_dict().items()},
        "moments": {k: full(v["exp_avg"]) for k, v in state.items()},
    }


def checkpoint_across(spec: dict[str, Any], path: str, saved_under_pp: bool) -> dict[str, Any]:
    """Train a step under one plan (the pipeline's, or FSDP over every rank), save sharded,
    load under the other; this rank's states after saving and after loading."""
    if saved_under_pp:
        model, optimizer, plan = _pipelined(spec)
        _one_pipelined_step(model, optimizer, plan)
    else:
        model, optimizer = _plain_fsdp(spec)
        tokens = batches(1)[0][: BATCH * dist.get_world_size()]
        mine = tokens[dist.get_rank() * BATCH // 4 : (dist.get_rank() + 1) * BATCH // 4]
        lm_loss(model(mine[:, :-1]), mine[:, 1:]).backward()
        optimizer.step()
    fs.checkpoint.save(path, model, optimizer)
    saved = _states(model, optimizer)
    if saved_under_pp:
        target, target_optimizer = _plain_fsdp(spec)
    else:
        target, target_optimizer, _ = _pipelined(spec)
    fs.checkpoint.load(path, target, target_optimizer)
    return {"saved": saved, "loaded": _states(target, target_optimizer)}


def full_file_into_pipeline(spec: dict[str, Any], path: str) -> dict[str, Any]:
    """Save one full file under FSDP after a step, load it under the pipeline; and the
    error of a full save under the pipeline (empty: it saves)."""
    model, optimizer = _plain_fsdp(spec)
    tokens = batches(1)[0][: dist.get_world_size()]
    mine = tokens[dist.get_rank() : dist.get_rank() + 1]
    lm_loss(model(mine[:, :-1]), mine[:, 1:]).backward()
    optimizer.step()
    fs.checkpoint.save(path, model, optimizer, full=True)
    saved = _states(model, optimizer)
    target, target_optimizer, _ = _pipelined(spec)
    fs.checkpoint.load(path, target, target_optimizer)
    try:
        fs.checkpoint.save(path + ".again", target, target_optimizer, full=True)
        refusal = ""
    except fs.ShardingError as error:
        refusal = str(error)
    return {"saved": saved, "loaded": _states(target, target_optimizer), "refusal": refusal}


# (rows, tokens) of successive batches: fewer rows (an epoch's last batch), then shorter rows
SHAPES = ((4, SEQ), (2, SEQ), (4, SEQ - 4))


def batches_of_other_shapes() -> list[torch.Tensor]:
    """One batch of each of `SHAPES` (each with the next-token column)."""
    generator = torch.Generator().manual_seed(99)
    return [torch.randint(0, 128, (rows, seq + 1), generator=generator) for rows, seq in SHAPES]


def steps_of_other_shapes(spec: dict[str, Any]) -> dict[str, Any]:
    """A step on each of `batches_of_other_shapes`, then an evaluation of each: the losses, the gradients.

    (Not step and evaluation in turn: torch sizes its buffers again when a schedule turns from one
    to the other, which would hide a step's buffers sized for the step before.)
    """
    model = build(spec)
    plan = fs.shard(model, fs.Mesh(**spec["mesh"]), policy_of(spec))
    fs.apply(plan, model)
    step = fs.forward_backward(plan, model, lm_loss)
    evaluate = fs.forward_loss(plan, model, lm_loss)
    every = batches_of_other_shapes()
    losses = [float(step(tokens[:, :-1], tokens[:, 1:])) for tokens in every]
    losses += [float(evaluate(tokens[:, :-2], tokens[:, 1:-1])) for tokens in every]
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return {"losses": losses, "params": grads}


def steps_of_other_shapes_in_one_process(spec: dict[str, Any]) -> dict[str, Any]:
    """`steps_of_other_shapes` in one process."""
    model = build(spec)
    every = batches_of_other_shapes()
    losses = []
    for tokens in every:
        loss = lm_loss(_logits(model(tokens[:, :-1])), tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
    with torch.no_grad():
        losses += [lm_loss(_logits(model(tokens[:, :-2])), tokens[:, 1:-1]).item() for tokens in every]
    return {"losses": losses, "params": {k: p.grad.clone() for k, p in model.named_parameters()}}
