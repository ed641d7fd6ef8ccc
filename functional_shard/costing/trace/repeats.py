"""Repeated layers (a transformer's blocks) traced once and twice, the rest worked out from those.

A trace runs one of each group of alike siblings and then two, the others passing their input on
(`passing_on`); each further layer adds what the second added (`extrapolated`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["NotPassableError", "extrapolated", "left_out_layers", "passing_on", "reached", "repeated_layers"]

# counts that say what the model's or a stage's last module hands on, not what each layer adds
_NOT_ADDED = (
    "output_bytes",
    "output_numel",
    "stage_output_bytes",
    "stage_shared_bytes",
    "stage_shared_flops",
    "stage_shared_memory_bytes",
    "step_bytes",
)
# counts that are the largest of alike calls, which further layers repeat, not add to
_LARGEST = ("recompute_bytes",)


class NotPassableError(Exception):
    """A left-out layer got no tensor to hand on."""


def repeated_layers(model: nn.Module, plan: Any, state: Mapping[str, torch.Tensor]) -> list[tuple[str, ...]]:
    """Sibling modules of one class, local parameter shapes and plan treatment, 3 or more of them.

    ``state``: the parameters at the traced rank's local shapes. Alternating ``layer_types`` makes none.

    Examples:
        >>> from functional_shard.zoo import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(num_layers=3)).to("meta")
        >>> plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate())
        >>> repeated_layers(model, plan, dict(model.named_parameters()))
        [('layers.0', 'layers.1', 'layers.2')]
    """
    config = plan.config
    layer_types = getattr(getattr(model, "config", None), "layer_types", None) or ()
    if len(set(layer_types)) > 1:
        return []  # e.g. sliding-window and full attention alternate: same shapes, other work

    # the styled and checkpointed paths under each module, relative to it, in plan order
    # (indexed once: scanning every style per module is quadratic in the layers)
    def owners(path: str) -> Iterator[tuple[str, str]]:
        parts = path.split(".")
        for end in range(1, len(parts) + 1):
            owner = ".".join(parts[:end])
            yield owner, path.removeprefix(owner)

    styles_under: dict[str, list[tuple[str, str]]] = {}
    for styled, style, _ in config.tp_styles:
        for owner, relative in owners(styled):
            styles_under.setdefault(owner, []).append((relative, style))
    checkpointed_under: dict[str, list[str]] = {}
    for checkpointed_path in config.checkpointed:
        for owner, relative in owners(checkpointed_path):
            checkpointed_under.setdefault(owner, []).append(relative)

    # each module's parameters and buffers, relative to it, from one walk of the model
    def index(named: Iterator[tuple[str, torch.Tensor]], *read: Any) -> dict[str, list[tuple[Any, ...]]]:
        under: dict[str, list[tuple[Any, ...]]] = {}
        for full, tensor in named:
            entry = tuple(f(full, tensor) for f in read)
            dot = full.find(".")
            while dot >= 0:
                under.setdefault(full[:dot], []).append((full[dot + 1 :], *entry))
                dot = full.find(".", dot + 1)
        return under

    params_under = index(
        model.named_parameters(remove_duplicate=False),
        lambda full, _: tuple(state[full].shape),
        lambda full, _: state[full].dtype,
    )
    buffers_under = index(model.named_buffers(remove_duplicate=False), lambda _, buffer: tuple(buffer.shape))

    def treatment(path: str, module: nn.Module) -> Any:
        shapes = tuple(params_under.get(path, ()))
        buffers = tuple(buffers_under.get(path, ()))
        styles = tuple(styles_under.get(path, ()))
        checkpointed = tuple(checkpointed_under.get(path, ()))
        return type(module), shapes, buffers, styles, checkpointed

    groups: list[tuple[str, ...]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = [(f"{prefix}{name}", child) for name, child in module.named_children()]
        by_key: dict[Any, list[str]] = {}
        keys = {}
        for path, child in children:
            keys[path] = treatment(path, child)
            by_key.setdefault(keys[path], []).append(path)
        for path, child in children:
            members = by_key[keys[path]]
            # layers: modules of modules, with weights (q/k/v projections are alike but not
            # repeats; an activation function may see other shapes each time)
            if len(members) >= 3 and keys[path][1] and any(True for _ in child.children()):
                if path == members[0]:
                    groups.append(tuple(members))
            else:
                visit(f"{path}.", child)

    visit("", model)
    return groups


def left_out_layers(groups: list[tuple[str, ...]], doubled: tuple[int, ...]) -> tuple[str, ...]:
    """The layers a run leaves out: every group runs its first member (its first two where ``doubled``).

    Examples:
        >>> left_out_layers([("a", "b", "c"), ("x", "y", "z")], doubled=(1,))
        ('b', 'c', 'z')
    """
    return tuple(path for index, group in enumerate(groups) for path in group[2 if index in doubled else 1 :])


def reached(plan: Any, left_out: tuple[str, ...]) -> Any:
    """``plan`` less the styles and checkpointing of modules inside ``left_out`` (no run reaches them).

    Examples:
        >>> from functional_shard.zoo import Block, llama
        >>> plan = fs.shard(llama("tiny"), fs.Mesh(dp=1), fs.checkpointing(Block))
        >>> reached(plan, ("layers.1",)).config.checkpointed
        ('layers.0',)
    """
    if not left_out:
        return plan
    skipped = set(left_out)
    prefixes = tuple(f"{path}." for path in left_out)

    def runs(path: str) -> bool:
        return path not in skipped and not path.startswith(prefixes)

    tp = plan.config.tp
    config = dataclasses.replace(
        plan.config,
        tp=tp and dataclasses.replace(tp, styles=tuple(entry for entry in tp.styles if runs(entry[0]))),
        checkpointed=tuple(path for path in plan.config.checkpointed if runs(path)),
    )
    return dataclasses.replace(plan, config=config)


@contextlib.contextmanager
def passing_on(
    modules: Mapping[str, nn.Module],
    groups: list[tuple[str, ...]],
    doubled: tuple[int, ...],
    broken: Callable[[], None],
) -> Iterator[None]:
    """Within the block, the layers `left_out_layers` names hand their input on.

    ``broken`` is called where that cannot stand in for them.

    Raises:
        NotPassableError: a left-out layer called without a tensor first.

    Examples:
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2)) for _ in range(3)])
        >>> with passing_on(dict(model.named_modules()), [("0", "1", "2")], (), broken=print):
        ...     model(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    # handing the input on stands in only where running layers return their first argument's
    # shape and every layer of a group sees the same shape (a chain, not a U-Net's levels)
    seen: dict[int, tuple[Any, ...]] = {}
    group_of = {path: index for index, group in enumerate(groups) for path in group}

    def sees(index: int, first: torch.Tensor) -> None:
        if seen.setdefault(index, (first.shape, first.dtype)) != (first.shape, first.dtype):
            broken()

    def same_shape(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        first = args[0] if args else None
        if not (isinstance(first, torch.Tensor) and isinstance(output, torch.Tensor)) or (
            first.shape != output.shape or first.dtype != output.dtype
        ):
            broken()
        else:
            sees(group_of[names[module]], first)

    def pass_on(index: int, *args: Any, **kwargs: Any) -> Any:
        if not args or not isinstance(args[0], torch.Tensor):
            broken()
            raise NotPassableError
        sees(index, args[0])
        return args[0]

    left_out = set(left_out_layers(groups, doubled))
    running = {path for group in groups for path in group} - left_out
    handles, saved = [], []
    names: dict[nn.Module, str] = {}
    try:
        for path, module in modules.items():
            names[module] = path
            if path in left_out:
                saved.append((module, module.__dict__.get("forward")))
                module.forward = functools.partial(pass_on, group_of[path])  # type: ignore[method-assign]
            elif path in running:
                handles.append(module.register_forward_hook(same_shape))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, forward in saved:
            if forward is None:
                del module.forward
            else:
                module.forward = forward  # type: ignore[method-assign]


def extrapolated(
    first: Mapping[str, Any],
    seconds: Sequence[Mapping[str, Any]],
    groups: list[tuple[str, ...]],
    *,
    stages_of: Callable[[str], Iterable[int]],
) -> dict[str, Any]:
    """The counts of a run of every layer, from a run of one per group and one of two for each.

    ``first`` ran each group's first member, ``seconds[i]`` also group ``i``'s second; per-stage lists
    add to the stages ``stages_of(member)`` names.

    Examples:
        >>> first = {"activation_bytes": 10, "output_bytes": 4}
        >>> second = {"activation_bytes": 13, "output_bytes": 4}
        >>> extrapolated(first, [second], [("a", "b", "c")], stages_of=lambda member: ())
        {'activation_bytes': 16, 'output_bytes': 4}
    """
    counts = {key: list(value) if isinstance(value, list) else value for key, value in first.items()}
    for group, second in zip(groups, seconds, strict=True):
        for key in counts:
            if key in _NOT_ADDED:
                continue
            if key in _LARGEST:
                counts[key] = max(counts[key], second[key])
                continue
            if isinstance(counts[key], list):
                # each further layer adds what the second added, to its own stage
                added = sum(second[key]) - sum(first[key])
                for member in group[1:]:
                    for stage in stages_of(member):
                        counts[key][stage] += added
            else:
                counts[key] += (len(group) - 1) * (second[key] - first[key])
    return counts
