"""Sequence parallel re-enacted on plain tensors, for a trace at one rank's local shapes.

`sequence_parallel` does to whole tensors what torch's styles do at module edges, so each module
keeps what it keeps on a rank; `check_sequence_parallel` refuses what `functional_shard.apply` refuses.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from functional_shard.core.sequence import check_split_share
from functional_shard.core.validate import refuse
from functional_shard.planning.tp.rules import first_input_name, sequence_gathers, sequence_parallel_problems

__all__ = ["check_sequence_parallel", "sequence_parallel"]


def _gathered_features(plan: Any, path: str, kind: str) -> int:
    """The global output width of a module whose output is gathered (a colwise_gather one)."""
    shape = plan.tensors[plan.canonical(f"{path}.weight")].shape
    # Linear's weight is (out, in); Conv1D's (in, out); an embedding's (num, dim) gives dim
    return shape[-1] if kind in ("conv1d", "embedding") else shape[0]


@contextlib.contextmanager
def sequence_parallel(model: nn.Module, plan: Any, tp_size: int, seq: int) -> Iterator[None]:
    """Within the block, ``model``'s modules move activations as torch's styles do under sequence parallel."""
    # the residual stream is a sequence-split DTensor whose shape reads whole (Hugging Face
    # derives position ids and the mask from it) while each rank holds its part
    split = _SequenceSplit(tp_size, seq)
    tp = plan.config.tp
    styles = tp.styles if tp else ()
    gathers = set(sequence_gathers(styles)) if tp and tp.sequence_parallel else set()
    changes = _Changes()
    try:
        _hook_gathering_modules(model, gathers, split, changes)
        for path, style, kind in styles:
            if kind == "experts":  # split inside each expert: rank_experts re-enacts their forward
                continue
            _run_as_apply(model, (path, style, kind), tp_size, changes)
            _hook_style(model, plan, (path, style, kind), gathers, split, changes)
        yield
    finally:
        changes.undo()


@dataclass(frozen=True)
class _SequenceSplit:
    """Activations cut into and gathered from ``tp_size`` parts of a ``seq``-long sequence."""

    tp_size: int
    seq: int

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x] * self.tp_size, dim=1) if x.shape[1] * self.tp_size == self.seq else x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` all-gathered over the sequence: always a new buffer, as torch's all-gather makes."""
        gathered = self.whole(x)
        return gathered if gathered is not x else x.clone()

    def part(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point() or x.shape[1] != self.seq:
            return x  # token ids, or a part already
        return x.narrow(1, 0, self.seq // self.tp_size).clone()

    def gather_input(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (self.gather(args[0]), *args[1:])

    def scatter_seq(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        """A rowwise layer's output reduce-scattered over the sequence."""
        return out.narrow(1, 0, out.shape[1] // self.tp_size).clone()


@dataclass(frozen=True)
class _Changes:
    """What `sequence_parallel` changed in the model, to undo on leaving: hooks, forwards and sizes."""

    handles: list[Any] = field(default_factory=list)
    overridden: list[nn.Module] = field(default_factory=list)
    resized: list[tuple[Any, str, int]] = field(default_factory=list)

    def undo(self) -> None:
        for handle in self.handles:
            handle.remove()
        for module in self.overridden:
            del module.forward
        for parent, name, value in self.resized:
            setattr(parent, name, value)


def _first_input(name: str, change: Any) -> Any:
    """A pre-hook that changes a module's first input, the other arguments passing through.

    The first input by position or by name (Hugging Face's attention gets hidden_states=).
    """

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args and isinstance(args[0], torch.Tensor):
            return (change(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get(name), torch.Tensor):
            return args, {**kwargs, name: change(kwargs[name])}
        return None

    return hook


def _hook_gathering_modules(
    model: nn.Module, gathers: set[str], split: _SequenceSplit, changes: _Changes
) -> None:
    """Each module that gathers takes its whole input; each block holding one takes its part.

    The embedding's output stays whole so the model reads the whole length; each block takes its
    part on entry (a new buffer), and each gathering module (`rules.sequence_gathers`) a buffer of its own.
    """
    blocks = {path.rpartition(".")[0] for path in gathers} - {""}
    for paths, change in ((gathers, split.gather), (blocks, split.part)):
        for path in sorted(paths):
            module = model.get_submodule(path)
            name = first_input_name(module) or ""
            changes.handles.append(
                module.register_forward_pre_hook(_first_input(name, change), with_kwargs=True)
            )


def _run_as_apply(model: nn.Module, styled: tuple[str, str, str], tp_size: int, changes: _Changes) -> None:
    """A Conv1D layer or a packed projection runs as apply runs it, a packed one's attention shrunk."""
    path, style, kind = styled
    module = model.get_submodule(path)
    if style in ("colwise", "rowwise", "packed_colwise") and (kind == "conv1d" or style == "packed_colwise"):
        module.forward = _split_projection(module, style, kind)
        changes.overridden.append(module)
    if style == "packed_colwise":  # as apply shrinks the attention to this rank's heads
        parent = model.get_submodule(path.rpartition(".")[0])
        for name in ("split_size", "num_heads"):
            if isinstance(getattr(parent, name, None), int):
                changes.resized.append((parent, name, getattr(parent, name)))
                setattr(parent, name, getattr(parent, name) // tp_size)


def _hook_style(
    model: nn.Module,
    plan: Any,
    styled: tuple[str, str, str],
    gathers: set[str],
    split: _SequenceSplit,
    changes: _Changes,
) -> None:
    """The moves at one styled layer's edges.

    A column-split layer outside the gathering modules gathers its own input; a row-split one
    reduce-scatters its output; a colwise_gather one also all-gathers its output.
    """
    path, style, kind = styled
    module = model.get_submodule(path)
    tp = plan.config.tp
    sequence = tp is not None and tp.sequence_parallel
    inside = path.rpartition(".")[0] in gathers
    if sequence and style in ("colwise", "colwise_gather") and kind != "embedding" and not inside:
        changes.handles.append(module.register_forward_pre_hook(split.gather_input))
    head_of_parallel_loss = style == "colwise_gather" and tp is not None and tp.loss_parallel
    if (style == "colwise_gather" and not head_of_parallel_loss) or (
        style == "colwise" and kind == "embedding"
    ):
        # a colwise embedding's output is gathered over the features too
        full = _gathered_features(plan, path, kind)
        changes.handles.append(module.register_forward_hook(functools.partial(_gather_features, full)))
    if sequence and style in ("rowwise", "rowwise_split_input") and kind != "embedding":
        changes.handles.append(module.register_forward_hook(split.scatter_seq))
    if style == "rowwise_split_input":
        changes.handles.append(module.register_forward_pre_hook(functools.partial(_split_input, kind)))


def _gather_features(full: int, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    # the gathered output has the global width whatever this rank's piece is (uneven
    # splits: trailing ranks hold less, torch.chunk style; DTensor pads only in transit)
    return F.pad(out, (0, full - out.shape[-1]))


def _split_input(kind: str, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    # rowwise_split_input: torch's RowwiseParallel(input_layouts=Replicate()) keeps this
    # rank's in-features of the whole input, a copy; the local weight says how many
    local = module.weight.shape[0 if kind == "conv1d" else -1]
    return (args[0].narrow(-1, 0, local).clone(), *args[1:])


def _split_projection(module: Any, style: str, kind: str) -> Any:
    # apply runs Conv1D layers and packed projections itself (_split_projection): a
    # matmul on the local weight; a packed layer slices its whole bias to its pieces
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x @ module.weight if kind == "conv1d" else x @ module.weight.t()
        bias = module.bias
        if bias is None:
            return y
        return y + (bias.narrow(0, 0, y.shape[-1]) if style == "packed_colwise" else bias)

    return forward


def check_sequence_parallel(modules: dict[str, nn.Module], plan: Any, seq: int, tp_size: int) -> None:
    """Refuse, before tracing, what apply refuses to run under sequence parallel.

    ``seq`` is one rank's length: under cp, its share of the whole sequence.
    """
    from functional_shard.core.errors import PlanError, bullets

    styles = plan.config.tp_styles
    axes = ",".join(plan.config.tensor_parallel_axes)
    context = plan.config.context
    cp = plan.config.cp_size(plan.mesh)
    # refused as the argument ``seq``: the public function the caller ran (estimate, auto) names itself
    if context is not None and cp > 1:  # speak of the length the caller gave, not of a rank's share of it
        check_split_share(seq * cp, cp, tp_size, load_balance=context.load_balance, axis=axes)
    elif seq % tp_size:
        refuse(
            "seq",
            str(seq),
            f"sequence parallel over {axes!r} splits the sequence evenly over its {tp_size} ranks (torch "
            f"pads no activation), and {tp_size} does not divide {seq}. Use a sequence length that is a "
            f"multiple of {tp_size}, or drop sequence_parallel",
        )
    if problems := sequence_parallel_problems(styles, modules):
        raise PlanError(
            bullets(
                f"trace_activations: torch's engines cannot run sequence parallel over {axes!r} here:",
                problems,
                "Change the rules, or drop sequence_parallel.",
            )
        )
