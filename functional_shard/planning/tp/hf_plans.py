"""Tensor-parallel rules from Hugging Face transformers models' own plans.

`plan_entries` reads a model's combined ``model.tp_plan`` (the class's ``_tp_plan`` and the config's
``base_model_tp_plan`` under the base model's prefix) and maps each style to ours, or refuses it by
name; `functional_shard.planning.tp.rules.from_hf` makes `Rules` of it. transformers is imported only
here, and only to build a model from a config.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from functional_shard.core.errors import PolicyError
from functional_shard.core.tree import is_hf_model

__all__ = [
    "HF_STYLES",
    "REFUSED_HF_STYLES",
    "expert_patterns",
    "expert_top_k",
    "hf_plan",
    "is_hf_model",
    "plan_entries",
]

HF_STYLES: dict[str, str] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather",
    "rowwise_split_input": "rowwise_split_input",
    "rowwise_rep": "rowwise_split_input",
    "embedding_rowwise": "rowwise",
    "embedding_colwise": "colwise",
    "replicated_with_grad_allreduce": "replicate_grad_allreduce",
    "sequence_parallel": "sequence",
    "replicate": "replicate",
    # mixture-of-experts weights (3-D, one (out, in) matrix per expert): gate and up packed in
    # one tensor, each split on its own; the experts module's output all-reduced
    "packed_colwise": "packed_colwise",
    "moe_tp_experts": "moe_tp_experts",
}
"""transformers' style name → ours (the styles of `functional_shard.planning.tp.rules`)."""

REFUSED_HF_STYLES: dict[str, str] = {
    "packed_rowwise": "the rowwise twin of packed_colwise (mixture-of-experts weights)",
    "moe_identity_expert": "part of transformers' expert-parallel routing",
    "mla_kv_a_proj": "multi-head latent attention splits its projection into KV and RoPE parts by hand",
    "local_params": "transformers' local (non-DTensor) parameter path, for quantized weights",
    "all_reduce": "an output all-reduce with no split parameter, outside torch's styles",
}
"""transformers' styles that torch's tensor-parallel styles cannot run, and why."""


def _is_hf_config(value: object) -> bool:
    return any(
        cls.__name__ in ("PretrainedConfig", "PreTrainedConfig")
        and cls.__module__.startswith("transformers.")
        for cls in type(value).__mro__
    )


