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
The constructors (`fsdp`, `tp`, ...) are in `functional_shard.planning.policy.builders`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypeAlias, TypeVar, cast

from functional_shard.core.errors import PolicyError
from functional_shard.core.mesh import Mesh
from functional_shard.core.spec import Owned, P, ParamSharding
from functional_shard.core.tree import Pattern, TensorSpec
from functional_shard.core.validate import entry_point
from functional_shard.planning.tp.rules import Rules, index_free, resolve
from functional_shard.planning.tp.styles import StyleError

__all__ = [
    "ContextParallel",
    "DataParallel",
    "ExpertParallel",
    "Layer",
    "Options",
    "Pipeline",
    "Policy",
    "TensorParallel",
    "UnitSelector",
    "policy_builder",
]

LayerFn: TypeAlias = Callable[[str, TensorSpec, Mesh], ParamSharding | None]
Selector: TypeAlias = type | Pattern
"""A module class (instances and subclasses match) or a module-path pattern."""
UnitSelector: TypeAlias = Selector | tuple[Selector, ...]
"""An FSDP unit: modules a selector picks (one unit each), or a tuple of selectors whose
modules together make one unit (``("norm", "output")``)."""


class ParamProblemError(Exception):
    """A layer cannot place one parameter; ``shard()`` collects these (internal)."""


@dataclass(frozen=True, slots=True)
class DataParallel:
    """Data parallelism: the batch is split over ``replicate_axes + shard_axes``.

    ``kind``: ``ddp``, ``zero1``, ``zero2``, ``zero3``/``fsdp`` or ``hsdp`` (see `zero` and `hsdp`).
    """

    kind: Literal["ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"]
    shard_axes: tuple[str, ...] = ()
    replicate_axes: tuple[str, ...] | None = ()
    """``None`` (``replicate()`` with no axis): every axis that no other layer claims."""
    reshard_after_forward: bool = True
    units: tuple[UnitSelector, ...] | None = None
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
        return _data_parallel_answer(self.kind == "zero1", self.shard_axes, tensor.ndim == 0)


@functools.lru_cache(maxsize=256)
def _data_parallel_answer(zero1: bool, shard_axes: tuple[str, ...], scalar: bool) -> ParamSharding:
    # one object per answer (a model has a few): merging and checking it is a cache hit
    if zero1:
        return ParamSharding(optim=Owned(shard_axes[0]))
    if scalar:
        # a 0-d tensor (a CLIP-style logit_scale) has no dim to shard: it stays whole on
        # every rank and its gradient is all-reduced over the data axes, as under DDP
        return ParamSharding.replicated()
    split = P(shard_axes)
    return ParamSharding(storage=split, compute=P(), grad=split, optim=split)


class _OnOneAxis:
    """A layer that claims one mesh axis of its own, its ``axis``."""

    __slots__ = ()
    axis: str

    @property
    def claimed_axes(self) -> tuple[str, ...]:
        """The mesh axes this layer uses."""
        return (self.axis,)


