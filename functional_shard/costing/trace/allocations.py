"""A training step's device allocations in order, traced on fake tensors: what the caching allocator is fed.

`step_allocations` runs the whole model (no repeated layer left out) forward, through the
loss the bench's step computes (``F.cross_entropy`` of the logits cast to fp32) and
backward on fake tensors, noting every storage an op makes when it is made and when it
dies (a dispatch mode polls its weak references before each op). Around that, what the
trace does not run is placed where torch runs it:

- FSDP2 on one rank (``FSDPParamGroup.unshard`` / ``wait_for_unshard`` with
  ``world_size == 1``): before a unit's forward, and again before its backward, each
  parameter's compute-dtype copy (the all-gather input, cast from the fp32 shard, then
  the unsharded parameter, the cast freed); after its forward the unsharded parameters go
  (the root's stay to the end of backward); once a unit's every gradient is accumulated,
  ``foreach_reduce``: the fp32 reduce-scatter input on the default stream, the output on
  the reduce-scatter stream (the sharded gradients are views of it, kept to the next
  ``zero_grad``), the compute-dtype gradients and the input freed;
- foreach AdamW (``torch/optim/adam.py``, ``_multi_tensor_adam``): its first step makes two
  states the size of each fp32 parameter (``_init_group``); every step makes one
  ``_foreach_sqrt`` temporary per parameter, freed at its end; the rest runs in place, the
  step counts on the host;
- the parameters' fp32 shards first (``fs.materialize``), each step's token ids.

Three steps, the first without optimizer state, are what the warm-up leaves in the cache
(one step is traced: every step runs the same ops):
`functional_shard.costing.estimate.caching_allocator` runs them. Held to an H200's rows in
tests/unit/test_gpu_truth.py. Only plans of that kind are traced (FSDP whose shard group is
one rank, resharding after forward, one module a unit; a 16-bit compute dtype with float32
reduction; without tensor, context or pipeline parallelism, experts or offload; AdamW), and
only a language model's (logits to the loss): others raise `PlanError`.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from functional_shard.core.errors import PlanError
from functional_shard.planning.plan.cost_record import OptimizerKind

from .activations import _Run, _RunSetup, _stage_holder
from .counting import Births, Flops, _device_query
from .fake_parameters import FakeParameters
from .model_inputs import first_tensor, is_hf, model_inputs

__all__ = ["REDUCE_SCATTER", "Event", "order_problems", "step_allocations"]

REDUCE_SCATTER = 1  # the reduce-scatter stream's id in the events (the default stream is 0)

Event = tuple[str, int, int, int]
"""(``"alloc"`` or ``"free"``, bytes, a key naming the block, stream)."""


class _Log:
    """The events, and the storages alive that a dispatch mode noted."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.alive: dict[StorageWeakRef, int] = {}
        self.untracked: set[StorageWeakRef] = set()
        self._keys = 0

    def alloc(self, size: int, stream: int = 0) -> int:
        self._keys += 1
        self.events.append(("alloc", size, self._keys, stream))
        return self._keys

    def free(self, key: int) -> None:
        self.events.append(("free", 0, key, 0))

    def born(self, tensor: torch.Tensor) -> None:
        ref = StorageWeakRef(tensor.untyped_storage())
        size = tensor.untyped_storage().nbytes()
        if size and ref not in self.untracked and ref not in self.alive:
            self.alive[ref] = self.alloc(size)

    def collect(self) -> None:
        """Free the noted storages that died since the last look."""
        for ref in [ref for ref in self.alive if ref.expired()]:
            self.free(self.alive.pop(ref))


class _Lifetimes(TorchDispatchMode):
    """Notes each op's new output storages, and before each op the storages that died."""

    supports_higher_order_operators = True

    def __init__(self, log: _Log) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if (device := _device_query(func, args)) is not None:
            return device
        self.log.collect()
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.log.born(leaf)
        return out


def order_problems(plan: Any, optimizer: OptimizerKind) -> list[str]:
    """Why the step's allocation order of ``plan`` is not known (empty: it is traced)."""
    config = plan.config
    fsdp = config.fsdp
    problems = []
    if fsdp is None:
        problems.append("it has no FSDP (fs.fsdp)")
    elif fsdp.kind != "fsdp":
        problems.append(f"its data parallelism is {fsdp.kind}, not FSDP resharding after forward (fs.fsdp)")
    else:
        if fsdp.shard_axes and plan.mesh.axes_size(fsdp.shard_axes) != 1:
            problems.append("FSDP shards over more than one rank (its all-gathers were not measured)")
        if not fsdp.reshard_after_forward:
            problems.append("FSDP keeps the gathered parameters after forward")
        if fsdp.unit_groups:
            problems.append("it has FSDP units of several modules")
    if config.param_dtype not in ("bfloat16", "float16") or config.reduce_dtype != "float32":
        problems.append("its mixed precision is not a 16-bit compute dtype with float32 reduction")
    if config.tp_size(plan.mesh) > 1 or config.cp_size(plan.mesh) > 1 or config.pipeline is not None:
        problems.append("it has tensor, context or pipeline parallelism")
    if config.expert_modules or config.offload_params or config.offload_grads or config.offload_optimizer:
        problems.append("it splits experts or offloads")
    if optimizer not in ("adamw", "adam"):
        problems.append(f"its optimizer is {optimizer!r}, not AdamW")
    return problems


