"""The cost model: memory per device and bytes sent per training step, before running.

It follows torch's engines, not the textbook (FSDP2's padding, its root unit gathered from forward
to backward, ZeroRedundancyOptimizer's whole-tensor state). Collective bytes are what each rank sends
with NCCL's ring algorithms; docs/cost-model.md gives each formula. Under a pipeline a rank counts
its own stages' tensors, the worst rank is sought over every pp coordinate, and activations between
stages are ``send_recv`` bytes, counted by the sender.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from functional_shard.core.layout import flattened_local_shape_and_offset, local_numel
from functional_shard.core.spec import Owned, ParamSharding
from functional_shard.core.tree import dtype_from_name
from functional_shard.core.validate import entry_point, positive_int, refuse
from functional_shard.costing.time.context_engines import counted_engine
from functional_shard.planning.plan.cost_record import Cost, OptimizerKind

from .census import Census, census_of, grouped, zero1_owners
from .expert_traffic import expert_comm
from .traffic import Comm, activation_comm, compute_itemsize, context_comm, parameter_comm, pipeline_comm

if TYPE_CHECKING:
    from functional_shard.planning.plan.plan import Plan

__all__ = ["Cost", "OptimizerKind", "check_plan_and_optimizer", "cost", "unit_gathered"]

# torch's Adam/AdamW keep exp_avg and exp_avg_sq in the parameter's dtype, plus a
# float32 scalar "step" tensor per parameter.
_OPTIMIZERS: dict[str, tuple[int, int]] = {"adamw": (2, 4), "adam": (2, 4), "sgd": (0, 0)}


def _memory(
    plan: Plan, coords: Mapping[str, int], optimizer: OptimizerKind, census: Census, buffers: bool = True
) -> dict[str, int]:
    def owns(sharding: ParamSharding, _: tuple[str, ...], owner: int) -> bool:
        optim = sharding.optim
        return isinstance(optim, Owned) and owner == coords[optim.axis] and optim.holds(coords)

    params = grads = optim = 0
    fsdp_axes = plan.config.shard_axes
    for (shape, itemsize, differentiable, sharding, owned), count in grouped(census, owns).items():
        if not sharding.storage.holds(coords):  # another stage's: not even a step counter
            continue
        padded = sharding.at_rest_axes
        # FSDP2 pads its own shards; a tensor-parallel shard is a view into the padded
        # buffer distribute_tensor scattered (measured), so it is padded over every axis
        param_padding = padded or frozenset(sharding.storage.axes)
        params += count * local_numel(shape, sharding.storage, plan.mesh, coords, param_padding) * itemsize
        if not differentiable:  # no gradient, so the optimizer makes no state, not even its step
            continue
        grads += count * local_numel(shape, sharding.grad, plan.mesh, coords, padded) * itemsize
        if isinstance(sharding.optim, Owned):
            optim += count * _state_bytes(math.prod(shape), itemsize, optimizer) if owned else 0
        else:
            # every rank keeps state for its shard, an empty one included; unpadded, as
            # the optimizer allocates zeros_like of FSDP2's unpadded local view (measured)
            if len(fsdp_axes) > 1:  # FSDP2 cuts once over its flattened axes, not in turn
                cut = flattened_local_shape_and_offset(shape, sharding.optim, plan.mesh, coords, fsdp_axes)
                numel = math.prod(cut[0])
            else:
                numel = local_numel(shape, sharding.optim, plan.mesh, coords)
            optim += count * _state_bytes(numel, itemsize, optimizer)
    buffer_bytes = sum(
        local_numel(plan.tensors[p].shape, s.storage, plan.mesh, coords) * plan.tensors[p].itemsize
        for p, s in (plan.buffers.items() if buffers else ())
    )
    return {"params": params, "grads": grads, "optimizer": optim, "buffers": buffer_bytes}


def check_plan_and_optimizer(plan: Any, optimizer: Any) -> None:
    """Refuse, naming the argument, a ``plan`` that is not a `Plan` or an optimizer `cost` cannot count.

    Raises:
        ShardingError: ``plan`` is no `Plan`, or ``optimizer`` is not a known name nor bytes per element.

    Examples:
        >>> import torch
        >>> check_plan_and_optimizer(None, "adamw")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: plan=NoneType: a Plan (make one with fs.shard(...))
        >>> plan = fs.shard(nn.Linear(2, 2), fs.Mesh(dp=2), fs.fsdp())
        >>> check_plan_and_optimizer(plan, torch.optim.AdamW)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: optimizer=<class '...AdamW'>: 'adamw', 'adam' or 'sgd' ...
    """
    # a Plan exists only once its module has loaded: looked up, not imported, as Plan.cost
    # imports this module (an import back would close a circle)
    plans = sys.modules.get("functional_shard.planning.plan.plan")
    if plans is None or not isinstance(plan, plans.Plan):
        refuse("plan", type(plan).__name__, "a Plan", meaning="make one with fs.shard(model, mesh, policy)")
    number = isinstance(optimizer, int | float) and not isinstance(optimizer, bool)
    if (isinstance(optimizer, str) and optimizer not in _OPTIMIZERS) or (
        not isinstance(optimizer, str) and not (number and math.isfinite(optimizer) and optimizer >= 0)
    ):
        names = f"{', '.join(map(repr, list(_OPTIMIZERS)[:-1]))} or {list(_OPTIMIZERS)[-1]!r}"
        what = f"{names} (the optimizer's name, not its class), or bytes of state per element (a number >= 0)"
        refuse("optimizer", repr(optimizer), what)


def _check_tokens(plan: Plan, tokens: Any) -> None:
    # under context parallel the tokens are whole sequences, cut as a run cuts them
    from functional_shard.core.sequence import check_sequence_length, chunk_count

    config = plan.config
    cp = config.cp_size(plan.mesh)
    balanced = config.context.load_balance if config.context else True
    chunks = chunk_count(cp, load_balance=balanced)
    divided = f"that the {chunks} cp chunks divide: " if chunks > 1 else ""
    meaning = f"{divided}sequences × tokens per sequence, on one data-parallel rank"
    positive_int(tokens, "tokens", meaning=meaning)
    if cp > 1:
        check_sequence_length(tokens, cp, load_balance=balanced, what="tokens", name="tokens")


def _state_bytes(numel: int, itemsize: int, optimizer: OptimizerKind) -> int:
    """Optimizer state of one tensor's ``numel`` elements held on a rank (its step counter too)."""
    if isinstance(optimizer, str):
        states, step_bytes = _OPTIMIZERS[optimizer]
        return numel * states * itemsize + step_bytes
    return round(numel * optimizer)


