"""Policies: pure functions from (path, tensor, mesh) to a `ParamSharding`, composed with ``+``.

A policy is a stack of layers plus plan-level options. Each layer gives a parameter a
`ParamSharding` or ``None`` ("no opinion"); ``shard()`` merges the answers of every layer:

* **compute splits are major.** An axis that the computation sees split (tensor parallel)
  comes first in a dim's entry; splits that exist only at rest (FSDP, ZeRO) nest inside it.
  ``fsdp("dp") + tp(rules.llama, "tp")`` therefore stores a colwise weight as
  ``P(("tp", "dp"), None)``, exactly as torch's FSDP2 nests inside a TP shard.
* **otherwise left before right.** Among storage-only splits of one dim, the layer on the
  left of ``+`` is major.
* **no layer overrides another.** Two layers that split one dim for compute, or that claim
  the same mesh axis, are an error.

Options (mixed precision, offload, activation checkpointing) are set at most once each.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypeAlias, cast

import torch

from functional_shard.core.errors import PolicyError
from functional_shard.core.mesh import Mesh
from functional_shard.core.spec import Owned, P, ParamSharding
from functional_shard.core.tree import Pattern, TensorSpec

from .rules import Rules, StyleError, deferred, resolve

__all__ = [
    "DataParallel",
    "ExpertParallel",
    "Layer",
    "Options",
    "Pipeline",
    "Policy",
    "TensorParallel",
    "checkpointing",
    "ep",
    "fsdp",
    "hsdp",
    "mixed_precision",
    "offload",
    "pipeline",
    "replicate",
    "tp",
    "zero",
]

LayerFn: TypeAlias = Callable[[str, TensorSpec, Mesh], ParamSharding | None]
Selector: TypeAlias = type | Pattern
"""A module class (instances and subclasses match) or a module-path pattern."""


class ParamProblemError(Exception):
    """A layer cannot place one parameter; ``shard()`` collects these (internal)."""


def _axes(axis: str | Iterable[str], what: str) -> tuple[str, ...]:
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise PolicyError(f"{what}: axis must be a mesh axis name or a tuple of them, got {axis!r}")
    return axes


@dataclass(frozen=True, slots=True)
class DataParallel:
    """Data parallelism: the batch is split over ``replicate_axes + shard_axes``.

    ``kind`` names the engine behaviour: ``ddp`` (all replicated), ``zero1`` (optimizer
    state owned whole per rank), ``zero2`` (FSDP2 without resharding after forward),
    ``zero3``/``fsdp`` (FSDP2), ``hsdp`` (FSDP2 on a replicate × shard mesh).
    """

    kind: Literal["ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"]
    shard_axes: tuple[str, ...] = ()
    replicate_axes: tuple[str, ...] | None = ()
    """``None`` (``replicate()`` with no axis): every axis that no other layer claims."""
    reshard_after_forward: bool = True
    units: tuple[Selector, ...] | None = None
    min_params: int | None = None

    @property
    def name(self) -> str:
        """A short label for messages."""
        axes = ", ".join(repr(a) for a in (self.replicate_axes or ()) + self.shard_axes)
        return f"{self.kind}({axes})"

    @property
    def claimed_axes(self) -> tuple[str, ...]:
        """The mesh axes this layer uses."""
        return (self.replicate_axes or ()) + self.shard_axes

    @property
    def shards(self) -> bool:
        """Whether this layer splits anything (everything but plain DDP)."""
        return bool(self.shard_axes)

    def __call__(self, path: str, tensor: TensorSpec, mesh: Mesh) -> ParamSharding | None:
        """The sharding this layer gives one parameter."""
        if not self.shard_axes:
            return None
        if self.kind == "zero1":
            return ParamSharding(optim=Owned(self.shard_axes[0]))
        if tensor.ndim == 0:
            # a 0-d tensor (a CLIP-style logit_scale) has no dim to shard: it stays whole on
            # every rank and its gradient is all-reduced over the data axes, as under DDP
            return ParamSharding.replicated()
        split = P(self.shard_axes)
        return ParamSharding(storage=split, compute=P(), grad=split, optim=split)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """Tensor parallelism over ``axis`` following a rule set."""

    rules: Rules
    axis: str
    sequence_parallel: bool = False

    @property
    def name(self) -> str:
        """A short label for messages."""
        return f"tp({self.rules.name}, {self.axis!r})"

    @property
    def claimed_axes(self) -> tuple[str, ...]:
        """The mesh axes this layer uses."""
        return (self.axis,)

    def __call__(self, path: str, tensor: TensorSpec, mesh: Mesh) -> ParamSharding | None:
        """The sharding this layer gives one parameter."""
        rule = self.rules.match(path)
        if rule is None:
            if self.rules.strict:
                raise ParamProblemError(
                    f"{self.name}: no rule of the strict rule set {self.rules.name!r} matches; "
                    "add a rule for it (e.g. 'replicate'), or pass strict=False"
                )
            return None
        try:
            return ParamSharding.uniform(rule.spec_for(path, tensor, self.axis))
        except StyleError as error:
            raise ParamProblemError(f"{self.name}, rule {rule.pattern!r}: {error}") from None


@dataclass(frozen=True, slots=True)
class Custom:
    """A user function ``(path, tensor_spec, mesh) -> ParamSharding | None`` as a layer."""

    fn: LayerFn

    @property
    def name(self) -> str:
        """A short label for messages."""
        return getattr(self.fn, "__name__", repr(self.fn))

    @property
    def claimed_axes(self) -> tuple[str, ...]:
        """A function claims no axes up front; the specs it returns show its axes."""
        return ()

    def __call__(self, path: str, tensor: TensorSpec, mesh: Mesh) -> ParamSharding | None:
        """The sharding the function gives one parameter."""
        result = self.fn(path, tensor, mesh)
        if result is not None and not isinstance(result, ParamSharding):
            raise ParamProblemError(
                f"policy function {self.name} returned {result!r}; return a ParamSharding or None"
            )
        return result


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Pipeline parallelism over ``axis``: each pp rank holds and runs its stages only.

    ``split`` is ``None`` (cut torchtitan's way, or by an HF model's ``base_model_pp_plan``)
    or the module paths of each stage.
    """

    axis: str
    microbatches: int
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    split: tuple[tuple[str, ...], ...] | None = None
    pieces: tuple[str, ...] | None = None
    """The model's own pipeline pieces in order (an HF ``base_model_pp_plan``); set by `shard`."""
    hidden_size: int | None = None
    """The width of what stages send each other, when the model's config names it; set by `shard`."""

    @property
    def name(self) -> str:
        """A short label for messages."""
        return f"pipeline({self.axis!r}, microbatches={self.microbatches}, schedule={self.schedule!r})"

    @property
    def claimed_axes(self) -> tuple[str, ...]:
        """The mesh axes this layer uses."""
        return (self.axis,)

    def __call__(self, path: str, tensor: TensorSpec, mesh: Mesh) -> ParamSharding | None:
        """No split within a tensor: where a whole tensor lives along ``axis`` is set per stage."""
        return None


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """Expert parallelism over ``axis``: expert tensors split whole by expert index (dim 0).

    ``experts`` are path patterns of the expert parameters (globs, ``*`` spanning dots, or
    compiled regexes); ``None`` until ``shard()`` finds them in the model (see `ep`).
    The axis is borrowed from data parallelism (tokens are dispatched over it), so this
    layer claims no axis of its own.
    """

    axis: str
    experts: tuple[Pattern, ...] | None = None

    @property
    def name(self) -> str:
        """A short label for messages."""
        return f"ep({self.axis!r})"

    @property
    def claimed_axes(self) -> tuple[str, ...]:
        """None: the axis is a data-parallel axis (or unused), split by expert for these tensors only."""
        return ()

    @property
    def index_free(self) -> bool:
        """Whether every pattern selects the same tensors in every repeated block."""
        return self.experts is not None and all(
            isinstance(p, str) and not set("0123456789?[") & set(p) for p in self.experts
        )

    def selects(self, path: str) -> bool:
        """Whether the parameter at ``path`` is an expert tensor of this layer."""
        from functional_shard.core.tree import matches

        return self.experts is not None and any(matches(pattern, path) for pattern in self.experts)

    def __call__(self, path: str, tensor: TensorSpec, mesh: Mesh) -> ParamSharding | None:
        """``P(axis, None, ...)`` for an expert tensor, no opinion on the others."""
        if tensor.kind == "buffer" or not self.selects(path):
            return None
        if self.axis not in mesh:
            raise ParamProblemError(f"{self.name} names axis {self.axis!r}, which is not in {mesh!r}")
        size = mesh[self.axis]
        if tensor.ndim == 0 or tensor.shape[0] % size:
            count = tensor.shape[0] if tensor.ndim else 0
            raise ParamProblemError(
                f"{self.name}: {count} experts (dim 0) do not split whole over axis {self.axis!r} of size "
                f"{size}; make the axis size divide {count}, or select other expert tensors with experts="
            )
        return ParamSharding.uniform(P(self.axis, *(None,) * (tensor.ndim - 1)))


