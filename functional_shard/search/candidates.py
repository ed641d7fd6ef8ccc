"""The points the search tries: meshes, data-parallel families, tp, sp, ep and pipelines, as policies.

What the model allows is read here too (its heads, repeated block, tensor-parallel rules and
experts); `search` estimates the points, `auto` chooses among them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from functional_shard.core.errors import PolicyError, one_line
from functional_shard.core.mesh import Mesh
from functional_shard.core.tree import ModelTree, read_model
from functional_shard.core.validate import refuse
from functional_shard.costing.time.hardware import Hardware
from functional_shard.planning.policy import builders as policies
from functional_shard.planning.policy.format import format_policy
from functional_shard.planning.policy.types import ExpertParallel, Policy, TensorParallel
from functional_shard.planning.tp.styles import titan_expert_names

__all__ = ["PIPELINE_SCHEDULES", "expert_count", "head_counts", "repeated_block"]

FAMILIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
CHECKPOINTING = ("none", "selective", "full")
MAX_PIPELINE = 16
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved1f1b", 2))
"""What the search tries under pp: torchtitan's default and its interleaved variant."""


def head_counts(model: Any) -> tuple[int, int] | None:
    """(query heads, key/value heads) from a Hugging Face config, our zoo's config or modules.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> head_counts(llama("llama-70b"))
        (64, 8)
    """
    config = getattr(model, "config", None)
    if config is not None:
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)
        if isinstance(heads, int):
            return heads, kv if isinstance(kv, int) else heads
    if isinstance(model, nn.Module):
        for module in model.modules():
            heads = getattr(module, "num_heads", None)
            if isinstance(heads, int):
                kv = getattr(module, "num_key_value_heads", None) or getattr(module, "num_kv_heads", None)
                return heads, kv if isinstance(kv, int) else heads
            head_dim = getattr(module, "head_dim", None)
            q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
            if isinstance(head_dim, int) and isinstance(q, nn.Linear) and isinstance(k, nn.Linear):
                return q.out_features // head_dim, k.out_features // head_dim
    return None


def repeated_block(model: Any) -> type | None:
    """The class of the blocks a model repeats (the elements of its largest ModuleList).

    Examples:
        >>> from functional_shard.zoo import Block, llama
        >>> repeated_block(llama("tiny")) is Block
        True
    """
    if not isinstance(model, nn.Module):
        return None
    best: nn.ModuleList | None = None
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > 1
            and (best is None or len(module) > len(best))
        ):
            best = module
    return type(best[0]) if best is not None else None


def tensor_parallel_rules(model: Any) -> tuple[Any, str | None]:
    """The model's tensor-parallel rules, or None and why no rule set fits it."""
    from functional_shard.planning.tp import rules

    try:
        found = rules.for_model(model)
    except PolicyError as error:  # e.g. mixture-of-experts layers: data parallelism only
        return None, one_line(error, 240)
    return found, None


def expert_count(model: Any, tree: ModelTree) -> int:
    """Experts per mixture-of-experts layer (dim 0 of its 3-D expert tensors); 0 for a dense model.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> from functional_shard.core.tree import read_model
        >>> expert_count(llama("tiny"), read_model(llama("tiny")))
        0
    """
    from functional_shard.core.tree import matches
    from functional_shard.planning.tp.hf_plans import expert_patterns

    try:
        patterns = expert_patterns(model)
    except (PolicyError, TypeError, AttributeError):
        return 0
    for path, tensor in tree.params.items():
        if tensor.ndim == 3 and any(matches(pattern, path) for pattern in patterns):
            return int(tensor.shape[0])
    return 0


def splits_experts(rules: Any, tree: ModelTree) -> bool:
    """Whether the rules' tensor parallelism reaches inside the experts (apply runs it without sp)."""
    return rules is not None and any(
        tensor.ndim == 3 and (rule := rules.match(path)) is not None and rule.target != "replicate"
        for path, tensor in tree.params.items()
    )


