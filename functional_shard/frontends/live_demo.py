"""``functional-shard demo``: a plan trained for real on local processes, beside its prediction.

A tiny Llama is planned, built on the meta device, applied and materialized shard by shard,
then trains a few AdamW steps on gloo processes while its collectives and tensors are
measured. The demo prints the prediction beside the measurement, and the losses beside one
process training on the same batches. With ``packed=True`` the batches are packed rows
(`functional_shard.core.packing.pack`): documents of mixed lengths end to end, each attending
only to itself, under cp cut over the ranks by attention work.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from functional_shard.core.errors import ShardingError
from functional_shard.core.mesh import Mesh
from functional_shard.core.packing import PackedBatch, collate_packed, pack
from functional_shard.core.validate import entry_point, instance_of, one_of, refuse
from functional_shard.costing.time.hardware import process_limit
from functional_shard.planning.plan.cost_record import Cost
from functional_shard.planning.plan.plan import Plan
from functional_shard.planning.planner import shard
from functional_shard.planning.policy.parse import format_policy, parse_policy
from functional_shard.planning.policy.types import Policy
from functional_shard.runtime.apply import apply, check_runnable, materialize, optimizer
from functional_shard.runtime.engines.step import forward_backward
from functional_shard.runtime.launch import LocalWorld, current_rank
from functional_shard.runtime.measure import CollectiveLog, resident_bytes

from .model_zoo import CONFIGS, Llama, LlamaConfig

__all__ = ["DemoResult", "model_shapes", "process_limit", "run"]

_LR = 1e-2
_SEQUENCE = 16
_MICRO_BATCH = 2
_MEASURED_STEP = 2  # steady state: lazy optimizer state built, DDP's buckets rebuilt
# against one float32 process: float32 reordering of sharded reductions is ~1e-6 here;
# a low-precision plan computes in its dtype (bfloat16's relative step is 7.8e-3)
_LOSS_TOLERANCE = {None: 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


@dataclass(frozen=True)
class DemoResult:
    """What the demo found: each check's verdict, and the report it printed."""

    memory_matches: bool
    comm_matches: bool
    losses_match: bool
    report: str

    @property
    def ok(self) -> bool:
        """Every prediction held and the run matched one process."""
        return self.memory_matches and self.comm_matches and self.losses_match


# A step's rows: the model's inputs, its targets, and for packed rows their layout by keyword.
_Rows = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def _batches(config: LlamaConfig, data_parallel: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    shape = (_MICRO_BATCH * data_parallel, _SEQUENCE + 1)
    return [torch.randint(0, config.vocab_size, shape, generator=generator) for _ in range(steps)]


def _packed_batches(config: LlamaConfig, data_parallel: int, steps: int) -> list[PackedBatch]:
    """Each step's packed rows of ``_SEQUENCE`` tokens, the same on every rank.

    One long document (7 to 11 tokens) among short ones (1 to 3) in each row, then padding if any.
    """
    generator = torch.Generator().manual_seed(1234)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=generator))

    def row() -> PackedBatch:
        lengths = [draw(1, 3) for _ in range(draw(1, 3))]
        lengths.insert(draw(0, len(lengths)), draw(7, 11))
        while sum(lengths) + 3 <= _SEQUENCE:
            lengths.append(draw(1, 3))
        return pack(
            [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in lengths], _SEQUENCE
        )

    return [collate_packed([row() for _ in range(_MICRO_BATCH * data_parallel)]) for _ in range(steps)]


def _steps_rows(config: LlamaConfig, data_parallel: int, steps: int, packed: bool) -> list[_Rows]:
    """Every step's global rows, as the model takes them."""
    if not packed:
        return [(b[:, :-1], b[:, 1:], {}) for b in _batches(config, data_parallel, steps)]
    return [
        (b.tokens, b.labels, {"positions": b.positions, "document_ids": b.document_ids})
        for b in _packed_batches(config, data_parallel, steps)
    ]


def _slice(rows: _Rows, index: int) -> _Rows:
    """Data-parallel slice ``index`` of a step's rows."""
    cut = slice(index * _MICRO_BATCH, (index + 1) * _MICRO_BATCH)
    inputs, targets, layout = rows
    return inputs[cut], targets[cut], {k: v[cut] for k, v in layout.items()}


