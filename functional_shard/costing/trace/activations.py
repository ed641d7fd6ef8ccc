"""What a model keeps for backward, traced on meta tensors at one rank's local shapes.

`trace_activations` runs the model's forward and backward on fake tensors: no memory, no process
group. Every parameter has its compute shape on the rank, sequence parallel's moves are re-enacted at
module edges, and checkpointed modules run under torch's own checkpoint, as `functional_shard.apply`
runs them.

Kept: every storage made during the forward that is still alive once it has returned, parameters and
their casts excluded (`functional_shard.runtime.measure.kept_activation_bytes` counts the same in real
runs). Repeated layers run once and twice, the rest worked out (`functional_shard.costing.trace.repeats`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_map_only

from functional_shard.core.errors import PlanError, ShardingError, bullets
from functional_shard.core.sequence import check_sequence_length, check_step_tokens
from functional_shard.core.validate import entry_point
from functional_shard.costing.time.documents import RowDocuments, cp_rank_of, row_documents
from functional_shard.planning.pipeline.stages import stage_finder
from functional_shard.planning.plan.json_format import config_value_problems
from functional_shard.planning.tp.styles import titan_expert_names

from .checkpointing import SAVED_OPS, checkpointed, selective_context
from .context_attention import context_parallel_attention
from .counting import Births, Flops, kept_bytes_by_owner, recomputed_bytes, storage_key
from .cuda_kernels import cuda_kernels
from .fake_parameters import FakeParameters
from .model_inputs import (
    check_model_and_plan,
    flex_on_fake_cpu,
    is_hf,
    model_inputs,
    tensors,
    unpacked_sequences,
)
from .model_inputs import first_tensor as _first_tensor  # the name the stage helpers below call
from .rank_experts import rank_experts
from .repeats import NotPassableError, extrapolated, left_out_layers, passing_on, reached, repeated_layers
from .results import PER_STEP, ActivationTrace, counts_of, regroup
from .routing import check_expert_imbalance, is_traced_titan_experts
from .sequence_edges import check_sequence_parallel, sequence_parallel

# ActivationTrace and regroup live in results, SAVED_OPS and selective_context in
# checkpointing; they are named here too, where the trace's users find them
__all__ = ["SAVED_OPS", "ActivationTrace", "regroup", "selective_context", "trace_activations"]


@contextlib.contextmanager
def _stage_owner(
    modules: Mapping[str, nn.Module],
    stage_modules: Mapping[str, int],
    stacks: list[list[int]],
    outputs: dict[str, int],
) -> Iterator[None]:
    """While a stage's module runs its forward, its index is on top of each of ``stacks``.

    ``outputs`` gets the bytes of each stage module's (first) output tensor.
    """

    def enter(stage: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            for stack in stacks:
                stack.append(stage)

        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        for stack in stacks:
            if stack:
                stack.pop()
        first = _first_tensor(output)
        if isinstance(first, torch.Tensor):
            outputs[names[module]] = first.numel() * first.element_size()

    names = {modules[path]: path for path in stage_modules if path in modules}

    handles = []
    try:
        for path, stage in stage_modules.items():
            module = modules.get(path)
            if module is not None:
                handles.append(module.register_forward_pre_hook(enter(stage)))
                handles.append(module.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True, kw_only=True)
class _RunSetup:
    """What every run of one trace shares: the model, its fake parameters, the call and the rank."""

    model: nn.Module
    # every run walks the modules (a 70B model has over a thousand): walked once per trace
    modules: dict[str, nn.Module]
    parameters: FakeParameters
    # the plan the runs follow at first: less what no run reaches (`repeats.reached`)
    plan: Any
    tp_size: int
    expert_imbalance: float
    rank: int
    # with ``stages``: how many, each stage module's stage, each stage's last module
    stages: int = 0
    stage_modules: Mapping[str, int] = field(default_factory=dict)
    stage_last: tuple[str, ...] = ()
    # the forward's call (`model_inputs.model_inputs`): this rank's tokens of each sequence
    # (a cp-th of them under context parallel, whose attention sees ``cp`` times as many)
    batch: int
    seq: int
    inputs: Any
    dtype: torch.dtype | None
    cp: int = 1
    cuda: bool = False  # torch's CUDA kernel choices (`cuda_kernels.cuda_kernels`)
    documents: RowDocuments | None = None  # packed rows: attention counted per document


class _Run:
    """One rank's forward and backward on fake tensors, some repeated layers left out."""

    def __init__(self, setup: _RunSetup) -> None:
        self.setup = setup
        # the plan the runs follow: the whole one once the model is traced whole
        self.plan = setup.plan
        self.repeats_are_passable = True

    def _not_passable(self) -> None:
        self.repeats_are_passable = False

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The traced parameters in the model and its experts routed, for the runs inside.

        Swapped in once for all the runs of one trace, and through backward (checkpoint recomputes with them).
        """
        setup = self.setup
        with (
            _reparametrize_module(setup.model, setup.parameters.state, tie_weights=False, strict=False),
            rank_experts(setup.modules, setup.expert_imbalance, self.plan, setup.rank),
            cuda_kernels(setup.cuda),
        ):
            yield

    def trace(
        self, groups: list[tuple[str, ...]], doubled: tuple[int, ...] = (), *, backward: bool = True
    ) -> dict[str, Any]:
        """Bytes kept and flops of one forward and backward, repeated layers partly left out.

        Each group runs its first member (its first two where ``doubled``); the rest pass through.
        """
        setup, params = self.setup, self.setup.parameters.params
        model = setup.model
        with setup.parameters.fake:
            # token ids reach the embedding whole; the embedding's output is what sequence parallel splits
            args, kwargs = model_inputs(model, setup.batch, setup.seq, setup.inputs, setup.dtype)
        if is_hf(model):
            kwargs.setdefault("use_cache", False)
        births = Births()
        for tensor in tensors((args, kwargs)):
            births.note(tensor)
        excluded = {StorageWeakRef(p.untyped_storage()) for p in params}
        flops = _flops_knowing_weights(params, setup.documents)
        outputs: dict[str, int] = {}
        with self._running(groups, doubled, births, flops, outputs) as per_step:
            with flops, births:
                raw = self._forward(groups, args, kwargs)
            output = _first_tensor(raw)
            del raw, args, kwargs
            if not isinstance(output, torch.Tensor):
                raise ShardingError(f"trace_activations: {type(model).__name__}'s forward returned no tensor")
            output_key = {StorageWeakRef(output.untyped_storage())}
            for tensor in per_step:  # held once a step, not once a micro-batch
                births.owner[storage_key(tensor)] = PER_STEP
            by_owner = kept_bytes_by_owner(births, excluded | output_key, collect=1)
            # before the backward, whose recomputes make and free them again
            recomputed = recomputed_bytes(flops.packed, collect=0)
            output_counts = (output.untyped_storage().nbytes(), output.numel())
            if backward:
                flops.backward = True
                seed = torch.ones_like(output)  # the loss's gradient: the loss's own bytes are counted apart
                with flops:
                    if output.requires_grad:
                        torch.autograd.backward(output, seed)
        for param in params:
            param.grad = None
        if not backward:
            _count_recompute_in_forward(flops, self.plan.config.checkpoint_policy)
        return counts_of(
            flops,
            by_owner,
            recomputed=recomputed,
            output=output_counts,
            stages=setup.stages,
            stage_output_bytes=[outputs.get(last, 0) for last in setup.stage_last],
        )

    @contextlib.contextmanager
    def _running(
        self,
        groups: list[tuple[str, ...]],
        doubled: tuple[int, ...],
        births: Births,
        flops: Flops,
        outputs: dict[str, int],
    ) -> Iterator[Any]:
        """Inside, the model runs as on its rank, on fake tensors.

        Each stage's output bytes go to ``outputs``; yields the tensors cp's attention holds once a step.
        """
        setup, config = self.setup, self.plan.config
        model = setup.model
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                checkpointed(model, tuple(config.checkpointed), config.checkpoint_policy, flops)
            )
            stack.enter_context(passing_on(setup.modules, groups, doubled, broken=self._not_passable))
            stack.enter_context(sequence_parallel(model, self.plan, setup.tp_size, setup.seq))
            # "auto" counts as the all-gather engine here, as in `cost` (the estimate
            # hands over the engine its hardware runs)
            context = config.context
            per_step = stack.enter_context(
                context_parallel_attention(
                    setup.cp,
                    context.engine if context else "auto",
                    cp_rank=self.plan.mesh.coords(setup.rank)[context.axis] if context else 0,
                    load_balance=context.load_balance if context else True,
                    packed=setup.documents is not None,
                )
            )
            stack.enter_context(unpacked_sequences(model))
            stack.enter_context(flex_on_fake_cpu())
            owners = [births.running, flops.running]
            stack.enter_context(_stage_owner(setup.modules, setup.stage_modules, owners, outputs))
            stack.enter_context(setup.parameters.fake)
            yield per_step

    def _forward(self, groups: list[tuple[str, ...]], args: Any, kwargs: dict[str, Any]) -> Any:
        """The model's forward; a failure told as the inputs not fitting it, or a left-out layer's."""
        model = self.setup.model
        try:
            return model(*args, **kwargs)
        except (ShardingError, NotPassableError):
            raise
        except Exception as error:
            if groups and not self.repeats_are_passable:  # a left-out layer's stand-in broke it
                raise NotPassableError from error
            raise _forward_failed(
                model, args, kwargs, error, self.plan.config.tensor_parallel_axes
            ) from error


def _flops_knowing_weights(params: list[torch.Tensor], documents: RowDocuments | None) -> Flops:
    """A `Flops` counter told the 2-D parameters: it tells weights' gradients from inputs' by them."""
    flops = Flops(documents)
    for param in params:
        if param.dim() == 2:
            flops.weight_shapes |= {tuple(param.shape), tuple(param.shape[::-1])}
            flops.weights.add(storage_key(param))
    return flops


def _forward_failed(
    model: nn.Module, args: Any, kwargs: dict[str, Any], error: Exception, tensor_parallel: tuple[str, ...]
) -> ShardingError:
    shapes = tree_map_only(torch.Tensor, lambda t: f"{t.dtype}{list(t.shape)}", (args, kwargs))
    split = (
        "; if they do, the plan may split what the model cannot run at its local "
        "shapes (attention heads a tensor-parallel size does not divide, say): "
        "fs.check_runnable(plan, model) names it"
        if tensor_parallel
        else ""
    )
    return ShardingError(
        f"trace_activations: {type(model).__name__}'s forward failed on inputs {shapes}: "
        f"{type(error).__name__}: {error}. Pass inputs= that fit its forward (a tensor, a "
        f"tuple or a dict of keyword arguments){split}"
    )


def _count_recompute_in_forward(flops: Flops, policy: str) -> None:
    """Without a backward, the recompute flops: what the forward's checkpointed modules would re-run."""
    # torch's checkpoint stops recomputing once every saved tensor is back; selective
    # checkpointing hands back the outputs it keeps (`checkpointing.keeps`) instead of running them
    if policy != "full":  # selective ones
        flops.counts["recompute"] = flops.inside["all"] - flops.inside["saved"]
        flops.attention["recompute"] = flops.attention_inside["all"] - flops.attention_inside["saved"]
        flops.attention_kernel["recompute"] = flops.kernel_inside["all"] - flops.kernel_inside["saved"]
    else:
        flops.counts["recompute"] = flops.rerun
        # (a block's attention runs before the ops that save its output: re-run too)
        flops.attention["recompute"] = flops.attention_inside["all"]
        flops.attention_kernel["recompute"] = flops.kernel_inside["all"]
    flops.memory["recompute"] = flops.memory_rerun