def checkpoint_options(block: type | None) -> tuple[str, ...]:
    """The checkpointing the search tries: none without a repeated block to checkpoint."""
    return ("none",) if block is None else CHECKPOINTING


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the search reads of a model, once: its tensors, heads, repeated block, rules, experts."""

    model: Any
    tree: ModelTree
    """The model's tensors and modules, read once for the many plans of the search."""
    heads: tuple[int, int] | None
    block: type | None
    rules: Any
    """Its tensor-parallel rules; None when no rule set fits it."""
    no_tensor_parallel: str | None
    """Why no rule set fits it (None when one does)."""
    experts: int
    expert_patterns: tuple[str, ...] | None
    """The expert tensors' patterns, for ep (None for a dense model)."""
    experts_split_by_tp: bool
    expert_parallel: bool = True
    """Whether fs.ep runs its experts (torchtitan's grouped experts: tensor parallel only)."""
    units: tuple[tuple[str, ...], ...]
    """The units of work a pipeline deals out to its stages; () without repeated blocks."""


def model_facts(model: Any) -> ModelFacts:
    """What the search needs to know of ``model``, read once.

    Examples:
        >>> from functional_shard.zoo import llama
        >>> facts = model_facts(llama("tiny"))
        >>> facts.heads, facts.experts, len(facts.units)
        ((4, 2), 0, 4)
    """
    rules, no_tensor_parallel = tensor_parallel_rules(model)
    tree = read_model(model)
    if not tree.params:  # every plan of it would be alike: nothing to search
        refuse(
            "model",
            type(model).__name__,
            "a model with parameters",
            meaning="the search chooses how to shard parameters; this model has none",
        )
    experts = expert_count(model, tree)
    patterns = None
    if experts:
        from functional_shard.planning.tp.hf_plans import expert_patterns

        patterns = expert_patterns(model)
    grouped = any(titan_expert_names(module) is not None for module in model.modules())
    return ModelFacts(
        model=model,
        tree=tree,
        heads=head_counts(model),
        block=repeated_block(model),
        rules=rules,
        no_tensor_parallel=no_tensor_parallel,
        experts=experts,
        expert_patterns=patterns,
        experts_split_by_tp=splits_experts(rules, tree),
        expert_parallel=not grouped,
        units=pipeline_units(tree),
    )


def _divisors(n: int) -> list[int]:
    # in pairs (d, n // d) up to the square root: a million devices cost a thousand tries, not a million
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


@dataclass(frozen=True, kw_only=True)
class Space:
    """What the points depend on: the devices, the global batch, the hardware and the model."""

    devices: int
    batch: int
    hardware: Hardware
    heads: tuple[int, int] | None
    """(query heads, key/value heads): a tensor-parallel size divides both."""
    tensor_parallel: bool = True
    """False when no rule set fits the model: data parallelism only."""
    experts: int = 0
    """Experts per layer, which expert-parallel sizes divide (0: no ep, a dense model or ep-less experts)."""
    experts_split_by_tp: bool = False
    """Whether tp reaches inside the experts: then without sequence parallelism."""
    seq: int = 0
    """Tokens per sequence: context-parallel sizes cut it into 2·cp equal chunks (0: no cp)."""

    @classmethod
    def of(cls, facts: ModelFacts, *, devices: int, batch: int, hardware: Hardware, seq: int = 0) -> Space:
        """The space for the model ``facts`` describes."""
        return cls(
            devices=devices,
            batch=batch,
            seq=seq,
            hardware=hardware,
            heads=facts.heads,
            tensor_parallel=facts.rules is not None,
            experts=facts.experts if facts.expert_parallel else 0,
            experts_split_by_tp=facts.experts_split_by_tp,
        )

    def tensor_parallel_sizes(self, ranks: int) -> Iterator[int]:
        """The tp sizes for ``ranks`` devices: inside one node, dividing the heads (1 always)."""
        heads = self.heads
        for size in _divisors(ranks):
            if size == 1 or (
                self.tensor_parallel
                and size <= self.hardware.devices_per_node
                and not (heads and (heads[0] % size or heads[1] % size))
            ):
                yield size


