"""Policies as text: ``"fsdp(dp) + tp(llama, tp) + bf16"`` for the command line and configs.

The text reads like the Python API without quotes. It is parsed with `ast` and walked by hand, never
evaluated, so a policy string cannot run code.

| text                                      | Python                                              |
|-------------------------------------------|-----------------------------------------------------|
| ``fsdp(dp)``, ``fsdp(dp, cp)``            | ``fsdp("dp")``, ``fsdp(("dp", "cp"))``              |
| ``fsdp(dp, reshard_after_forward=false)`` | ``fsdp("dp", reshard_after_forward=False)``         |
| ``zero(2, dp)``                           | ``zero(2, "dp")``                                   |
| ``ddp(dp)``, ``replicate(dp)``, ``ddp``   | ``replicate("dp")``, ``replicate()``                |
| ``hsdp(node, gpu)``                       | ``hsdp("node", "gpu")``                             |
| ``ep(dp)``, ``ep(ep, experts="*.experts.*")`` | ``ep("dp")``, ``ep("ep", experts="*.experts.*")`` |
| ``cp(cp)``, ``cp(cp, load_balance=false)`` | ``cp("cp")``, ``cp("cp", load_balance=False)``      |
| ``cp(cp, engine=ring)``                   | ``cp("cp", engine="ring")`` (``all_gather``, ``auto``) |
| ``tp(llama, tp)``, ``sp(llama, tp)``      | ``tp(rules.llama, "tp")``, ``sequence_parallel=True`` |
| ``tp(hf, tp)``, ``tp(auto, tp)``          | ``tp("hf", "tp")``, ``tp("auto", "tp")``            |
| ``tp(llama, tp, loss_parallel=true)``     | ``tp(rules.llama, "tp", loss_parallel=True)``       |
| ``checkpointing(Block, selective)``       | ``checkpointing(Block, policy="selective")``        |
| ``checkpointing("layers.*")``             | ``checkpointing("layers.*")`` (a module-path pattern) |
| ``offload``, ``offload(optimizer)``       | ``offload()``, ``offload(params=False, grads=False)`` |
| ``bf16``, ``mixed_precision(bf16, fp32)`` | ``mixed_precision(torch.bfloat16, torch.float32)``  |
| ``pipeline(pp, microbatches=32)``          | ``pipeline("pp", microbatches=32)``                 |
| ``pipeline(pp, microbatches=8, schedule=zbv, stages_per_rank=2)`` | the same, quoted       |
| ``pipeline(pp, ..., split=((embed, 'layers.0'), (head,)))`` | ``split=[["embed", "layers.0"], ["head"]]`` |

A schedule name that is not a Python name (``'1f1b'``) is quoted.

A bare class name in ``checkpointing`` or ``units=`` names a module class of the model
(pass ``model=``); a quoted string is a module-path pattern.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from functional_shard.core.errors import PolicyError, one_line
from functional_shard.core.tree import as_written
from functional_shard.planning.tp import rules as rules_module
from functional_shard.planning.tp.rules import DEFERRED

from . import builders as build
from .builders import CHECKPOINT_POLICIES
from .format import OFFLOAD_PARTS, RULE_SETS, SHORT_DTYPES
from .format import format_policy as format_policy
from .types import Policy

__all__ = ["FORMS", "format_policy", "parse_policy"]

FORMS = (
    "fsdp(AXES), hsdp(REPLICATE_AXES, SHARD_AXES), zero(1|2|3, AXIS), ddp(AXES) or replicate(AXES), "
    "tp(RULES, AXIS), sp(RULES, AXIS), ep(AXIS), cp(AXIS), "
    f"checkpointing(CLASS or 'path.*', {'|'.join(CHECKPOINT_POLICIES)}), "
    "offload, bf16, fp16, mixed_precision(DTYPE), "
    "pipeline(AXIS, microbatches=N, schedule=NAME, stages_per_rank=N, split=((PATH, ...), ...)), "
    "none, joined by +; "
    "AXES: AXIS or (AXIS, ...); RULES: llama, torchtitan, gpt2, gpt2_hf, mlp, hf, auto"
)
"""The accepted forms, as every parse error lists them."""

# text names a dtype by its short name or by torch's names for it (bfloat16, half, double, ...)
_TORCH_NAME = {short: name for name, short in SHORT_DTYPES.items()}


class _TextError(Exception):
    """One bad part of the text (internal); ``parse_policy`` adds the text and the forms."""

    def __init__(self, node: ast.AST | None, message: str) -> None:
        super().__init__(message)
        self.node = node
        self.message = message


@dataclass(frozen=True)
class _Name:
    """A bare name in the text: an axis, a rule set, a class, a dtype or a keyword value."""

    text: str

    def __repr__(self) -> str:
        """As the text wrote it: a message quoting a value shows ``(pp, dp)``, not the class."""
        return self.text


_Value = Any  # _Name, str, int, bool, None, or a tuple of these


def _value(node: ast.expr) -> _Value:
    if isinstance(node, ast.Name):
        return _Name(node.id)
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, str | int | bool)):
        return node.value
    if isinstance(node, ast.Tuple | ast.List):
        return tuple(_value(element) for element in node.elts)
    raise _TextError(node, "arguments are bare names, 'strings', integers, true/false or (tuples, of, them)")


@dataclass(frozen=True)
class _Call:
    """One term of the sum: a name and its arguments, as written."""

    node: ast.expr
    name: str
    args: tuple[_Value, ...]
    kwargs: dict[str, _Value]


def _terms(node: ast.expr) -> list[_Call]:
    if isinstance(node, ast.BinOp):
        if not isinstance(node.op, ast.Add):
            raise _TextError(node, "terms are joined by + only")
        return _terms(node.left) + _terms(node.right)
    if isinstance(node, ast.Name):
        return [_Call(node, node.id, (), {})]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if any(keyword.arg is None for keyword in node.keywords):
            raise _TextError(node, "**keywords are not accepted")
        if any(isinstance(arg, ast.Starred) for arg in node.args):
            raise _TextError(node, "*arguments are not accepted")
        names = [str(keyword.arg) for keyword in node.keywords]
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:  # ast parses it (only Python's compiler refuses); a dict keeps the last
            raise _TextError(node, f"{node.func.id}() is given the keyword {twice!r} twice; give it once")
        args = tuple(_value(arg) for arg in node.args)
        kwargs = {str(keyword.arg): _value(keyword.value) for keyword in node.keywords}
        return [_Call(node, node.func.id, args, kwargs)]
    raise _TextError(node, "each term is a name like bf16 or a call like fsdp(dp)")


def _text(value: _Value, what: str, node: ast.AST) -> str:
    if isinstance(value, _Name):
        return value.text
    if isinstance(value, str):
        return value
    raise _TextError(node, f"{what} is a name, got {value!r}")


def _axes(values: Sequence[_Value], node: ast.AST) -> tuple[str, ...]:
    axes: list[str] = []
    for value in values:
        if isinstance(value, tuple):
            axes.extend(_text(v, "a mesh axis", node) for v in value)
        else:
            axes.append(_text(value, "a mesh axis", node))
    return tuple(axes)


def _flag(value: _Value, what: str, node: ast.AST) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, _Name) and value.text.lower() in ("true", "false"):
        return value.text.lower() == "true"
    raise _TextError(node, f"{what} is true or false, got {_show(value)}")


def _show(value: _Value) -> str:
    if isinstance(value, _Name):
        return value.text
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return repr(value)


def _only(call: _Call, allowed: Sequence[str]) -> None:
    unknown = sorted(set(call.kwargs) - set(allowed))
    if unknown:
        accepted = ", ".join(allowed) if allowed else "none"
        raise _TextError(call.node, f"{call.name}() takes no keyword {unknown[0]!r} (accepted: {accepted})")


class _Resolver:
    """Class names in the text → the model's module classes."""

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model
        self.classes: dict[str, list[type]] = {}
        if model is not None:
            for module in model.modules():
                # a parallelized model's classes by the names its code wrote (Block, not FSDPBlock)
                written = as_written(type(module))
                found = self.classes.setdefault(written.__name__, [])
                if written not in found:
                    found.append(written)

    def selector(self, value: _Value, node: ast.AST, what: str) -> type | str:
        if isinstance(value, str):
            return value  # a module-path pattern, quoted
        if not isinstance(value, _Name):
            raise _TextError(
                node, f"{what} is a module class name or a quoted path pattern, got {_show(value)}"
            )
        if self.model is None:
            raise _TextError(
                node,
                f"{what} {value.text!r} names a module class, which needs the model to resolve "
                "(pass model=...), or quote a module-path pattern such as 'layers.*'",
            )
        found = self.classes.get(value.text, [])
        if len(found) == 1:
            return found[0]
        if found:
            names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in found)
            raise _TextError(node, f"{what} {value.text!r} is ambiguous in this model: {names}")
        raise _TextError(
            node,
            f"{what} {value.text!r} is not a module class of the model; its classes are "
            + ", ".join(sorted(self.classes)),
        )