def _worst_memory(
    plan: Plan, candidates: list[dict[str, int]], optimizer: OptimizerKind, census: Census
) -> tuple[dict[str, int], dict[str, int]]:
    """The heaviest candidate rank's memory, and its coordinates (the first one on ties).

    When only `Owned` specs name a ZeRO-1 axis, candidates differ only in whose state they own: one
    pass over the census gives every owner's share instead of one `_memory` per rank.
    """
    base = candidates[0]
    memory = _memory(plan, base, optimizer, census)
    if len(candidates) == 1:
        return memory, base
    varying = {axis for coords in candidates[1:] for axis in coords if coords[axis] != base[axis]}

    def names_varying(spec: Any) -> bool:
        return not isinstance(spec, Owned) and any(axis in varying for axis in spec.axes)

    if any(
        names_varying(s.storage) or names_varying(s.grad) or names_varying(s.optim) for _, s, *_ in census
    ) or any(names_varying(s.storage) for s in plan.buffers.values()):
        return max(
            ((_memory(plan, coords, optimizer, census), coords) for coords in candidates),
            key=lambda item: sum(item[0].values()),
        )
    owned: dict[tuple[str, int], int] = defaultdict(int)
    for tensor, sharding, units, owner, count in census:
        # another pipeline stage's tensors are owned on other ranks: their state is not the candidates'
        if (
            tensor.differentiable
            and isinstance(sharding.optim, Owned)
            and sharding.storage.holds(base)
            and sharding.optim.holds(base)
        ):
            owned[sharding.optim.axis, owner] += (
                count * len(units) * _state_bytes(tensor.numel, tensor.itemsize, optimizer)
            )
    worst, worst_total = (memory, base), sum(memory.values())
    for coords in candidates[1:]:
        (axis,) = (a for a in coords if coords[a] != base[a])
        other = {
            **memory,
            "optimizer": memory["optimizer"] - owned[axis, base[axis]] + owned[axis, coords[axis]],
        }
        if sum(other.values()) > worst_total:
            worst, worst_total = (other, coords), sum(other.values())
    return worst