def _loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # the mean over the targets, a packed row's -100s (cross_entropy's ignore_index) left out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _train_on_rank(plan: Plan, config: LlamaConfig, steps: int, seed: int, packed: bool) -> dict[str, Any]:
    # FSDP2 warns that the logits are a view (of the tensor-parallel gather); the demo
    # never writes into them, so the warning would only hide the report
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    # sharded plans build on the meta device and allocate only their shards; DDP and
    # ZeRO-1 keep every parameter on every rank, so they build whole
    meta = plan.config.data_parallel not in ("ddp", "zero1")
    torch.manual_seed(seed)
    with torch.device("meta") if meta else nullcontext():
        model = Llama(config)
    apply(plan, model)
    if meta:
        materialize(plan, model, seed=seed)
    adamw = optimizer(plan, model, torch.optim.AdamW, lr=_LR)
    # the plain forward and backward, or under cp each rank's chunks of the rows
    train_step = forward_backward(plan, model, _loss_fn)
    index, data_parallel = plan.data_parallel_rank(current_rank())
    log = CollectiveLog(plan.mesh)
    losses = []
    for step, rows in enumerate(_steps_rows(config, data_parallel, steps, packed)):
        inputs, targets, layout = _slice(rows, index)
        with log if step == _MEASURED_STEP else nullcontext():
            adamw.zero_grad()
            loss = train_step(inputs, targets, **layout)
            adamw.step()
        losses.append(loss.item())
    return {"losses": losses, "memory": resident_bytes(model, adamw), "sent": log.sent}


def _one_process(config: LlamaConfig, data_parallel: int, steps: int, seed: int, packed: bool) -> list[float]:
    torch.manual_seed(seed)
    model = Llama(config)
    adamw = torch.optim.AdamW(model.parameters(), lr=_LR)
    losses = []
    for rows in _steps_rows(config, data_parallel, steps, packed):
        adamw.zero_grad()
        # data parallel averages its ranks' gradients: the mean of each slice's mean loss (a
        # packed slice's targets are its own count, so not the mean over the whole batch)
        slices = [_slice(rows, index) for index in range(data_parallel)] if packed else [rows]
        loss = torch.stack([_loss_fn(model(i, **layout), t) for i, t, layout in slices]).sum() / len(slices)
        loss.backward()
        adamw.step()
        losses.append(loss.item())
    return losses


def _policy_text(policy: Policy) -> str:
    try:
        return format_policy(policy)
    except ShardingError:  # a policy function has no text form: name its layers
        return " + ".join(layer.name for layer in policy.layers)


def _mark(ok: bool) -> str:
    return "ok" if ok else "DIFFERS"


def model_shapes(model: str) -> Llama:
    """The demo's ``model`` built on the meta device: its shapes, for planning and reading a policy.

    Examples:
        >>> model_shapes("tiny").lm_head.weight.device
        device(type='meta')
    """
    config = CONFIGS[one_of(model, tuple(CONFIGS), "model", meaning="a functional_shard.zoo model name")]
    with torch.device("meta"):
        return Llama(config)


@entry_point
def run(
    mesh: Mesh,
    policy: Policy | str,
    *,
    model: str = "tiny",
    steps: int = 5,
    seed: int = 0,
    out: Callable[[str], None] = print,
    force: bool = False,
    packed: bool = False,
) -> DemoResult:
    """Plan, train on ``mesh.size`` local processes, and compare with the prediction and one process.

    Args:
        mesh: the mesh (an axis of -1 is refused: the demo's world is the mesh).
        policy: the policy, or its text (``"fsdp(dp) + tp(llama, tp)"``, as `planning.policy.parse` reads it).
        model: a small `functional_shard.zoo.CONFIGS` name.
        steps: AdamW steps (at least 3: the third is measured).
        seed: initialisation seed, for the run and the one-process reference.
        out: where report lines go.
        force: start ``mesh.size`` processes even past `process_limit`.
        packed: train on packed rows (one long document among short ones in each), each document
            attending only to itself; the one process runs the same rows.

    Raises:
        ShardingError: more processes than `process_limit` (without ``force``), too few steps, or a
            policy or plan that cannot run; before any process starts.

    Examples:
        >>> # fs.demo.run(fs.Mesh(dp=2, tp=2), "fsdp(dp) + tp(llama, tp)").ok
    """
    _check_demo(mesh, steps, force)
    shapes_only = model_shapes(model)
    config = shapes_only.config
    if isinstance(policy, str):
        policy = parse_policy(policy, shapes_only)
    plan = shard(shapes_only, mesh, policy)
    check_runnable(plan, shapes_only)  # before any process starts
    predicted = plan.cost("adamw", tokens=_MICRO_BATCH * _SEQUENCE)
    lines: list[str] = []

    def say(line: str = "") -> None:
        lines.append(line)
        out(line)

    say(f"functional-shard demo: {model} Llama on {mesh.size} local processes (gloo), {mesh!r}")
    say(f"policy: {_policy_text(policy)}")
    if packed:
        say(
            f"packed rows of {_SEQUENCE} tokens: one long document among short ones in each, every "
            "document attending only to itself"
            + ("; cut over the cp ranks by attention work" if plan.config.context is not None else "")
        )
    say()
    say("The plan, before anything runs:")
    say(plan.explain())
    say()
    say(str(predicted))
    say()
    with LocalWorld(mesh.size) as world:
        ranks = world.run(_train_on_rank, plan, config, steps, seed, packed)

    memory_ok = _say_memory(plan, ranks, steps, say)
    comm_ok = _say_comm(predicted, ranks, say)
    losses_ok = _say_losses(plan, config, ranks, steps, seed, say, packed=packed)
    verdict = all((memory_ok, comm_ok, losses_ok))
    say(
        "All predictions held and the run matched one process."
        if verdict
        else "Something differed: see the rows marked DIFFERS."
    )
    return DemoResult(memory_ok, comm_ok, losses_ok, "\n".join(lines))