def _data_parallel_options(call: _Call, resolver: _Resolver) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if "reshard_after_forward" in call.kwargs:
        options["reshard_after_forward"] = _flag(
            call.kwargs["reshard_after_forward"], "reshard_after_forward", call.node
        )
    if "min_params" in call.kwargs:
        count = call.kwargs["min_params"]
        if isinstance(count, bool) or not isinstance(count, int):
            raise _TextError(call.node, f"min_params is a number of parameters, got {_show(count)}")
        options["min_params"] = count
    if "units" in call.kwargs:
        units = call.kwargs["units"]
        units = units if isinstance(units, tuple) else (units,)
        # a tuple inside the tuple is a group: its modules make one unit
        options["units"] = tuple(
            tuple(resolver.selector(m, call.node, "FSDP unit group member") for m in u)
            if isinstance(u, tuple)
            else resolver.selector(u, call.node, "FSDP unit")
            for u in units
        )
    return options


def _rule_set(value: _Value, node: ast.AST) -> Any:
    name = _text(value, "a rule set", node)
    if name in RULE_SETS:
        return getattr(rules_module, name)
    if name in DEFERRED:
        return name
    raise _TextError(node, f"unknown rule set {name!r}; use one of {', '.join(RULE_SETS + DEFERRED)}")


