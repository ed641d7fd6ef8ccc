"""Tensor-parallel rule sets: ordered (path pattern → spec or module style), first match wins.

A pattern (a glob, ``*`` spanning dots, or a compiled regex) matches a parameter when it fullmatches
its path or an enclosing module's: ``"*.q_proj"`` covers ``layers.0.self_attn.q_proj.weight``. A style
expands to per-parameter specs as torch's styles shard them (`functional_shard.planning.tp.styles`).
`for_model` and `from_hf` pick rules for a model.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import cast

from torch import nn

from functional_shard.core.errors import PolicyError
from functional_shard.core.spec import P
from functional_shard.core.tree import Pattern, TensorSpec

from .sequence_parallel import first_input_name, sequence_gathers, sequence_parallel_problems
from .structural_rules import structural_rules
from .styles import STYLES, Packed, Style, expand_style, packed_problem
from .styles import StyleError as StyleError
from .styles import is_conv1d as is_conv1d
from .styles import layout_of as layout_of

__all__ = [
    "DEFERRED",
    "STYLES",
    "Rule",
    "Rules",
    "Style",
    "for_model",
    "from_hf",
    "gpt2",
    "gpt2_hf",
    "llama",
    "first_input_name",
    "mlp",
    "sequence_gathers",
    "sequence_parallel_problems",
]

DEFERRED: tuple[str, ...] = ("hf", "auto")
"""Rule-set names that ``tp()`` accepts as text and ``shard()`` resolves against the model:
``"hf"`` the model's own Hugging Face plan (`from_hf`), ``"auto"`` `for_model`."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: parameters whose path (or module path) matches get ``target``."""

    pattern: Pattern
    target: P | Style | Packed

    def __post_init__(self) -> None:
        if not isinstance(self.target, P | Packed) and self.target not in STYLES:
            raise PolicyError(
                f"rule {self.pattern!r} has target {self.target!r}; a target is a P(...), "
                f"fs.packed((sizes...)) or one of the styles {STYLES}"
            )

    @property
    def style(self) -> Style | None:
        """The module style this rule gives (a `Packed` target's is ``packed_colwise``); None for a P."""
        if isinstance(self.target, Packed):
            return self.target.style
        return None if isinstance(self.target, P) else self.target

    def matches(self, path: str) -> bool:
        """Whether this rule covers the parameter at ``path`` or a module enclosing it."""
        return _covering(self.pattern).fullmatch(path) is not None

    def spec_for(self, path: str, tensor: TensorSpec, axis: str) -> P:
        """The spec this rule gives the parameter at ``path`` (styles expanded)."""
        if isinstance(self.target, P):
            return self.target
        if isinstance(self.target, Packed):
            if problem := packed_problem(self.target, path, tensor):
                raise StyleError(problem)
            return expand_style(self.target.style, path, tensor, axis)
        return expand_style(self.target, path, tensor, axis)


# only a glob with these characters can tell one block index from another (``layers.3.*``)
_INDEX_SENSITIVE = frozenset("0123456789?[")


def index_free(pattern: Pattern) -> bool:
    """Whether ``pattern`` matches alike in every repeated block (``layers.3.x`` as ``layers.7.x``).

    A compiled regex is never taken to be.

    Examples:
        >>> index_free("*.q_proj"), index_free("layers.?.q_proj"), index_free(re.compile("x"))
        (True, False, False)
    """
    return isinstance(pattern, str) and not _INDEX_SENSITIVE.intersection(pattern)


@functools.lru_cache(maxsize=1024)
def _covering(pattern: Pattern) -> re.Pattern[str]:
    # the pattern, then optionally a dot and the rest of the path (fnmatch's \Z would forbid it)
    source = fnmatch.translate(pattern).removesuffix(r"\Z") if isinstance(pattern, str) else pattern.pattern
    return re.compile(rf"(?:{source})(?:\..*)?", re.S)


