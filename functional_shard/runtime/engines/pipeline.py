"""Pipeline parallel: this rank's stages kept, each a torch ``PipelineStage`` over the pp group.

Module paths stay as they are, so state dicts and checkpoints keep the model's names. The
modules of other ranks' stages become parameter-free pass-throughs, so a stage runs the
model's *own* forward on the hidden states it receives (torchtitan's per-stage deep copy
with modules set to None needs a forward written for it). What a model needs to be
pipelined: docs/applying.md, "Pipeline parallel".
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from functional_shard.core.document_attention import PackedForward, packed_forward
from functional_shard.core.errors import ShardingError
from functional_shard.core.tree import within
from functional_shard.planning.pipeline.stage_plans import stage_plan, without_pipeline
from functional_shard.planning.pipeline.stages import SCHEDULES, SINGLE_STAGE, rank_stages
from functional_shard.planning.plan.plan import Plan

from .activation_checkpointing import apply_checkpointing
from .applied import retie
from .data_parallel import apply_data_parallel, reduce_whole_grads
from .experts import apply_expert_parallel
from .gradients import gradients_set_aside
from .stage_failures import raise_any_failure, raise_first_stage_failure
from .stage_forward import ScheduleGate, refuse_direct_calls, run_as_stage
from .tensor_parallel import apply_tensor_parallel, plain_loss, refuse_uneven_sequences


class PassThrough(nn.Module):
    """Stands for a module another pipeline stage runs: returns its first input unchanged."""

    def __init__(self, replaces: str, module: nn.Module | None = None) -> None:
        super().__init__()
        self.replaces = replaces
        # A module on the meta device is kept (no memory, no child, so no engine sees it):
        # materialize replays its initialisation so this rank's stages draw the random
        # numbers they would in one process.
        on_meta = module is not None and all(p.is_meta for p in module.parameters())
        self.__dict__["replaced"] = module if on_meta else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The first positional argument (the hidden states), or the first keyword one."""
        if args:
            return args[0]
        return next(iter(kwargs.values()))

    def extra_repr(self) -> str:
        """Which module this one stands for."""
        return f"runs on another pipeline stage: {self.replaces}"


