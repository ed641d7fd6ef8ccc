"""What a pipeline rank holds for backward while torch's schedule runs, measured on gloo ranks.

Importable, so spawn can send it. `held_for_backward` trains a `pipeline_cases` case for a
warm-up step (torch's stages infer shapes on the first) and measures the next one. During
that step it counts, by storage identity, what this rank keeps alive for a backward still
to come:

* every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``; parameters
  and views of them left out), alive from its pack until the graph node that holds it is
  freed, which a weak reference on the packed holder sees;
* what torch's ``PipelineStage`` caches between a micro-batch's forward and its backward:
  the stage's inputs (the activation it received, or the token ids) and its outputs, which
  ``backward_one_chunk`` hands to ``torch.autograd.backward``; its receive buffers, one per
  micro-batch for the activation (not on the first stage) and for the output's gradient (not
  on the last), which it keeps from step to step; and the last stage's
  outputs it keeps to return them merged when the step ends (``output_chunks``: the
  engine asks for none, so it keeps none, unless a case asks for torch's default with
  ``keep_outputs``).

The count is taken after each forward, loss and backward action of the schedule: a
forward and its loss only add to what is held and a backward only frees, so the peak is
at one of those boundaries. The saved tensors of the loss are counted apart from the
stages'. On a CPU there is no ``max_memory_allocated``; this is the part of memory the
estimate's ``activations`` model (the last stage's logits and log-softmax included; not
the transient workspace inside an op, which ``loss_workspace`` and the trace model).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

import functional_shard as fs

from . import pipeline_cases as pc
from .dist_cases import mean_over_ranks


def _parameter_like(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _Packed:
    """What autograd keeps instead of a saved tensor: freed with the graph node that holds it."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class HeldForBackward:
    """Live storages saved for backward (by the stages, by the loss) and cached by the stages."""

    def __init__(self, stages: tuple[Any, ...]) -> None:
        self.stages = stages
        self.live: dict[str, dict[StorageWeakRef, list[Any]]] = {"stages": {}, "loss": {}}
        self.in_loss = False
        self.measuring = False
        self.peak = {"stages": 0, "loss": 0, "both": 0}
        self.ended = 0  # what the last stage holds when the step returns (kept outputs)
        self.samples: list[tuple[str, int, int]] = []

    def _free(self, kind: str, key: StorageWeakRef) -> None:
        entry = self.live[kind].get(key)
        if entry is not None:
            entry[1] -= 1
            if not entry[1]:
                del self.live[kind][key]

    def pack(self, tensor: torch.Tensor) -> Any:
        if _parameter_like(tensor):
            return tensor
        storage = _local(tensor).untyped_storage()
        key = StorageWeakRef(storage)
        kind = "loss" if self.in_loss else "stages"
        entry = self.live[kind].setdefault(key, [storage, 0])
        entry[1] += 1
        # detached: a node that saves its own output (SDPA, rsqrt) would otherwise hold,
        # through the holder, a tensor whose grad_fn is that node, a cycle only the node's
        # release breaks; a split backward's W step never releases the nodes only I ran
        packed = _Packed(tensor.detach())
        weakref.finalize(packed, self._free, kind, key)
        return packed

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Packed) else packed

    def _cached(self) -> dict[StorageWeakRef, torch.UntypedStorage]:
        # torch's private per-stage caches (torch 2.13): fwd_cache maps a micro-batch to
        # (its outputs, its inputs) until its backward; output_chunks the last stage's outputs
        out: dict[StorageWeakRef, torch.UntypedStorage] = {}
        for stage in self.stages:
            kept = [t for outputs, inputs in stage.fwd_cache.values() for t in [*outputs, *inputs]]
            kept += torch.utils._pytree.tree_leaves(stage.output_chunks)
            for tensor in kept:
                if isinstance(tensor, torch.Tensor):
                    storage = _local(tensor).untyped_storage()
                    out[StorageWeakRef(storage)] = storage
        return out

    def _buffers(self) -> dict[StorageWeakRef, torch.UntypedStorage]:
        # torch's receive buffers (torch 2.13): per micro-batch, the stage's inputs (not on
        # the first stage) and its output's gradient (not on the last), kept between steps
        out: dict[StorageWeakRef, torch.UntypedStorage] = {}
        for stage in self.stages:
            infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
            for info in (info for chunk in infos for info in chunk):
                if isinstance(info.buffer, torch.Tensor):
                    storage = _local(info.buffer).untyped_storage()
                    out[StorageWeakRef(storage)] = storage
        return out

    def buffers(self) -> int:
        """Bytes of the stages' receive buffers."""
        return sum(storage.nbytes() for storage in self._buffers().values())

    def sample(self, what: str) -> None:
        if not self.measuring:
            return
        stages = {key: entry[0] for key, entry in self.live["stages"].items()}
        stages.update(self._cached())
        stages.update(self._buffers())
        loss = {key: entry[0] for key, entry in self.live["loss"].items() if key not in stages}
        held = sum(s.nbytes() for s in stages.values())
        in_loss = sum(s.nbytes() for s in loss.values())
        self.peak["stages"] = max(self.peak["stages"], held)
        self.peak["loss"] = max(self.peak["loss"], in_loss)
        self.peak["both"] = max(self.peak["both"], held + in_loss)
        self.samples.append((what, held, in_loss))


def _watched(held: HeldForBackward, method: Any, what: str) -> Any:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        out = method(*args, **kwargs)
        held.sample(f"{what}{args[0] if args else ''}")
        return out

    return run