Layer: TypeAlias = DataParallel | TensorParallel | Pipeline | ExpertParallel | Custom


def _dtype_name(dtype: torch.dtype | str | None) -> str | None:
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise PolicyError(f"{dtype!r} is not a torch dtype; use e.g. torch.bfloat16")
    return name


@dataclass(frozen=True, slots=True)
class Options:
    """Plan-level options; ``None`` means "not set" so that ``+`` can merge them.

    Examples:
        >>> (mixed_precision(torch.bfloat16) + offload()).options.offload_params
        True
    """

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    offload_params: bool | None = None
    offload_grads: bool | None = None
    offload_optimizer: bool | None = None
    checkpoint: tuple[Selector, ...] | None = None
    checkpoint_policy: str | None = None

    def merge(self, other: Options) -> Options:
        """Both option sets; an option set on both sides to different values is an error."""
        merged = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is not None and theirs is not None and mine != theirs:
                raise PolicyError(f"option {f.name!r} is set twice, to {mine!r} and {theirs!r}; set it once")
            merged[f.name] = theirs if mine is None else mine
        return Options(**merged)


@dataclass(frozen=True, slots=True)
class Policy:
    """Layers and options; combine with ``+``, pass to ``shard()``.

    Examples:
        >>> from functional_shard import rules
        >>> policy = fsdp("dp") + tp(rules.llama, "tp") + mixed_precision(torch.bfloat16)
        >>> [layer.name for layer in policy.layers]
        ["fsdp('dp')", "tp(llama, 'tp')"]
    """

    layers: tuple[Layer, ...] = ()
    options: Options = field(default_factory=Options)

    def __add__(self, other: Policy | LayerFn) -> Policy:
        other = as_policy(other)
        layers = self.layers + other.layers
        _check_layers(layers)
        return Policy(layers, self.options.merge(other.options))

    def __radd__(self, other: LayerFn) -> Policy:
        return as_policy(other) + self

    @property
    def data_parallel(self) -> tuple[DataParallel, ...]:
        """The data-parallel layers."""
        return tuple(layer for layer in self.layers if isinstance(layer, DataParallel))

    @property
    def tensor_parallel(self) -> tuple[TensorParallel, ...]:
        """The tensor-parallel layers."""
        return tuple(layer for layer in self.layers if isinstance(layer, TensorParallel))

    @property
    def pipeline(self) -> Pipeline | None:
        """The pipeline layer, if any."""
        return next((layer for layer in self.layers if isinstance(layer, Pipeline)), None)

    @property
    def expert_parallel(self) -> ExpertParallel | None:
        """The expert-parallel layer, if any."""
        return next((layer for layer in self.layers if isinstance(layer, ExpertParallel)), None)


