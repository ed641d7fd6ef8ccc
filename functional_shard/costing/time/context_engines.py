"""Which context-parallel engine a cost or an estimate counts, and what torch's ring adds.

``"auto"`` runs torch's ring on CUDA devices and our all-gather engine elsewhere: `plan.cost`,
device-free, counts it as the all-gather engine; `fs.estimate` and `fs.auto` count the engine their
hardware runs (`for_hardware`). Per attention call, torch's ring all-gathers the local keys and values
in forward and again in backward, then permutes their float32 gradients ``cp`` times
(tests/dist/test_ring_attention.py); its elementwise merges are timed apart (`ring_merge_seconds`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from functional_shard.core.sequence import CONTEXT_ENGINES, engine_that_runs
from functional_shard.core.validate import one_of
from functional_shard.costing.cost.traffic import compute_itemsize, key_value_features, ring_passes

from .ring_merges import ring_merge_bytes

if TYPE_CHECKING:
    from functional_shard.costing.estimate.record import Estimate
    from functional_shard.planning.plan.plan import Plan

    from .hardware import Hardware

__all__ = [
    "counted_engine",
    "for_hardware",
    "recompute_beyond",
    "ring_exposed_seconds",
    "ring_merge_bytes",
    "ring_merge_seconds",
    "ring_workspace_bytes",
    "with_engine",
]


def counted_engine(plan: Plan, engine: str | None = None) -> str:
    """The engine whose collectives `cost` counts: ``"ring"`` or ``"all_gather"``.

    ``engine`` overrides the plan's; ``"auto"`` counts as the all-gather engine (what runs without CUDA).

    Raises:
        ShardingError: ``engine`` is not one of `CONTEXT_ENGINES` (or None).

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(cp=2), fs.replicate() + fs.cp("cp"))
        >>> counted_engine(plan), counted_engine(plan, "ring")
        ('all_gather', 'ring')
    """
    own = plan.config.context.engine if plan.config.context else "auto"
    if engine is not None:
        one_of(engine, CONTEXT_ENGINES, "context_engine", meaning=f"or None for the plan's own, {own!r}")
    chosen = own if engine is None else engine
    return engine_that_runs(chosen, cuda=False)  # the cost model knows no device


def for_hardware(plan: Plan, hardware: Hardware, *, packed: bool = False) -> Plan:
    """``plan`` with its ``"auto"`` cp engine made the one ``hardware`` runs (else unchanged).

    ``packed``: rows of packed documents, which the all-gather engine runs whatever the plan's engine
    (torch's ring masks causally over the whole sequence only), each cut into ``cp`` shares by work
    (`functional_shard.core.sequence.document_ranges`), not into the ``2·cp`` chunks of load balancing.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(cp=2), fs.replicate() + fs.cp("cp"))
        >>> for_hardware(plan, fs.hardware("h100")).config.context.engine
        'ring'
        >>> cpu = fs.hardware("h100").replace(cuda=False)
        >>> for_hardware(plan, cpu).config.context.engine
        'all_gather'
        >>> packed = for_hardware(plan, fs.hardware("h100"), packed=True).config.context
        >>> packed.engine, packed.load_balance
        ('all_gather', False)
    """
    context = plan.config.context
    if context is None or (context.engine != "auto" and not packed):
        return plan
    if packed:
        context = dataclasses.replace(context, engine="all_gather", load_balance=False)
    else:
        context = dataclasses.replace(context, engine=engine_that_runs("auto", cuda=hardware.cuda))
    return dataclasses.replace(plan, config=dataclasses.replace(plan.config, context=context))


def _ring_layers(plan: Plan, tokens: int) -> tuple[int, int, list[int]]:
    """The cp size, this rank's tokens and each attention layer's repeated key/value features."""
    n = plan.config.cp_size(plan.mesh)
    return n, tokens // n, key_value_features(plan, repeated=True)


def ring_workspace_bytes(plan: Plan, tokens: int) -> int:
    """Bytes torch's ring holds inside one attention backward, beyond what forward kept.

    ``tokens``: whole sequences' tokens on the cp group. The widest layer's gathered keys and values,
    and in float32 the query's gradient and the keys' and values' sum, the copy sent and the one arriving.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(cp=2), fs.replicate() + fs.cp("cp", engine="ring"))
        >>> ring_workspace_bytes(plan, 1024) == 1024 * 128 * 4 + 512 * (64 + 3 * 128) * 4
        True
    """
    n, mine, layers = _ring_layers(plan, tokens)
    if n <= 1 or not layers:
        return 0
    features = max(layers)
    size = compute_itemsize(plan)
    return n * mine * features * size + mine * (features // 2 + 3 * features) * 4


def ring_exposed_seconds(
    plan: Plan,
    comm_bytes: Mapping[str, Mapping[str, float]],
    hw: Hardware,
    attention_seconds: float,
) -> float:
    """Seconds of torch's ring collectives that its attention kernels do not hide, per step.

    Only the attention op's own chunks hide them: each all-gather under the first chunk, each of the
    first ``cp - 1`` permutes under the next, the last permute after them all. ``sent`` and
    ``attention_seconds`` (the rank's per step) are shared evenly over layers and passes; the loss's
    all-reduce is exposed whole. The permutes go rank to rank (`Hardware.bandwidth`'s point to point).

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(cp=2), fs.replicate() + fs.cp("cp", engine="ring"))
        >>> sent, h100 = plan.cost(tokens=1024).comm_bytes, fs.hardware("h100")
        >>> alone = ring_exposed_seconds(plan, sent, h100, attention_seconds=0.0)
        >>> hidden = ring_exposed_seconds(plan, sent, h100, attention_seconds=1e-6)
        >>> hidden < alone  # all but the last permute of each backward hides
        True
    """
    context = plan.config.context
    layers = len(key_value_features(plan))
    gathers, n = ring_passes(plan)
    if context is None or n <= 1 or not layers:
        return 0.0
    axis, latency = context.axis, hw.collective_latency
    bandwidth = hw.bandwidth(plan.mesh, (axis,))
    forward = attention_seconds / layers / (gathers + 1)  # fwd (+ recompute) + bwd (twice fwd)
    backward = 2 * forward
    gather = latency + comm_bytes.get("all_gather", {}).get(axis, 0.0) / (layers * gathers) / bandwidth
    sent = comm_bytes.get("all_to_all", {}).get(axis, 0.0) / (layers * n)
    permute = latency + sent / hw.bandwidth(plan.mesh, (axis,), point_to_point=True)
    per_layer = (
        (gathers - 1) * max(0.0, gather - forward / n)
        + max(0.0, gather - backward / n)
        + (n - 1) * max(0.0, permute - backward / n)
        + permute
    )
    loss = comm_bytes.get("all_reduce", {}).get(axis, 0.0) / bandwidth + latency
    return layers * per_layer + loss


def with_engine(estimate: Estimate, plan: Plan) -> Estimate:
    """``estimate`` of ``plan`` (its cp engine made the hardware's) saying which engine it counted.

    Under torch's ring the memory already holds ``ring_workspace`` (`with_ring_workspace`).

    Examples:
        >>> from functional_shard.zoo import llama
        >>> model = llama("tiny")
        >>> plan = fs.shard(model, fs.Mesh(cp=2), fs.fsdp("cp") + fs.cp("cp"))
        >>> found = fs.estimate(model, plan, batch=1, seq=64, hardware="h100")
        >>> found.context_engine, "ring_workspace" in found.memory
        ('ring', True)
    """
    if plan.config.context is None:
        return estimate
    return dataclasses.replace(estimate, context_engine=counted_engine(plan))


def with_ring_workspace(memory: Mapping[str, int], plan: Plan, tokens: int) -> dict[str, int]:
    """``memory`` with ``ring_workspace`` where ``plan``'s cp runs torch's ring, else as it is.

    One attention backward's buffers (`ring_workspace_bytes` of one micro-batch's ``tokens``) follow the
    loss's workspace, so they raise the peak by what they exceed it.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(cp=2), fs.fsdp("cp") + fs.cp("cp", engine="ring"))
        >>> with_ring_workspace({"loss_workspace": 0}, plan, 64)["ring_workspace"] > 0
        True
    """
    workspace = _ring_backward_bytes(plan, tokens)
    if workspace is None:
        return dict(memory)
    return dict(memory) | {"ring_workspace": max(0, workspace - memory.get("loss_workspace", 0))}


def _runs_ring(plan: Plan) -> bool:
    """Whether ``plan``'s cp runs torch's ring (its engine as counted: `counted_engine`)."""
    return plan.config.context is not None and counted_engine(plan) == "ring"


def _ring_backward_bytes(plan: Plan, tokens: int) -> int | None:
    """`ring_workspace_bytes` where ``plan``'s cp runs torch's ring; None where it does not."""
    return ring_workspace_bytes(plan, tokens) if _runs_ring(plan) else None


def ring_merge_seconds(
    plan: Plan, attention_flops: float, seq: int, hardware: Hardware, speedup: float = 1.0
) -> float:
    """Seconds a step of the busiest cp rank spends in torch's ring's own passes (`ring_merge_bytes`).

    ``attention_flops``: the rank's attention flops per step (`functional_shard.costing.time.flops`'
    convention), from which its query elements follow. Timed at the memory rate, ``speedup`` times
    faster under compile; 0 where the plan's cp does not run torch's ring.

    Examples:
        >>> from functional_shard.costing.time.hardware import hardware
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(cp=4), fs.replicate() + fs.cp("cp", engine="ring"))
        >>> ring_merge_seconds(plan, 3 * 4 * 1024 * 2048, 2048, hardware("h100")) > 0
        True
    """
    context = plan.config.context
    n = plan.config.cp_size(plan.mesh)
    if context is None or not _runs_ring(plan) or n <= 1 or not attention_flops:
        return 0.0
    gathers, _ = ring_passes(plan)
    forwards = gathers - 1  # the forward, and a full recompute's again; the backward is twice one
    queries = attention_flops / (forwards + 2) / (4 * seq)
    size = compute_itemsize(plan)
    worst = max(
        forwards * forward + backward
        for forward, backward in (
            ring_merge_bytes(n, r, load_balance=context.load_balance, queries=queries, itemsize=size)
            for r in range(n)
        )
    )
    rate = hardware.memory_bandwidth * (hardware.memory_efficiency or 1.0)
    return worst / rate / speedup


def recompute_beyond(plan: Plan, tokens: int, recompute: int, loss: int) -> int:
    """What a checkpointed block's backward adds to the peak beyond the loss's workspace and the ring's.

    The recompute (``recompute`` bytes) and torch's ring workspace, where it runs, follow the loss's
    workspace (``loss`` bytes): they raise the peak by what they exceed it, less the ring's already counted.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(dp=2), fs.fsdp())
        >>> recompute_beyond(plan, 64, recompute=100, loss=30), recompute_beyond(plan, 64, 100, loss=300)
        (70, 0)
    """
    ring = _ring_backward_bytes(plan, tokens) or 0
    return max(0, recompute + ring - loss) - max(0, ring - loss)