def _tensor_parallel(call: _Call, sequence_parallel: bool) -> Policy:
    _only(call, ("sequence_parallel", "loss_parallel") if call.name == "tp" else ("loss_parallel",))
    if len(call.args) != 2:
        raise _TextError(
            call.node, f"{call.name}() takes a rule set and an axis, e.g. {call.name}(llama, tp)"
        )
    if "sequence_parallel" in call.kwargs:
        sequence_parallel = _flag(call.kwargs["sequence_parallel"], "sequence_parallel", call.node)
    loss = "loss_parallel" in call.kwargs and _flag(call.kwargs["loss_parallel"], "loss_parallel", call.node)
    rules = _rule_set(call.args[0], call.node)
    axis = _text(call.args[1], "the tensor-parallel axis", call.node)
    try:
        return build.tp(rules, axis, sequence_parallel=sequence_parallel, loss_parallel=loss)
    except PolicyError as error:
        if isinstance(rules, str):
            raise _TextError(
                call.node, f"rules {rules!r} cannot be used in this installation ({error})"
            ) from None
        raise


def _dtype(value: _Value, node: ast.AST) -> torch.dtype | None:
    if value is None or (isinstance(value, _Name) and value.text.lower() == "none"):
        return None
    name = _text(value, "a dtype", node)
    found = getattr(torch, _TORCH_NAME.get(name, name), None)
    if found not in build.MIXED_PRECISION_DTYPES:
        known = f"{', '.join(SHORT_DTYPES.values())} (or torch's name: bfloat16, half, ...)"
        raise _TextError(node, f"unknown dtype {name!r}; use one of {known}")
    return found


_CHECKPOINT_CHOICES = f"{', '.join(CHECKPOINT_POLICIES[:-1])} or {CHECKPOINT_POLICIES[-1]}"


def _checkpointing(call: _Call, resolver: _Resolver) -> Policy:
    _only(call, ("policy",))
    args = list(call.args)
    policy = "full"
    if args and isinstance(args[-1], _Name) and args[-1].text in CHECKPOINT_POLICIES:
        policy = args.pop().text
    elif (
        len(args) > 1
        and isinstance(args[-1], _Name)
        and args[-1].text[:1].islower()
        and args[-1].text not in resolver.classes
    ):  # classes are CamelCase: a lower-case name after them is the policy, mistyped
        raise _TextError(
            call.node,
            f"checkpointing policy {args[-1].text!r}: {_CHECKPOINT_CHOICES} (the argument after the "
            "module classes is the policy)",
        )
    if "policy" in call.kwargs:
        policy = _text(call.kwargs["policy"], "the checkpointing policy", call.node)
        if policy not in CHECKPOINT_POLICIES:
            raise _TextError(call.node, f"checkpointing policy {policy!r}: {_CHECKPOINT_CHOICES}")
    if not args:
        raise _TextError(
            call.node, "checkpointing() needs the module classes (or 'path.*' patterns) to recompute"
        )
    selectors = [resolver.selector(arg, call.node, "checkpointing") for arg in args]
    if policy == "full":
        return build.checkpointing(*selectors)
    if "policy" not in inspect.signature(build.checkpointing).parameters:
        raise _TextError(call.node, f"checkpointing policy {policy!r} is not available in this installation")
    return build.checkpointing(*selectors, policy=policy)  # type: ignore[call-arg,unused-ignore]


