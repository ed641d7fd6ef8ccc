"""Tensor-parallel rule sets: ordered (path pattern → spec or module style), first match wins.

A pattern matches a parameter when it fullmatches the parameter's path or any enclosing
module path, so ``"*.q_proj"`` covers ``layers.0.self_attn.q_proj.weight`` and ``.bias``.
Glob patterns (``*`` spans dots) or compiled regexes. A style expands to per-parameter
specs by the owning module's type, as torch's parallel styles shard them:

| style      | nn.Linear (out, in)          | nn.Embedding (num, dim) |
|------------|------------------------------|-------------------------|
| colwise    | weight P(tp, None), bias P(tp) | weight P(None, tp)    |
| colwise_gather | as colwise; the output is all-gathered | —             |
| rowwise    | weight P(None, tp), bias P()   | weight P(tp, None)    |
| rowwise_split_input | as rowwise; a whole input is split here | —        |
| packed_colwise | as colwise, each packed piece split on its own | —     |
| sequence   | replicated (activations split on the sequence dim) | — |
| replicate_grad_allreduce | replicated; gradients all-reduced | —           |
| replicate  | replicated                   | replicated              |
| moe_tp_experts | (marks an experts module whose 3-D weights are split; replicated otherwise) | — |

Mixture-of-experts weights stacked in 3-D tensors (Hugging Face's ``gate_up_proj``
``[E, 2f, d]`` and ``down_proj`` ``[E, d, f]``, each expert an (out, in) matrix) split per
expert as a Linear would: colwise (and packed_colwise) on dim 1, rowwise on dim 2.

Hugging Face's ``Conv1D`` (GPT-2) stores its weight ``(in, out)``, the transpose of
``nn.Linear``'s: colwise splits its dim 1, rowwise its dim 0.

Buffers of a styled module stay replicated: torch's styles distribute parameters only.
`for_model` and `from_hf` (Hugging Face models' own plans, `functional_shard.planning.hf`) pick
rules for a model.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias, cast, get_args

from torch import nn

from functional_shard.core.errors import PolicyError
from functional_shard.core.spec import P
from functional_shard.core.tree import Pattern, TensorSpec

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

Style: TypeAlias = Literal[
    "colwise",
    "colwise_gather",
    "rowwise",
    "rowwise_split_input",
    "packed_colwise",
    "sequence",
    "replicate_grad_allreduce",
    "replicate",
    "moe_tp_experts",
]
STYLES: tuple[str, ...] = get_args(Style)
"""``colwise_gather`` splits like ``colwise`` and all-gathers the output, for a final
projection whose whole output the loss needs (torch's ``ColwiseParallel(output_layouts=
Replicate())``). ``rowwise_split_input`` splits like ``rowwise`` but takes a whole
(replicated) input and slices it locally, after a ``colwise_gather`` layer (Hugging
Face's Phi-3). ``replicate_grad_allreduce`` keeps a module whole on every rank while it
sees only this rank's heads (a per-head norm after a colwise projection): its gradient is
a partial sum, all-reduced over the tensor-parallel axis. ``packed_colwise`` is for a
projection whose output packs equal pieces (GPT-2's ``c_attn``: q, k, v): each piece is
split on its own, so every rank holds its heads of each (a strided split: the spec says
how much each rank holds, the pieces say which part); the attention module's
``split_size`` tells the pieces apart, and apply shrinks it and ``num_heads`` to this
rank's share, as torch tensor-parallel users adjust head counts."""

DEFERRED: tuple[str, ...] = ("hf", "auto")
"""Rule-set names that ``tp()`` accepts as text and ``shard()`` resolves against the model:
``"hf"`` the model's own Hugging Face plan (`from_hf`), ``"auto"`` `for_model`."""


class StyleError(Exception):
    """A style that torch's tensor parallel cannot apply to this parameter (internal)."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: parameters whose path (or module path) matches get ``target``."""

    pattern: Pattern
    target: P | Style

    def __post_init__(self) -> None:
        if not isinstance(self.target, P) and self.target not in STYLES:
            raise PolicyError(
                f"rule {self.pattern!r} has target {self.target!r}; a target is a P(...) "
                f"or one of the styles {STYLES}"
            )

    def matches(self, path: str) -> bool:
        """Whether this rule covers the parameter at ``path`` or a module enclosing it."""
        return _covering(self.pattern).fullmatch(path) is not None

    def spec_for(self, path: str, tensor: TensorSpec, axis: str) -> P:
        """The spec this rule gives the parameter at ``path`` (styles expanded)."""
        if isinstance(self.target, P):
            return self.target
        return expand_style(self.target, path, tensor, axis)


@functools.lru_cache(maxsize=1024)
def _covering(pattern: Pattern) -> re.Pattern[str]:
    # "matches the path or an enclosing module path" as one regex: the pattern, then
    # optionally a dot and the rest of the path
    # (fnmatch's translation ends in \Z, which would forbid the suffix)
    source = fnmatch.translate(pattern).removesuffix(r"\Z") if isinstance(pattern, str) else pattern.pattern
    return re.compile(rf"(?:{source})(?:\..*)?", re.S)


def is_conv1d(module_name: str | None) -> bool:
    """Whether ``module_name`` is Hugging Face's ``Conv1D`` (GPT-2), without importing it.

    Examples:
        >>> is_conv1d("transformers.pytorch_utils.Conv1D"), is_conv1d("torch.nn.modules.linear.Linear")
        (True, False)
    """
    return (
        module_name is not None
        and module_name.startswith("transformers.")
        and module_name.endswith(".Conv1D")
    )


def layout_of(tensor: TensorSpec) -> str:
    """How torch's styles see the owning module: "linear", "embedding", "conv1d", "experts" or "other".

    A bare pytree (no module type) is read with the Linear (out, in) layout; "conv1d" is
    Hugging Face's ``Conv1D``, weight (in, out); "experts" a 3-D parameter of any other
    module: a stack of per-expert (out, in) matrices (mixture-of-experts weights).
    """
    if tensor.module_is(nn.Linear):
        return "linear"
    if tensor.module_is(nn.Embedding):
        return "embedding"
    if is_conv1d(tensor.module_name):
        return "conv1d"
    if tensor.ndim == 3 and tensor.kind != "buffer" and not (tensor.module_name or "").startswith("torch."):
        return "experts"
    if tensor.module_name is None:  # a bare pytree: assume the (out, in) Linear layout
        return "linear"
    return "other"


def expand_style(style: Style, path: str, tensor: TensorSpec, axis: str) -> P:
    """The spec that torch's ``style`` gives the parameter ``path`` of ``tensor``'s module.

    Raises:
        StyleError: torch has no such style for this module type or parameter.
    """
    whole = ("sequence", "replicate", "replicate_grad_allreduce", "moe_tp_experts")
    if style in whole or tensor.kind == "buffer":
        return P()
    layout = layout_of(tensor)
    name = path.rpartition(".")[2]
    # the edge variants split their parameters as the plain styles do
    split = {"colwise_gather": "colwise", "rowwise_split_input": "rowwise", "packed_colwise": "colwise"}.get(
        style, style
    )
    if layout == "other":
        raise StyleError(
            f"style {split!r} on a {tensor.module_name}: torch's ColwiseParallel and "
            "RowwiseParallel support nn.Linear and nn.Embedding only (functional_shard splits "
            "Hugging Face's Conv1D too). Give this path a P(...) rule, or 'replicate'"
        )
    if layout == "experts":
        # each expert's (out, in) matrix split as a Linear's: the packed gate/up pieces are told
        # apart by halving dim 1 (gate then up), which apply splits piece by piece
        return P(None, axis, None) if split == "colwise" else P(None, None, axis)
    if style == "packed_colwise" and layout == "embedding":
        raise StyleError(
            f"style 'packed_colwise' on an embedding ({path}): only projections pack pieces in their "
            "output; use 'colwise' or 'rowwise'"
        )
    if name == "weight" and tensor.ndim == 2:
        split_dim = {
            ("linear", "colwise"): 0,
            ("linear", "rowwise"): 1,
            ("embedding", "colwise"): 1,
            ("embedding", "rowwise"): 0,
            ("conv1d", "colwise"): 1,
            ("conv1d", "rowwise"): 0,
        }[(layout, split)]
        return P(*(axis if dim == split_dim else None for dim in range(2)))
    if name == "bias" and tensor.ndim == 1 and layout in ("linear", "conv1d"):
        # a packed bias stays whole: each rank slices its pieces in forward (see apply)
        return P(axis) if split == "colwise" and style != "packed_colwise" else P()
    raise StyleError(
        f"style {split!r} does not know how to split {name!r} of shape {tensor.shape} "
        f"in a {tensor.module_name}; give this path a P(...) rule"
    )


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
        rules: Iterable[Rule | tuple[Pattern, P | Style]],
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

    def __add__(self, other: Iterable[Rule | tuple[Pattern, P | Style]]) -> Rules:
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


_GATHERED_STYLES = ("colwise", "colwise_gather", "packed_colwise")


def sequence_gathers(tp_styles: Iterable[tuple[str, str, str]]) -> tuple[str, ...]:
    """Modules that gather the sequence under sequence parallel: attention and MLP blocks.

    Under sequence parallel the residual stream holds each rank's part of the sequence. As
    torchtitan does, the module holding column-split projections (a layer's ``self_attn``
    or ``mlp``) all-gathers its input over the sequence once, on entry (torch's
    ``PrepareModuleInput``), and the projections inside take that whole input; the
    row-split projections inside reduce-scatter their outputs back over the sequence.
    A column-split layer whose parent also holds other such modules or an embedding (the
    model around ``lm_head``) gathers its own input.

    Args:
        tp_styles: ``(module path, style, layout)`` as ``PlanConfig.tp_styles`` holds them.

    Returns:
        The parent module path of column-split projections (embeddings aside), innermost
        only and holding no split embedding, in first-seen order.

    Examples:
        >>> sequence_gathers([("embed", "rowwise", "embedding"),
        ...     ("layers.0.mlp.up_proj", "colwise", "linear"),
        ...     ("layers.0.mlp.down_proj", "rowwise", "linear"),
        ...     ("lm_head", "colwise_gather", "linear")])
        ('layers.0.mlp',)
    """
    return _sequence_gathers(tuple(tp_styles))


def _ancestors(path: str) -> Iterator[str]:
    """The module paths strictly enclosing ``path``, innermost first ("" encloses every other)."""
    while path:
        path = path.rpartition(".")[0]
        yield path


@functools.lru_cache(maxsize=256)
def _sequence_gathers(styles: tuple[tuple[str, str, str], ...]) -> tuple[str, ...]:
    # a search plans many meshes with one set of styles: worked out once per set
    candidates: dict[str, None] = {}
    for path, style, kind in styles:
        if style in _GATHERED_STYLES and kind != "embedding":
            candidates.setdefault(path.rpartition(".")[0])

    # a candidate that encloses another one, or a split embedding, does not gather
    enclosing = {a for path in candidates for a in _ancestors(path)}
    enclosing |= {a for path, _, kind in styles if kind == "embedding" for a in _ancestors(path)}
    return tuple(parent for parent in candidates if parent not in enclosing)


def first_input_name(module: nn.Module) -> str | None:
    """The first parameter of ``module.forward`` that can be passed by position or by name.

    Examples:
        >>> first_input_name(nn.Linear(2, 2))
        'input'
    """
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    return next((p.name for p in parameters if p.kind in kinds), None)


# functional_shard splits these on Hugging Face's Conv1D itself (and packed projections)
_OWN_SPLIT_STYLES = ("colwise", "packed_colwise", "rowwise")


def sequence_parallel_problems(
    tp_styles: tuple[tuple[str, str, str], ...], modules: Mapping[str, nn.Module]
) -> list[str]:
    """What sequence parallel cannot run of ``tp_styles`` on these modules, one line each.

    Pure (the modules may live on the meta device): `functional_shard.apply` and the
    activation trace refuse the same.

    Args:
        tp_styles: ``(module path, style, layout)`` as ``PlanConfig.tp_styles`` holds them.
        modules: the model's modules by path (``dict(model.named_modules())``).

    Examples:
        >>> model = nn.Sequential(nn.LayerNorm(4), nn.Sequential(nn.Linear(4, 4)))
        >>> sequence_parallel_problems((("1.0", "colwise", "linear"),), dict(model.named_modules()))[0][:40]
        '0: a LayerNorm with weights but no tenso'
    """
    gathering = sequence_gathers(tp_styles)
    gathers = set(gathering)
    styled = {path for path, _, _ in tp_styles}
    found = []

    def under(path: str, parents: set[str]) -> str | None:
        return next((p for p in _ancestors(path) if p in parents), None)

    for path, style, _ in tp_styles:
        target = modules.get(path)
        name = f"{type(target).__module__}.{type(target).__qualname__}"
        if style in _OWN_SPLIT_STYLES and (is_conv1d(name) or style == "packed_colwise"):
            # (functional_shard's own split: Conv1D layers, packed projections)
            found.append(
                f"{path}: style {style!r} on a {type(target).__name__} with sequence parallel; "
                "functional_shard's own split of Conv1D layers and packed projections (Hugging Face "
                "GPT-2) takes whole activations, which sequence parallel does not hand it. Drop "
                "sequence_parallel (plain tensor parallel runs it)"
            )
    # Under sequence parallel the residual stream holds this rank's tokens; the modules
    # sequence_gathers names gather them on entry. Outside those, a module with weights sees
    # a part of the sequence: only a split layer or a 'sequence' one (torch's SequenceParallel,
    # which all-reduces the weight's gradient) computes its gradient whole. Inside, activations
    # are whole: a 'sequence' module there would take its whole input for a part.
    for path in gathering:
        if first_input_name(modules[path]) is None:
            found.append(
                f"{path}: gathers the sequence under sequence parallel (it holds column-split layers), but "
                f"{type(modules[path]).__name__}.forward takes no input by position or name to gather"
            )
    for path, style, _ in tp_styles:
        gather = under(path, gathers)
        if style == "sequence" and gather is not None:
            found.append(
                f"{path}: style 'sequence' inside {gather!r}, which gathers the whole sequence on entry (it "
                "holds column-split layers); give it 'replicate_grad_allreduce' (a per-head norm) or no style"
            )
    for path, module in modules.items():
        if path in styled or under(path, styled) or under(path, gathers):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            found.append(
                f"{path or '<root>'}: a {type(module).__name__} with weights but no tensor-parallel style, "
                "outside the modules that gather the sequence: under sequence parallel it sees this rank's "
                "tokens only, so its gradient would be a part. Give it the style 'sequence' (a norm), split "
                "it, or drop sequence_parallel"
            )
    return found


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
    """Rules from a Hugging Face model's own tensor-parallel plan (see `functional_shard.planning.hf`).

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
    from . import hf

    _, pairs = hf.plan_entries(model_or_config)
    return Rules([Rule(pattern, cast(Style, style)) for pattern, style in pairs], name="hf")


def _misfit(rules: Rules, paths: list[str]) -> str | None:
    # a named set fits when each of its splitting rules covers some parameter; else why not
    missing = [
        str(rule.pattern)
        for rule in rules
        if rule.target not in ("replicate", "sequence") and not any(rule.matches(p) for p in paths)
    ]
    return f"no parameter matches {missing}" if missing else None


def for_model(model: object) -> Rules:
    """HF rules for a transformers model with a plan, else the named set that fits its layers.

    A named set (`gpt2_hf` for Hugging Face models, then `llama`, `gpt2`, `mlp`, in that
    order) fits when each of its splitting rules covers some parameter of the model.

    Args:
        model: the module to split.

    Returns:
        `from_hf` rules, or the first named set that fits.

    Raises:
        PolicyError: ``model`` is not a module, or no rule set fits; the message names
            every set tried and why it did not fit.

    Examples:
        >>> for_model(nn.ModuleDict({"fc1": nn.Linear(4, 8), "fc2": nn.Linear(8, 4)})).name
        'mlp'
    """
    from . import hf

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
    for named in (gpt2_hf, llama, gpt2, mlp) if hf.is_hf_model(model) else (llama, gpt2, mlp):
        why = _misfit(named, paths)
        if why is None:
            return named
        tried.append(f"{named.name}: {why}")
    raise PolicyError(
        "tp('auto'): no rule set fits this model's parameter names:\n"
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

mlp = Rules([("*fc1", "colwise"), ("*fc2", "rowwise")], name="mlp")
"""A two-layer MLP (``fc1`` → activation → ``fc2``) split Megatron-style."""