def _check_layers(layers: tuple[Layer, ...]) -> None:
    owner: dict[str, str] = {}
    problems = []
    for layer in layers:
        for axis in layer.claimed_axes:
            if axis in owner:
                problems.append(f"axis {axis!r} is claimed by both {owner[axis]} and {layer.name}")
            owner[axis] = layer.name
    sharding = [layer for layer in layers if isinstance(layer, DataParallel) and layer.shards]
    if len(sharding) > 1:
        names = " and ".join(layer.name for layer in sharding)
        problems.append(
            f"{names} both shard data-parallel state; use one, with several axes if needed "
            "(e.g. fsdp(('dp', 'cp')))"
        )
    if sum(isinstance(layer, Pipeline) for layer in layers) > 1:
        problems.append("pipeline() appears twice; a plan has one pipeline axis")
    if sum(isinstance(layer, ExpertParallel) for layer in layers) > 1:
        problems.append("ep() appears twice; a plan has one expert-parallel axis")
    if sum(isinstance(layer, DataParallel) and layer.replicate_axes is None for layer in layers) > 1:
        problems.append("replicate() without an axis appears twice")
    if problems:
        raise PolicyError(
            "policies cannot be combined:\n"
            + "\n".join(f"* {p}" for p in problems)
            + "\nGive each layer its own mesh axes."
        )