@dataclass(frozen=True, slots=True)
class Rules:
    """An ordered rule set; the first matching rule wins.

    Examples:
        >>> rules = Rules([("*.fc1", "colwise"), ("*.fc2", "rowwise")], name="mine")
        >>> rules.match("blocks.0.fc2.weight").target
        'rowwise'
        >>> (rules + [("head", P(None, "tp"))]).name
        'mine+1'
    """

    rules: tuple[Rule, ...]
    strict: bool = False
    name: str = "rules"

    def __init__(
        self,
        rules: Iterable[Rule | tuple[Pattern, P | Style | Packed]],
        *,
        strict: bool = False,
        name: str = "rules",
    ) -> None:
        parsed = []
        for rule in rules:
            if isinstance(rule, Rule):
                parsed.append(rule)
            elif isinstance(rule, tuple) and len(rule) == 2:
                parsed.append(Rule(*rule))
            else:
                raise PolicyError(f"a rule is (pattern, target), got {rule!r}")
        object.__setattr__(self, "rules", tuple(parsed))
        object.__setattr__(self, "strict", strict)
        object.__setattr__(self, "name", name)

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def __add__(self, other: Iterable[Rule | tuple[Pattern, P | Style | Packed]]) -> Rules:
        extra = other if isinstance(other, Rules) else Rules(other)
        label = extra.name if isinstance(other, Rules) else str(len(extra))
        return Rules(
            self.rules + extra.rules, strict=self.strict or extra.strict, name=f"{self.name}+{label}"
        )

    def with_strict(self, strict: bool = True) -> Rules:
        """The same rules; with ``strict`` an unmatched parameter is an error."""
        return Rules(self.rules, strict=strict, name=self.name)

    def match(self, path: str) -> Rule | None:
        """The first rule that covers ``path``, or None."""
        return next((rule for rule in self.rules if rule.matches(path)), None)

    @property
    def deferred(self) -> bool:
        """Whether this is a placeholder (``"hf"``, ``"auto"``) that ``shard()`` resolves."""
        return not self.rules and self.name in DEFERRED


def deferred(name: str) -> Rules:
    """The placeholder for ``tp("hf")`` / ``tp("auto")``, resolved by `resolve` in ``shard()``.

    Raises:
        PolicyError: ``name`` is not one of `DEFERRED`.

    Examples:
        >>> deferred("hf").deferred
        True
    """
    if name not in DEFERRED:
        raise PolicyError(
            f"tp({name!r}): a rule set given by name is one of {DEFERRED} "
            "(or pass fs.rules.llama, fs.rules.gpt2, fs.rules.mlp, or your own Rules)"
        )
    return Rules((), name=name)


def resolve(rules: Rules, model: object) -> Rules:
    """``rules`` itself, or for a placeholder the rules it names for ``model``.

    Raises:
        PolicyError: the model has no such rules (see `from_hf`, `for_model`).

    Examples:
        >>> resolve(mlp, None) is mlp
        True
    """
    if not rules.deferred:
        return rules
    if rules.name == "hf":
        return from_hf(model)
    return for_model(model)


def from_hf(model_or_config: object) -> Rules:
    """Rules from a Hugging Face model's own tensor-parallel plan (see `planning.tp.hf_plans`).

    A config is built into a model on the meta device first.

    Args:
        model_or_config: a transformers ``PreTrainedModel`` or ``PretrainedConfig``.

    Returns:
        Rules named ``"hf"``, one per plan entry that covers a parameter, in plan order.

    Raises:
        PolicyError: not a transformers model or config, no plan, or a style torch cannot run (named).

    Examples:
        >>> import transformers
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
        >>> rules = from_hf(config)
        >>> rules.match("model.layers.0.self_attn.o_proj.weight").target
        'rowwise'
        >>> rules.match("lm_head.weight").target
        'colwise_gather'
    """
    from . import hf_plans as hf

    _, pairs = hf.plan_entries(model_or_config)
    return Rules([Rule(pattern, cast(Style, style)) for pattern, style in pairs], name="hf")


def _misfit(rules: Rules, paths: list[str]) -> str | None:
    # each splitting rule covers some parameter (optional ones aside), and one alternative of
    # each group covers some with all its rules; else why not
    def covered(pattern: Pattern) -> bool:
        return any(_covering(pattern).fullmatch(p) for p in paths)

    patterns = {rule.pattern for rule in rules}
    choices = [group for group in _ALTERNATIVES if patterns & {p for names in group for p in names}]
    either = {pattern for group in choices for names in group for pattern in names}
    missing = [
        str(rule.pattern)
        for rule in rules
        if rule.target not in ("replicate", "sequence")
        and rule.pattern not in _OPTIONAL | either
        and not any(rule.matches(p) for p in paths)
    ]
    missing += [
        " or ".join(str(list(names)) for names in group)
        for group in choices
        if not any(all(covered(pattern) for pattern in names) for names in group)
    ]
    return f"no parameter matches {missing}" if missing else None