def _meta_model(config: Any) -> nn.Module:
    import torch
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            try:
                return transformers.AutoModelForCausalLM.from_config(config)
            except ValueError:
                return transformers.AutoModel.from_config(config)
    except ValueError as error:
        raise PolicyError(
            f"fs.rules.from_hf: transformers cannot build a model from {type(config).__name__} ({error})"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def hf_plan(model: nn.Module) -> dict[str, str]:
    """The combined tensor-parallel plan of a transformers model, as transformers combines it.

    Returns:
        Module pattern → transformers style name (``*`` for a layer index); empty when there is none.
    """
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict):
        return dict(plan)
    # older transformers: the class plan, then the base model's config plan under its prefix
    combined = dict(getattr(type(model), "_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    inner = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    combined.update({f"{inner}{key}": style for key, style in base.items()})
    return combined


def _pattern(key: str) -> re.Pattern[str]:
    # transformers' "*" stands for one layer index
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def plan_entries(model_or_config: object) -> tuple[str, list[tuple[re.Pattern[str], str]]]:
    """The model's class name and its plan as (pattern, our style) pairs, in the plan's order.

    A config is built into a model on the meta device to read the plan and its parameter paths.

    Args:
        model_or_config: a ``PreTrainedModel`` or a ``PretrainedConfig``.

    Returns:
        ``(class name, pairs)``: one per plan entry covering a parameter, its style mapped by `HF_STYLES`.

    Raises:
        PolicyError: not a transformers model or config, no plan, or a style torch cannot run (named).

    Examples:
        >>> import transformers
        >>> name, pairs = plan_entries(transformers.LlamaConfig(num_hidden_layers=1))
        >>> name, pairs[0][1]
        ('LlamaForCausalLM', 'colwise_gather')
    """
    if _is_hf_config(model_or_config):
        model = _meta_model(model_or_config)
    elif is_hf_model(model_or_config):
        model = model_or_config  # type: ignore[assignment]
    else:
        raise PolicyError(
            f"fs.rules.from_hf needs a transformers PreTrainedModel or PretrainedConfig, got "
            f"{type(model_or_config).__name__}; for other models use fs.rules.for_model or a named set"
        )
    plan = hf_plan(model)
    name = type(model).__name__
    if not plan:
        raise PolicyError(
            f"{name} has no tensor-parallel plan in transformers (config.base_model_tp_plan and "
            f"{name}._tp_plan are empty); give tp() rules of your own"
            + (", e.g. fs.rules.gpt2_hf (tp('auto') picks it)" if name.startswith("GPT2") else "")
        )
    paths = [path for path, _ in model.named_parameters(remove_duplicate=False)]
    pairs: list[tuple[re.Pattern[str], str]] = []
    refused: list[str] = []
    for key, style in plan.items():
        pattern = _pattern(key)
        covered = [p for p in paths if re.fullmatch(rf"(?:{pattern.pattern})(?:\..*)?", p)]
        if not covered:
            continue  # an entry for modules this configuration does not build
        if style in HF_STYLES:
            pairs.append((pattern, HF_STYLES[style]))
        else:
            why = REFUSED_HF_STYLES.get(style, "transformers style unknown to functional_shard")
            refused.append(f"{covered[0]}: plan entry {key!r} has style {style!r}: {why}")
    if refused:
        raise PolicyError(
            f"{name}'s tensor-parallel plan uses styles torch's tensor parallel cannot run:\n"
            + "\n".join(f"  - {line}" for line in refused)
            + "\nGive tp() rules of your own (fs.tp([(pattern, 'colwise'), ...], axis)) that leave "
            "these modules whole, or shard this model with data parallelism only."
        )
    return name, pairs + _residual_norms(model, pairs)


_SPLIT_STYLES = ("colwise", "colwise_gather")


def _residual_norms(
    model: nn.Module, pairs: list[tuple[re.Pattern[str], str]]
) -> list[tuple[re.Pattern[str], str]]:
    # transformers' plans name the projections only; under sequence parallel the norms between
    # them see this rank's tokens and need SequenceParallel. Norms inside a module with split
    # projections (Qwen3's q_norm) see gathered activations and keep the plan's style.
    split = [
        path
        for path, module in model.named_modules()
        if not isinstance(module, nn.Embedding)
        and any(style in _SPLIT_STYLES and pattern.fullmatch(path) for pattern, style in pairs)
    ]
    inner = {path.rpartition(".")[0] for path in split}
    found: dict[str, None] = {}
    for path, module in model.named_modules():
        owned = any(True for _ in module.parameters(recurse=False))
        covered = any(re.fullmatch(rf"(?:{p.pattern})(?:\..*)?", path) for p, _ in pairs)
        inside = any(path.startswith(f"{parent}.") for parent in inner if parent)
        if owned and "Norm" in type(module).__name__ and not covered and not inside:
            found.setdefault(re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(path)))
    return [(re.compile(pattern), "sequence") for pattern in found]


def pp_pieces(model: object) -> tuple[str, ...] | None:
    """A transformers model's pipeline pieces in forward order, from its ``base_model_pp_plan``.

    The base model's pieces under its prefix, then the class's own; None without a pipeline plan.

    Examples:
        >>> import torch, transformers
        >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, vocab_size=64)
        >>> with torch.device("meta"):
        ...     model = transformers.LlamaForCausalLM(config)
        >>> pp_pieces(model)
        ('model.embed_tokens', 'model.layers', 'model.norm', 'lm_head')
    """
    if not is_hf_model(model):
        return None
    base = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
    if not isinstance(base, dict) or not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    inner = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    pieces = [f"{inner}{key}" for key in base]
    combined = getattr(model, "_pp_plan", None) or getattr(type(model), "_pp_plan", None) or {}
    pieces += [key for key in combined if key not in pieces and not (inner and key.startswith(inner))]
    return tuple(pieces)


def hidden_size(model: object) -> int | None:
    """The residual stream's width a transformers model's config names (None otherwise)."""
    if not is_hf_model(model):
        return None
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    return size if isinstance(size, int) else None


# transformers' expert-parallel styles on the expert weights themselves (base_model_ep_plan)
_EP_WEIGHT_STYLES = ("grouped_gemm",)


def _ep_plan_patterns(model: nn.Module) -> tuple[str, ...]:
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = f"{prefix}." if prefix and hasattr(model, prefix) and getattr(model, prefix) is not model else ""
    return tuple(f"{inner}{key}" for key, style in plan.items() if style in _EP_WEIGHT_STYLES)


def expert_patterns(model: object) -> tuple[str, ...]:
    """Glob patterns (``*`` for a layer index) of a model's expert tensors, for `fs.ep`.

    From a transformers config's ``base_model_ep_plan``, else every 3-D parameter of a module named like
    ``experts`` (not a shared expert).

    Raises:
        PolicyError: no expert tensor found; the message says how to name them.

    Examples:
        >>> import torch
        >>> model = nn.ModuleDict({"experts": nn.ParameterDict({"w": nn.Parameter(torch.zeros(4, 2, 2))})})
        >>> expert_patterns(model)
        ('experts.w',)
    """
    from functional_shard.core.tree import matches, read_model

    tree = read_model(model)
    if is_hf_model(model):
        from_plan = _ep_plan_patterns(model)  # type: ignore[arg-type]
        if any(matches(pattern, path) for pattern in from_plan for path in tree.params):
            return from_plan
    found: dict[str, None] = {}
    for path, tensor in tree.params.items():
        owner = path.rpartition(".")[0].rpartition(".")[2].lower()
        if tensor.ndim == 3 and "experts" in owner:
            found.setdefault(re.sub(r"\.\d+\.", ".*.", path))
    if not found:
        raise PolicyError(
            "fs.ep: found no expert tensors: no base_model_ep_plan entry covers a parameter, and no "
            "module named like 'experts' holds a 3-D parameter. Name them: fs.ep(axis, "
            "experts='*.experts.*')"
        )
    return tuple(found)


def expert_top_k(model: Any) -> int:
    """Experts each token visits in ``model``'s mixture-of-experts layers (0: none found).

    From a transformers config's ``num_experts_per_tok``, else a router module's ``top_k``.

    Examples:
        >>> import torch.nn as nn
        >>> router = nn.Linear(4, 8)
        >>> router.top_k = 2
        >>> expert_top_k(nn.Sequential(router)), expert_top_k(nn.Linear(2, 2))
        (2, 0)
    """
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if isinstance(top_k, int) and top_k > 0:
        return top_k
    modules = model.modules() if callable(getattr(model, "modules", None)) else ()
    for module in modules:
        found = getattr(module, "top_k", None)
        if isinstance(found, int) and found > 0:
            return found
    return 0