@dataclass(frozen=True, slots=True)
class TensorParallel(_OnOneAxis):
    """Tensor parallelism over ``axis`` following a rule set."""

    rules: Rules
    axis: str
    sequence_parallel: bool = False
    loss_parallel: bool = False
    """The head's logits stay split on the vocabulary; the loss runs under torch's ``loss_parallel()``."""

    @property
    def name(self) -> str:
        """A short label for messages: the switches set show, as `tp` takes them."""
        switches = "".join(
            f", {switch}=True" for switch in ("sequence_parallel", "loss_parallel") if getattr(self, switch)
        )
        return f"tp({self.rules.name}, {self.axis!r}{switches})"

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
class Pipeline(_OnOneAxis):
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

    def __call__(self, path: str, tensor: TensorSpec, mesh: Mesh) -> ParamSharding | None:
        """No split within a tensor: where a whole tensor lives along ``axis`` is set per stage."""
        return None


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """Expert parallelism over ``axis``: expert tensors split whole by expert index (dim 0).

    ``experts``: path patterns, ``None`` until ``shard()`` finds them. The axis is data parallelism's:
    this layer claims none.
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
        return self.experts is not None and all(index_free(p) for p in self.experts)

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


@dataclass(frozen=True, slots=True)
class ContextParallel:
    """Context parallelism over ``axis``: its ranks hold chunks of every sequence.

    ``axis`` is one of the plan's data-parallel axes (its ranks average gradients): this layer claims none.
    """

    axis: str
    load_balance: bool = True
    engine: str = "auto"

    @property
    def name(self) -> str:
        """A short label for messages."""
        balance = "" if self.load_balance else ", load_balance=False"
        engine = "" if self.engine == "auto" else f", engine={self.engine!r}"
        return f"cp({self.axis!r}{balance}{engine})"

    @property
    def claimed_axes(self) -> tuple[str, ...]:
        """None: the axis is a data-parallel axis, whose ranks split sequences rather than batches."""
        return ()

    def __call__(self, path: str, tensor: TensorSpec, mesh: Mesh) -> ParamSharding | None:
        """No opinion on any tensor: context parallelism splits activations, not parameters."""
        return None


Layer: TypeAlias = DataParallel | TensorParallel | Pipeline | ExpertParallel | ContextParallel | Custom


@dataclass(frozen=True, slots=True)
class Options:
    """Plan-level options; ``None`` means "not set" so that ``+`` can merge them.

    Examples:
        >>> (fs.mixed_precision(torch.bfloat16) + fs.offload()).options.offload_params
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
        >>> policy = fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp") + fs.mixed_precision(torch.bfloat16)
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

    @property
    def context_parallel(self) -> ContextParallel | None:
        """The context-parallel layer, if any."""
        return next((layer for layer in self.layers if isinstance(layer, ContextParallel)), None)


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
    if sum(isinstance(layer, ContextParallel) for layer in layers) > 1:
        problems.append("cp() appears twice; a plan has one context-parallel axis")
    if sum(isinstance(layer, DataParallel) and layer.replicate_axes is None for layer in layers) > 1:
        problems.append("replicate() without an axis appears twice")
    if problems:
        raise PolicyError(
            "policies cannot be combined:\n"
            + "\n".join(f"* {p}" for p in problems)
            + "\nGive each layer its own mesh axes."
        )


Builder = TypeVar("Builder", bound=Callable[..., Policy])
_BUILDER_MARK = "_functional_shard_policy_builder"


def policy_builder(fn: Builder) -> Builder:
    """``fn`` as a public entry point (`entry_point`), marked: passed uncalled, it is refused by name."""
    checked = cast(Builder, entry_point(fn))
    # a mark on the function itself, not a module-level registry
    setattr(checked, _BUILDER_MARK, True)
    return checked


def as_policy(obj: Policy | LayerFn) -> Policy:
    """A `Policy` as is; a plain function as a one-layer policy.

    Raises:
        PolicyError: ``obj`` is neither, or is a policy builder not called (``fs.cp``).
    """
    if isinstance(obj, Policy):
        return obj
    if getattr(obj, _BUILDER_MARK, False):
        # a builder takes arguments, not (path, tensor, mesh): as a layer it would fail
        # on the first parameter with a TypeError from inside the planner
        name = getattr(obj, "__name__", "builder")
        raise PolicyError(f"fs.{name} is the policy builder itself; call it: fs.{name}(...)")
    if callable(obj):
        return Policy((Custom(obj),))
    raise PolicyError(
        f"cannot use {obj!r} as a policy; pass fs.fsdp(...), fs.tp(...), ... or a function "
        "(path, tensor_spec, mesh) -> ParamSharding | None"
    )


def resolve_rules(policy: Policy, model: Any) -> Policy:
    """``policy`` with ``tp("hf")`` / ``tp("auto")`` rules resolved against ``model``.

    Raises:
        PolicyError: the model has no such rules.
    """
    experts = policy.expert_parallel
    if experts is not None and experts.experts is None:
        from functional_shard.planning.tp.hf_plans import expert_patterns

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