def _stage_holder(plan: Any, rank: int) -> Any:
    """``path -> rank`` to read a parameter's local shape at.

    Under a pipeline, ``rank`` moved to the pp coordinate of the stage holding the parameter.
    """
    pipeline = plan.config.pipeline
    if pipeline is None or not pipeline.stages:
        return lambda path: rank
    stage_of_module = {m: i for i, modules in enumerate(pipeline.stages) for m in modules}

    def holder(path: str) -> int:
        module = path.rpartition(".")[0]
        while module and module not in stage_of_module:
            module = module.rpartition(".")[0]
        if module not in stage_of_module:
            return rank
        return pipeline.moved(plan.mesh, rank, pipeline.coordinate_of(stage_of_module[module], plan.mesh))

    return holder


@entry_point
def trace_activations(
    model: nn.Module,
    plan: Any,
    *,
    batch: int,
    seq: int,
    rank: int | None = None,
    inputs: Any = None,
    expert_imbalance: float = 1.0,
    backward: bool = True,
    stages: tuple[tuple[str, ...], ...] | None = None,
    cuda: bool = False,
    documents: Any = None,
) -> ActivationTrace:
    """Bytes ``model`` keeps for backward and its flops on one rank, traced on meta tensors.

    Args:
        model: any ``nn.Module`` (meta device is enough); it is not changed.
        plan: the `functional_shard.Plan` for ``model`` (its cp ``"auto"`` engine traces as ``"all_gather"``).
        batch: sequences per data-parallel rank (the micro-batch).
        seq: sequence length.
        rank: the rank whose local shapes are traced (default 0).
        inputs: the forward's arguments (a tensor, a tuple, or a dict of keywords); default: token ids.
        expert_imbalance: expert 0's share of routed tokens over an even share (`routing.expert_loads`).
        backward: run the backward; without it ``backward_flops`` is 0 and ``recompute_flops`` a bound.
        stages: each pipeline stage's module paths; the trace then counts per stage, for one micro-batch.
        cuda: trace the kernels torch picks on CUDA (`functional_shard.costing.trace.cuda_kernels`).
        documents: packed rows' document lengths (`functional_shard.costing.time.documents.row_documents`):
            attention over a row is counted per document; under cp, ``rank``'s share of each row as
            `functional_shard.core.sequence.document_ranges` cuts it (by default the busiest cp rank's),
            run by the all-gather engine under a boolean mask a row.

    Returns:
        An `ActivationTrace`.

    Raises:
        ShardingError: inputs that do not fit the model, an unknown checkpoint policy, a bad imbalance,
            ``documents`` malformed or of more than ``seq`` tokens a row, or cp not dividing ``seq``.
        PlanError: under sequence parallel, tp does not divide ``seq`` or a layer sp cannot run;
            torchtitan's grouped experts the trace does not run (0.3.0's, or under expert parallelism).

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
        >>> trace = fs.trace_activations(model, plan, batch=2, seq=8)
        >>> trace.output_bytes == 2 * 8 * 256 * 4
        True
    """
    check_model_and_plan(model, plan, "trace_activations")
    check_step_tokens(batch, seq)
    config = plan.config
    cp_rank = cp_rank_of(plan, rank)  # packed rows: whose share is counted; None: the busiest
    rank = 0 if rank is None else rank
    checkpointed = tuple(config.checkpointed)
    if any(i != o and (not o or i.startswith(f"{o}.")) for o in checkpointed for i in checkpointed):
        backward = True  # an inner module's forward runs again in the outer one's recompute
    modules = dict(model.named_modules())
    dtype = getattr(torch, config.param_dtype) if config.param_dtype else None
    tp_size = config.tp_size(plan.mesh)
    cp = config.cp_size(plan.mesh)
    _check_traceable(plan, modules, seq, expert_imbalance, packed=documents is not None)
    rows = (
        None
        if documents is None
        else row_documents(documents, seq, cp=cp, cp_rank=cp_rank, who="trace_activations")
    )

    # fake CPU tensors: no memory, and torch picks the fused attention kernels it runs for real
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    parameters = FakeParameters(model, plan, holder=_stage_holder(plan, rank), dtype=dtype, fake=fake)
    # repeated layers (a transformer's blocks) are traced once and twice: each further one
    # adds what the second added, so a 70B model traces as fast as a 2-layer one
    groups = repeated_layers(model, plan, parameters.local)
    left_out = left_out_layers(groups, tuple(range(len(groups))))
    parameters.refill(left_out)
    stage_modules = {path: index for index, paths in enumerate(stages or ()) for path in paths}
    run = _Run(
        _RunSetup(
            model=model,
            modules=modules,
            parameters=parameters,
            plan=reached(plan, left_out),
            tp_size=tp_size,
            expert_imbalance=expert_imbalance,
            rank=rank,
            stages=len(stages or ()),
            stage_modules=stage_modules,
            stage_last=tuple(paths[-1] if paths else "" for paths in stages or ()),
            batch=batch,
            seq=seq // cp,
            inputs=inputs,
            dtype=dtype,
            cp=cp,
            cuda=cuda,
            documents=rows,
        )
    )

    stage_of = stage_finder(tuple(tuple(paths) for paths in stages or ()))

    def stages_of(member: str) -> range | tuple[int, ...]:
        # what a repeated layer adds goes to its stage; outside every stage's modules, to each
        owner = stage_of(member, module=True)
        return range(len(stages or ())) if owner is None else (owner,)

    try:
        with run.swapped():
            first = run.trace(groups, backward=backward)
            seconds = [run.trace(groups, (index,), backward=backward) for index in range(len(groups))]
        counts = extrapolated(first, seconds, groups, stages_of=stages_of)
    except NotPassableError:
        run.repeats_are_passable = False
    if not run.repeats_are_passable:  # a layer's output is not shaped like its input: trace them all
        parameters.refill(())
        run.plan = plan
        with run.swapped():
            counts = run.trace([], backward=backward)
    fields: dict[str, Any] = {
        key: tuple(value) if isinstance(value, list) else value for key, value in counts.items()
    }
    return ActivationTrace(rank=rank, batch=batch, seq=seq, **fields)