def as_policy(obj: Policy | LayerFn) -> Policy:
    """A `Policy` as is; a plain function as a one-layer policy.

    Raises:
        PolicyError: ``obj`` is neither.
    """
    if isinstance(obj, Policy):
        return obj
    if callable(obj):
        return Policy((Custom(obj),))
    raise PolicyError(
        f"cannot use {obj!r} as a policy; pass fs.fsdp(...), fs.tp(...), ... or a function "
        "(path, tensor_spec, mesh) -> ParamSharding | None"
    )


def replicate(axis: str | Iterable[str] | None = None) -> Policy:
    """DDP: parameters, gradients and optimizer state replicated; batch split over ``axis``.

    Args:
        axis: the data-parallel axis or axes; ``None`` takes every mesh axis that no other
            layer claims.

    Examples:
        >>> from functional_shard import Mesh, shard
        >>> plan = shard(nn.Linear(4, 4), Mesh(dp=2), replicate())
        >>> plan.params["weight"]
        ParamSharding(storage=P(None, None), compute=P(None, None), grad=P(None, None), optim=P(None, None))
    """
    axes = None if axis is None else _axes(axis, "replicate()")
    return Policy((DataParallel("ddp", (), axes),))


def zero(stage: Literal[1, 2, 3], axis: str = "dp") -> Policy:
    """ZeRO stage 1, 2 or 3 over ``axis``, as torch's engines run them.

    Stage 1 keeps each parameter's optimizer state whole on one rank
    (ZeroRedundancyOptimizer); stage 2 is FSDP2 without resharding after forward; stage 3
    is FSDP2.

    Raises:
        PolicyError: ``stage`` is not 1, 2 or 3.

    Examples:
        >>> zero(1).layers[0].kind, zero(2).layers[0].reshard_after_forward
        ('zero1', False)
    """
    if stage not in (1, 2, 3):
        raise PolicyError(f"zero(stage={stage!r}): stage is 1, 2 or 3; for plain DDP use replicate()")
    if not isinstance(axis, str):
        raise PolicyError(f"zero(axis={axis!r}): one mesh axis name")
    kind: Literal["zero1", "zero2", "zero3"] = ("zero1", "zero2", "zero3")[stage - 1]
    return Policy((DataParallel(kind, (axis,), (), reshard_after_forward=stage != 2),))


def _check_units(
    units: Iterable[Selector] | Selector | None, min_params: int | None
) -> tuple[Selector, ...] | None:
    if min_params is not None and (not isinstance(min_params, int) or min_params < 1):
        raise PolicyError(f"min_params={min_params!r}: a positive number of parameters")
    if units is None:
        return None
    units = (units,) if isinstance(units, str | type | re.Pattern) else tuple(units)
    for unit in units:
        if not (isinstance(unit, str | type) or hasattr(unit, "fullmatch")):
            raise PolicyError(f"FSDP unit {unit!r}: a module class or a module-path pattern")
    return units


def fsdp(
    axis: str | Iterable[str] = "dp",
    *,
    reshard_after_forward: bool = True,
    units: Iterable[Selector] | Selector | None = None,
    min_params: int | None = None,
) -> Policy:
    """Fully sharded data parallel (ZeRO-3) with torch's FSDP2 over ``axis``.

    Args:
        axis: the mesh axis (or axes, flattened) to shard over; also data-parallel.
        reshard_after_forward: free gathered parameters after forward and gather them
            again in backward (``False`` is ZeRO-2). The root unit never reshards after
            forward, as FSDP2 does.
        units: which modules are sharded as one unit (one all-gather each): module
            classes or module-path patterns. By default every element of an
            ``nn.ModuleList`` (the transformer blocks), plus the root.
        min_params: instead, make a unit of every module whose not-yet-wrapped parameters
            reach this count (FairScale's ``min_num_params``, Lightning's size policy).

    Examples:
        >>> layer = fsdp("dp", min_params=1_000_000).layers[0]
        >>> layer.kind, layer.shard_axes, layer.min_params
        ('fsdp', ('dp',), 1000000)
    """
    axes = _axes(axis, "fsdp()")
    if not isinstance(reshard_after_forward, bool):
        raise PolicyError(
            f"fsdp(reshard_after_forward={reshard_after_forward!r}): True or False "
            "(resharding to a smaller group is not modelled yet)"
        )
    layer = DataParallel(
        "fsdp" if reshard_after_forward else "zero2",
        axes,
        (),
        reshard_after_forward,
        _check_units(units, min_params),
        min_params,
    )
    return Policy((layer,))