@dataclass
class Pipelined:
    """This rank's pipeline: its stages, the pp group, and the one schedule that drives them.

    Training and evaluation share one schedule: torch's schedule re-initialises its stages'
    buffers when it switches between ``step`` and ``eval``; a second schedule would not.
    Its loss function calls ``loss``, the loss of the step that runs now.
    """

    plan: Plan
    stages: tuple[Any, ...]  # torch PipelineStage, in increasing stage order
    group: dist.ProcessGroup
    last_stage_rank: int  # the pp-group rank that runs the last stage
    # how the model's own forward, which every stage runs, takes packed rows: read from the
    # whole model before this rank's stages were cut from it, so every rank refuses alike
    packing: PackedForward
    gate: ScheduleGate  # open while a schedule runs the stages: their forwards run only then
    schedule: Any = None
    loss: Callable[..., torch.Tensor] | None = field(default=None, repr=False)
    # the shapes and dtypes of the batch the schedule sized its stages' buffers for
    batch_layout: tuple[Any, ...] | None = None
    # the batch layouts (targets' included) a step has run loss_fn on without a failure
    loss_checked: set[tuple[Any, ...]] = field(default_factory=set, repr=False)
    # while a step runs a layout not checked yet: what loss_fn raised on the last stage
    catching: bool = False
    failure: BaseException | None = field(default=None, repr=False)

    def loss_of_microbatch(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the current step's loss on one micro-batch.

        On a batch layout not checked yet, what it raises is kept (`failure`) and a stand-in loss
        lets the schedule run to its end: the other stages wait for what this one sends, and
        every pp rank raises it after the step (`_mean_from_last_stage`).
        """
        if self.loss is None:
            raise ShardingError("a pipeline schedule ran without a loss function set for its step")
        if not self.catching:
            return self.loss(outputs, targets)
        if self.failure is None and self.gate.failure is None:  # a stage's failure comes first
            try:
                return self.loss(outputs, targets)
            except Exception as error:  # any: it is raised on every pp rank after the step
                self.failure = error
        return outputs.sum() * 0 if outputs.requires_grad else outputs.new_zeros(())


# The modules apply pipelined, weakly. Each keeps its Pipelined in its own __dict__: the
# stages refer back to the module, and a weak dictionary's values must not (its keys
# would never die); a cycle the garbage collector can free.
_PIPELINED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def pipeline_of(module: nn.Module) -> Pipelined | None:
    """The pipeline `apply_pipeline` built for ``module``, or None."""
    found = module.__dict__.get("_fs_pipeline")
    return found if isinstance(found, Pipelined) else None


def pipeline_group_of(params: Iterable[torch.Tensor]) -> dist.ProcessGroup | None:
    """The pp group of the pipelined module that holds any of ``params``, or None."""
    wanted = {id(p) for p in params}
    for module in list(_PIPELINED):
        pipelined = pipeline_of(module)
        # both alive now, so equal ids are the same tensors (no weak reference to a
        # parameter: it would stop to_empty from swapping it)
        if pipelined is not None and any(id(p) in wanted for p in module.parameters()):
            return pipelined.group
    return None


def _pruned(module: nn.Module, prefix: str, keep: set[str], drop: set[str]) -> nn.Module:
    """``module`` (at ``prefix``) as a stage sees it: shared where kept, a clone along the way."""
    if prefix in drop:
        return PassThrough(prefix, module)
    holds_dropped = any(prefix == "" or d.startswith(prefix + ".") for d in drop)
    if (prefix and within(prefix, keep)) or not holds_dropped:
        return module  # this stage's own module, or one that holds nothing of another stage
    clone = copy.copy(module)
    # its own hook and child tables: engines that wrap the clone must not wrap the original
    clone.__dict__ = {k: (copy.copy(v) if isinstance(v, dict) else v) for k, v in module.__dict__.items()}
    for name, child in module._modules.items():
        if child is not None:
            clone._modules[name] = _pruned(child, f"{prefix}.{name}" if prefix else name, keep, drop)
    return clone


def _drop_in_place(module: nn.Module, drop: set[str]) -> None:
    for path in sorted(drop, key=lambda p: p.count(".")):
        parent_path, _, name = path.rpartition(".")
        try:
            parent = module.get_submodule(parent_path)
        except AttributeError:  # inside a module dropped already
            continue
        if isinstance(parent, PassThrough):
            continue
        setattr(parent, name, PassThrough(path, getattr(parent, name)))


def _device(device_mesh: DeviceMesh) -> torch.device:
    if device_mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_mesh.device_type, torch.accelerator.current_device_index())


def _sub_mesh(device_mesh: DeviceMesh) -> Callable[..., DeviceMesh]:
    # A stage receiving a DTensor (sequence parallel's hidden states, split over tp) rebuilds
    # it on the mesh its sender named: the same axes of this rank's own mesh
    def get_mesh(names: tuple[str, ...], layout: Any = None) -> DeviceMesh:
        return device_mesh[names[0]] if len(names) == 1 else device_mesh[names]

    return get_mesh


def apply_pipeline(plan: Plan, module: nn.Module, device_mesh: DeviceMesh) -> Plan:
    """Keep this rank's stages of ``module``, parallelize each, and wrap it in a ``PipelineStage``.

    Returns:
        The plan of this rank's stages (`stage_plan`), which materialize and the optimizer use.
    """
    from torch.distributed.pipelining import PipelineStage

    pipeline = plan.config.pipeline
    if pipeline is None:
        raise ShardingError("apply_pipeline needs a plan with a pipeline axis")
    pp = pipeline.size(plan.mesh)
    pp_mesh = device_mesh[pipeline.axis]
    pp_rank = pp_mesh.get_local_rank()
    n_stages = len(pipeline.stages)
    mine = rank_stages(pp_rank, pp, pipeline.stages_per_rank, pipeline.schedule)
    packing, gate = packed_forward(module), ScheduleGate()
    others = {m for s in range(n_stages) if s not in mine for m in pipeline.stages[s]}
    _drop_in_place(module, others)
    stage_modules: list[tuple[int, nn.Module]] = []
    for stage in mine:
        if len(mine) == 1:
            view = module
        else:
            own = set(pipeline.stages[stage])
            siblings = {m for s in mine if s != stage for m in pipeline.stages[s]}
            view = _pruned(module, "", own, siblings)
        stage_modules.append((stage, view))
    device = _device(device_mesh)
    built = []
    for stage, view in stage_modules:
        local = without_pipeline(stage_plan(plan, (stage,)))
        apply_tensor_parallel(local, view, device_mesh)
        # the stage's experts, split over the ep axis: every micro-batch's forward (and its
        # backward) dispatches its tokens among the ranks that run this stage
        apply_expert_parallel(local, view, device_mesh)
        retie(local, view)
        apply_checkpointing(local, view)
        apply_data_parallel(local, view, device_mesh, "")
        reduce_whole_grads(local, view, device_mesh)
        refuse_uneven_sequences(local, view)
        run_as_stage(view, stage, first=stage == 0, packing=packing, gate=gate)
        built.append(
            PipelineStage(
                view, stage, n_stages, device, group=pp_mesh.get_group(), get_mesh=_sub_mesh(device_mesh)
            )
        )
    if len(mine) > 1:
        refuse_direct_calls(module, mine)
    last_rank = pipeline.coordinate_of(n_stages - 1, plan.mesh)
    pipelined = Pipelined(plan, tuple(built), pp_mesh.get_group(), last_rank, packing, gate)
    module.__dict__["_fs_pipeline"] = pipelined
    _PIPELINED.add(module)
    return without_pipeline(stage_plan(plan, mine))


def _schedule(pipelined: Pipelined, inputs: torch.Tensor, keywords: dict[str, torch.Tensor] | None) -> Any:
    """The schedule for a batch of ``inputs`` (and ``keywords``): made again when their shapes change.

    Torch's schedule sizes the buffers its stages send and receive from its first step's
    micro-batches and reuses them; a batch of other rows or another length would then send
    more or fewer bytes than the next stage waits for (a hang, or gloo aborting the process).
    A new schedule sizes them again; every pp rank passes the same batch, so all make one.
    """
    from torch.distributed.pipelining import schedules

    layout = tuple((name, tuple(t.shape), t.dtype) for name, t in {"": inputs, **(keywords or {})}.items())
    if layout != pipelined.batch_layout:
        _check_first_stage_takes(pipelined, inputs, keywords or {})
        pipelined.schedule, pipelined.batch_layout = None, layout
    if pipelined.schedule is None:
        pipeline = pipelined.plan.config.pipeline
        assert pipeline is not None  # (apply_pipeline made it of a plan with one)
        schedule_class = getattr(schedules, SCHEDULES[pipeline.schedule])
        single = pipeline.schedule in SINGLE_STAGE
        stages: Any = pipelined.stages[0] if single else list(pipelined.stages)
        try:
            pipelined.schedule = schedule_class(
                stages,
                n_microbatches=pipeline.microbatches,
                loss_fn=pipelined.loss_of_microbatch,
                scale_grads=True,
            )
        except (ValueError, RuntimeError, AssertionError) as error:
            raise ShardingError(
                f"torch's {schedule_class.__name__} refuses {pipeline.microbatches} micro-batches over "
                f"{len(pipeline.stages)} stages: {error}"
            ) from None
    return pipelined.schedule


def _check_first_stage_takes(
    pipelined: Pipelined, inputs: torch.Tensor, keywords: dict[str, torch.Tensor]
) -> None:
    """Refuse on every pp rank a batch layout the first stage cannot run (float ids, a dim too few).

    Inside the schedule the first stage would raise alone, and the other ranks wait for what it
    sends until the process group's timeout. Run once a layout, like the new schedule it needs:
    the first stage's forward on one micro-batch, without gradients or a draw from the random
    generators the step's forward uses. Running out of memory is no refusal: the first stage's rank
    raises its error as it is, the other pp ranks one of its class that names that rank.
    """
    pipeline = pipelined.plan.config.pipeline
    assert pipeline is not None  # (apply_pipeline made it of a plan with one)
    first = next((stage for stage in pipelined.stages if stage.is_first), None)
    failure: BaseException | None = None
    if first is not None:
        one = {name: t.tensor_split(pipeline.microbatches)[0] for name, t in {"": inputs, **keywords}.items()}
        generators = [first.device] if first.device.type != "cpu" else []
        forked = torch.random.fork_rng(devices=generators, device_type=first.device.type)
        try:
            with torch.no_grad(), forked, pipelined.gate.running():
                first.submod(one.pop(""), **one)
        except Exception as error:  # any: it is raised on every pp rank below
            failure = error
    source = pipeline.coordinate_of(0, pipelined.plan.mesh)
    raise_first_stage_failure(failure, inputs, pipelined.group, pipelined.stages[0].device, source)


def _grads_set_aside(pipelined: Pipelined) -> contextlib.AbstractContextManager[None]:
    """Run a schedule step with the stages' gradients set aside, then add them back.

    Every torch schedule ends a step, ``eval`` included, by dividing each parameter's
    ``.grad`` by the micro-batch count (``perform_reduce_grad``): gradients accumulated
    before the step (an earlier batch's, kept for accumulation) would be divided too.
    """
    return gradients_set_aside(p for stage in pipelined.stages for p in stage.submod.parameters())


@contextlib.contextmanager
def _evaluating(pipelined: Pipelined) -> Iterator[None]:
    """Let a schedule's ``eval`` run over two adjacent stages of this rank (a V-shaped schedule's).

    Torch's runtime schedules keep their backward actions in ``eval``: each stage's backward returns
    at once, but between two stages of one rank the schedule then hands the gradient over by
    ``get_local_bwd_output``, which asserts the stage has a backward (torch 2.13), and the other
    ranks wait for this one forever. With no backward there is no gradient to hand over.
    """
    for stage in pipelined.stages:
        stage.get_local_bwd_output = lambda mb_index: ()
        stage.set_local_bwd_input = lambda outputs, mb_index: None
    try:
        yield
    finally:
        for stage in pipelined.stages:
            del stage.get_local_bwd_output, stage.set_local_bwd_input


def _ends(pipelined: Pipelined) -> tuple[bool, bool]:
    """Whether this rank runs the first stage, and the last."""
    return any(s.is_first for s in pipelined.stages), any(s.is_last for s in pipelined.stages)


def _raise_on_every_rank(pipelined: Pipelined) -> None:
    """Raise on every pp rank what a stage's forward or loss_fn raised in the step just run, if anything."""
    pipeline = pipelined.plan.config.pipeline
    assert pipeline is not None  # (apply_pipeline made it of a plan with one)
    try:
        raise_any_failure(pipelined.group, pipeline.stages, pipelined.gate.failure, pipelined.failure)
    except BaseException:
        # its stages' buffers may be sized from a failed stage's stand-in: the next step makes another
        pipelined.schedule, pipelined.batch_layout = None, None
        raise


def _mean_from_last_stage(pipelined: Pipelined, losses: list[torch.Tensor], last: bool) -> torch.Tensor:
    """The mean micro-batch loss on every pp rank; while catching, a stage's failure raised on each."""
    if pipelined.catching:
        # only while catching: the device is waited for on a layout's first step, not on each
        _raise_on_every_rank(pipelined)
    # float32 on every rank: under precision="bf16-true" the default dtype is bfloat16; a
    # loss-parallel loss is a replicated DTensor, which c10d cannot broadcast: its value
    device = pipelined.stages[0].device
    mean = torch.stack([plain_loss(x).float() for x in losses]).mean() if last else torch.zeros(())
    sent = mean.float().to(device)
    dist.broadcast(sent, group=pipelined.group, group_src=pipelined.last_stage_rank)
    return sent


def _returning(run: Callable[..., Any], outputs: bool) -> dict[str, Any]:
    """``return_outputs=outputs`` for a schedule's ``step``/``eval`` where torch takes it.

    A schedule without the keyword would hand it to the model (docs/torch-versions.md).

    Examples:
        >>> _returning(lambda *args, target=None, return_outputs=True, **kwargs: None, False)
        {'return_outputs': False}
        >>> _returning(lambda *args, target=None, losses=None, **kwargs: None, False)
        {}
    """
    taken = "return_outputs" in inspect.signature(run).parameters
    return {"return_outputs": outputs} if taken else {}


def scheduled_loss(
    pipelined: Pipelined,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    forward_only: bool = False,
    keywords: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the schedule once: forward and backward, or forward only (``schedule.eval``, under no_grad).

    ``keywords``: tensors of the batch's rows for the model's forward, which every stage runs
    (packed rows' ``positions`` and ``document_ids``); each micro-batch's rows of them reach
    every stage of every pp rank. The caller checks packed rows whole first, on every rank, and runs
    this within `values_checked` (the step's ``checked_pipelined_rows``): a stage's forward then
    checks its micro-batch's shapes alone.

    Returns:
        The mean micro-batch loss, on every pp rank.
    """
    schedule = _schedule(pipelined, inputs, keywords)
    run = schedule.eval if forward_only else schedule.step
    pipelined.loss = loss_fn
    checked = (pipelined.batch_layout, tuple(targets.shape), targets.dtype, forward_only)
    pipelined.catching, pipelined.failure = checked not in pipelined.loss_checked, None
    first, last = _ends(pipelined)
    losses: list[torch.Tensor] = []
    # return_outputs=False: else the last stage keeps every micro-batch's output (the
    # logits) until the next step, and concatenates them at the end, for a result unused
    kwargs = _returning(run, False) | (keywords or {})
    if last:
        kwargs |= {"target": targets, "losses": losses}
    evaluating = _evaluating(pipelined) if forward_only else contextlib.nullcontext()
    with _grads_set_aside(pipelined), evaluating, pipelined.gate.running(pipelined.catching):
        if first:
            run(inputs, **kwargs)
        else:
            run(**kwargs)
    loss = _mean_from_last_stage(pipelined, losses, last)
    pipelined.loss_checked.add(checked)
    pipelined.catching = False
    return loss


def _no_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), device=targets.device)


def pipeline_eval_outputs(
    pipelined: Pipelined, inputs: torch.Tensor, keywords: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """Run the schedule forward only; the last stage's whole outputs, sent to every pp rank.

    Every rank passes its batch: the last stage sizes stand-in targets from it, since torch's
    schedule computes a loss wherever it has a loss function. ``keywords``: as `scheduled_loss`'s.
    """
    schedule = _schedule(pipelined, inputs, keywords)
    pipelined.loss = _no_loss
    first, last = _ends(pipelined)
    device = pipelined.stages[0].device
    kwargs = _returning(schedule.eval, True) | (keywords or {})
    if last:
        kwargs["target"] = torch.zeros(inputs.shape[0], device=device)
    # a layout's first run catches a later stage's failure, as `scheduled_loss` does
    checked = (pipelined.batch_layout, "outputs")
    catching, pipelined.failure = checked not in pipelined.loss_checked, None
    with _grads_set_aside(pipelined), _evaluating(pipelined), pipelined.gate.running(catching):
        outputs = schedule.eval(inputs, **kwargs) if first else schedule.eval(**kwargs)
    if catching:
        _raise_on_every_rank(pipelined)
        pipelined.loss_checked.add(checked)
    if last:
        full = getattr(outputs, "full_tensor", None)  # a DTensor from a tensor-parallel head
        outputs = full() if callable(full) else outputs
        if not isinstance(outputs, torch.Tensor):
            raise ShardingError(
                f"the pipeline's last stage returned a {type(outputs).__name__}; evaluating under a "
                "pipeline plan needs a model whose output is one tensor"
            )
    header: list[Any] = [(tuple(outputs.shape), outputs.dtype) if last else None]
    source = pipelined.last_stage_rank
    dist.broadcast_object_list(header, group=pipelined.group, group_src=source, device=device)
    shape, dtype = header[0]
    if not last:
        outputs = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(outputs, group=pipelined.group, group_src=pipelined.last_stage_rank)
    return outputs
