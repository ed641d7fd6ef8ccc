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
| sequence   | replicated (activations split on the sequence dim) | — |
| replicate  | replicated                   | replicated              |
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeAlias

from torch import nn

from .errors import PolicyError
from .spec import P
from .tree import Pattern, TensorSpec

__all__ = ["STYLES", "Rule", "Rules", "Style", "gpt2", "llama", "mlp"]

Style: TypeAlias = Literal["colwise", "colwise_gather", "rowwise", "sequence", "replicate"]
STYLES: tuple[str, ...] = ("colwise", "colwise_gather", "rowwise", "sequence", "replicate")
"""``colwise_gather`` splits like ``colwise`` and all-gathers the output, for a final
projection whose whole output the loss needs (torch's ``ColwiseParallel(output_layouts=
Replicate())``)."""


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


def layout_of(tensor: TensorSpec) -> str:
    """How torch's styles see the owning module: "linear", "embedding" or "other".

    A bare pytree (no module type) is read with the Linear (out, in) layout.
    """
    if tensor.module_is(nn.Linear):
        return "linear"
    if tensor.module_is(nn.Embedding):
        return "embedding"
    if tensor.module_name is None:  # a bare pytree: assume the (out, in) Linear layout
        return "linear"
    return "other"


def expand_style(style: Style, path: str, tensor: TensorSpec, axis: str) -> P:
    """The spec that torch's ``style`` gives the parameter ``path`` of ``tensor``'s module.

    Raises:
        StyleError: torch has no such style for this module type or parameter.
    """
    if style in ("sequence", "replicate"):
        return P()
    layout = layout_of(tensor)
    name = path.rpartition(".")[2]
    style = "colwise" if style == "colwise_gather" else style
    if layout == "other":
        raise StyleError(
            f"style {style!r} on a {tensor.module_name}: torch's ColwiseParallel and "
            "RowwiseParallel support nn.Linear and nn.Embedding only. Give this path a "
            "P(...) rule, or 'replicate'"
        )
    if name == "weight" and tensor.ndim == 2:
        split_dim = {
            ("linear", "colwise"): 0,
            ("linear", "rowwise"): 1,
            ("embedding", "colwise"): 1,
            ("embedding", "rowwise"): 0,
        }[(layout, style)]
        return P(*(axis if dim == split_dim else None for dim in range(2)))
    if name == "bias" and tensor.ndim == 1 and layout == "linear":
        return P(axis) if style == "colwise" else P()
    raise StyleError(
        f"style {style!r} does not know how to split {name!r} of shape {tensor.shape} "
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
heads. Hugging Face's ``Conv1D`` layers are refused by the styles: torch's TP has none."""

mlp = Rules([("*fc1", "colwise"), ("*fc2", "rowwise")], name="mlp")
"""A two-layer MLP (``fc1`` → activation → ``fc2``) split Megatron-style."""
