"""A traced model's inputs and output on fake tensors, and what Hugging Face models need there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import refuse

__all__ = [
    "check_model_and_plan",
    "fitted_inputs",
    "flex_on_fake_cpu",
    "first_tensor",
    "is_hf",
    "model_inputs",
    "tensors",
    "unpacked_sequences",
]


def check_model_and_plan(model: object, plan: object, caller: str) -> None:
    """Refuse anything but an ``nn.Module`` then a `Plan`, naming a swapped pair as such."""
    from functional_shard.planning.plan.plan import Plan  # the planning layer, below; loaded by now

    if isinstance(model, Plan) and not isinstance(plan, Plan):
        raise ShardingError(
            f"{caller}({type(model).__name__}, {type(plan).__name__}, ...): the model comes first, then "
            f"its plan: fs.{caller}(model, plan, batch=..., seq=...)"
        )
    if not isinstance(model, nn.Module):
        what = "the nn.Module the plan was made from"
        refuse("model", type(model).__name__, what, meaning="meta device is enough")
    if not isinstance(plan, Plan):
        refuse("plan", type(plan).__name__, "a Plan", meaning="make one with fs.shard(model, mesh, policy)")


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of ``value`` (a pytree), in order.

    Examples:
        >>> len(tensors(((torch.ones(1), 2), {"x": torch.ones(2)})))
        2
    """
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def first_tensor(output: Any) -> Any:
    """What counts as a forward's output: its logits, or its first tensor (``output`` if none).

    Examples:
        >>> first_tensor((torch.ones(2), torch.ones(3))).shape
        torch.Size([2])
    """
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, torch.Tensor):
        return output
    found = tensors(output.to_tuple() if hasattr(output, "to_tuple") else output)
    return found[0] if found else output


def is_hf(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face transformers model (one with a config).

    Examples:
        >>> is_hf(nn.Linear(2, 2))
        False
    """
    return hasattr(model, "config") and type(model).__module__.startswith("transformers.")


@contextlib.contextmanager
def flex_on_fake_cpu() -> Iterator[None]:
    """Within the block, flex attention takes fake CPU tensors that need gradients.

    torch refuses flex attention's backward on CPU, but fake tensors run no kernel; it runs
    uncompiled (``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG``), since compiling refuses the trace's modes.

    Examples:
        >>> with flex_on_fake_cpu():
        ...     pass
    """
    try:
        import torch.nn.attention.flex_attention as flex
    except ImportError:
        yield
        return
    original = getattr(flex, "_validate_device", None)
    compiled = getattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", None)
    if original is None or compiled is None:
        yield
        return
    flex._validate_device = lambda query, key, value: None
    # its eager path compiles the operator, and torch.compile refuses the trace's dispatch
    # modes; torch's own switch runs the operator as it is, which fake tensors can follow
    flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        yield
    finally:
        flex._validate_device = original
        flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = compiled


@contextlib.contextmanager
def unpacked_sequences(model: nn.Module) -> Iterator[None]:
    """Within the block, a Hugging Face model takes its sequences as whole ones, not packed.

    Examples:
        >>> with unpacked_sequences(nn.Linear(2, 2)):  # not Hugging Face's: nothing changes
        ...     pass
    """
    # Hugging Face reads position ids' values to find packed sequences; fake tensors have
    # none, so it assumes packing and builds a full mask where a real run (whole sequences)
    # builds none and lets SDPA run causal, with grouped-query heads unrepeated
    masking: Any = None
    if is_hf(model):
        with contextlib.suppress(ImportError):
            import transformers.masking_utils as masking
    original = getattr(masking, "find_packed_sequence_indices", None)
    if masking is None or original is None:
        yield
        return
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def model_inputs(
    model: nn.Module, batch: int, seq: int, inputs: Any, dtype: torch.dtype | None
) -> tuple[Any, Any]:
    """The forward's ``(args, kwargs)`` as new tensors (fake ones, under a `FakeTensorMode`).

    Token ids ``(batch, seq)`` by default; else ``inputs`` at its shapes, floats cast to ``dtype`` if given.

    Raises:
        ShardingError: ``inputs`` is none of those.

    Examples:
        >>> args, kwargs = model_inputs(nn.Linear(2, 2), 3, 1, torch.ones(3, 2), torch.bfloat16)
        >>> args[0].dtype, kwargs
        (torch.bfloat16, {})
    """

    def to_meta(tensor: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        return torch.empty(tensor.shape, dtype=cast)

    if inputs is None:
        return (torch.empty(batch, seq, dtype=torch.long),), {}
    if isinstance(inputs, torch.Tensor):
        return (to_meta(inputs),), {}
    if isinstance(inputs, tuple | list):
        return tuple(tree_map_only(torch.Tensor, to_meta, list(inputs))), {}
    if not isinstance(inputs, Mapping):
        refuse(
            "inputs",
            type(inputs).__name__,
            "a tensor, a tuple of them or a dict of keyword arguments",
            meaning="what the model's forward takes",
        )
    return (), dict(tree_map_only(torch.Tensor, to_meta, dict(inputs)))


def fitted_inputs(inputs: Any, *, batch: int, seq: int, traced_batch: int, traced_seq: int) -> Any:
    """``inputs`` of ``batch`` whole sequences of ``seq`` tokens, cut to what one rank's trace runs.

    The first tensor must be ``(batch, seq, ...)``. Each tensor's dim 0 (where it is ``batch``) is cut to
    ``traced_batch`` and dim 1 (where it is ``seq``) to ``traced_seq``, as meta tensors.

    Raises:
        ShardingError: the first tensor's shape disagrees with ``batch`` or ``seq``.

    Examples:
        >>> fitted_inputs(torch.ones(4, 8), batch=4, seq=8, traced_batch=2, traced_seq=4).shape
        torch.Size([2, 4])
        >>> fitted_inputs(torch.ones(1, 6), batch=1, seq=8, traced_batch=1, traced_seq=8)
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: estimate(inputs=...): the first input has shape (1, 6), but ...
    """
    found = tensors(inputs)
    if not found:
        return inputs
    shape = tuple(found[0].shape)
    if not shape or shape[0] != batch or (seq > 1 and (len(shape) < 2 or shape[1] != seq)):
        tokens = f", seq={seq}" if seq > 1 else ""
        raise ShardingError(
            f"estimate(inputs=...): the first input has shape {shape}, but batch={batch}{tokens} make it "
            f"{(batch, seq) if seq > 1 else (batch,)} and up (dim 0 the sequences, dim 1 their tokens); "
            "pass inputs of batch × seq whole sequences (one data-parallel rank's step), or the batch "
            "and seq they hold"
        )
    if (traced_batch, traced_seq) == (batch, seq):
        return inputs

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        sizes = list(tensor.shape)
        if sizes and sizes[0] == batch:
            sizes[0] = traced_batch
        if len(sizes) > 1 and sizes[1] == seq:
            sizes[1] = traced_seq
        return torch.empty(sizes, dtype=tensor.dtype, device="meta")

    return tree_map_only(torch.Tensor, cut, inputs)
