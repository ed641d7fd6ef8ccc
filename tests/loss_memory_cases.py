"""What a step's loss holds, measured by a live-storage meter (importable, so spawn can send it).

`LiveStorages` is a ``TorchDispatchMode`` that notes the storage of every tensor an op
returns, with its bytes and the label current at its birth, and forgets it when torch
frees it: a ``weakref.finalize`` on the storage's Python object, which torch keeps alive
exactly as long as the storage itself (it preserves the object while the C++ storage
lives, as it does a tensor's; `tests/dist/test_loss_workspace.py` checks that frees are seen
and that the meter's whole-step peak equals torch's own ``MemTracker``'s). DTensor ops
are handed back to DTensor, so the meter sees the local ops they turn into.

`metered` wraps a loss function so that what the loss makes is labelled ``"loss"``: the
logits (relabelled when the loss gets them), every tensor made inside it, and in the
backward everything from the loss's gradient until the logits' gradient is made (a hook
on the loss turns the label on, one on the logits turns it off). Its peak is what
``Estimate.memory["loss_workspace"]`` models (with the last pipeline stage's logits and
log-softmax of the micro-batches in flight, which the estimate counts with that stage's
activations).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import functional_shard as fs

from . import pipeline_cases as pc


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class LiveStorages(TorchDispatchMode):
    """Live bytes per label of the storages ops make while active, and each label's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.label = "other"
        self.live: dict[StorageWeakRef, list[Any]] = {}  # key -> [label, bytes]
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.total = self.total_peak = 0

    def _forget(self, key: StorageWeakRef) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current[entry[0]] -= entry[1]
            self.total -= entry[1]

    def note(self, tensor: torch.Tensor, label: str | None = None, *, move: bool = True) -> None:
        """Count ``tensor``'s storage under ``label`` (the current one by default), or move it there.

        ``move=False`` leaves a storage already counted where it is (an op's output that
        views a parameter or an input is still theirs)."""
        local = _local(tensor)
        if type(local) not in (torch.Tensor, torch.nn.Parameter) or local.device.type != "cpu":
            return  # meta, fake, and wrapper tensors (funcol's async one) have no storage of their own
        storage = local.untyped_storage()
        if not storage.nbytes():
            return
        key, label = StorageWeakRef(storage), label or self.label
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [label, storage.nbytes()]
            self.current[label] = self.current.get(label, 0) + storage.nbytes()
            self.total += storage.nbytes()
            weakref.finalize(storage, self._forget, key)
        elif entry[0] != label and move:
            self.current[entry[0]] -= entry[1]
            self.current[label] = self.current.get(label, 0) + entry[1]
            entry[0] = label
        self._peaks()

    def _peaks(self) -> None:
        for label, nbytes in self.current.items():
            self.peak[label] = max(self.peak.get(label, 0), nbytes)
        self.total_peak = max(self.total_peak, self.total)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for leaf in torch.utils._pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.note(leaf, move=False)
        return out


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def upcast_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on fp32 logits, as torchtitan writes it."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def metered(meter: LiveStorages, loss_fn: LossFn = upcast_loss) -> LossFn:
    """``loss_fn`` with what it makes, forward and backward, labelled ``"loss"`` in ``meter``."""

    def label(name: str) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            meter.label = name

        return hook

    def run(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        meter.note(logits, "loss")
        meter.label = "loss"
        try:
            loss = loss_fn(logits, targets)
        finally:
            meter.label = "other"
        loss.register_hook(label("loss"))
        logits.register_hook(label("other"))
        return loss

    return run


def last_stage_loss_peak(spec: dict[str, Any], loss_parallel: bool = False) -> dict[str, Any]:
    """On every rank: train ``spec`` (bf16 compute) a step, meter the next; the loss's peak bytes.

    FSDP's mixed precision makes the bf16 compute; with ``loss_parallel`` the model is bf16
    and the head's logits stay split on the vocabulary over ``tp`` (torch's
    ``loss_parallel()``). Returns the rank's pp coordinate, the measured peak of what the
    loss held, the estimate's loss workspace for that rank and one micro-batch's logits'
    elements on a rank (its vocabulary shard under loss parallel), with its tokens.
    """
    mesh = fs.Mesh(**spec["mesh"])
    model = pc.build(spec)
    if loss_parallel:
        model = model.to(torch.bfloat16)
        policy = pc.policy_of({**spec, "tp": False}) + fs.tp(fs.rules.llama, "tp", loss_parallel=True)
    else:
        policy = pc.policy_of(spec) + fs.mixed_precision()
    plan = fs.shard(model, mesh, policy)
    rows = spec["rows"]
    estimate = fs.estimate(model, plan, batch=rows, seq=pc.SEQ, rank=dist.get_rank())
    fs.apply(plan, model)
    meter = LiveStorages()
    step = fs.forward_backward(plan, model, metered(meter))
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    for number, tokens in enumerate(pc.batches(data_parallel, rows)[:2]):
        mine = tokens[index * rows : (index + 1) * rows]
        inputs, targets = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
        if number == 0:  # torch's stages infer their shapes in the first step
            step(inputs, targets)
            model.zero_grad()
            continue
        with meter:
            step(inputs, targets)
    vocab = pc.CONFIGS[spec["config"]].vocab_size // (mesh["tp"] if loss_parallel else 1)
    tokens = rows // spec["microbatches"] * pc.SEQ
    return {
        "pp_rank": plan.mesh.coords(dist.get_rank())["pp"],
        "measured": meter.peak.get("loss", 0),
        "loss_workspace": estimate.memory["loss_workspace"],
        "numel": tokens * vocab,
        "tokens": tokens,
    }
