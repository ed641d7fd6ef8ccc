"""`shard()`: model + mesh + policy → `Plan`. Pure and deterministic; touches no data.

Two ways give equal plans (tests hold it): every parameter placed on its own (the reference, which
writes the error message), and each kind of repeated block once (`functional_shard.planning.block_reuse`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from functional_shard.core.errors import MeshError, PlanError, bullets
from functional_shard.core.mesh import Mesh, as_mesh
from functional_shard.core.spec import ParamSharding
from functional_shard.core.tree import ModelTree, read_model

from .assemble import assemble
from .block_reuse import shard_reusing_blocks
from .config_builder import plan_config, tp_styles
from .placement import axis_problems, compute_free_axes, place, tensor_problems, unused_axes
from .plan.config import ExpertConfig
from .plan.plan import Plan
from .policy.types import Custom, DataParallel, ParamProblemError, Policy, as_policy, resolve_rules
from .tp.hf_plans import expert_top_k

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["shard"]


def shard(model: Any, mesh: Mesh | DeviceMesh, policy: Policy | Any) -> Plan:
    """Plan how ``model`` is laid out on ``mesh`` under ``policy``. Pure and deterministic.

    Args:
        model: an ``nn.Module`` (meta too), a state dict or a pytree of tensors; no data is read.
        mesh: an `fs.Mesh` (every axis resolved) or a torch ``DeviceMesh``.
        policy: layers joined by ``+``, or a function ``(path, tensor_spec, mesh) -> ParamSharding | None``.

    Returns:
        A `Plan` with one `ParamSharding` per parameter (tied ones once) and per buffer.

    Raises:
        MeshError: ``mesh`` is not a mesh, or has an axis of size -1.
        PolicyError: ``policy`` is not a policy, its layers conflict, or they select modules the model lacks.
        PlanError: the plan does not fit the model; one bullet per parameter path.

    Examples:
        >>> import torch.nn as nn, functional_shard as fs
        >>> model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        >>> policy = fs.fsdp("dp") + fs.tp([("0", "colwise"), ("2", "rowwise")], "tp")
        >>> plan = fs.shard(model, fs.Mesh(dp=2, tp=2), policy)
        >>> plan.params["0.weight"].storage, plan.params["2.weight"].storage
        (P(('tp', 'dp'), None), P('dp', 'tp'))
    """
    return _shard(model, mesh, policy, reuse_blocks=True)


def _shard(model: Any, mesh: Mesh | DeviceMesh, policy: Policy | Any, *, reuse_blocks: bool) -> Plan:
    """`shard`; with ``reuse_blocks`` each kind of repeated block is planned once.

    The per-parameter way writes the error message when the reusing way finds any problem.
    """
    mesh = _as_mesh(model, mesh)
    mesh.require_resolved("shard()")
    policy = _with_model_pieces(resolve_rules(as_policy(policy), model), model)
    tree = read_model(model)
    experts = policy.expert_parallel
    plan = None
    if (
        reuse_blocks
        and tree.blocks
        and not any(isinstance(layer, Custom) for layer in policy.layers)
        and (experts is None or experts.index_free)
    ):
        plan = shard_reusing_blocks(tree, mesh, policy)
    if plan is None:
        plan = _shard_each(tree, mesh, policy)
    return with_expert_top_k(plan, model)


def _as_mesh(model: Any, mesh: Any) -> Mesh:
    if isinstance(model, Mesh) and not isinstance(mesh, Mesh):
        raise MeshError(
            f"shard(model=...) got the mesh {model!r}; the arguments are shard(model, mesh, policy)"
        )
    return as_mesh(mesh, "shard(mesh=...)")


def with_expert_top_k(plan: Plan, model: Any) -> Plan:
    """``plan`` told how many experts each token visits, where it splits experts modules.

    Dispatch costs depend on it and only the model says it: a plan made from a `ModelTree` learns it here.

    Raises:
        PlanError: the model's tokens visit more experts than a split experts module holds.
    """
    config = plan.config
    experts = config.experts or ExpertConfig()
    if not experts.modules and not config.tensor_parallel_experts:
        return plan
    told = dataclasses.replace(experts, top_k=expert_top_k(model))
    _refuse_top_k_beyond_experts(plan, told.top_k, (*experts.modules, *config.tensor_parallel_experts))
    # experts split by tp alone, of a model that does not say its top-k: still no expert config
    config = dataclasses.replace(config, experts=None if told == ExpertConfig() else told)
    return dataclasses.replace(plan, config=config)


def _refuse_top_k_beyond_experts(plan: Plan, top_k: int, modules: tuple[str, ...]) -> None:
    # a router cannot pick more experts than a layer holds (torch.topk fails in the forward), and
    # the cost model would count dispatch for token copies that never exist
    wanted = set(modules)
    held: dict[str, int] = {}  # the experts each module's [E, out, in] weights hold
    for path, tensor in plan.tensors.items():
        owner = path.rpartition(".")[0]
        if tensor.ndim == 3 and owner in wanted:
            held[owner] = min(held.get(owner, tensor.shape[0]), tensor.shape[0])
    for module, experts in held.items():
        if top_k > experts:
            raise PlanError(
                f"{module}: each token visits {top_k} experts (the model's num_experts_per_tok or its "
                f"router's top_k), but the module holds {experts}; set num_experts_per_tok (or top_k) "
                f"to at most {experts}"
            )


def _with_model_pieces(policy: Policy, model: Any) -> Policy:
    """The pipeline layer told what the model says of itself: HF pieces and hidden size."""
    from .tp.hf_plans import hidden_size, pp_pieces

    pipe = policy.pipeline
    if pipe is None:
        return policy
    told = dataclasses.replace(pipe, pieces=pp_pieces(model), hidden_size=hidden_size(model))
    layers = tuple(told if layer is pipe else layer for layer in policy.layers)
    return dataclasses.replace(policy, layers=layers)


def _shard_each(tree: ModelTree, mesh: Mesh, policy: Policy) -> Plan:
    """Plan every parameter on its own: the reference, and the path that reports problems."""
    layers = policy.layers
    problems = axis_problems(policy, mesh)
    # data parallelism shards parameters and their state, never buffers
    buffer_layers = tuple(layer for layer in layers if not isinstance(layer, DataParallel))
    params: dict[str, ParamSharding] = {}
    buffers: dict[str, ParamSharding] = {}
    for placed, group, group_layers in (
        (params, tree.params, layers),
        (buffers, tree.buffers, buffer_layers),
    ):
        for path, tensor in group.items():
            try:
                placed[path] = place(group_layers, tree.aliases.get(path, (path,)), tree, tensor, mesh)
            except ParamProblemError as problem:
                problems.append(f"{path}, shape {tensor.shape}: {problem}")
    everything = {**params, **buffers}
    compute_axes = {axis for sharding in everything.values() for axis in sharding.compute.axes}
    config = plan_config(policy, mesh, tree, compute_axes=compute_axes, tp_styles=tp_styles(policy, tree))
    if not problems:
        data_axes = compute_free_axes(config)
        problems += unused_axes(policy, mesh, everything.values())
        tensors = {**tree.params, **tree.buffers}
        for path, sharding in everything.items():
            problems += tensor_problems(path, tensors[path], sharding, mesh, data_axes)
    if problems:
        raise PlanError(
            bullets(
                f"plan does not fit the model on {mesh!r}:",
                problems,
                "Fix the rule, change the mesh, or pad the parameter.",
            )
        ) from None
    return assemble(tree, mesh, params, buffers, config)