def for_model(model: object) -> Rules:
    """HF rules for a transformers model with a plan, else the named set that fits, else its structure's.

    A named set fits when each of its splitting rules covers some parameter; tried in order,
    `gpt2_hf`, `llama`, `gpt2`, `mlp` for a transformers model and `llama`, `torchtitan`, `gpt2`,
    `mlp` for any other. When none fits, rules come from the model's data flow
    (`functional_shard.planning.tp.structural_rules.structural_rules`, named ``"structure"``).

    Args:
        model: the module to split.

    Returns:
        `from_hf` rules, the first named set that fits, or the structure's rules.

    Raises:
        PolicyError: ``model`` is not a module, or nothing fits (every set tried named, with why).

    Examples:
        >>> for_model(nn.ModuleDict({"fc1": nn.Linear(4, 8), "fc2": nn.Linear(8, 4)})).name
        'mlp'
    """
    from . import hf_plans as hf

    if not isinstance(model, nn.Module):
        raise PolicyError(
            f"tp('auto') picks rules from the model's modules; got {type(model).__name__}. "
            "Pass a rule set (fs.rules.llama, ...) when planning a state dict or pytree"
        )
    tried: list[str] = []
    if hf.is_hf_model(model):
        if hf.hf_plan(model):
            return from_hf(model)
        tried.append(f"hf: {type(model).__name__} has no tensor-parallel plan in transformers")
    else:
        tried.append("hf: not a transformers PreTrainedModel")
    paths = [path for path, _ in model.named_parameters(remove_duplicate=False)]
    # gpt2_hf relies on Hugging Face's attention (its split_size), so only HF models get it
    for named in (gpt2_hf, llama, gpt2, mlp) if hf.is_hf_model(model) else (llama, torchtitan, gpt2, mlp):
        why = _misfit(named, paths)
        if why is None:
            return named
        tried.append(f"{named.name}: {why}")
    try:  # no named set fits: rules from the model's structure (its data flow, not its names)
        return Rules(structural_rules(model), name="structure")
    except PolicyError as error:
        tried.append(f"structure: {str(error).removeprefix('tp(' + repr('auto') + '): ')}")
    raise PolicyError(
        "tp('auto'): no rule set fits this model's parameter names, and its structure gives none:\n"
        + "\n".join(f"  - {line}" for line in tried)
        + "\nPass rules of your own: fs.tp([(pattern, 'colwise'), ...], axis)"
    )


# Qwen3's per-head norms of the queries and keys: one weight of head_dim that every head uses,
# so a tp rank, holding some heads, has part of its gradient (torchtitan's NoParallel, transformers'
# replicated_with_grad_allreduce)
_QK_NORM: tuple[tuple[str, Style], ...] = (
    ("*.q_norm", "replicate_grad_allreduce"),
    ("*.k_norm", "replicate_grad_allreduce"),
)

llama = Rules(
    [
        ("*.q_proj", "colwise"),
        ("*.k_proj", "colwise"),
        ("*.v_proj", "colwise"),
        ("*.o_proj", "rowwise"),
        ("*.gate_proj", "colwise"),
        ("*.up_proj", "colwise"),
        ("*.down_proj", "rowwise"),
        ("*embed_tokens", "rowwise"),
        ("*lm_head", "colwise_gather"),
        *_QK_NORM,
        ("*norm", "sequence"),
    ],
    name="llama",
)
"""Hugging Face Llama naming: attention and MLP projections split Megatron-style, the
embedding split over the vocabulary (rowwise), ``lm_head`` colwise with its logits
gathered for the loss, norms replicated (sequence-parallel when `tp` asks for it), Qwen3's per-head
``q_norm``/``k_norm`` with their gradients all-reduced."""

gpt2 = Rules(
    [
        ("*.mlp.c_fc", "colwise"),
        ("*.mlp.c_proj", "rowwise"),
        ("*wte", "rowwise"),
        ("*lm_head", "colwise_gather"),
        ("*.attn.c_attn", "replicate"),
        ("*.attn.c_proj", "replicate"),
        ("*wpe", "replicate"),
        ("*ln_*", "sequence"),
    ],
    name="gpt2",
)
"""GPT-2 naming with ``nn.Linear`` layers (nanoGPT style): MLP and embeddings split, attention
replicated (``c_attn`` packs q, k and v, which a plain column split would mix; see `gpt2_hf`)."""

