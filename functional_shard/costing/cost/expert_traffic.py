"""The mixture-of-experts terms of the cost model: what expert layers send per step.

Per experts module and step, for ``T`` tokens on a rank each visiting ``k`` experts (``d`` features,
``s`` bytes each in the compute dtype):

| engine                        | collective, over the axis          | bytes sent per rank       |
|-------------------------------|------------------------------------|---------------------------|
| expert parallel over ``ep``   | counts, forward (``E`` int64)      | (ep-1)/ep · E · 8         |
|                               | dispatch and combine, forward      | 2 · (ep-1)/ep · T·k·d·s   |
|                               | their mirrors, backward            | 2 · (ep-1)/ep · T·k·d·s   |
| tensor parallel over ``tp``   | output all-reduce, forward         | 2(tp-1)/tp · T·d·s        |
|                               | input-gradient all-reduce, backward| 2(tp-1)/tp · T·d·s        |
|                               | routing-weight gradient, backward  | 2(tp-1)/tp · T·k·4        |

A checkpointed module sends its forward rows again in the recompute. The all-to-all rows assume
balanced routing; routing weights count as float32 (Mixtral's). Expert gradients need no collective
over the expert axis (the all-to-all's backward brings every rank's tokens): see `expert_grad_axes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from functional_shard.core.errors import ShardingError
from functional_shard.core.spec import ParamSharding
from functional_shard.core.tree import within
from functional_shard.planning.tp.styles import TITAN_EXPERT_WEIGHTS

if TYPE_CHECKING:
    from functional_shard.planning.plan.plan import Plan

__all__ = ["expert_comm", "expert_grad_axes", "expert_layers", "first_expert_weight", "tp_forward_copies"]

_COUNT_BYTES = 8  # the per-expert counts are int64
_ROUTING_WEIGHT_BYTES = 4


def expert_layers(plan: Plan) -> list[tuple[str, int, int]]:
    """(module path, experts E, hidden features d) of each experts module an engine splits.

    The expert-parallel modules and those tensor parallel reaches inside, in module order.

    Examples:
        >>> expert_layers(fs.shard(nn.Linear(2, 2), fs.Mesh(dp=2), fs.fsdp()))
        []
    """
    config = plan.config
    paths = config.expert_modules + config.tensor_parallel_experts
    layers = []
    for path in dict.fromkeys(paths):
        gate_up = plan.tensors[plan.canonical(first_expert_weight(plan, path))]
        layers.append((path, gate_up.shape[0], gate_up.shape[2]))
    return layers


def _titan_first_weight(plan: Plan, path: str) -> str | None:
    # torchtitan's grouped experts' w1 [E, f, d] under either naming, if the module is theirs
    return next((f"{path}.{w1}" for w1, _, _ in TITAN_EXPERT_WEIGHTS if f"{path}.{w1}" in plan.tensors), None)


def first_expert_weight(plan: Plan, path: str) -> str:
    """The path of the first weight of the experts at ``path``.

    transformers' ``gate_up_proj`` ``[E, 2f, d]``, or torchtitan's grouped experts' ``w1`` ``[E, f, d]``.
    """
    return _titan_first_weight(plan, path) or f"{path}.gate_up_proj"


def tp_forward_copies(plan: Plan, path: str) -> int:
    """Copies of each token the forward of the experts at ``path`` all-reduces under tensor parallel.

    torchtitan's experts take the routed copies and all-reduce their output, ``top_k`` a token;
    transformers' sum the copies inside, so their output is one a token.
    """
    if _titan_first_weight(plan, path) is None:
        return 1
    return plan.config.experts.top_k if plan.config.experts else 0


def is_expert_tensor(plan: Plan, sharding: ParamSharding) -> bool:
    """Whether ``sharding`` is an expert tensor's: its compute spec names the expert axis."""
    experts = plan.config.experts
    return experts is not None and experts.axis is not None and experts.axis in sharding.compute.axes


def expert_grad_axes(plan: Plan, sharding: ParamSharding, axes: tuple[str, ...]) -> tuple[str, ...]:
    """``axes`` (data axes a gradient is reduced over) less the expert axis, for an expert tensor.

    Examples:
        >>> plan = fs.shard(nn.Linear(2, 2), fs.Mesh(dp=2), fs.fsdp())
        >>> expert_grad_axes(plan, plan.params["weight"], ("dp",))
        ('dp',)
    """
    if not is_expert_tensor(plan, sharding):
        return axes
    assert plan.config.experts is not None  # (is_expert_tensor says so)
    return tuple(axis for axis in axes if axis != plan.config.experts.axis)


def expert_comm(
    plan: Plan,
    tokens: int,
    itemsize: int,
    add: Callable[[str, tuple[str, ...], int, float, int], None],
    held: Mapping[str, int],
) -> None:
    """Add each experts module's activation traffic for ``tokens`` tokens to ``add``.

    ``add(kind, axes, n, full_bytes, times)`` counts as the cost model's collectives do (the module's table).

    Raises:
        ShardingError: the plan does not know how many experts a token visits (made from a state dict, or
            from a model that names no top-k).
    """
    config = plan.config
    layers = expert_layers(plan)
    if not layers:
        return
    top_k = config.experts.top_k if config.experts else 0
    if top_k < 1:
        raise ShardingError(
            "cost(tokens=...): the plan splits experts modules but does not know how many experts each "
            "token visits (its config's experts.top_k is 0): make the plan with fs.shard(model, ...) from "
            "a model that says it, by its config's num_experts_per_tok or a router module's int top_k"
        )
    dispatched = set(config.expert_modules)
    tp_axes = config.tensor_parallel_axes
    tp = config.tp_size(plan.mesh)
    for path, experts, hidden in layers:
        gate_up = plan.sharding(plan.canonical(first_expert_weight(plan, path)))
        if not gate_up.storage.holds(held):  # another pipeline stage's layer
            continue
        if path in dispatched:
            axis = config.experts.axis if config.experts else None
            assert axis is not None
            ep = plan.mesh[axis]
            # a checkpointed module around the experts runs their forward again in backward
            again = int(within(path, config.checkpointed))
            add("all_to_all", (axis,), ep, experts * _COUNT_BYTES, 1 + again)
            add("all_to_all", (axis,), ep, tokens * top_k * hidden * itemsize, 4 + 2 * again)
        elif _titan_first_weight(plan, path):
            # torchtitan's experts take the routed token copies: their input's gradient and
            # their output are all-reduced (the routing weights apply outside, whole)
            add("all_reduce", tp_axes, tp, tokens * top_k * hidden * itemsize, 2)
        else:
            add("all_reduce", tp_axes, tp, tokens * hidden * itemsize, 2)
            add("all_reduce", tp_axes, tp, tokens * top_k * _ROUTING_WEIGHT_BYTES, 1)