def _offload(call: _Call) -> Policy:
    _only(call, OFFLOAD_PARTS)
    if call.kwargs:
        chosen = {part: _flag(call.kwargs.get(part, False), part, call.node) for part in OFFLOAD_PARTS}
        return build.offload(**chosen)
    if not call.args:
        return build.offload()
    parts = [_text(arg, "an offloaded part", call.node) for arg in call.args]
    unknown = [part for part in parts if part not in OFFLOAD_PARTS]
    if unknown:
        raise _TextError(call.node, f"offload part {unknown[0]!r}: use any of {', '.join(OFFLOAD_PARTS)}")
    return build.offload(**{part: part in parts for part in OFFLOAD_PARTS})


def _mixed_precision(call: _Call) -> Policy:
    _only(call, ("param", "reduce"))
    values = dict(zip(("param", "reduce"), call.args, strict=False))
    if len(call.args) > 2 or set(values) & set(call.kwargs):
        raise _TextError(call.node, "mixed_precision() takes a parameter dtype and a reduce dtype")
    values.update(call.kwargs)
    param = _dtype(values.get("param", _Name("bf16")), call.node)
    if param is None:
        raise _TextError(call.node, "mixed_precision() needs a parameter dtype, e.g. mixed_precision(bf16)")
    reduce = _dtype(values["reduce"], call.node) if "reduce" in values else torch.float32
    return build.mixed_precision(param, reduce)


def _pipeline(call: _Call) -> Policy:
    _only(call, ("microbatches", "schedule", "stages_per_rank", "split"))
    if len(call.args) > 1:
        raise _TextError(
            call.node, "pipeline() takes one axis and keywords, e.g. pipeline(pp, microbatches=8)"
        )
    axis = _text(call.args[0], "the axis", call.node) if call.args else "pp"
    if "microbatches" not in call.kwargs:
        raise _TextError(call.node, "pipeline() needs microbatches=N")
    counts = {}
    for key, default in (("microbatches", None), ("stages_per_rank", 1)):
        value = call.kwargs.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise _TextError(call.node, f"pipeline({key}=...) is a whole number, got {_show(value)}")
        counts[key] = value
    schedule = _text(call.kwargs.get("schedule", "1f1b"), "the schedule", call.node)
    split = call.kwargs.get("split")
    stages = None
    if split is not None:
        if not isinstance(split, tuple) or not all(isinstance(stage, tuple) for stage in split):
            raise _TextError(call.node, "split= is a tuple of stages, each a tuple of module paths")
        stages = [[_text(path, "a module path", call.node) for path in stage] for stage in split]
    return build.pipeline(axis, schedule=schedule, split=stages, **counts)