gpt2_hf = Rules(
    [
        ("*.attn.c_attn", "packed_colwise"),
        ("*.attn.c_proj", "rowwise"),
        ("*.mlp.c_fc", "colwise"),
        ("*.mlp.c_proj", "rowwise"),
        ("*wte", "rowwise"),
        ("*lm_head", "colwise_gather"),
        ("*wpe", "replicate"),
        ("*ln_*", "sequence"),
    ],
    name="gpt2_hf",
)
"""Hugging Face GPT-2 (``Conv1D`` layers), which has no plan in transformers: ``c_attn``
``packed_colwise``, the attention's ``c_proj`` rowwise, the rest as in `gpt2`."""

_TITAN_MOE: tuple[tuple[str, Style], ...] = (
    ("*.moe.router.gate", "replicate"),
    # the grouped experts, each split on its hidden features (f): 0.3.0's
    ("*.moe.experts.w1", "colwise"),
    ("*.moe.experts.w3", "colwise"),
    ("*.moe.experts.w2", "rowwise"),
    # torchtitan's main branch's (styles.TITAN_EXPERT_WEIGHTS): under routed_experts.inner_experts
    # since July 2026, under experts from May
    ("*.moe.routed_experts.inner_experts.w1_EFD", "colwise"),
    ("*.moe.routed_experts.inner_experts.w3_EFD", "colwise"),
    ("*.moe.routed_experts.inner_experts.w2_EDF", "rowwise"),
    ("*.moe.experts.w1_EFD", "colwise"),
    ("*.moe.experts.w3_EFD", "colwise"),
    ("*.moe.experts.w2_EDF", "rowwise"),
    ("*.moe.shared_experts.w1", "colwise"),
    ("*.moe.shared_experts.w3", "colwise"),
    ("*.moe.shared_experts.w2", "rowwise"),
)
# rules a named set may hold that its model need not have (a dense torchtitan model has no MoE)
_OPTIONAL = frozenset(pattern for pattern, _ in (*_TITAN_MOE, *_QK_NORM))

# torchtitan's attention projections and head under each name its releases use (fused
# qkv_linear.wqkv, qkv_linear.wq/wk/wv, attention.wq/wk/wv; lm_head, output)
_TITAN_QKV = (
    ("*.attention.qkv_linear.wqkv",),
    ("*.attention.qkv_linear.wq", "*.attention.qkv_linear.wk", "*.attention.qkv_linear.wv"),
    ("*.attention.wq", "*.attention.wk", "*.attention.wv"),
)
_TITAN_HEAD = (("lm_head",), ("output",))
# groups of alternatives: a named set fits when one alternative of each group covers the model
_ALTERNATIVES: tuple[tuple[tuple[str, ...], ...], ...] = (_TITAN_QKV, _TITAN_HEAD)

torchtitan = Rules(
    [
        *_TITAN_MOE,
        # the fused wqkv is laid out by key/value group, so a column split into whole groups
        # gives each rank its heads of q, k and v, as torchtitan splits it (no piece sizes)
        *((pattern, cast(Style, "colwise")) for names in _TITAN_QKV for pattern in names),
        ("*.attention.wo", "rowwise"),
        ("*.feed_forward.w1", "colwise"),
        ("*.feed_forward.w3", "colwise"),
        ("*.feed_forward.w2", "rowwise"),
        ("tok_embeddings", "rowwise"),
        *((pattern, cast(Style, "colwise_gather")) for (pattern,) in _TITAN_HEAD),
        *_QK_NORM,
        ("*norm", "sequence"),
    ],
    name="torchtitan",
)
"""torchtitan's Llama names, split as `llama` splits Hugging Face's, under each name its releases
use (the fused ``wqkv`` needs tp to divide the key/value heads); mixture-of-experts layers split as
torchtitan splits them (router whole, experts colwise/rowwise per expert), its 0.3.0 names
(``moe.experts.w1``) and its main branch's (``moe.routed_experts.inner_experts.w1_EFD``) alike;
Qwen3's per-head ``q_norm``/``k_norm`` whole, their gradients all-reduced. The attention must read
its local head count from the split projections (``view(..., -1, head_dim)``)."""

mlp = Rules([("*fc1", "colwise"), ("*fc2", "rowwise")], name="mlp")
"""A two-layer MLP (``fc1`` → activation → ``fc2``) split Megatron-style."""