def _check_titan_experts(plan: Any, modules: dict[str, nn.Module]) -> None:
    """Refuse torchtitan's grouped experts where the trace does not run them as torchtitan would."""
    dispatched = set(plan.config.expert_modules)
    for path, module in modules.items():
        if titan_expert_names(module) is None:
            continue
        what = f"trace_activations: {path} ({type(module).__name__}) holds torchtitan's grouped experts"
        if not is_traced_titan_experts(module):
            raise PlanError(
                f"{what} under 0.3.0's names (w1, w2, w3), whose forward pads each expert's rows to a "
                "multiple of 8 (generate_permute_indices), which the trace does not re-enact; it runs "
                "torchtitan's main-branch experts (w1_EFD, w2_EDF, w3_EFD). plan.cost() counts this plan's "
                "memory at rest and its traffic"
            )
        if path in dispatched:
            raise PlanError(
                f"{what}, which expert parallelism does not run (functional_shard's experts engine splits "
                "them by tensor parallel only). Leave them to tensor or data parallelism, or use "
                "transformers' expert layout under fs.ep"
            )


def _check_traceable(
    plan: Any, modules: dict[str, nn.Module], seq: int, expert_imbalance: float, *, packed: bool
) -> None:
    """Refuse a plan the trace cannot run at ``seq`` tokens (`trace_activations`' Raises)."""
    config = plan.config
    if problems := config_value_problems(config):  # a config built by hand
        raise ShardingError(
            bullets(
                "trace_activations: the plan's config holds values nothing runs:",
                [f"plan.{problem}" for problem in problems],
                "set each to a value named, or make the plan with fs.shard(model, mesh, policy)",
            )
        )
    check_expert_imbalance(expert_imbalance)
    _check_titan_experts(plan, modules)
    cp = config.cp_size(plan.mesh)
    if config.context is not None and cp > 1:
        # packed rows are cut into cp shares by work (`document_ranges`), never into 2·cp chunks
        check_sequence_length(seq, cp, load_balance=config.context.load_balance and not packed)
    if config.sequence_parallel:
        check_sequence_parallel(modules, plan, seq // cp, config.tp_size(plan.mesh))
