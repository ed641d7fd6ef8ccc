"""The policy constructors: `fsdp`, `zero`, `hsdp`, `replicate`, `tp`, `ep`, `pipeline`, options.

Each returns a one-layer `Policy` (or one carrying options) for ``+`` to combine; see
`functional_shard.planning.policy.types` for how the layers merge.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Literal, cast

import torch

from functional_shard.core.errors import PolicyError
from functional_shard.core.sequence import CONTEXT_ENGINES
from functional_shard.core.tree import Pattern
from functional_shard.core.validate import instance_of, one_of, positive_int, refuse
from functional_shard.planning.tp.rules import Rules, deferred

from .types import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    Options,
    Pipeline,
    Policy,
    Selector,
    TensorParallel,
    UnitSelector,
    policy_builder,
)

# by kind: data parallel, model parallel, plan options
__all__ = [
    "replicate",
    "zero",
    "fsdp",
    "hsdp",
    "tp",
    "ep",
    "cp",
    "pipeline",
    "mixed_precision",
    "offload",
    "checkpointing",
]


def _axes(axis: str | Iterable[str], name: str = "axis") -> tuple[str, ...]:
    axes = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, Iterable) else None
    if not axes or not all(isinstance(a, str) for a in axes):
        fix = "write a name such as 'dp', or a tuple such as ('dp', 'cp')"
        refuse(name, repr(axis), "a mesh axis name or a tuple of them", meaning=fix, error=PolicyError)
    if twice := sorted({a for a in axes if axes.count(a) > 1}):
        fix = "name each mesh axis once"
        refuse(name, repr(axis), f"names {twice[0]!r} twice", meaning=fix, error=PolicyError)
    return axes


def _axis(axis: Any) -> str:
    return instance_of(axis, str, "axis", meaning="one mesh axis name", error=PolicyError)


def _flag(value: Any, option: str, meaning: str = "") -> bool:
    if not isinstance(value, bool):
        refuse(option, repr(value), "True or False", meaning=meaning, error=PolicyError)
    return value


# what FSDP2 may cast parameters to and reduce gradients in
MIXED_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _dtype_name(dtype: torch.dtype | str | None, what: str) -> str | None:
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        refuse(what, repr(dtype), "a torch dtype", meaning="e.g. torch.bfloat16", error=PolicyError)
    if found not in MIXED_PRECISION_DTYPES:
        # parameters and gradients are cast to it: an integer or bool dtype truncates them, and
        # layers cannot compute in float8/float4 (they need scaled matmuls, not a cast)
        fix = "e.g. torch.bfloat16, torch.float16 or torch.float32"
        refuse(what, str(found), "a floating dtype layers compute in", meaning=fix, error=PolicyError)
    # the dtype's own name, not an alias ('half', 'double'): plans compare and cost it by name
    return str(found).removeprefix("torch.")


@policy_builder
def replicate(axis: str | Iterable[str] | None = None) -> Policy:
    """DDP: parameters, gradients and optimizer state replicated; batch split over ``axis``.

    Args:
        axis: the data-parallel axis or axes; ``None``: every mesh axis no other layer claims.

    Examples:
        >>> from functional_shard import Mesh, shard
        >>> plan = shard(nn.Linear(4, 4), Mesh(dp=2), replicate())
        >>> plan.params["weight"]
        ParamSharding(storage=P(None, None), compute=P(None, None), grad=P(None, None), optim=P(None, None))
    """
    axes = None if axis is None else _axes(axis)
    return Policy((DataParallel("ddp", (), axes),))


@policy_builder
def zero(stage: Literal[1, 2, 3], axis: str = "dp") -> Policy:
    """ZeRO stage 1, 2 or 3 over ``axis``, as torch's engines run them.

    Stage 1 is ZeroRedundancyOptimizer; stage 2 FSDP2 without resharding after forward; stage 3 FSDP2.

    Raises:
        PolicyError: ``stage`` is not 1, 2 or 3.

    Examples:
        >>> zero(1).layers[0].kind, zero(2).layers[0].reshard_after_forward
        ('zero1', False)
    """
    one_of(stage, (1, 2, 3), "stage", meaning="for plain DDP use replicate()", error=PolicyError)
    _axis(axis)
    kind: Literal["zero1", "zero2", "zero3"] = ("zero1", "zero2", "zero3")[stage - 1]
    return Policy((DataParallel(kind, (axis,), (), reshard_after_forward=stage != 2),))


def _is_selector(value: Any) -> bool:
    return isinstance(value, str | type) or hasattr(value, "fullmatch")


def _check_units(
    units: Iterable[Any] | Selector | None, min_params: int | None, *, groups: bool = True
) -> tuple[Any, ...] | None:
    if min_params is not None:
        meaning = "the parameters a unit holds at least"
        positive_int(min_params, "min_params", meaning=meaning, error=PolicyError)
    if units is None:
        return None
    if min_params is not None:
        # the planner picks units by size when min_params is given: units would be dropped unread
        what = f"modules to make units, or min_params={min_params}, not both"
        meaning = "units picks the modules, min_params picks them by size"
        refuse("units", repr(units), what, meaning=meaning, error=PolicyError)
    if not isinstance(units, str | type | re.Pattern | Iterable):
        what = "module classes or module-path patterns, e.g. units=['layers.*']"
        refuse("units", repr(units), what, meaning="for a size threshold use min_params=", error=PolicyError)
    units = (units,) if isinstance(units, str | type | re.Pattern) else tuple(units)
    for unit in units:
        if groups and isinstance(unit, tuple) and unit and all(_is_selector(member) for member in unit):
            continue  # a group: its modules make one unit
        if not _is_selector(unit):
            kinds = "a module class, a module-path pattern, or a tuple of them (one unit of several modules)"
            raise PolicyError(
                f"FSDP unit {unit!r}: {kinds if groups else 'a module class or a module-path pattern'}"
            )
    return units


@policy_builder
def fsdp(
    axis: str | Iterable[str] = "dp",
    *,
    reshard_after_forward: bool = True,
    units: Iterable[UnitSelector] | Selector | None = None,
    min_params: int | None = None,
) -> Policy:
    """Fully sharded data parallel (ZeRO-3) with torch's FSDP2 over ``axis``.

    Args:
        axis: the mesh axis (or axes, flattened) to shard over; also data-parallel.
        reshard_after_forward: free gathered parameters after forward (``False`` is ZeRO-2; never the root).
        units: module classes or path patterns (a unit each) or tuples of them (one unit); default: blocks.
        min_params: instead, a unit of every module whose unwrapped parameters reach this count.

    Examples:
        >>> layer = fsdp("dp", min_params=1_000_000).layers[0]
        >>> layer.kind, layer.shard_axes, layer.min_params
        ('fsdp', ('dp',), 1000000)
    """
    axes = _axes(axis)
    _flag(reshard_after_forward, "reshard_after_forward", "resharding to a smaller group is not modelled yet")
    layer = DataParallel(
        "fsdp" if reshard_after_forward else "zero2",
        axes,
        (),
        reshard_after_forward,
        _check_units(units, min_params),
        min_params,
    )
    return Policy((layer,))


@policy_builder
def hsdp(
    replicate_axis: str,
    shard_axis: str,
    *,
    reshard_after_forward: bool = True,
    units: Iterable[UnitSelector] | Selector | None = None,
    min_params: int | None = None,
) -> Policy:
    """Hybrid sharding: FSDP2 within ``shard_axis``, replicas across ``replicate_axis``.

    Raises:
        PolicyError: an axis is not a name, or one axis both replicates and shards.

    Examples:
        >>> layer = hsdp("node", "gpu").layers[0]
        >>> layer.replicate_axes, layer.shard_axes
        (('node',), ('gpu',))
    """
    inner = cast(
        DataParallel,
        fsdp(
            shard_axis, reshard_after_forward=reshard_after_forward, units=units, min_params=min_params
        ).layers[0],
    )
    replicate_axes = _axes(replicate_axis, "replicate_axis")
    if both := [axis for axis in replicate_axes if axis in inner.shard_axes]:
        raise PolicyError(
            f"hsdp({replicate_axis!r}, {shard_axis!r}): axis {both[0]!r} would both replicate and shard; "
            "replicas go across one mesh axis and shards within another, e.g. hsdp('node', 'gpu')"
        )
    layer = replace(inner, kind="hsdp", replicate_axes=replicate_axes)
    return Policy((layer,))


@policy_builder
def tp(
    rules: Rules | str | Iterable[Any],
    axis: str = "tp",
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> Policy:
    """Tensor parallelism over ``axis`` following ``rules`` (see `functional_shard.planning.tp.rules`).

    Parameters no rule matches are left to the other layers, unless the rule set is strict. ``rules``
    may be ``"hf"`` (the model's own plan) or ``"auto"`` (`functional_shard.planning.tp.rules.for_model`).
    With ``loss_parallel`` the head keeps its logits split on the vocabulary and `fs.forward_backward`
    computes the loss under torch's ``loss_parallel()``.

    Raises:
        PolicyError: ``axis`` is not one name, or ``rules`` a name other than "hf"/"auto".

    Examples:
        >>> from functional_shard import rules
        >>> tp(rules.mlp, "tp").layers[0].name
        "tp(mlp, 'tp')"
        >>> tp("auto", "tp").layers[0].name
        "tp(auto, 'tp')"
        >>> tp(rules.mlp, "tp", sequence_parallel=True).layers[0].name
        "tp(mlp, 'tp', sequence_parallel=True)"
    """
    _axis(axis)
    if isinstance(rules, str):
        rule_set = deferred(rules)
    elif isinstance(rules, Rules):
        rule_set = rules
    elif isinstance(rules, Iterable):
        rule_set = Rules(cast(Iterable[Any], rules))
    else:
        what = "a rule set (fs.rules.llama), 'hf', 'auto', or a list of (pattern, style) pairs"
        fix = "e.g. tp([('*.q_proj', 'colwise')], 'tp')"
        refuse("rules", repr(rules), what, meaning=fix, error=PolicyError)
    _flag(sequence_parallel, "sequence_parallel")
    _flag(loss_parallel, "loss_parallel")
    return Policy((TensorParallel(rule_set, axis, sequence_parallel, loss_parallel),))


@policy_builder
def mixed_precision(
    param_dtype: torch.dtype | str = torch.bfloat16,
    reduce_dtype: torch.dtype | str | None = torch.float32,
) -> Policy:
    """Compute in ``param_dtype``, reduce gradients in ``reduce_dtype``; keep fp32 at rest.

    Raises:
        PolicyError: a dtype other than bfloat16, float16, float32 and float64 (float8 needs scaled
            matmuls, not a cast).

    Examples:
        >>> mixed_precision(torch.bfloat16).options.param_dtype
        'bfloat16'
    """
    param = _dtype_name(param_dtype, "param_dtype")
    return Policy(options=Options(param_dtype=param, reduce_dtype=_dtype_name(reduce_dtype, "reduce_dtype")))


@policy_builder
def offload(*, params: bool = True, grads: bool = True, optimizer: bool = True) -> Policy:
    """Keep sharded parameters, gradients and/or optimizer state in host memory.

    Raises:
        PolicyError: a part given other than True or False.

    Examples:
        >>> offload(params=False).options.offload_optimizer
        True
    """
    for part, value in (("params", params), ("grads", grads), ("optimizer", optimizer)):
        _flag(value, part)
    return Policy(options=Options(offload_params=params, offload_grads=grads, offload_optimizer=optimizer))


@policy_builder
def pipeline(
    axis: str = "pp",
    *,
    microbatches: int,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    split: Iterable[Iterable[str]] | None = None,
) -> Policy:
    """Pipeline parallelism over ``axis``, run by ``torch.distributed.pipelining``.

    Every tensor is placed on its stage's pp rank; FSDP keeps each stage gathered for the whole step.
    The schedules are torch's: ``gpipe``, ``1f1b``, ``interleaved1f1b``, ``looped_bfs``,
    ``interleaved_zb``, ``zbv`` and ``dualpipev``.

    Args:
        axis: the mesh axis whose ranks hold successive stages.
        microbatches: how many micro-batches each step's batch is cut into.
        schedule: the schedule's name.
        stages_per_rank: stages each rank runs (2 for the V-shaped schedules).
        split: each stage's module paths, in order; by default the blocks split evenly (torchtitan's cut).

    Raises:
        PolicyError: an unknown schedule, a stage count it cannot run, a bad count, or a ``split``
            that is not a list of stages, each a list of module paths.

    Examples:
        >>> layer = pipeline("pp", microbatches=8, schedule="interleaved1f1b", stages_per_rank=2).layers[0]
        >>> layer.name, layer.stages_per_rank
        ("pipeline('pp', microbatches=8, schedule='interleaved1f1b')", 2)
    """
    from functional_shard.planning.pipeline.stages import check_schedule

    _axis(axis)
    positive_int(microbatches, "microbatches", meaning="micro-batches per step", error=PolicyError)
    check_schedule(schedule, stages_per_rank)
    return Policy((Pipeline(axis, microbatches, schedule, stages_per_rank, _split(split)),))


def _split(split: Any) -> tuple[tuple[str, ...], ...] | None:
    """``split`` as a tuple of stages, each a tuple of module paths; refused if it is not that shape."""
    if split is None:
        return None

    def listed(value: Any) -> bool:  # a list of things, not a str (itself an iterable of letters)
        return isinstance(value, Iterable) and not isinstance(value, str)

    given = tuple(tuple(stage) if listed(stage) else stage for stage in split) if listed(split) else None
    if given is None or not all(listed(stage) and all(isinstance(p, str) for p in stage) for stage in given):
        refuse(
            "split",
            repr(split),
            "a list of stages, each a list of module paths",
            meaning='as split=[["embed_tokens", "layers.0"], ["layers.1", "norm", "lm_head"]]',
            error=PolicyError,
        )
    return given


@policy_builder
def ep(axis: str = "ep", *, experts: Pattern | Iterable[Pattern] | None = None) -> Policy:
    """Expert parallelism: expert tensors split whole by expert index (dim 0) over ``axis``.

    Each rank of ``axis`` holds ``E / size`` experts whole; `apply` dispatches tokens to them by
    all-to-all, as torchtitan does. ``axis`` is a data-parallel one: ``fsdp(("dp", "ep")) + ep("ep")``.

    Args:
        axis: the mesh axis whose ranks hold different experts.
        experts: the expert tensors' path patterns (globs or regexes); by default found by ``shard()``.

    Raises:
        PolicyError: ``axis`` is not one name, or ``experts`` not patterns.

    Examples:
        >>> (fsdp("dp") + ep("dp")).expert_parallel.name
        "ep('dp')"
        >>> ep("ep", experts="*.experts.*").layers[0].experts
        ('*.experts.*',)
    """
    _axis(axis)
    patterns: tuple[Pattern, ...] | None = None
    if experts is not None:
        patterns = (experts,) if isinstance(experts, str | re.Pattern) else tuple(experts)
        if not patterns or not all(isinstance(p, str | re.Pattern) for p in patterns):
            refuse("experts", repr(experts), "path patterns (globs or compiled regexes)", error=PolicyError)
    return Policy((ExpertParallel(axis, patterns),))


@policy_builder
def cp(axis: str = "cp", *, load_balance: bool = True, engine: str = "auto") -> Policy:
    """Context parallelism: every sequence cut along its length over ``axis``.

    Attention sees the whole sequence; everything else works on the rank's own tokens, so activations
    shrink by the axis size. The ranks of ``axis`` read the same sequences and average their gradients:
    name ``axis`` in the data-parallel layer too (``fsdp(("dp", "cp"))``), as torchtitan does.

    Args:
        axis: the mesh axis whose ranks hold different chunks of each sequence.
        load_balance: pair an early chunk with a late one on every rank.
        engine: ``"ring"`` (torch's, CUDA only), ``"all_gather"`` (ours) or ``"auto"`` (ring on CUDA).

    Raises:
        PolicyError: ``axis`` is not one name, ``load_balance`` not a bool, or an unknown ``engine``.

    Examples:
        >>> (fsdp(("dp", "cp")) + cp("cp")).context_parallel.name
        "cp('cp')"
    """
    _axis(axis)
    _flag(load_balance, "load_balance")
    one_of(engine, CONTEXT_ENGINES, "engine", error=PolicyError)
    return Policy((ContextParallel(axis, load_balance, engine),))


CHECKPOINT_POLICIES = ("full", "selective", "torchtitan")


@policy_builder
def checkpointing(*modules: Selector, policy: str = "full") -> Policy:
    """Recompute activations in backward for these modules (classes or path patterns).

    Args:
        modules: module classes or path patterns (a pattern picks the outermost modules it matches).
        policy: ``"full"`` recomputes each whole forward; ``"selective"`` keeps matmul and attention outputs;
            ``"torchtitan"`` keeps them too but recomputes every second matmul of each call, as torchtitan's
            per-op selective checkpointing does.

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
    one_of(policy, CHECKPOINT_POLICIES, "policy", error=PolicyError)
    return Policy(
        options=Options(checkpoint=_check_units(modules, None, groups=False), checkpoint_policy=policy)
    )