def held_for_backward(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec`` one step, then measure the next: this rank's peak bytes held for backward."""
    from functional_shard.runtime.engines.pipeline import pipeline_of

    mesh = fs.Mesh(**spec["mesh"])
    model = pc.build(spec)
    plan = fs.shard(model, mesh, pc.policy_of(spec))
    fs.apply(plan, model)
    pipelined = pipeline_of(model)
    assert pipelined is not None
    held = HeldForBackward(pipelined.stages)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        held.in_loss = True
        try:
            loss = pc.lm_loss(logits, targets)
        finally:
            held.in_loss = False
        held.sample("loss")
        return loss

    step = fs.forward_backward(plan, model, loss_fn)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    rows = spec["rows"]
    tokens = pc.batches(data_parallel, rows)
    for number in range(2):
        # a rank's own batch, as a data loader hands it (not a view of the global batch,
        # which would keep every rank's token ids alive with this rank's)
        mine = tokens[number][index * rows : (index + 1) * rows]
        inputs, targets = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
        if number == 0:  # torch's stages infer their shapes in the first step
            step(inputs, targets)
            model.zero_grad()
            if spec.get("keep_outputs"):
                _keep_outputs(pipelined.schedule, held)
            continue
        for stage in pipelined.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                label = f"{stage.stage_index}{name[0]}"
                setattr(stage, name, _watched(held, getattr(stage, name), label))
        held.measuring = True
        with torch.autograd.graph.saved_tensors_hooks(held.pack, held.unpack):
            loss = step(inputs, targets)
        held.measuring = False
    pp_rank = plan.mesh.coords(dist.get_rank())["pp"]
    return {
        "pp_rank": pp_rank,
        "stages": [stage.stage_index for stage in pipelined.stages],
        "peak": held.peak,
        "ended": held.ended,
        "buffers": held.buffers(),
        "samples": held.samples,
        "mesh_rank": dist.get_rank(),
        "loss": float(mean_over_ranks(loss)),
        "data_parallel": data_parallel,
    }


def _keep_outputs(schedule: Any, held: HeldForBackward) -> None:
    """Make ``schedule.step`` keep the last stage's outputs, as torch's default does (the
    engine asks it not to), and note in ``held.ended`` the bytes of the outputs it kept and
    of their concatenation, when it returns that."""
    step = schedule.step

    def keeping(*args: Any, **kwargs: Any) -> Any:
        merged = step(*args, **(kwargs | {"return_outputs": True}))
        if merged is not None and held.measuring:
            chunks = {StorageWeakRef(s): s for s in held._cached().values()}
            chunks[StorageWeakRef(_local(merged).untyped_storage())] = _local(merged).untyped_storage()
            held.ended = sum(storage.nbytes() for storage in chunks.values())
        return merged

    schedule.step = keeping


def held_for_backward_each(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`held_for_backward` of each case in turn, in one call of the world."""
    return [held_for_backward(spec) for spec in specs]


def _whole_grad_bytes(stage: Any) -> int:
    """Bytes of a pipeline stage's gradients FSDP2 holds whole (accumulated or just made)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(stage.submod)
    total = 0
    for inner in state._state_ctx.all_states:
        for group in inner._fsdp_param_groups:
            for param in group.fsdp_params:
                whole = param.unsharded_accumulated_grad
                if whole is None:
                    whole = param._unsharded_param.grad
                total += 0 if whole is None else whole.untyped_storage().nbytes()
    return total


def accumulated_grad_bytes(spec: dict[str, Any], mixed: bool) -> dict[str, Any]:
    """This rank's whole gradients as torch holds them just before its stages' one reduce-scatter
    (every micro-batch's backward done), beside the sum of the estimate's ``whole_grad_bytes``
    over the rank's stages; and, around each stage's first backward, what the stage held
    before and after it, beside its estimate. ``mixed``: bf16 parameters, fp32 reduction."""
    from torch.distributed.pipelining.stage import PipelineStage

    mesh = fs.Mesh(**spec["mesh"])
    model = pc.build(spec)
    policy = pc.policy_of(spec) + (
        fs.mixed_precision(torch.bfloat16, torch.float32) if mixed else fs.Policy()
    )
    plan = fs.shard(model, mesh, policy)
    estimate = fs.estimate(model, plan, batch=spec["rows"], seq=pc.SEQ, rank=dist.get_rank())
    assert estimate.pipeline is not None
    assert plan.config.pipeline is not None
    coordinate = mesh.coords(dist.get_rank())[plan.config.pipeline.axis]
    expected = {s.stage: s.whole_grad_bytes for s in estimate.pipeline.stages if s.rank == coordinate}
    fs.apply(plan, model)
    seen: list[int] = []
    firsts: dict[int, tuple[int, int]] = {}
    reduce, backward = PipelineStage.perform_reduce_grad, PipelineStage.backward_one_chunk

    def measured(stage: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(_whole_grad_bytes(stage))
        return reduce(stage, *args, **kwargs)

    def watched(stage: Any, *args: Any, **kwargs: Any) -> Any:
        before = _whole_grad_bytes(stage)
        out = backward(stage, *args, **kwargs)
        firsts.setdefault(stage.stage_index, (before, _whole_grad_bytes(stage)))
        return out

    step = fs.forward_backward(plan, model, pc.lm_loss)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    rows = spec["rows"]
    mine = pc.batches(data_parallel, rows)[0][index * rows : (index + 1) * rows]
    PipelineStage.perform_reduce_grad = measured  # type: ignore[method-assign]
    PipelineStage.backward_one_chunk = watched  # type: ignore[method-assign]
    try:
        step(mine[:, :-1], mine[:, 1:])
    finally:
        PipelineStage.perform_reduce_grad = reduce  # type: ignore[method-assign]
        PipelineStage.backward_one_chunk = backward  # type: ignore[method-assign]
    return {
        "measured": sum(seen),
        "estimated": sum(expected.values()),
        "firsts": {stage: (*firsts[stage], expected[stage]) for stage in expected},
    }