def _check_demo(mesh: Mesh, steps: int, force: bool) -> None:
    """Refuse, before any process starts, a mesh the demo cannot start or too few steps to measure."""
    instance_of(mesh, Mesh, "mesh", meaning="as fs.Mesh(dp=2, tp=2)")
    if not mesh.is_resolved:
        raise ShardingError(f"{mesh!r}: the demo starts one process per device, so give every axis its size")
    limit = process_limit()
    if mesh.size > limit and not force:
        raise ShardingError(
            f"{mesh!r} needs {mesh.size} local processes (one per device), more than the {limit} the "
            "demo starts on this machine (4 per CPU core, at least 8): use a smaller mesh, or pass --force "
            "(force=True) to start them anyway"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= _MEASURED_STEP:
        refuse(
            "steps",
            repr(steps),
            "an int of 3 or more",
            meaning=f"the demo measures step {_MEASURED_STEP + 1}",
        )


def _say_memory(plan: Plan, ranks: list[dict[str, Any]], steps: int, say: Callable[[str], None]) -> bool:
    """Each rank's states, predicted beside measured; whether every rank's matched."""
    say(f"Memory per rank after {steps} steps, bytes (predicted by plan.cost / measured from storages):")
    memory_ok = True
    for rank, result in enumerate(ranks):
        on_rank = plan.cost("adamw", rank=rank)
        expected = {
            "params": on_rank.params_bytes,
            "grads": on_rank.grads_bytes,
            "optimizer": on_rank.optimizer_bytes,
        }
        row_ok = expected == result["memory"]
        memory_ok &= row_ok
        cells = "  ".join(f"{k} {expected[k]:>9,} / {result['memory'][k]:>9,}" for k in expected)
        say(f"  rank {rank}: {cells}  {_mark(row_ok)}")
    say("")
    return memory_ok


def _say_comm(predicted: Cost, ranks: list[dict[str, Any]], say: Callable[[str], None]) -> bool:
    """The measured step's bytes sent by collective, predicted beside measured; whether all matched."""
    say(f"Bytes sent in step {_MEASURED_STEP + 1}, per rank (predicted / measured from torch's collectives):")
    predicted_comm = predicted.comm_bytes
    comm_ok = True
    kinds = sorted({(k, a) for k, by in predicted_comm.items() for a in by})
    kinds += sorted({(k, a) for r in ranks for k, by in r["sent"].items() for a in by} - set(kinds))
    for kind, axes in kinds:
        expected_bytes = predicted_comm.get(kind, {}).get(axes, 0.0)
        measured = [r["sent"].get(kind, {}).get(axes, 0.0) for r in ranks]
        row_ok = all(math.isclose(m, expected_bytes, abs_tol=0.5) for m in measured)
        comm_ok &= row_ok
        spread = f"{min(measured):,.0f}" + (
            f"..{max(measured):,.0f}" if max(measured) != min(measured) else ""
        )
        say(f"  {kind:<15} over {axes or '-':<8} {expected_bytes:>12,.0f} / {spread:>12}  {_mark(row_ok)}")
    say("")
    return comm_ok


def _say_losses(
    plan: Plan,
    config: LlamaConfig,
    ranks: list[dict[str, Any]],
    steps: int,
    seed: int,
    say: Callable[[str], None],
    *,
    packed: bool,
) -> bool:
    """Each step's loss beside one process training on the same batches; whether they agree."""
    data_parallel = plan.data_parallel_rank(0)[1]
    alone = _one_process(config, data_parallel, steps, seed, packed)
    # every data-parallel group weighs the same: the mean over ranks is the global loss
    sharded = [sum(step) / len(ranks) for step in zip(*(r["losses"] for r in ranks), strict=True)]
    worst = max(abs(a - b) for a, b in zip(sharded, alone, strict=True))
    allowed = _LOSS_TOLERANCE[plan.config.param_dtype]
    losses_ok = worst <= allowed
    rows = "packed rows" if packed else "tokens"
    say(f"Training, global batch {_MICRO_BATCH * data_parallel} x {_SEQUENCE} {rows}: loss per step")
    say(f"  {'step':>4}  {f'{len(ranks)} processes':>14}  {'1 process':>12}")
    for step, (a, b) in enumerate(zip(sharded, alone, strict=True), start=1):
        say(f"  {step:>4}  {a:>14.6f}  {b:>12.6f}")
    tolerance = f"{plan.config.param_dtype or 'float32'} against float32; tolerance {allowed:g}"
    say(f"  largest difference {worst:.2e} ({tolerance})  {_mark(losses_ok)}")
    say("")
    return losses_ok