def hsdp(
    replicate_axis: str,
    shard_axis: str,
    *,
    reshard_after_forward: bool = True,
    units: Iterable[Selector] | Selector | None = None,
    min_params: int | None = None,
) -> Policy:
    """Hybrid sharding: FSDP2 within ``shard_axis``, replicas across ``replicate_axis``.

    Examples:
        >>> layer = hsdp("node", "gpu").layers[0]
        >>> layer.replicate_axes, layer.shard_axes
        (('node',), ('gpu',))
    """
    inner = fsdp(
        shard_axis, reshard_after_forward=reshard_after_forward, units=units, min_params=min_params
    ).layers[0]
    layer = replace(cast(DataParallel, inner), kind="hsdp", replicate_axes=_axes(replicate_axis, "hsdp()"))
    return Policy((layer,))


def tp(rules: Rules | str | Iterable[Any], axis: str = "tp", *, sequence_parallel: bool = False) -> Policy:
    """Tensor parallelism over ``axis`` following ``rules`` (see `functional_shard.planning.rules`).

    Parameters no rule matches are left to the other layers (replicated if none), unless
    the rule set is strict. ``rules`` may be ``"hf"`` (the model's own Hugging Face plan)
    or ``"auto"`` (`functional_shard.planning.rules.for_model`): ``shard()`` resolves them
    against the model.

    Raises:
        PolicyError: ``axis`` is not one name, or ``rules`` a name other than "hf"/"auto".

    Examples:
        >>> from functional_shard import rules
        >>> tp(rules.mlp, "tp").layers[0].name
        "tp(mlp, 'tp')"
        >>> tp("auto", "tp").layers[0].name
        "tp(auto, 'tp')"
    """
    if not isinstance(axis, str):
        raise PolicyError(f"tp(axis={axis!r}): one mesh axis name")
    if isinstance(rules, str):
        rule_set = deferred(rules)
    elif isinstance(rules, Rules):
        rule_set = rules
    else:
        rule_set = Rules(cast(Iterable[Any], rules))
    return Policy((TensorParallel(rule_set, axis, sequence_parallel),))


def resolve_rules(policy: Policy, model: Any) -> Policy:
    """``policy`` with ``tp("hf")`` / ``tp("auto")`` rules resolved against ``model``.

    Raises:
        PolicyError: the model has no such rules.
    """
    experts = policy.expert_parallel
    if experts is not None and experts.experts is None:
        from .hf import expert_patterns

        found = replace(experts, experts=expert_patterns(model))
        layers = tuple(found if layer is experts else layer for layer in policy.layers)
        policy = Policy(layers, policy.options)
    if not any(layer.rules.deferred for layer in policy.tensor_parallel):
        return policy
    layers = tuple(
        replace(layer, rules=resolve(layer.rules, model))
        if isinstance(layer, TensorParallel) and layer.rules.deferred
        else layer
        for layer in policy.layers
    )
    return Policy(layers, policy.options)


def mixed_precision(
    param_dtype: torch.dtype | str = torch.bfloat16,
    reduce_dtype: torch.dtype | str | None = torch.float32,
) -> Policy:
    """Compute in ``param_dtype``, reduce gradients in ``reduce_dtype``; keep fp32 at rest.

    Examples:
        >>> mixed_precision(torch.bfloat16).options.param_dtype
        'bfloat16'
    """
    return Policy(
        options=Options(param_dtype=_dtype_name(param_dtype), reduce_dtype=_dtype_name(reduce_dtype))
    )


def offload(*, params: bool = True, grads: bool = True, optimizer: bool = True) -> Policy:
    """Keep sharded parameters, gradients and/or optimizer state in host memory.

    Examples:
        >>> offload(params=False).options.offload_optimizer
        True
    """
    return Policy(options=Options(offload_params=params, offload_grads=grads, offload_optimizer=optimizer))