def unit_gathered(
    plan: Plan, census: Census | None = None, coords: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Bytes each FSDP unit ("" is the root) holds while all-gathered, in the gather dtype.

    Only units holding sharded parameters appear; under a pipeline, only the stages at ``coords``
    (by default pp rank 0's).

    Examples:
        >>> plan = fs.shard(nn.ModuleList([nn.Linear(4, 4)]), fs.Mesh(dp=2), fs.fsdp())
        >>> unit_gathered(plan)
        {'0': 80}
    """
    census = census_of(plan, {}) if census is None else census
    origin = dict.fromkeys(plan.mesh.axis_names, 0)
    held = origin if coords is None else coords
    param_size = dtype_from_name(plan.config.param_dtype).itemsize if plan.config.param_dtype else None
    per_kind: dict[tuple[str, ...], int] = defaultdict(int)  # alike units, counted once
    each: dict[tuple[int, int], int] = {}  # gathered bytes of one tensor, by identity
    for tensor, sharding, units, _, count in census:
        if not sharding.storage.holds(held):
            continue
        padded = sharding.at_rest_axes
        if not padded:
            continue
        key = (id(tensor), id(sharding))
        gathered = each.get(key)
        if gathered is None:
            shard = local_numel(tensor.shape, sharding.storage, plan.mesh, held, padded)
            gathered = each[key] = (
                shard * plan.mesh.axes_size(tuple(padded)) * (param_size or tensor.itemsize)
            )
        per_kind[units] += count * gathered
    return {unit: held_bytes for units, held_bytes in per_kind.items() for unit in units}


def _gathered(plan: Plan, census: Census, coords: Mapping[str, int]) -> int:
    per_unit = unit_gathered(plan, census, coords)
    root = per_unit.pop("", 0)
    if not plan.config.reshard_after_forward:  # ZeRO-2: every unit stays gathered until backward
        return root + sum(per_unit.values())
    return root + max(per_unit.values(), default=0)


def _stage_memory(
    plan: Plan, optimizer: OptimizerKind, owners: Mapping[str, int]
) -> dict[int, dict[str, int]]:
    """Params, grads, optimizer and gathered bytes of each stage's own tensors, on its first rank.

    ``gathered``: every FSDP unit of the stage at once, as FSDP runs under a pipeline.
    """
    from functional_shard.planning.pipeline.stages import stage_finder

    pipeline = plan.config.pipeline
    if pipeline is None:
        return {}
    stage_of = stage_finder(pipeline.stages)
    by_stage: dict[int, dict[str, ParamSharding]] = defaultdict(dict)
    for path, sharding in plan.params.items():
        stage = stage_of(path)
        if stage is not None:
            by_stage[stage][path] = sharding
    result = {}
    for stage in range(len(pipeline.stages)):
        coords = pipeline.first_coords(plan.mesh, pipeline.coordinate_of(stage, plan.mesh))
        census: Census = [
            (plan.tensors[path], sharding, ("",), owners.get(path, -1), 1)
            for path, sharding in by_stage[stage].items()
        ]
        memory = _memory(plan, coords, optimizer, census, buffers=False)
        result[stage] = {key: memory[key] for key in ("params", "grads", "optimizer")}
        result[stage]["gathered"] = sum(unit_gathered(plan, census, coords).values())
    return result


@entry_point
def cost(
    plan: Plan,
    optimizer: OptimizerKind = "adamw",
    *,
    rank: int | None = None,
    tokens: int | None = None,
    context_engine: str | None = None,
) -> Cost:
    """Predict a plan's memory per device and bytes sent per training step.

    docs/cost-model.md gives each formula and what it was measured against.

    Args:
        plan: the plan.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, or bytes of optimizer state per element.
        rank: report this rank's memory; by default the worst rank's.
        tokens: tokens of one data-parallel rank's step (batch × sequence); adds activation collectives.
        context_engine: ``"ring"`` or ``"all_gather"``; ``None``: the plan's, ``"auto"`` as all-gather.

    Returns:
        A `Cost`: memory by kind and collectives by kind and axis, for one rank.

    Raises:
        ShardingError: an argument of the wrong type or value, named with its fix.

    Examples:
        >>> import torch.nn as nn, functional_shard as fs
        >>> plan = fs.shard(nn.Linear(1000, 1000, bias=False), fs.Mesh(dp=4), fs.fsdp())
        >>> c = plan.cost("adamw")
        >>> c.params_bytes, c.optimizer_bytes, c.comm_bytes["reduce_scatter"]["dp"]
        (1000000, 2000004, 3000000.0)
        >>> from functional_shard import zoo
        >>> piped = fs.shard(zoo.llama("tiny"), fs.Mesh(pp=2), fs.pipeline("pp", microbatches=4))
        >>> c = piped.cost("sgd", tokens=1024)
        >>> c.boundary_bytes, c.comm_bytes["send_recv"]["pp"]
        ({0: 262144.0}, 262144.0)
        >>> long = fs.shard(zoo.llama("tiny"), fs.Mesh(cp=2), fs.fsdp("cp") + fs.cp("cp"))
        >>> sorted(long.cost(tokens=1024, context_engine="ring").comm_bytes["all_to_all"])
        ['cp']
    """
    check_plan_and_optimizer(plan, optimizer)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        refuse("rank", repr(rank), f"a rank of {plan.mesh!r} (an int), or None for the worst")
    if tokens is not None:
        _check_tokens(plan, tokens)
    engine = counted_engine(plan, context_engine)
    owners = zero1_owners(plan)
    census = census_of(plan, owners)
    if rank is not None:
        memory, coords = _worst_memory(plan, [plan.mesh.coords(rank)], optimizer, census)
        gathered = _gathered(plan, census, coords)
    else:
        # Rank 0 holds the largest chunk of every split; only ZeRO-1 ownership can make
        # another rank heavier, so try each owner along that axis, on each pp rank.
        zero_axes = {s.optim.axis for s in plan.params.values() if isinstance(s.optim, Owned)}
        pipeline = plan.config.pipeline
        worst_total = -1
        for pp_rank in range(plan.config.pp_size(plan.mesh)):
            base = pipeline.first_coords(plan.mesh, pp_rank) if pipeline else plan.mesh.coords(0)
            candidates = [base] + [{**base, a: i} for a in zero_axes for i in range(1, plan.mesh[a])]
            found, found_coords = _worst_memory(plan, candidates, optimizer, census)
            found_gathered = _gathered(plan, census, found_coords)
            if sum(found.values()) + found_gathered > worst_total:
                memory, coords, gathered = found, found_coords, found_gathered
                worst_total = sum(found.values()) + found_gathered
    config = plan.config
    host = 0
    for key, offloaded in (
        ("params", config.offload_params),
        ("grads", config.offload_grads),
        ("optimizer", config.offload_optimizer),
    ):
        if offloaded:
            host += memory[key]
            memory[key] = 0
    comm = Comm()
    parameter_comm(plan, comm, census, coords)
    boundaries: dict[int, float] = {}
    if tokens is not None:
        # under context parallel a rank runs a cp-th of the tokens; only attention sees them all
        mine = tokens // plan.config.cp_size(plan.mesh)
        activation_comm(plan, comm, mine, coords)
        context_comm(plan, comm, tokens, engine)
        expert_comm(plan, mine, compute_itemsize(plan), comm.add, coords)
        boundaries = pipeline_comm(plan, comm, mine, coords)
    return Cost(
        rank=plan.mesh.rank(coords),
        params_bytes=memory["params"],
        grads_bytes=memory["grads"],
        optimizer_bytes=memory["optimizer"],
        buffers_bytes=memory["buffers"],
        gathered_bytes=gathered,
        host_bytes=host,
        comm_bytes=comm.result(),
        activation_comm_included=tokens is not None,
        boundary_bytes=boundaries,
        stage_bytes=_stage_memory(plan, optimizer, owners),
    )