def _unit_of(path: str, units: tuple[str, ...]) -> str:
    """The innermost FSDP unit holding parameter ``path`` ("" is the root)."""
    holding = [unit for unit in units if unit and (path == unit or path.startswith(f"{unit}."))]
    return max(holding, key=len, default="")


def step_allocations(
    model: nn.Module, plan: Any, *, batch: int, seq: int, steps: int = 3, optimizer: OptimizerKind = "adamw"
) -> list[Event]:
    """The device allocations and frees of ``steps`` training steps of ``plan``, in order.

    Raises:
        PlanError: a plan of another kind than the module docstring names.
    """
    if problems := order_problems(plan, optimizer):
        raise PlanError(
            "the step's allocations are traced only for plans of the kind an H200 measured "
            "(fs.fsdp on one rank with fs.mixed_precision(), AdamW): " + "; ".join(problems)
        )
    dtype = getattr(torch, plan.config.param_dtype) if plan.config.param_dtype else None
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    parameters = FakeParameters(model, plan, holder=_stage_holder(plan, 0), dtype=dtype, fake=fake)
    parameters.refill(())  # every layer runs: each its own parameters
    modules = dict(model.named_modules())
    run = _Run(
        _RunSetup(
            model=model,
            modules=modules,
            parameters=parameters,
            plan=plan,
            tp_size=1,
            expert_imbalance=1.0,
            rank=0,
            batch=batch,
            seq=seq,
            inputs=None,
            dtype=dtype,
            cuda=True,
        )
    )
    log = _Log()
    log.untracked = {StorageWeakRef(p.untyped_storage()) for p in parameters.params}
    names = list(dict.fromkeys(parameters.canonical_of.values()))  # model order, tied ones once
    units = tuple(plan.config.fsdp.units)
    unit_of = {name: _unit_of(name, units) for name in names}
    members = {unit: [name for name in names if unit_of[name] == unit] for unit in units}
    tensor = parameters.state
    compute_bytes = {name: tensor[name].numel() * tensor[name].element_size() for name in names}
    fp32_bytes = {name: tensor[name].numel() * 4 for name in names}
    fsdp = _Fsdp(log, members, compute_bytes, fp32_bytes, tensor)

    with _hooks(modules, model, members, fsdp, tensor, unit_of), run.swapped():
        _one_step(run, model, log, fake, batch=batch, seq=seq, dtype=dtype, fsdp=fsdp)
    traced, log.events = log.events, []
    gc.collect()
    log.collect()
    remains = log.events  # what died with the step's last references, freed after the optimizer's step
    return _repeated(
        traced,
        remains,
        gradients=list(fsdp.gradients.values()),
        parameters=[fp32_bytes[name] for name in names],
        steps=steps,
    )


def _repeated(
    traced: list[Event], remains: list[Event], *, gradients: list[int], parameters: list[int], steps: int
) -> list[Event]:
    """``steps`` steps of one traced step, in torch's order around it.

    Every step runs the same ops, so one trace serves them all, each step's blocks under keys
    of their own. Around each: ``zero_grad`` first (the previous step's reduce-scatter outputs),
    the optimizer's step before the step's last references die; the fp32 shards before the
    first (``fs.materialize``).
    """
    events: list[Event] = []
    keys = itertools.count(1)

    def alloc(size: int, stream: int = 0) -> int:
        key = next(keys)
        events.append(("alloc", size, key, stream))
        return key

    for size in parameters:
        alloc(size)
    kept: list[int] = []
    for step in range(steps):
        events.extend(("free", 0, key, 0) for key in kept)
        renamed: dict[int, int] = {}
        for action, size, key, stream in traced:
            if action == "alloc":
                renamed[key] = alloc(size, stream)
            else:
                events.append((action, size, renamed[key], stream))
        if step == 0:
            for size in parameters:  # AdamW's first step() makes exp_avg and exp_avg_sq
                alloc(size)
                alloc(size)
        temporaries = [alloc(size) for size in parameters]  # _foreach_sqrt(exp_avg_sqs)
        events.extend(("free", 0, key, 0) for key in temporaries)
        events.extend((action, size, renamed[key], stream) for action, size, key, stream in remains)
        kept = [renamed[key] for key in gradients]
    return events


