"""`shard()`'s fast way: each kind of repeated block (``layers.0`` ... ``layers.79``) planned once.

Blocks are of one kind when their keys are equal (`functional_shard.core.tree.Block`) and every
tensor-parallel layer picks the same rule for their tensors: one block of each kind is placed, styled
and checked, the others take its answers.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import cast

from functional_shard.core.mesh import Mesh
from functional_shard.core.spec import ParamSharding
from functional_shard.core.tree import Block, ModelTree, TensorSpec

from .assemble import assemble
from .config_builder import SharedStyles, StyleEntry, plan_config, styles_of, tp_styles
from .placement import axis_problems, compute_free_axes, place, sharding_problems, unused_axes
from .plan.plan import Plan
from .policy.types import DataParallel, ParamProblemError, Policy, TensorParallel
from .tp.rules import index_free

__all__ = ["shard_reusing_blocks"]

_FirstRules = tuple[tuple[int | None, ...], ...]


def _first_rules(
    tp_layers: tuple[TensorParallel, ...],
    sensitive: tuple[tuple[int, ...], ...],
    paths: tuple[str, ...],
    free: _FirstRules,
) -> _FirstRules:
    """For each tensor-parallel layer and path, the index of the first rule that matches.

    ``free``: the first index-free rule matching each relative path; only earlier ones are tried here.
    """
    result = []
    for layer, free_first, candidates in zip(tp_layers, free, sensitive, strict=True):
        rules = layer.rules.rules
        firsts = []
        for path, bound in zip(paths, free_first, strict=True):
            limit = len(rules) if bound is None else bound
            firsts.append(next((i for i in candidates if i < limit and rules[i].matches(path)), bound))
        result.append(tuple(firsts))
    return tuple(result)


def _free_rules(tp_layers: tuple[TensorParallel, ...], paths: tuple[str, ...]) -> _FirstRules:
    """For each tensor-parallel layer and path, the first index-free rule that matches it."""
    return tuple(
        tuple(
            next(
                (
                    i
                    for i, rule in enumerate(layer.rules.rules)
                    if index_free(rule.pattern) and rule.matches(path)
                ),
                None,
            )
            for path in paths
        )
        for layer in tp_layers
    )


def _kinds(tree: ModelTree, policy: Policy) -> list[list[Block]]:
    """The blocks grouped by kind, each group in model order (its first block planned)."""
    by_key: dict[Hashable, list[Block]] = {}
    group: list[Block] = []
    for block in tree.blocks:
        # a block mostly follows one of its kind: comparing keys is cheaper than hashing one
        if not group or block.key != group[0].key:
            group = by_key.setdefault(block.key, [])
        group.append(block)
    tp_layers = policy.tensor_parallel
    sensitive = tuple(
        tuple(i for i, rule in enumerate(layer.rules.rules) if not index_free(rule.pattern))
        for layer in tp_layers
    )
    if not any(sensitive):
        return list(by_key.values())
    kinds: dict[tuple[Hashable, _FirstRules], list[Block]] = {}
    for key, blocks in by_key.items():
        free = _free_rules(tp_layers, blocks[0].params + blocks[0].buffers)
        for block in blocks:
            firsts = _first_rules(tp_layers, sensitive, block.params + block.buffers, free)
            kinds.setdefault((key, firsts), []).append(block)
    return list(kinds.values())


def _in_tree_order(tensors: dict[str, TensorSpec]) -> dict[str, ParamSharding]:
    """A dict of ``tensors``' paths in the tree's order, every value ``None`` until placed."""
    return cast(dict[str, ParamSharding], dict.fromkeys(tensors))


def shard_reusing_blocks(tree: ModelTree, mesh: Mesh, policy: Policy) -> Plan | None:
    """The plan that placing every parameter on its own gives, with each kind of block planned once.

    ``None`` on any problem: the per-parameter way then writes the message.

    Raises:
        PolicyError: the pipeline cannot be cut or scheduled, or a selector selects what a pytree cannot say.

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> tree = read_model(nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
        >>> plan = shard_reusing_blocks(tree, fs.Mesh(dp=2), fs.fsdp("dp"))
        >>> plan.params["2.weight"] is plan.params["0.weight"]
        True
    """
    layers = policy.layers
    if axis_problems(policy, mesh):
        return None
    buffer_layers = tuple(layer for layer in layers if not isinstance(layer, DataParallel))
    all_params, all_buffers = _in_tree_order(tree.params), _in_tree_order(tree.buffers)
    relative_styles: dict[str, tuple[StyleEntry, ...]] = {}
    checked: list[tuple[TensorSpec, ParamSharding]] = []  # one block of each kind stands for all
    try:
        for blocks in _kinds(tree, policy):
            first = blocks[0]
            params = [place(layers, (path,), tree, tree.params[path], mesh) for path in first.params]
            buffers = [
                place(buffer_layers, (path,), tree, tree.buffers[path], mesh) for path in first.buffers
            ]
            checked += zip(
                [tree.params[p] for p in first.params] + [tree.buffers[p] for p in first.buffers],
                params + buffers,
                strict=True,
            )
            styles: dict[str, StyleEntry] = {}
            styles_of(policy, tree, first.params, styles)
            cut = len(first.path)
            relative = tuple((module[cut:], style, kind) for module, style, kind in styles.values())
            for block in blocks:
                all_params.update(zip(block.params, params, strict=True))
                all_buffers.update(zip(block.buffers, buffers, strict=True))
                relative_styles[block.path] = relative
        outside = [path for path, sharding in all_params.items() if sharding is None]
        buffers_outside = [path for path, sharding in all_buffers.items() if sharding is None]
        for group, group_layers, tensors, paths in (
            (all_params, layers, tree.params, outside),
            (all_buffers, buffer_layers, tree.buffers, buffers_outside),
        ):
            for path in paths:
                group[path] = sharding = place(
                    group_layers, tree.aliases.get(path, (path,)), tree, tensors[path], mesh
                )
                checked.append((tensors[path], sharding))
    except ParamProblemError:
        return None
    distinct = {id(sharding): sharding for _, sharding in checked}.values()
    compute_axes = {axis for sharding in distinct for axis in sharding.compute.axes}
    shared = SharedStyles(
        tuple(outside), tuple((block.path, relative_styles[block.path]) for block in tree.blocks)
    )
    config = plan_config(
        policy, mesh, tree, compute_axes=compute_axes, tp_styles=tp_styles(policy, tree, shared)
    )
    if unused_axes(policy, mesh, distinct):
        return None
    data_axes = compute_free_axes(config)
    if any(sharding_problems(tensor.shape, sharding, mesh, data_axes) for tensor, sharding in checked):
        return None
    return assemble(tree, mesh, all_params, all_buffers, config)
