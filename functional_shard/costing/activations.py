"""What a model keeps for backward, traced on meta tensors at one rank's local shapes.

`trace_activations` runs the model's forward (and backward, for flops) on the meta device:
no memory, no process group. Tensor parallel is reproduced by handing every parameter to
the forward at its compute shape on the rank (``Plan.local_shape(path, rank, "compute")``)
and by re-enacting at module edges what torch's parallel styles do to activations under
sequence parallel: a colwise layer all-gathers its sequence-split input (the gathered
input is what its matmul saves), a rowwise layer reduce-scatters its output over the
sequence. Checkpointed modules run under torch's own (non-reentrant) checkpoint, with
`selective_context` for ``policy="selective"``, exactly as `functional_shard.apply` runs them.

What counts as kept: every storage made during the forward (and the inputs) that is still
alive once the forward has returned and the caller holds only the output, parameters and
their casts excluded. That is what autograd's graph and checkpoint frames hold on to
until backward; `functional_shard.runtime.measure.saved_activation_bytes` counts the same thing
in real runs. Hugging Face models are called with ``use_cache=False``; their attention
implementation is the one the config names (``"sdpa"`` and ``"eager"`` both trace;
``"flex_attention"`` is refused: torch has no flex attention backward on CPU).

Repeated layers (siblings of one class, with the same local parameter shapes and the same
plan treatment, each handing on a tensor shaped like its input) are run once and twice,
the others passing their input on; each further layer adds what the second one added. A
model whose alike layers see other shapes, or alternate attention kinds (Hugging Face
``layer_types``), is traced whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map_only

from functional_shard.core.errors import ShardingError

from .routing import check_expert_imbalance
from .trace_checkpointing import SAVED_OPS, checkpointed, selective_context
from .trace_counting import Births, Flops, kept_bytes_by_owner, storage_key
from .trace_experts import rank_experts
from .trace_sequence_parallel import check_sequence_parallel, sequence_parallel

__all__ = ["SAVED_OPS", "ActivationTrace", "selective_context", "trace_activations"]

_aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class ActivationTrace:
    """What one rank's forward keeps for backward, and the flops of one micro-batch step.

    Attributes:
        rank: the rank traced.
        activation_bytes: bytes of unique storages kept for backward during the model call
            (parameters and their gathered/cast copies excluded; the output excluded).
        output_bytes: bytes of the model's output (logits, say).
        output_numel: elements of the model's output, whatever its dtype.
        forward_flops: flops of the forward: matmuls as torch's ``FlopCounterMode`` counts
            them, attention on every kernel as its full score matrix (`functional_shard.costing.flops`).
        backward_flops: flops of the backward, recompute excluded.
        recompute_flops: flops of checkpointed modules run again in backward.
        batch: sequences per data-parallel rank.
        seq: sequence length (global, before sequence parallel splits it).
        stage_activation_bytes: when traced with ``stages``, the activation bytes each
            pipeline stage keeps: storages made while one of its modules ran, plus those
            made outside every stage's modules (the inputs, the model's own code between
            them), which every stage's forward makes again.
        stage_forward_flops: per stage, forward flops of ops run inside its modules (ops
            outside them counted for every stage).
        stage_backward_flops: per stage, backward flops, shared out as the forward's are
            (autograd runs backward outside the modules' calls); repeated layers exactly.
        stage_recompute_flops: per stage, recompute flops shared out the same way.
        backward_weight_flops: of ``backward_flops``, the weights' gradients (the matmuls
            whose output has a 2-D parameter's shape): what zero-bubble schedules defer
            to their ``W`` step; the rest is the inputs' (``I``).
        stage_backward_weight_flops: per stage, shared out as the backward's.
        stage_output_bytes: per stage, the bytes of its last module's output: what it
            sends the next stage per micro-batch.
        stage_shared_bytes: of each stage's activation bytes, those made outside every
            stage's modules (counted in each).
        stage_shared_flops: of each stage's forward flops, those run outside them.
    """

    rank: int
    activation_bytes: int
    output_bytes: int
    output_numel: int
    forward_flops: int
    backward_flops: int
    recompute_flops: int
    batch: int
    seq: int
    stage_activation_bytes: tuple[int, ...] = ()
    stage_forward_flops: tuple[int, ...] = ()
    stage_backward_flops: tuple[int, ...] = ()
    stage_recompute_flops: tuple[int, ...] = ()
    backward_weight_flops: int = 0
    stage_backward_weight_flops: tuple[int, ...] = ()
    stage_output_bytes: tuple[int, ...] = ()
    stage_shared_bytes: int = 0
    stage_shared_flops: int = 0

    @property
    def step_flops(self) -> int:
        """Forward + backward + recompute flops."""
        return self.forward_flops + self.backward_flops + self.recompute_flops


def regroup(trace: ActivationTrace, groups: list[list[int]]) -> ActivationTrace:
    """A trace with ``stages=`` seen through coarser stages: new stage ``i`` is the old ``groups[i]``.

    Tracing each unit of work (embedding, each block, head) as its own stage once serves
    every cut into stages of whole units: what a stage keeps and computes is the sum of
    its units', what they all make outside their modules counted once per new stage.

    Examples:
        >>> trace = ActivationTrace(0, 30, 1, 1, 30, 60, 0, 1, 8, stage_activation_bytes=(11, 11, 11),
        ...     stage_forward_flops=(10, 10, 10), stage_backward_flops=(20, 20, 20),
        ...     stage_recompute_flops=(0, 0, 0), stage_output_bytes=(4, 4, 4), stage_shared_bytes=1)
        >>> merged = regroup(trace, [[0, 1], [2]])
        >>> merged.stage_activation_bytes, merged.stage_forward_flops, merged.stage_output_bytes
        ((21, 11), (20, 10), (4, 4))
    """
    shared_bytes, shared_flops = trace.stage_shared_bytes, trace.stage_shared_flops
    activation = tuple(
        sum(trace.stage_activation_bytes[u] - shared_bytes for u in group) + shared_bytes for group in groups
    )
    forward = [
        sum(trace.stage_forward_flops[u] - shared_flops for u in group) + shared_flops for group in groups
    ]
    return dataclasses.replace(
        trace,
        stage_activation_bytes=activation,
        stage_forward_flops=tuple(forward),
        stage_backward_flops=tuple(_shared_out(sum(trace.stage_backward_flops), forward)),
        stage_recompute_flops=tuple(_shared_out(sum(trace.stage_recompute_flops), forward)),
        stage_backward_weight_flops=tuple(_shared_out(sum(trace.stage_backward_weight_flops), forward)),
        stage_output_bytes=tuple(trace.stage_output_bytes[group[-1]] for group in groups),
    )


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


def _stage_of_path(path: str, stage_modules: Mapping[str, int]) -> int:
    while True:
        if path in stage_modules:
            return stage_modules[path]
        if not path:
            return -1
        path = path.rpartition(".")[0]


def _per_stage(by_owner: Mapping[int, int], stages: int) -> list[int]:
    # what no stage's module made (inputs, the model's code between its modules) every stage makes
    shared = by_owner.get(-1, 0)
    return [by_owner.get(stage, 0) + shared for stage in range(stages)]


def _shared_out(total: int, weights: list[int]) -> list[int]:
    whole = sum(weights)
    if not whole:
        return [total // max(len(weights), 1)] * len(weights)
    return [round(total * w / whole) for w in weights]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def _first_tensor(output: Any) -> Any:
    # Hugging Face models return a ModelOutput: its logits (or first tensor) is the output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, torch.Tensor):
        return output
    tensors = _tensors(output.to_tuple() if hasattr(output, "to_tuple") else output)
    return tensors[0] if tensors else output


@contextlib.contextmanager
def _unpacked_sequences(model: nn.Module) -> Iterator[None]:
    # Hugging Face reads position ids' values to find packed sequences; fake tensors have
    # none, so it assumes packing and builds a full mask where a real run (whole sequences)
    # builds none and lets SDPA run causal, with grouped-query heads unrepeated
    masking: Any = None
    if _is_hf(model):
        with contextlib.suppress(ImportError):
            import transformers.masking_utils as masking
    original = getattr(masking, "find_packed_sequence_indices", None)
    if masking is None or original is None:
        yield
        return
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _inputs(
    model: nn.Module, batch: int, seq: int, inputs: Any, dtype: torch.dtype | None
) -> tuple[Any, Any]:
    def to_meta(tensor: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        return torch.empty(tensor.shape, dtype=cast)

    if inputs is None:
        return (torch.empty(batch, seq, dtype=torch.long),), {}
    if isinstance(inputs, torch.Tensor):
        return (to_meta(inputs),), {}
    if isinstance(inputs, tuple | list):
        return tuple(tree_map_only(torch.Tensor, to_meta, list(inputs))), {}
    if isinstance(inputs, Mapping):
        return (), dict(tree_map_only(torch.Tensor, to_meta, dict(inputs)))
    raise ShardingError(
        f"trace_activations(inputs={type(inputs).__name__}): pass a tensor, a tuple of them or a dict of "
        "keyword arguments for the model's forward"
    )


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and type(model).__module__.startswith("transformers.")


def _repeats(model: nn.Module, plan: Any, state: Mapping[str, torch.Tensor]) -> list[tuple[str, ...]]:
    """Sibling modules of one class, local parameter shapes and plan treatment, 3 or more of them."""
    config = plan.config
    layer_types = getattr(getattr(model, "config", None), "layer_types", None) or ()
    if len(set(layer_types)) > 1:
        return []  # e.g. sliding-window and full attention alternate: same shapes, other work

    # the styled and checkpointed paths under each module, relative to it, in plan order
    # (indexed once: scanning every style for every module was quadratic in the layers)
    def owners(path: str) -> Iterator[tuple[str, str]]:
        parts = path.split(".")
        for end in range(1, len(parts) + 1):
            owner = ".".join(parts[:end])
            yield owner, path.removeprefix(owner)

    styles_under: dict[str, list[tuple[str, str]]] = {}
    for styled, style, _ in config.tp_styles:
        for owner, relative in owners(styled):
            styles_under.setdefault(owner, []).append((relative, style))
    checkpointed_under: dict[str, list[str]] = {}
    for checkpointed_path in config.checkpointed:
        for owner, relative in owners(checkpointed_path):
            checkpointed_under.setdefault(owner, []).append(relative)

    # each module's parameters and buffers, relative to it, in its own named_parameters'
    # order (the model's pre-order walk, cut at the module): one walk of the model, not
    # one per module and level (a fifth of a 405B model's trace)
    def index(named: Iterator[tuple[str, torch.Tensor]], *read: Any) -> dict[str, list[tuple[Any, ...]]]:
        under: dict[str, list[tuple[Any, ...]]] = {}
        for full, tensor in named:
            entry = tuple(f(full, tensor) for f in read)
            dot = full.find(".")
            while dot >= 0:
                under.setdefault(full[:dot], []).append((full[dot + 1 :], *entry))
                dot = full.find(".", dot + 1)
        return under

    params_under = index(
        model.named_parameters(remove_duplicate=False),
        lambda full, _: tuple(state[full].shape),
        lambda full, _: state[full].dtype,
    )
    buffers_under = index(model.named_buffers(remove_duplicate=False), lambda _, buffer: tuple(buffer.shape))

    def treatment(path: str, module: nn.Module) -> Any:
        shapes = tuple(params_under.get(path, ()))
        buffers = tuple(buffers_under.get(path, ()))
        styles = tuple(styles_under.get(path, ()))
        checkpointed = tuple(checkpointed_under.get(path, ()))
        return type(module), shapes, buffers, styles, checkpointed

    groups: list[tuple[str, ...]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = [(f"{prefix}{name}", child) for name, child in module.named_children()]
        by_key: dict[Any, list[str]] = {}
        keys = {}
        for path, child in children:
            keys[path] = treatment(path, child)
            by_key.setdefault(keys[path], []).append(path)
        for path, child in children:
            members = by_key[keys[path]]
            # layers: modules of modules, with weights (q/k/v projections are alike but not
            # repeats; an activation function may see other shapes each time)
            if len(members) >= 3 and keys[path][1] and any(True for _ in child.children()):
                if path == members[0]:
                    groups.append(tuple(members))
            else:
                visit(f"{path}.", child)

    visit("", model)
    return groups


def _skipped(groups: list[tuple[str, ...]], doubled: tuple[int, ...]) -> tuple[str, ...]:
    # every group runs its first member (and its second where doubled); the rest pass their input on
    return tuple(path for index, group in enumerate(groups) for path in group[2 if index in doubled else 1 :])


class _Run:
    """One rank's forward and backward on fake tensors, some repeated layers left out."""

    def __init__(
        self,
        model: nn.Module,
        plan: Any,
        state: dict[str, torch.Tensor],
        params: list[torch.Tensor],
        fake: FakeTensorMode,
        batch: int,
        seq: int,
        inputs: Any,
        dtype: torch.dtype | None,
        tp_size: int,
        expert_imbalance: float,
        modules: dict[str, nn.Module],
    ) -> None:
        self.model, self.plan, self.state, self.params, self.fake = model, plan, state, params, fake
        # every run walks the modules (a 70B model has over a thousand): walked once per trace
        self.modules = modules
        self.batch, self.seq, self.inputs, self.dtype, self.tp_size = batch, seq, inputs, dtype, tp_size
        self.expert_imbalance = expert_imbalance
        self.rank = 0
        self.repeats_are_passable = True
        self.stage_modules: dict[str, int] = {}
        self.stage_last: list[str] = []
        self.stages = 0

    @contextlib.contextmanager
    def _left_out(self, groups: list[tuple[str, ...]], doubled: tuple[int, ...]) -> Iterator[None]:
        # a left-out layer hands its input on; that stands in for it only where the layers
        # that do run give back a tensor shaped like their first argument, and each layer of
        # a group sees the shape the others see (a chain, not a U-Net's levels)
        seen: dict[int, tuple[Any, ...]] = {}
        group_of = {path: index for index, group in enumerate(groups) for path in group}

        def sees(index: int, first: torch.Tensor) -> None:
            if seen.setdefault(index, (first.shape, first.dtype)) != (first.shape, first.dtype):
                self.repeats_are_passable = False

        def same_shape(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            first = args[0] if args else None
            if not (isinstance(first, torch.Tensor) and isinstance(output, torch.Tensor)) or (
                first.shape != output.shape or first.dtype != output.dtype
            ):
                self.repeats_are_passable = False
            else:
                sees(group_of[names[module]], first)

        def pass_on(index: int, *args: Any, **kwargs: Any) -> Any:
            if not args or not isinstance(args[0], torch.Tensor):
                self.repeats_are_passable = False
                raise _NotPassableError
            sees(index, args[0])
            return args[0]

        left_out = set(_skipped(groups, doubled))
        running = {path for group in groups for path in group} - left_out
        handles, saved = [], []
        names: dict[nn.Module, str] = {}
        try:
            for path, module in self.modules.items():
                names[module] = path
                if path in left_out:
                    saved.append((module, module.__dict__.get("forward")))
                    module.forward = functools.partial(pass_on, group_of[path])  # type: ignore[method-assign]
                elif path in running:
                    handles.append(module.register_forward_hook(same_shape))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for module, forward in saved:
                if forward is None:
                    del module.forward
                else:
                    module.forward = forward  # type: ignore[method-assign]

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The traced parameters in the model and its experts routed, for the runs inside.

        Parameters stay swapped through backward (checkpoint recomputes with them); the
        runs of one trace share them, so they are swapped in once (each swap walks every
        parameter of the model, a 405B one's too).
        """
        with (
            _reparametrize_module(self.model, self.state, tie_weights=False, strict=False),
            rank_experts(self.modules, self.expert_imbalance, self.plan, self.rank),
        ):
            yield

    def trace(
        self, groups: list[tuple[str, ...]], doubled: tuple[int, ...] = (), *, backward: bool = True
    ) -> dict[str, Any]:
        """Bytes kept and flops of one forward and backward, repeated layers partly left out.

        Each group runs its first member (its first two where ``doubled``); the rest pass
        through. Without ``backward`` the backward is not run: its flops are 0 and the
        recompute flops are those recomputation re-runs, counted in the forward.
        """
        model, config, fake = self.model, self.plan.config, self.fake
        with fake:
            # token ids reach the embedding whole; the embedding's output is what sequence parallel splits
            args, kwargs = _inputs(model, self.batch, self.seq, self.inputs, self.dtype)
        if _is_hf(model):
            kwargs.setdefault("use_cache", False)
        births = Births()
        for tensor in _tensors((args, kwargs)):
            births.note(tensor)
        excluded = {StorageWeakRef(p.untyped_storage()) for p in self.params}
        flops = Flops()
        for param in self.params:
            if param.dim() == 2:
                flops.weight_shapes |= {tuple(param.shape), tuple(param.shape[::-1])}
                flops.weights.add(storage_key(param))
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                checkpointed(model, tuple(config.checkpointed), config.checkpoint_policy, flops)
            )
            stack.enter_context(self._left_out(groups, doubled))
            stack.enter_context(sequence_parallel(model, self.plan, self.tp_size, self.seq))
            stack.enter_context(_unpacked_sequences(model))
            owners = [births.running, flops.running]
            outputs: dict[str, int] = {}
            stack.enter_context(_stage_owner(self.modules, self.stage_modules, owners, outputs))
            stack.enter_context(fake)
            with flops, births:
                try:
                    raw = model(*args, **kwargs)
                except (ShardingError, _NotPassableError):
                    raise
                except Exception as error:
                    if not self.repeats_are_passable:  # a left-out layer's stand-in broke the forward
                        raise _NotPassableError from error
                    shapes = tree_map_only(
                        torch.Tensor, lambda t: f"{t.dtype}{list(t.shape)}", (args, kwargs)
                    )
                    raise ShardingError(
                        f"trace_activations: {type(model).__name__}'s forward failed on inputs {shapes}: "
                        f"{type(error).__name__}: {error}. Pass inputs= that fit its forward (a tensor, a "
                        "tuple or a dict of keyword arguments)"
                    ) from error
            output = _first_tensor(raw)
            del raw, args, kwargs
            if not isinstance(output, torch.Tensor):
                raise ShardingError(f"trace_activations: {type(model).__name__}'s forward returned no tensor")
            output_key = {StorageWeakRef(output.untyped_storage())}
            by_owner = kept_bytes_by_owner(births, excluded | output_key, collect=1)
            activation_bytes = sum(by_owner.values())
            output_bytes = output.untyped_storage().nbytes()
            output_numel = output.numel()
            if backward:
                flops.backward = True
                with flops:
                    if output.requires_grad:
                        torch.autograd.backward(output, torch.ones_like(output))
        for param in self.params:
            param.grad = None
        if not backward:
            # torch's checkpoint re-runs a module's forward in backward and stops once every
            # saved tensor is back: under the full policy, up to the last op that saved one;
            # selective checkpointing hands back SAVED_OPS' outputs instead of running them
            if config.checkpoint_policy == "selective":
                flops.counts["recompute"] = flops.inside["all"] - flops.inside["saved"]
            else:
                flops.counts["recompute"] = flops.rerun
        counts: dict[str, Any] = {
            "activation_bytes": activation_bytes,
            "output_bytes": output_bytes,
            "output_numel": output_numel,
            "forward_flops": flops.counts["forward"],
            "backward_flops": flops.counts["backward"],
            "recompute_flops": flops.counts["recompute"],
            "backward_weight_flops": flops.counts["weight"],
        }
        if self.stages:
            forward = _per_stage(flops.by_stage, self.stages)
            counts["stage_activation_bytes"] = _per_stage(by_owner, self.stages)
            counts["stage_forward_flops"] = forward
            counts["stage_backward_weight_flops"] = _shared_out(flops.counts["weight"], forward)
            for key in ("backward", "recompute"):
                counts[f"stage_{key}_flops"] = _shared_out(flops.counts[key], forward)
            counts["stage_output_bytes"] = [outputs.get(last, 0) for last in self.stage_last]
            counts["stage_shared_bytes"] = by_owner.get(-1, 0)
            counts["stage_shared_flops"] = flops.by_stage.get(-1, 0)
        return counts


def _reached(plan: Any, left_out: tuple[str, ...]) -> Any:
    """``plan`` less the styles and checkpointing of modules inside ``left_out`` (no run reaches them).

    Hooking the styled modules of 80 layers for every run was a tenth of a 70B model's trace.
    """
    if not left_out:
        return plan
    skipped = set(left_out)
    prefixes = tuple(f"{path}." for path in left_out)

    def reached(path: str) -> bool:
        return path not in skipped and not path.startswith(prefixes)

    config = dataclasses.replace(
        plan.config,
        tp_styles=tuple(entry for entry in plan.config.tp_styles if reached(entry[0])),
        checkpointed=tuple(path for path in plan.config.checkpointed if reached(path)),
    )
    return dataclasses.replace(plan, config=config)


class _NotPassableError(Exception):
    """A left-out layer got no tensor to hand on."""


def _stage_holder(plan: Any, rank: int) -> Any:
    """``path -> rank`` to read a parameter's local shape at.

    Under a pipeline: the rank with ``rank``'s coordinates but the pp coordinate of the
    stage that holds the parameter (its shapes are those where it lives); else ``rank``.
    """
    config = plan.config
    axis = getattr(config, "pipeline_axis", None)
    if not axis or not config.pipeline_stages:
        return lambda path: rank
    from functional_shard.planning.stages import stage_rank

    stage_of_module = {m: i for i, modules in enumerate(config.pipeline_stages) for m in modules}
    pp = plan.mesh[axis]
    coords = plan.mesh.coords(rank)

    def holder(path: str) -> int:
        module = path.rpartition(".")[0]
        while module and module not in stage_of_module:
            module = module.rpartition(".")[0]
        if module not in stage_of_module:
            return rank
        stage = stage_of_module[module]
        coords[axis] = stage_rank(stage, pp, config.stages_per_rank, config.pipeline_schedule)
        return plan.mesh.rank(coords)

    return holder


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
) -> ActivationTrace:
    """Bytes ``model`` keeps for backward and its flops on one rank, traced on meta tensors.

    Args:
        model: any ``nn.Module`` (meta device is enough); it is not changed.
        plan: the `functional_shard.Plan` for ``model``: tensor/sequence parallel,
            mixed precision (``param_dtype``) and checkpointing are honoured.
        batch: sequences per data-parallel rank (the micro-batch).
        seq: sequence length.
        rank: the rank whose local shapes are traced (default 0).
        inputs: the forward's arguments for other signatures: a tensor, a tuple of tensors
            or a dict of keyword arguments (meta tensors are fine; only shapes and dtypes
            are read). By default the model gets token ids of shape ``(batch, seq)``.
        expert_imbalance: how mixture-of-experts layers route (transformers' experts modules,
            whose routing fake tensors cannot compute): 1.0 shares each layer's tokens x top-k
            visits evenly over its experts, more gives expert 0 that many times its even
            share; see `functional_shard.costing.routing.expert_loads`.
        backward: run the backward too (the default). Without it the trace is about half as
            long: ``backward_flops`` is 0, and ``recompute_flops`` is the most recomputation
            can run, counted in the forward: the flops of checkpointed modules' forward ops,
            under the selective policy all but `SAVED_OPS`' (torch stops recomputing once
            every saved tensor is back, so a full recompute may run less; 0 is exact).
            Checkpointing leaves the backward's own flops as they are without it. Nested
            checkpointed modules are traced with the backward whatever this says.
        stages: the module paths of each pipeline stage (``plan.config.pipeline_stages``):
            the trace then also says what each stage keeps and computes
            (``stage_activation_bytes`` and the ``stage_*_flops``), for one micro-batch of
            ``batch`` sequences.

    Returns:
        An `ActivationTrace`.

    Raises:
        ShardingError: the inputs do not fit the model (its forward raised), the plan names
            a checkpoint policy other than "full" and "selective", ``expert_imbalance`` is
            below 1 or asks more of one expert than there are tokens, or, under sequence
            parallel, the tensor-parallel size does not divide ``seq`` or the model has
            layers sequence parallel cannot run (`PlanError`, as `functional_shard.apply`
            refuses them), both before tracing.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
        >>> trace = fs.trace_activations(model, plan, batch=2, seq=8)
        >>> trace.output_bytes == 2 * 8 * 256 * 4
        True
    """
    rank = 0 if rank is None else rank
    config = plan.config
    checkpointed = tuple(config.checkpointed)
    if any(i != o and (not o or i.startswith(f"{o}.")) for o in checkpointed for i in checkpointed):
        backward = True  # an inner module's forward runs again in the outer one's recompute
    if _is_hf(model) and getattr(model.config, "_attn_implementation", None) == "flex_attention":
        # torch 2.13: flex attention has no backward on CPU, and its eager CPU forward goes
        # through torch.compile, which refuses the dispatch modes the trace runs under
        raise ShardingError(
            f"trace_activations: {type(model).__name__} uses attn_implementation='flex_attention', which "
            "cannot run on the CPU fake tensors the trace uses (no CPU backward in torch). Trace the same "
            "config with attn_implementation='sdpa': flops are counted alike (full score matrix) and, "
            "like flex attention, SDPA's fused kernels keep no score matrix for backward"
        )
    if config.checkpointed and config.checkpoint_policy not in ("full", "selective"):
        raise ShardingError(
            f"trace_activations: checkpoint_policy {config.checkpoint_policy!r} is neither 'full' nor "
            "'selective' (set it with fs.checkpointing(..., policy=...))"
        )
    check_expert_imbalance(expert_imbalance)
    modules = dict(model.named_modules())
    dtype = getattr(torch, config.param_dtype) if config.param_dtype else None
    tp_size = 1
    for axis in config.tensor_parallel_axes:
        tp_size *= plan.mesh[axis]
    if config.sequence_parallel:
        check_sequence_parallel(modules, plan, seq, tp_size)

    # fake CPU tensors: no memory, and torch picks the fused attention kernels it runs for real
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    # local shapes as meta tensors first (cheap): the repeated layers no run reaches share one
    # fake tensor per shape (making one each was a fifth of a 70B model's trace)
    local: dict[str, torch.Tensor] = {}
    canonical_of: dict[str, str] = {}
    holder = _stage_holder(plan, rank)
    # shard() gives alike blocks' parameters one TensorSpec and one ParamSharding object:
    # their local shapes are worked out once (the plan holds the objects, so ids are stable)
    local_shapes: dict[tuple[int, int, int], tuple[int, ...]] = {}
    for path, param in model.named_parameters(remove_duplicate=False):
        canonical = plan.canonical(path) if path not in plan.params else path
        canonical_of[path] = canonical
        if canonical not in local:
            shape: Any = param.shape
            if canonical in plan.params:
                at = holder(canonical)
                spec_at = (id(plan.tensors[canonical]), id(plan.params[canonical]), at)
                if spec_at not in local_shapes:
                    local_shapes[spec_at] = plan.local_shape(canonical, at, "compute")
                shape = local_shapes[spec_at]
            local[canonical] = torch.empty(shape, dtype=dtype or param.dtype, device="meta")
        local[path] = local[canonical]
    buffers = dict(model.named_buffers(remove_duplicate=False))
    state: dict[str, torch.Tensor] = {}
    params: list[torch.Tensor] = []

    def make_fake(left_out: tuple[str, ...]) -> None:
        # parameters (and buffers) only modules in left_out hold share one tensor per shape
        prefixes = tuple(f"{path}." for path in left_out)
        running = {canonical for path, canonical in canonical_of.items() if not path.startswith(prefixes)}
        shared: dict[tuple[Any, ...], torch.Tensor] = {}
        state.clear()
        params.clear()

        def new(like: torch.Tensor, grad: bool, share: bool) -> torch.Tensor:
            key = (tuple(like.shape), like.dtype, grad)
            if share and key in shared:
                return shared[key]
            tensor = torch.empty(like.shape, dtype=like.dtype, requires_grad=grad)
            if grad:
                params.append(tensor)
            if share:
                shared[key] = tensor
            return tensor

        with fake:
            for path, canonical in canonical_of.items():
                if canonical not in state:
                    state[canonical] = new(local[canonical], True, canonical not in running)
                state[path] = state[canonical]
            for path, buffer in buffers.items():
                state[path] = new(buffer, False, path.startswith(prefixes))

    # repeated layers (a transformer's blocks) are traced once and twice: each further one
    # adds what the second added, so a 70B model traces as fast as a 2-layer one
    groups = _repeats(model, plan, local)
    left_out = _skipped(groups, tuple(range(len(groups))))
    make_fake(left_out)
    run = _Run(
        model,
        _reached(plan, left_out),
        state,
        params,
        fake,
        batch,
        seq,
        inputs,
        dtype,
        tp_size,
        expert_imbalance,
        modules,
    )
    run.rank = rank
    if stages:
        run.stage_modules = {path: index for index, modules in enumerate(stages) for path in modules}
        run.stages = len(stages)
        run.stage_last = [modules[-1] if modules else "" for modules in stages]
    try:
        with run.swapped():
            first = run.trace(groups, backward=backward)
            counts = {key: list(value) if isinstance(value, list) else value for key, value in first.items()}
            seconds = [run.trace(groups, (index,), backward=backward) for index in range(len(groups))]
        for group, second in zip(groups, seconds, strict=True):
            for key in counts:
                if key in (
                    "output_bytes",
                    "output_numel",
                    "stage_output_bytes",
                    "stage_shared_bytes",
                    "stage_shared_flops",
                ):
                    continue
                if isinstance(counts[key], list):
                    # each further layer adds what the second added, to its own stage
                    added = sum(second[key]) - sum(first[key])
                    for member in group[1:]:
                        owner = _stage_of_path(member, run.stage_modules)
                        for stage in range(run.stages) if owner < 0 else (owner,):
                            counts[key][stage] += added
                else:
                    counts[key] += (len(group) - 1) * (second[key] - first[key])
    except _NotPassableError:
        run.repeats_are_passable = False
    if not run.repeats_are_passable:  # a layer's output is not shaped like its input: trace them all
        make_fake(())
        run.plan = plan
        with run.swapped():
            counts = run.trace([], backward=backward)
    fields: dict[str, Any] = {
        key: tuple(value) if isinstance(value, list) else value for key, value in counts.items()
    }
    return ActivationTrace(rank=rank, batch=batch, seq=seq, **fields)
