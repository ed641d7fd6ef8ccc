"""The traffic half of the cost model: bytes each rank sends per training step.

Parameters' and gradients' collectives, tensor and context parallel's activation collectives, and
the pipeline's point-to-point sends.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING

from functional_shard.core.layout import local_numel
from functional_shard.core.spec import Owned, ParamSharding
from functional_shard.core.tree import dtype_from_name
from functional_shard.planning.tp.rules import sequence_gathers

from .census import Census, grouped, itemsize_of
from .expert_traffic import expert_grad_axes

if TYPE_CHECKING:
    from functional_shard.planning.plan.plan import Plan

__all__ = [
    "Comm",
    "activation_comm",
    "compute_itemsize",
    "context_comm",
    "gathers_per_step",
    "key_value_features",
    "parameter_comm",
    "pipeline_comm",
    "ring_passes",
]


class Comm:
    """Bytes sent per step, summed by collective kind and axis (ring algorithms)."""

    def __init__(self) -> None:
        self.bytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, kind: str, axes: tuple[str, ...], n: int, full_bytes: float, times: int = 1) -> None:
        """Count ``times`` collectives of ``kind`` over ``n`` ranks on ``full_bytes`` (the gathered size)."""
        if n <= 1 or full_bytes == 0:
            return
        factor = 2 if kind == "all_reduce" else 1
        self.bytes[kind][",".join(axes)] += times * factor * (n - 1) / n * full_bytes

    def result(self) -> dict[str, dict[str, float]]:
        """Kind -> axes (joined by ``,``) -> bytes."""
        return {kind: dict(by_axis) for kind, by_axis in self.bytes.items()}


def gathers_per_step(plan: Plan, units: tuple[str, ...]) -> int:
    """How often FSDP gathers a tensor of ``units`` in a step.

    Twice when it reshards after forward, else once; the root once (FSDP2 keeps it gathered).

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(dp=2), fs.fsdp("dp"))
        >>> gathers_per_step(plan, ("layers.0",)), gathers_per_step(plan, ("",))
        (2, 1)
    """
    return 2 if plan.config.reshard_after_forward and units != ("",) else 1


def parameter_comm(plan: Plan, comm: Comm, census: Census, held: Mapping[str, int]) -> None:
    """Add the parameters' and gradients' collectives of the rank at ``held``."""
    # rank 0 of every axis but the pp one: the first rank of the reported rank's stages
    pipeline = plan.config.pipeline
    origin = {axis: 0 for axis in plan.mesh.axis_names} | (
        {pipeline.axis: held[pipeline.axis]} if pipeline else {}
    )
    config = plan.config
    data_axes = config.data_axes
    param_size = dtype_from_name(config.param_dtype).itemsize if config.param_dtype else None
    reduce_size = dtype_from_name(config.reduce_dtype).itemsize if config.reduce_dtype else None

    def gathers(_: ParamSharding, units: tuple[str, ...], __: int) -> int:
        return gathers_per_step(plan, units)

    for (shape, itemsize, differentiable, sharding, times), count in grouped(census, gathers).items():
        if not sharding.storage.holds(origin):
            continue
        padded = sharding.at_rest_axes
        at_rest = tuple(a for a in sharding.storage.axes if a in padded)
        if at_rest:
            n = plan.mesh.axes_size(at_rest)
            shard = local_numel(shape, sharding.storage, plan.mesh, origin, padded)
            comm.add("all_gather", at_rest, n, n * shard * (param_size or itemsize), times * count)
        if isinstance(sharding.optim, Owned):  # every parameter, updated or not
            axis = sharding.optim.axis
            comm.add("broadcast", (axis,), plan.mesh[axis], math.prod(shape) * itemsize, count)
        if not differentiable:  # an integer or bool parameter: no gradient to reduce
            continue
        # an expert tensor's gradient is complete over the expert axis (expert_traffic)
        grad_axes = expert_grad_axes(plan, sharding, tuple(a for a in sharding.grad.axes if a in data_axes))
        # without a reduce dtype FSDP2 reduces in the compute dtype (MixedPrecisionPolicy's contract);
        # the 0-d parameters it leaves whole are not cast, and reduced in their own dtype
        grad_size = reduce_size or (param_size if shape else None) or itemsize
        grad_bytes = local_numel(shape, sharding.grad, plan.mesh, origin, padded) * grad_size
        if grad_axes:
            n = plan.mesh.axes_size(grad_axes)
            comm.add("reduce_scatter", grad_axes, n, n * grad_bytes, count)
        replicas = expert_grad_axes(plan, sharding, tuple(a for a in data_axes if a not in grad_axes))
        if replicas:
            comm.add("all_reduce", replicas, plan.mesh.axes_size(replicas), grad_bytes, count)
    # (no buffer traffic: apply's DDP, torch's composable replicate, hands DDP the
    # parameters only, so buffers are never broadcast; measured)
    _sequence_parallel_grad_comm(plan, comm, param_size, origin)


def _sequence_parallel_grad_comm(
    plan: Plan, comm: Comm, param_size: int | None, held: Mapping[str, int]
) -> None:
    # a sequence-parallel module sees only this rank's tokens: its whole weight's gradient is a
    # partial sum, all-reduced over the tensor-parallel axes once
    tp = plan.config.tp
    if tp is None:
        return
    axes, n = tp.axes, tp.size(plan.mesh)
    # (a replicate_grad_allreduce module, a per-head norm, likewise sees this rank's heads,
    # with or without sequence parallel)
    partial_styles = ("sequence", "replicate_grad_allreduce") if tp.sequence_parallel else ()
    sequence_modules = {
        path for path, style, _ in tp.styles if style in (*partial_styles, "replicate_grad_allreduce")
    }
    if not sequence_modules:
        return
    for path, sharding in plan.params.items():
        tensor = plan.tensors[path]
        if (
            path.rpartition(".")[0] in sequence_modules
            and sharding.storage.holds(held)
            and tensor.differentiable
        ):
            comm.add("all_reduce", axes, n, tensor.numel * (param_size or tensor.itemsize))


def activation_comm(plan: Plan, comm: Comm, tokens: int, held: Mapping[str, int]) -> None:
    """Add tensor parallel's activation collectives for ``tokens`` tokens."""
    # per styled module, as torch's styles issue them (docs/cost-model.md lists them); under
    # sequence parallel a module holding column-split layers gathers its input once on entry
    # (`rules.sequence_gathers`), counted with the first of them
    tp = plan.config.tp
    if tp is None:
        return
    sequence = tp.sequence_parallel
    gathered = set(sequence_gathers(tp.styles)) if sequence else set()
    counted: set[str] = set()
    for module_path, style, kind in tp.styles:
        if style in ("sequence", "replicate", "replicate_grad_allreduce") or kind == "experts":
            continue  # (an experts module's traffic: expert_traffic)
        weight = plan.canonical(f"{module_path}.weight")
        tensor, compute = plan.tensors[weight], plan.sharding(weight).compute
        if not compute.holds(held):  # another stage's module
            continue
        axes = tuple(a for a in compute.axes)
        n = plan.mesh.axes_size(axes)
        per_token = itemsize_of(plan.config.param_dtype, tensor) * tokens
        out_features, in_features = tensor.shape[::-1] if kind == "conv1d" else tensor.shape
        if style == "packed_colwise" and f"{module_path}.bias" in plan.tensors:
            bias = plan.tensors[f"{module_path}.bias"]
            size = itemsize_of(plan.config.param_dtype, bias)
            pieces = plan.config.pieces_of(module_path)
            if pieces and len(set(pieces)) > 1:  # unequal pieces: each rank's slices, a partial sum
                comm.add("all_reduce", axes, n, bias.numel * size)
            else:
                comm.add("all_gather", axes, n, -(-bias.numel // n) * n * size)
        if kind == "embedding":
            if style == "rowwise":
                reductions = [in_features]  # the embedding dim of the (num, dim) table
                gathers = []
            else:
                reductions, gathers = [], [in_features]
        else:
            rowwise = style in ("rowwise", "rowwise_split_input")
            reductions = [out_features] if rowwise else [in_features]
            parent = module_path.rpartition(".")[0]
            if not rowwise and parent in gathered:
                reductions = [] if parent in counted else [in_features]
                counted.add(parent)
            # a loss-parallel head keeps its logits split: no gather; its loss all-reduces
            # each token's max, sum of exponentials and target logit (torch's loss_parallel)
            head_of_parallel_loss = style == "colwise_gather" and tp.loss_parallel
            gathers = [out_features] if style == "colwise_gather" and not head_of_parallel_loss else []
            if head_of_parallel_loss:
                comm.add("all_reduce", axes, n, 3 * per_token)
            if style == "rowwise_split_input":
                gathers.append(in_features)
        for features in reductions:
            if sequence:
                comm.add("all_gather", axes, n, features * per_token)
                comm.add("reduce_scatter", axes, n, features * per_token)
            else:
                comm.add("all_reduce", axes, n, features * per_token)
        for features in gathers:  # DTensor pads an uneven split inside the all-gather
            comm.add("all_gather", axes, n, -(-features // n) * n * per_token)


# the projections whose outputs are one attention layer's keys and values, by name (Llama,
# Mistral, Qwen, torchtitan's wk/wv, BERT-style key/value); GPT-2's c_attn packs q, k and v
_KEY_VALUE = ("k_proj", "v_proj", "wk", "wv", "key", "value")
_PACKED_QKV = ("c_attn",)
_QUERY = ("q_proj", "wq", "query")


def key_value_features(plan: Plan, *, repeated: bool = False) -> list[int]:
    """Per attention layer, the features per token of its keys and values together, on one rank.

    Tensor parallel splits the heads: a rank gathers its own heads' only. ``repeated``: key/value heads
    repeated to the query heads first, as torch's ring attention takes them.

    Examples:
        >>> from functional_shard import zoo
        >>> plan = fs.shard(zoo.llama("tiny"), fs.Mesh(cp=2), fs.replicate() + fs.cp("cp"))
        >>> key_value_features(plan)  # 2 layers: 2 key/value heads of 16, for k and for v
        [64, 64]
        >>> key_value_features(plan, repeated=True)  # repeated to the 4 query heads
        [128, 128]
    """
    layers: dict[str, int] = {}
    queries: dict[str, int] = {}
    for path, tensor in plan.tensors.items():
        module, _, leaf = path.rpartition(".")
        parent, _, name = module.rpartition(".")
        if leaf != "weight" or tensor.ndim != 2 or path not in plan.params:
            continue
        if name in _KEY_VALUE:  # (out, in): the keys or the values, on dim 0
            out, features, query = 0, tensor.shape[0], 0
        elif name in _PACKED_QKV:  # a Conv1D, (in, 3·out): a third each for q, k and v
            out, features, query = 1, 2 * tensor.shape[1] // 3, tensor.shape[1] // 3
        elif name in _QUERY:
            out, features, query = 0, 0, tensor.shape[0]
        else:
            continue
        split = plan.mesh.axes_size(plan.params[path].compute.dim_axes(2)[out])
        if features:
            layers[parent] = layers.get(parent, 0) + features // split
        queries[parent] = queries.get(parent, 0) + query // split
    if repeated:  # keys and values each as wide as the queries, where the queries were found
        return [2 * queries[parent] if queries.get(parent) else kv for parent, kv in layers.items()]
    return list(layers.values())


def ring_passes(plan: Plan) -> tuple[int, int]:
    """Per attention layer and step, torch's ring all-gathers and gradient permutes.

    An all-gather in forward, in a full recompute and in backward; ``cp`` permutes in backward.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(cp=4), fs.replicate() + fs.cp("cp", engine="ring"))
        >>> ring_passes(plan)
        (2, 4)
    """
    config = plan.config
    # a selective policy keeps attention's output, which the ring's collectives run inside
    recomputed = bool(config.checkpointed) and config.checkpoint_policy == "full"
    return 2 + recomputed, config.cp_size(plan.mesh)


def context_comm(plan: Plan, comm: Comm, tokens: int, engine: str = "all_gather") -> None:
    """Add context parallel's collectives for ``tokens`` tokens of whole sequences.

    ``"all_gather"`` (ours): keys and values all-gathered in forward (and recompute), their gradients
    reduce-scattered in backward. ``"ring"`` (torch's): `ring_passes` all-gathers, and the gradients
    passed round the ring ``cp`` times as float32 all-to-alls. Either way a 4-byte loss all-reduce.
    """
    config = plan.config
    if config.context is None:
        return
    axis, n = config.context.axis, config.context.size(plan.mesh)
    size = compute_itemsize(plan)
    if engine == "ring":
        gathers = ring_passes(plan)[0]
        for features in key_value_features(plan, repeated=True):
            comm.add("all_gather", (axis,), n, tokens * features * size, times=gathers)
            if n > 1:  # cp permutes, each sending this rank's float32 buffer (a cp-th of the tokens)
                comm.bytes["all_to_all"][axis] += tokens * features * 4
    else:
        recomputed = 2 if config.checkpointed else 1
        for features in key_value_features(plan):
            comm.add("all_gather", (axis,), n, tokens * features * size, times=recomputed)
            comm.add("reduce_scatter", (axis,), n, tokens * features * size)
    comm.add("all_reduce", (axis,), n, 4)


def compute_itemsize(plan: Plan) -> int:
    """Bytes per element of the activations stages send: the mixed-precision dtype, else the model's."""
    first = next(iter(plan.tensors.values()), None)
    if plan.config.param_dtype:
        return dtype_from_name(plan.config.param_dtype).itemsize
    return first.itemsize if first is not None else 4


def pipeline_comm(plan: Plan, comm: Comm, tokens: int, held: Mapping[str, int]) -> dict[int, float]:
    """Bytes crossing each stage boundary per step, each way; adds what ``held``'s rank sends.

    A boundary carries the sending stage's output for every token of the step forward and its
    gradient backward; a V's turn sends nothing; under sequence parallel each tp rank sends its slice.
    """
    pipeline, tp = plan.config.pipeline, plan.config.tp
    if pipeline is None:
        return {}
    axis = pipeline.axis
    itemsize = compute_itemsize(plan)
    # the planner refuses a sequence the tp size does not divide, so the slices are equal
    slices = tp.size(plan.mesh) if tp is not None and tp.sequence_parallel else 1
    boundaries: dict[int, float] = {}
    sent = 0.0
    for stage, features in enumerate(pipeline.boundary_features):
        source, target = (
            pipeline.coordinate_of(stage, plan.mesh),
            pipeline.coordinate_of(stage + 1, plan.mesh),
        )
        crossing = 0.0 if source == target else float(tokens * features * itemsize) / slices
        boundaries[stage] = crossing
        if held[axis] in (source, target):  # activations out of source, gradients out of target
            sent += crossing
    if sent:
        comm.bytes["send_recv"][axis] += sent
    return boundaries