@dataclass(frozen=True)
class Point:
    """One point of the space: a mesh and what runs on it, before checkpointing is chosen."""

    mesh: Mesh
    family: str
    tp: int
    sp: bool
    offload: bool
    pipeline: tuple[str, int, int] | None = None
    ep: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        """The ranks that split the batch (every rank of the mesh outside tp, pp and cp)."""
        pp = self.mesh["pp"] if "pp" in self.mesh else 1  # noqa: SIM401 - a Mesh has no .get
        return self.mesh.size // self.tp // pp // self.cp


def points(space: Space, *, offload: bool = False) -> Iterator[Point]:
    """The points without pipelines: ``dp x tp`` meshes, each data-parallel family, sp and ep."""
    for tp_size in space.tensor_parallel_sizes(space.devices):
        dp = space.devices // tp_size
        if space.batch % dp:
            continue
        tp_axes = {"tp": tp_size} if tp_size > 1 else {}
        for sp in (False, True) if tp_size > 1 and not space.experts_split_by_tp else (False,):
            # one data-parallel rank: the families shard nothing. FSDP2, as the one-GPU rows were
            # measured: its allocations are traced (`Search`), offload possible, and it casts to
            # bf16, which apply() runs through FSDP2 alone (DDP beside tp it does not run at all)
            families = FAMILIES if dp > 1 else ("fsdp",)
            for family in families:
                if offload and family not in ("zero2", "fsdp", "hsdp"):
                    continue
                if family == "hsdp":
                    for shard_size in _divisors(dp)[1:-1]:
                        mesh = Mesh(replicate=dp // shard_size, shard=shard_size, **tp_axes)
                        yield Point(mesh, family, tp_size, sp, offload)
                else:
                    yield Point(Mesh(dp=dp, **tp_axes), family, tp_size, sp, offload)
        if tp_size == 1 and dp > 1 and not offload:
            # ep borrows its axis from the data-parallel ranks, as torchtitan does; apply splits
            # an experts module one way, so not with tp (which would reach inside them too)
            for ep_size in _divisors(space.experts)[1:]:
                if dp % ep_size == 0:
                    yield Point(Mesh(dp=dp // ep_size, ep=ep_size), "fsdp", 1, False, False, ep=ep_size)


MAX_CONTEXT = 16
"""The largest cp size tried: torchtitan's published long-context runs go to 8, Megatron-LM's to 16."""
LONG_SEQUENCE = 32768
"""From here on cp is tried beside the plans without it (below, only when none of them fits)."""


def context_points(space: Space) -> Iterator[Point]:
    """The context-parallel points: ``Mesh(dp, cp)`` with FSDP over both, as torchtitan runs cp.

    A cp size divides the devices and cuts each sequence into 2·cp equal chunks; dp must divide the batch.
    """
    for cp in _divisors(space.devices)[1:]:
        dp = space.devices // cp
        if cp > MAX_CONTEXT or not space.seq or space.seq % (2 * cp) or space.batch % dp:
            continue
        yield Point(Mesh(dp=dp, cp=cp), "fsdp", 1, False, False, cp=cp)


def pipeline_points(space: Space, units: int) -> Iterator[Point]:
    """The pipelines: ``pp x dp x tp`` meshes for ``units`` units of work, FSDP over dp."""
    # torchtitan's layout (pp outermost, then FSDP, tp with sp within a node); up to 8
    # micro-batches per stage (1F1B's bubble under a tenth) and 16 pp ranks, as 405B runs use
    from functional_shard.planning.pipeline.schedules import check_pipeline

    for pp in _divisors(space.devices)[1:]:
        if pp > MAX_PIPELINE:
            break
        for tp_size in space.tensor_parallel_sizes(space.devices // pp):
            dp = space.devices // (pp * tp_size)
            if space.batch % dp:
                continue
            local = space.batch // dp
            for schedule, per_rank in PIPELINE_SCHEDULES:
                if pp * per_rank > units:
                    continue
                microbatches = max(m for m in _divisors(local) if m <= 8 * pp * per_rank)
                try:
                    check_pipeline(schedule, pp, per_rank, microbatches)
                except PolicyError:
                    continue
                mesh = Mesh(pp=pp, dp=dp, **({"tp": tp_size} if tp_size > 1 else {}))
                yield Point(mesh, "fsdp", tp_size, tp_size > 1, False, (schedule, per_rank, microbatches))


def pipeline_units(tree: ModelTree) -> tuple[tuple[str, ...], ...]:
    """Each unit of work torchtitan's cut deals out (embedding, each block, norm + head); () if none."""
    from functional_shard.planning.pipeline.stages import _outer, split_stages

    before, blocks, after = _outer(tree)
    if not blocks:
        return ()
    return split_stages(tree, bool(before) + len(blocks) + bool(after))


def _data_parallel(family: str) -> Policy:
    """The policy of one of FAMILIES, over the axes `points` gives its meshes."""
    match family:
        case "ddp":
            return policies.replicate("dp")
        case "zero1":
            return policies.zero(1, "dp")
        case "zero2":
            return policies.zero(2, "dp")
        case "hsdp":
            return policies.hsdp("replicate", "shard")
    return policies.fsdp("dp")


@dataclass(frozen=True)
class Policies:
    """What turns a point into its policy: the model's rules, block and experts, and the dtype."""

    facts: ModelFacts
    dtype: str | None
    """The mixed-precision dtype; None: fp32."""

    def of(self, point: Point, how: str) -> Policy:
        """The policy of ``point`` with ``how`` checkpointing of the repeated block."""
        if point.ep > 1:
            policy = policies.fsdp(("dp", "ep")) + policies.ep("ep", experts=self.facts.expert_patterns)
        elif point.cp > 1:
            policy = policies.fsdp(("dp", "cp")) + policies.cp("cp")
        else:
            policy = _data_parallel(point.family)
        if point.pipeline is not None:
            schedule, per_rank, microbatches = point.pipeline
            pipe = policies.pipeline(
                "pp", microbatches=microbatches, schedule=schedule, stages_per_rank=per_rank
            )
            policy = pipe + policy
        if point.tp > 1:
            policy = policy + policies.tp(self.facts.rules, "tp", sequence_parallel=point.sp)
        if self.dtype:
            policy = policy + policies.mixed_precision(self.dtype)
        if how != "none" and self.facts.block is not None:
            policy = policy + policies.checkpointing(self.facts.block, policy=how)
        if point.offload:
            policy = policy + policies.offload()
        return policy


def policy_text(policy: Policy) -> str:
    """The policy as the report shows it: its text form, ep's expert patterns left out.

    A layer the text form cannot spell (tp over the rules of the model's structure) is shown by its
    rule set's name; the rest, options included, is text as ever, so candidates stay told apart.
    """
    # ep's expert patterns are what ep(axis) finds in the model again
    layers = [
        dataclasses.replace(layer, experts=None) if isinstance(layer, ExpertParallel) else layer
        for layer in policy.layers
    ]
    terms = [_layer_text(layer) for layer in layers]
    options = format_policy(Policy((), policy.options))
    return " + ".join([*terms, *([options] if options != "none" else [])]) or "none"


def _layer_text(layer: Any) -> str:
    try:
        return format_policy(Policy((layer,)))
    except PolicyError:
        if isinstance(layer, TensorParallel):  # its text, under its rule set's name
            parallel = {"sequence_parallel": layer.sequence_parallel, "loss_parallel": layer.loss_parallel}
            spelled = format_policy(policies.tp("auto", layer.axis, **parallel))
            return spelled.replace("(auto,", f"({layer.rules.name},", 1)
        return str(layer.name)
