"""Tensor-parallel rule sets: ordered (path pattern → spec or module style), first match wins.

A pattern matches a parameter when it fullmatches the parameter's path or any enclosing
module path, so ``"*.q_proj"`` covers ``layers.0.self_attn.q_proj.weight`` and ``.bias``.
Glob patterns (``*`` spans dots) or compiled regexes. A style (``colwise``, ``rowwise``,
...) expands to per-parameter specs by the owning module's type, as torch's parallel
styles shard them (`functional_shard.planning.tp.styles` has the table).

`for_model` and `from_hf` (Hugging Face models' own plans, `functional_shard.planning.tp.hf_plans`) pick
rules for a model. The styles and what sequence parallel gathers
(`functional_shard.planning.tp.sequence_parallel`) are importable from here too.
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


# A glob of these characters can tell one block index from another (``layers.3.*``,
# ``layers.?.*``); any other glob matches ``layers.3.x`` exactly when it matches
# ``layers.7.x``: its literals cannot match the digits, so only a ``*`` spans them.
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
    # "matches the path or an enclosing module path" as one regex: the pattern, then
    # optionally a dot and the rest of the path
    # (fnmatch's translation ends in \Z, which would forbid the suffix)
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

    The plan is read as transformers combines it (``model.tp_plan``: the class's
    ``_tp_plan``, the config's ``base_model_tp_plan`` under the base model's prefix); a
    config is built into a model on the meta device first.

    Args:
        model_or_config: a transformers ``PreTrainedModel`` or ``PretrainedConfig``.

    Returns:
        Rules named ``"hf"``, one per plan entry that covers a parameter, in plan order.

    Raises:
        PolicyError: not a transformers model or config, the model has no plan, or the
            plan uses a style torch's tensor parallel cannot run (named, with its path).

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
    # a named set fits when each of its splitting rules covers some parameter, an optional
    # one aside, and each group of alternative names has one alternative all of whose rules
    # cover some; else why not
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

    A named set (`gpt2_hf` for Hugging Face models, then `llama`, `torchtitan` for other
    models, `gpt2`, `mlp`, in that order) fits when each of its splitting rules covers
    some parameter of the model (where torchtitan's names changed between versions, one
    version's names suffice). When none fits, rules are derived from the model's data
    flow (`functional_shard.planning.tp.structural_rules.structural_rules`, named ``"structure"``):
    in each repeated block the projections reading the residual stream colwise, those
    writing back into it rowwise, the embedding and head as `llama` splits them.

    Args:
        model: the module to split.

    Returns:
        `from_hf` rules, or the first named set that fits.

    Raises:
        PolicyError: ``model`` is not a module, or no rule set fits and the structure
            gives none; the message names every set tried and why it did not fit, and each
            module the structure could not classify.

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
        ("*norm", "sequence"),
    ],
    name="llama",
)
"""Hugging Face Llama naming: attention and MLP projections split Megatron-style, the
embedding split over the vocabulary (rowwise), ``lm_head`` colwise with its logits
gathered for the loss, norms replicated (sequence-parallel when `tp` asks for it)."""

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
"""GPT-2 naming with ``nn.Linear`` layers (nanoGPT/minGPT style). The MLP and embeddings
are split; attention stays replicated because ``c_attn`` packs q, k and v in one output
dim, so a plain column split would hand each rank a mix of the three rather than whole
heads (for Hugging Face's GPT-2, whose attention says how q, k and v are packed, see
`gpt2_hf`)."""

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
"""Hugging Face GPT-2 (``GPT2LMHeadModel``, ``Conv1D`` layers, weight ``(in, out)``), which
has no tensor-parallel plan in transformers: ``c_attn`` packs q, k and v in its output, so
it is ``packed_colwise`` (each rank holds its heads of each), the attention's ``c_proj``
rowwise; the MLP and the embeddings split as in `gpt2`. `for_model` picks it for HF GPT-2."""

_TITAN_MOE: tuple[tuple[str, Style], ...] = (
    ("*.moe.router.gate", "replicate"),
    ("*.moe.experts.w1", "colwise"),
    ("*.moe.experts.w3", "colwise"),
    ("*.moe.experts.w2", "rowwise"),
    ("*.moe.shared_experts.w1", "colwise"),
    ("*.moe.shared_experts.w3", "colwise"),
    ("*.moe.shared_experts.w2", "rowwise"),
)
# rules a named set may hold that its model need not have (a dense torchtitan model has no MoE)
_OPTIONAL = frozenset(pattern for pattern, _ in _TITAN_MOE)

# torchtitan's attention projections and head, under the names of each version: 0.3.0's
# fused qkv_linear.wqkv (or, unfused, qkv_linear.wq/wk/wv) and lm_head; earlier,
# attention.wq/wk/wv and output
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
        # 0.3.0 lays the fused wqkv out by key/value group (each group's query heads, its
        # key, its value), so a plain column split into whole groups gives each rank its
        # heads of q, k and v: torchtitan itself splits it colwise, and no piece sizes are
        # needed. The group size is the module's (its qkv_linear's head_dim and r_dim): apply
        # refuses a tensor-parallel size that does not divide the key/value heads.
        *((pattern, cast(Style, "colwise")) for names in _TITAN_QKV for pattern in names),
        ("*.attention.wo", "rowwise"),
        ("*.feed_forward.w1", "colwise"),
        ("*.feed_forward.w3", "colwise"),
        ("*.feed_forward.w2", "rowwise"),
        ("tok_embeddings", "rowwise"),
        *((pattern, cast(Style, "colwise_gather")) for (pattern,) in _TITAN_HEAD),
        ("*norm", "sequence"),
    ],
    name="torchtitan",
)
"""torchtitan's Llama names, split as `llama` splits Hugging Face's: 0.3.0's fused
``attention.qkv_linear.wqkv`` colwise (laid out by key/value group, so whole groups per rank:
the tensor-parallel size must divide the key/value heads) or its unfused
``qkv_linear.wq/wk/wv``, and the older ``attention.wq/wk/wv``; ``attention.wo`` rowwise,
``feed_forward.w1/w3`` colwise, ``w2`` rowwise, ``tok_embeddings`` over the vocabulary, the
head ``lm_head`` (older: ``output``) colwise with its logits gathered. A model fits with
either version's names. The attention must read its local head count from the split
projections (``view(..., -1, head_dim)``), as torchtitan's does. Its mixture-of-experts layers
(DeepSeek V3, Llama 4) split as torchtitan splits them: the router's ``moe.router.gate``
whole, the grouped experts' 3-D ``moe.experts.w1/w3`` ``[E, f, d]`` colwise (dim 1) and
``w2`` ``[E, d, f]`` rowwise (dim 2), their output all-reduced, and ``moe.shared_experts``
as a feed-forward. A dense model fits without them."""

mlp = Rules([("*fc1", "colwise"), ("*fc2", "rowwise")], name="mlp")
"""A two-layer MLP (``fc1`` → activation → ``fc2``) split Megatron-style."""