def pipeline(
    axis: str = "pp",
    *,
    microbatches: int,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    split: Iterable[Iterable[str]] | None = None,
) -> Policy:
    """Pipeline parallelism over ``axis``, run by ``torch.distributed.pipelining``.

    Args:
        axis: the mesh axis whose ranks hold successive stages.
        microbatches: how many micro-batches each step's batch is cut into.
        schedule: ``gpipe``, ``1f1b``, ``interleaved1f1b``, ``looped_bfs``,
            ``interleaved_zb``, ``zbv`` or ``dualpipev`` (torch's schedules).
        stages_per_rank: stages each rank runs (2 for the V-shaped schedules).
        split: the module paths of each stage, in order; by default the repeated blocks
            are split evenly with the embedding counted with the first stage and the
            final norm and head with the last, as torchtitan does; a Hugging Face
            model's ``base_model_pp_plan`` names the pieces when it has one.

    Every tensor of the plan is then placed on its stage's pp rank (``P(..., on=("pp", r))``).
    FSDP over the other axes keeps each stage's parameters gathered from the first
    micro-batch's forward to the last one's backward (``reshard_after_forward=False``, as
    torchtitan runs FSDP under a pipeline), so a step gathers them once.

    Raises:
        PolicyError: an unknown schedule, a stage count it cannot run, or a bad count.

    Examples:
        >>> layer = pipeline("pp", microbatches=8, schedule="interleaved1f1b", stages_per_rank=2).layers[0]
        >>> layer.name, layer.stages_per_rank
        ("pipeline('pp', microbatches=8, schedule='interleaved1f1b')", 2)
    """
    from .stages import check_schedule

    if not isinstance(axis, str):
        raise PolicyError(f"pipeline(axis={axis!r}): one mesh axis name")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise PolicyError(f"pipeline(microbatches={microbatches!r}): a positive number of micro-batches")
    check_schedule(schedule, stages_per_rank)
    stages = None if split is None else tuple(tuple(stage) for stage in split)
    return Policy((Pipeline(axis, microbatches, schedule, stages_per_rank, stages),))


def ep(axis: str = "ep", *, experts: Pattern | Iterable[Pattern] | None = None) -> Policy:
    """Expert parallelism: expert tensors split whole by expert index (dim 0) over ``axis``.

    Each rank of ``axis`` holds ``E / size`` experts whole (spec ``P(axis, None, None)``).
    When ``axis`` is a data-parallel axis (its ranks read different tokens), `apply`
    dispatches each token to the ranks holding its experts and combines the results back
    with torch's autograd-aware all-to-all, as torchtitan does. Dense parameters follow
    the data-parallel policy over all its axes; expert tensors are FSDP-sharded over the
    data-parallel axes other than ``axis`` (``fsdp(("dp", "ep")) + ep("ep")``).

    Args:
        axis: the mesh axis whose ranks hold different experts.
        experts: path patterns of the expert tensors (globs, ``*`` spanning dots, or
            compiled regexes). By default ``shard()`` finds them: a Hugging Face model's
            ``base_model_ep_plan`` (its ``grouped_gemm`` entries), else the 3-D parameters
            of modules named like ``experts``.

    Raises:
        PolicyError: ``axis`` is not one name, or ``experts`` not patterns.

    Examples:
        >>> (fsdp("dp") + ep("dp")).expert_parallel.name
        "ep('dp')"
        >>> ep("ep", experts="*.experts.*").layers[0].experts
        ('*.experts.*',)
    """
    if not isinstance(axis, str):
        raise PolicyError(f"ep(axis={axis!r}): one mesh axis name")
    patterns: tuple[Pattern, ...] | None = None
    if experts is not None:
        patterns = (experts,) if isinstance(experts, str | re.Pattern) else tuple(experts)
        if not patterns or not all(isinstance(p, str | re.Pattern) for p in patterns):
            raise PolicyError(f"ep(experts={experts!r}): path patterns (globs or compiled regexes)")
    return Policy((ExpertParallel(axis, patterns),))


CHECKPOINT_POLICIES = ("full", "selective")


def checkpointing(*modules: Selector, policy: str = "full") -> Policy:
    """Recompute activations in backward for these modules (classes or path patterns).

    Args:
        modules: module classes or path patterns to checkpoint.
        policy: ``"full"`` keeps only each module's inputs and recomputes its whole forward;
            ``"selective"`` also keeps the outputs of matrix multiplies and attention (the
            op-level selective recipe of torchtitan, through torch's selective-checkpoint
            API) and recomputes only the cheap element-wise ops between them.

    Raises:
        PolicyError: no module selector given, or an unknown ``policy``.

    Examples:
        >>> checkpointing(nn.TransformerEncoderLayer).options.checkpoint
        (<class 'torch.nn.modules.transformer.TransformerEncoderLayer'>,)
        >>> checkpointing(nn.TransformerEncoderLayer, policy="selective").options.checkpoint_policy
        'selective'
    """
    if not modules:
        raise PolicyError("checkpointing() needs module classes or path patterns to recompute")
    if policy not in CHECKPOINT_POLICIES:
        raise PolicyError(
            f"checkpointing(policy={policy!r}): unknown policy; choose one of {list(CHECKPOINT_POLICIES)}"
        )
    return Policy(options=Options(checkpoint=_check_units(modules, None), checkpoint_policy=policy))
