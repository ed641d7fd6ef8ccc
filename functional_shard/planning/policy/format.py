"""Policies written back as text: `format_policy`, the inverse of `parse_policy`.

A part text cannot say (a policy function, a custom rule set, a compiled pattern) is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from functional_shard.core.errors import PolicyError
from functional_shard.core.validate import instance_of
from functional_shard.planning.tp import rules as rules_module
from functional_shard.planning.tp.rules import DEFERRED

from .builders import CHECKPOINT_POLICIES
from .types import ContextParallel, DataParallel, ExpertParallel, Pipeline, Policy, TensorParallel

__all__ = ["OFFLOAD_PARTS", "RULE_SETS", "SHORT_DTYPES", "format_policy"]

RULE_SETS = ("llama", "torchtitan", "gpt2", "gpt2_hf", "mlp")
"""The named rule sets of `functional_shard.planning.tp.rules` that text can name."""
OFFLOAD_PARTS = ("params", "grads", "optimizer")
"""What ``offload(...)`` can keep in host memory."""
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
"""The short name text gives each dtype ``mixed_precision`` takes."""


def _format_axes(axes: Sequence[str]) -> str:
    return ", ".join(_format_name(axis) for axis in axes)


def _format_name(name: str) -> str:
    reserved = {"true", "false", "none", *CHECKPOINT_POLICIES}
    return name if name.isidentifier() and name.lower() not in reserved else repr(name)


def _format_selector(selector: Any) -> str:
    if isinstance(selector, tuple):  # a group of modules: one unit
        return "(" + ", ".join(_format_selector(member) for member in selector) + ",)"
    if isinstance(selector, type):
        return selector.__name__
    if isinstance(selector, str):
        return repr(selector)
    raise PolicyError(f"selector {selector!r} has no text form; use a module class or a glob pattern")


def _format_data_parallel(layer: DataParallel) -> str:
    extra = []
    if layer.units is not None:
        extra.append("units=(" + ", ".join(_format_selector(u) for u in layer.units) + ",)")
    if layer.min_params is not None:
        extra.append(f"min_params={layer.min_params}")
    one_axis = len(layer.shard_axes) == 1
    if layer.kind == "ddp":
        return "ddp" if layer.replicate_axes is None else f"ddp({_format_axes(layer.replicate_axes)})"
    if layer.kind in ("zero1", "zero3") or (layer.kind == "zero2" and one_axis and not extra):
        return f"zero({layer.kind[-1]}, {_format_name(layer.shard_axes[0])})"
    if not layer.reshard_after_forward:
        extra.insert(0, "reshard_after_forward=false")
    suffix = "".join(", " + e for e in extra)
    if layer.kind == "hsdp":
        replicate_axes = layer.replicate_axes or ()
        parts = [
            _format_axes(axes) if len(axes) == 1 else f"({_format_axes(axes)})"
            for axes in (replicate_axes, layer.shard_axes)
        ]
        return f"hsdp({parts[0]}, {parts[1]}{suffix})"
    return f"fsdp({_format_axes(layer.shard_axes)}{suffix})"


def _format_tensor_parallel(layer: TensorParallel) -> str:
    rules = layer.rules
    name = rules if isinstance(rules, str) else getattr(rules, "name", None)
    known = name in DEFERRED or (name in RULE_SETS and rules == getattr(rules_module, str(name)))
    if not known:
        raise PolicyError(
            f"tp rules {name!r} have no text form: only the named sets "
            f"{', '.join(RULE_SETS + DEFERRED)} can be written as text"
        )
    loss = ", loss_parallel=true" if layer.loss_parallel else ""
    return f"{'sp' if layer.sequence_parallel else 'tp'}({name}, {_format_name(layer.axis)}{loss})"


def _format_tuple(items: Iterable[str]) -> str:
    listed = list(items)
    return "(" + ", ".join(listed) + ("," if len(listed) == 1 else "") + ")"


def _format_pipeline(layer: Pipeline) -> str:
    parts = [_format_name(layer.axis), f"microbatches={layer.microbatches}"]
    if layer.schedule != "1f1b":
        parts.append(f"schedule={_format_name(layer.schedule)}")
    if layer.stages_per_rank != 1:
        parts.append(f"stages_per_rank={layer.stages_per_rank}")
    if layer.split is not None:
        parts.append("split=" + _format_tuple(_format_tuple(_format_name(p) for p in s) for s in layer.split))
    return f"pipeline({', '.join(parts)})"


def _format_expert_parallel(layer: ExpertParallel) -> str:
    if layer.experts is None:
        return f"ep({_format_name(layer.axis)})"
    if not all(isinstance(p, str) for p in layer.experts):
        raise PolicyError(f"{layer.name}: compiled expert patterns have no text form; use globs")
    patterns = ", ".join(repr(p) for p in layer.experts)
    return f"ep({_format_name(layer.axis)}, experts=({patterns},))"


def format_policy(policy: Policy) -> str:
    """The text `parse_policy` reads back as ``policy`` (the inverse, for policies text can say).

    Args:
        policy: the policy.

    Returns:
        Its text: ``parse_policy(format_policy(p), model) == p`` for a ``model`` with the classes it names.

    Raises:
        PolicyError: a part with no text form (a policy function, a custom rule set).

    Examples:
        >>> fs.format_policy(fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp", sequence_parallel=True))
        'fsdp(dp) + sp(llama, tp)'
        >>> fs.format_policy(fs.zero(1, "dp") + fs.mixed_precision(torch.float16, None))
        'zero(1, dp) + mixed_precision(fp16, none)'
        >>> fs.format_policy(fs.pipeline("pp", microbatches=8, schedule="zbv", stages_per_rank=2))
        'pipeline(pp, microbatches=8, schedule=zbv, stages_per_rank=2)'
    """
    meaning = "fs.fsdp(...) + fs.tp(...), or fs.parse_policy(text)"
    instance_of(policy, Policy, "policy", meaning=meaning, error=PolicyError)
    terms: list[str] = []
    for layer in policy.layers:
        if isinstance(layer, DataParallel):
            terms.append(_format_data_parallel(layer))
        elif isinstance(layer, TensorParallel):
            terms.append(_format_tensor_parallel(layer))
        elif isinstance(layer, Pipeline):
            terms.append(_format_pipeline(layer))
        elif isinstance(layer, ExpertParallel):
            terms.append(_format_expert_parallel(layer))
        elif isinstance(layer, ContextParallel):
            balance = "" if layer.load_balance else ", load_balance=false"
            engine = "" if layer.engine == "auto" else f", engine={layer.engine}"
            terms.append(f"cp({_format_name(layer.axis)}{balance}{engine})")
        else:
            raise PolicyError(f"policy layer {layer.name} is a function and has no text form")
    options = policy.options
    if options.param_dtype is not None:
        param = SHORT_DTYPES.get(options.param_dtype, options.param_dtype)
        reduce = (
            SHORT_DTYPES.get(options.reduce_dtype, options.reduce_dtype) if options.reduce_dtype else "none"
        )
        if param in ("bf16", "fp16") and reduce == "fp32":
            terms.append(param)
        else:
            terms.append(f"mixed_precision({param}, {reduce})")
    elif options.reduce_dtype is not None:
        raise PolicyError("a reduce dtype without a parameter dtype has no text form")
    parts = [(part, getattr(options, f"offload_{part}")) for part in OFFLOAD_PARTS]
    if any(flag is not None for _, flag in parts):
        if all(flag for _, flag in parts):
            terms.append("offload")
        elif any(flag for _, flag in parts):
            terms.append("offload(" + ", ".join(part for part, flag in parts if flag) + ")")
        else:
            terms.append(
                "offload(" + ", ".join(f"{part}={str(bool(flag)).lower()}" for part, flag in parts) + ")"
            )
    if options.checkpoint is not None:
        selectors = ", ".join(_format_selector(s) for s in options.checkpoint)
        checkpoint_policy = getattr(options, "checkpoint_policy", None) or "full"
        terms.append(
            f"checkpointing({selectors})"
            if checkpoint_policy == "full"
            else f"checkpointing({selectors}, {checkpoint_policy})"
        )
    return " + ".join(terms) or "none"