class _Fsdp:
    """FSDP2's allocations on one rank around the traced forward and backward."""

    def __init__(
        self,
        log: _Log,
        members: dict[str, list[str]],
        compute_bytes: dict[str, int],
        fp32_bytes: dict[str, int],
        tensor: dict[str, torch.Tensor],
    ) -> None:
        self.log, self.members = log, members
        self.compute_bytes, self.fp32_bytes, self.tensor = compute_bytes, fp32_bytes, tensor
        self.unsharded: dict[str, list[int]] = {}
        self.gradients: dict[str, int] = {}  # unit -> its reduce-scatter output
        self.accumulated: dict[str, int] = {}

    def unshard(self, unit: str) -> None:
        if unit in self.unsharded:
            return
        kept = []
        for name in self.members[unit]:
            cast = self.log.alloc(self.compute_bytes[name])
            kept.append(self.log.alloc(self.compute_bytes[name]))
            self.log.free(cast)
        self.unsharded[unit] = kept

    def reshard(self, unit: str) -> None:
        for key in self.unsharded.pop(unit, []):
            self.log.free(key)

    def accumulate(self, unit: str) -> None:
        self.accumulated[unit] = self.accumulated.get(unit, 0) + 1
        if self.accumulated[unit] < len(self.members[unit]):
            return
        total = sum(self.fp32_bytes[name] for name in self.members[unit])
        reduce_input = self.log.alloc(total)
        for name in self.members[unit]:
            self.tensor[name].grad = None
        self.log.collect()
        self.gradients[unit] = self.log.alloc(total, REDUCE_SCATTER)
        self.log.free(reduce_input)
        if unit:  # the root reshards at the end of backward
            self.reshard(unit)

    def zero_grad(self) -> None:
        for key in self.gradients.values():
            self.log.free(key)
        self.gradients.clear()
        self.accumulated.clear()


class _hooks:  # noqa: N801 (a context manager named for what it holds)
    """FSDP2's points in the module calls and the gradients' accumulation, for one trace."""

    def __init__(
        self,
        modules: dict[str, nn.Module],
        model: nn.Module,
        members: dict[str, list[str]],
        fsdp: _Fsdp,
        tensor: dict[str, torch.Tensor],
        unit_of: dict[str, str],
    ) -> None:
        self.handles: list[Any] = []
        for unit in members:
            if not unit:
                continue
            module = modules[unit]
            self.handles.append(module.register_forward_pre_hook(_call(fsdp.unshard, unit)))
            self.handles.append(module.register_forward_hook(_call(fsdp.reshard, unit)))
            self.handles.append(module.register_full_backward_pre_hook(_call(fsdp.unshard, unit)))
        for name, unit in unit_of.items():
            self.handles.append(tensor[name].register_post_accumulate_grad_hook(_call(fsdp.accumulate, unit)))

    def __enter__(self) -> _hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()


def _call(function: Callable[[str], None], unit: str) -> Callable[..., None]:
    def hook(*args: Any) -> None:
        function(unit)

    return hook


def _one_step(
    run: _Run,
    model: nn.Module,
    log: _Log,
    fake: FakeTensorMode,
    *,
    batch: int,
    seq: int,
    dtype: Any,
    fsdp: _Fsdp,
) -> None:
    """One forward, loss and backward, as bench/cuda_step_kernels.py's ``step`` runs them."""
    lifetimes = _Lifetimes(log)
    with fake, lifetimes:
        tokens = torch.randint(0, 2, (batch, seq + 1))
    births, flops = Births(), Flops()  # what `_running` fills; unused here
    outputs: dict[str, int] = {}
    with run._running([], (), births, flops, outputs), lifetimes:
        fsdp.unshard("")
        args, kwargs = model_inputs(model, batch, seq, None, dtype)
        if is_hf(model):
            kwargs.setdefault("use_cache", False)
        logits = first_tensor(model(*args, **kwargs))
        del args, kwargs
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (batch, seq):
            raise PlanError(
                f"the step's allocations are traced for a language model, whose output is logits "
                f"(batch, seq, vocabulary) = ({batch}, {seq}, ...) to a cross-entropy loss; "
                f"{type(model).__name__} returned shape {tuple(logits.shape)}"
            )
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        del logits
        log.collect()
        loss.backward()
        del loss
        log.collect()
    fsdp.reshard("")
    del tokens