def _term(call: _Call, resolver: _Resolver) -> Policy:
    name, args = call.name, call.args
    if name == "none" and not args and not call.kwargs:
        return Policy()
    if name in ("bf16", "fp16"):
        if args or call.kwargs:
            raise _TextError(
                call.node, f"{name} takes no arguments; for other dtypes use mixed_precision(...)"
            )
        return build.mixed_precision(getattr(torch, _TORCH_NAME[name]), torch.float32)
    if name == "mixed_precision":
        return _mixed_precision(call)
    if name == "offload":
        return _offload(call)
    if name == "checkpointing":
        return _checkpointing(call, resolver)
    if name in ("tp", "sp"):
        return _tensor_parallel(call, sequence_parallel=name == "sp")
    if name == "pipeline":
        return _pipeline(call)
    if name in ("ddp", "replicate"):
        _only(call, ())
        return build.replicate(_axes(args, call.node) or None)
    if name == "fsdp":
        _only(call, ("reshard_after_forward", "min_params", "units"))
        axes = _axes(args, call.node) or ("dp",)
        return build.fsdp(axes[0] if len(axes) == 1 else axes, **_data_parallel_options(call, resolver))
    if name == "hsdp":
        _only(call, ("reshard_after_forward", "min_params", "units"))
        if len(args) != 2:
            raise _TextError(
                call.node, "hsdp() takes a replicate axis and a shard axis, e.g. hsdp(node, gpu)"
            )
        replicate_axis, shard_axis = (_axes([a], call.node) for a in args)
        return build.hsdp(
            replicate_axis[0] if len(replicate_axis) == 1 else replicate_axis,  # type: ignore[arg-type]
            shard_axis[0] if len(shard_axis) == 1 else shard_axis,  # type: ignore[arg-type]
            **_data_parallel_options(call, resolver),
        )
    if name == "zero":
        _only(call, ())
        if not args or not isinstance(args[0], int) or isinstance(args[0], bool) or len(args) > 2:
            raise _TextError(call.node, "zero() takes a stage and an axis, e.g. zero(2, dp)")
        return build.zero(args[0], _text(args[1], "the axis", call.node) if len(args) == 2 else "dp")  # type: ignore[arg-type]
    if name == "ep":
        _only(call, ("experts",))
        if len(args) > 1:
            raise _TextError(call.node, "ep() takes one axis, e.g. ep(dp)")
        experts = call.kwargs.get("experts")
        patterns = None if experts is None else _axes([experts], call.node)
        return build.ep(_text(args[0], "the axis", call.node) if args else "ep", experts=patterns)
    if name == "cp":
        _only(call, ("load_balance", "engine"))
        if len(args) > 1:
            raise _TextError(call.node, "cp() takes one axis, e.g. cp(cp)")
        balance = call.kwargs.get("load_balance")
        engine = call.kwargs.get("engine")
        return build.cp(
            _text(args[0], "the axis", call.node) if args else "cp",
            load_balance=True if balance is None else _flag(balance, "load_balance", call.node),
            engine="auto" if engine is None else _text(engine, "engine", call.node),
        )
    if name in ("zero1", "zero2", "zero3"):
        raise _TextError(call.node, f"write zero({name[-1]}, AXIS)")
    raise _TextError(call.node, f"unknown name {name!r}")


def parse_policy(text: str, model: nn.Module | None = None) -> Policy:
    """Read a policy written as text, e.g. ``"fsdp(dp) + tp(llama, tp) + bf16"``.

    Args:
        text: terms joined by ``+`` (see the module docs for every form).
        model: resolves bare class names in ``checkpointing(...)`` and ``units=`` to its module classes.

    Returns:
        The `Policy` the same Python calls would build.

    Raises:
        PolicyError: the text is not a policy (the bad part named), or the Python call refuses it.

    Examples:
        >>> policy = fs.parse_policy("fsdp(dp) + tp(llama, tp) + bf16")
        >>> policy == fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp") + fs.mixed_precision(torch.bfloat16)
        True
        >>> fs.parse_policy("zero(2, dp)") == fs.zero(2, "dp")
        True
        >>> text = "pipeline(pp, microbatches=32) + fsdp(dp) + tp(llama, tp)"
        >>> same = fs.pipeline("pp", microbatches=32) + fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")
        >>> fs.parse_policy(text) == same
        True
    """
    if not isinstance(text, str) or not text.strip():
        raise PolicyError(
            f"policy {text!r}: empty; write one, e.g. 'fsdp(dp) + tp(llama, tp)', or none for no policy. "
            f"Accepted: {FORMS}"
        )
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as error:
        where = f" at column {error.offset}" if error.offset else ""
        hint = " (the old name:axis form is gone: write fsdp(dp) + tp(llama, tp))" if ":" in text else ""
        raise PolicyError(
            f"policy {text!r} is not an expression{where} ({error.msg}){hint}. Accepted: {FORMS}"
        ) from None
    resolver = _Resolver(model)
    source = text.strip()
    policy = Policy()
    try:
        for call in _terms(tree.body):
            try:
                term = _term(call, resolver)
            except PolicyError as error:  # what the Python call itself refuses
                raise _TextError(call.node, one_line(error)) from None
            try:
                policy = policy + term
            except PolicyError as error:
                raise _TextError(None, one_line(error)) from None
    except _TextError as problem:
        part = ast.get_source_segment(source, problem.node) if problem.node is not None else None
        where = f" in {part!r}" if part and part != source else ""
        message = problem.message.rstrip(".")  # a refusal's own fix may end its sentence
        raise PolicyError(f"policy {text!r}{where}: {message}. Accepted: {FORMS}") from None
    return policy
