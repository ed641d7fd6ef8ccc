"""A traced model's parameters and buffers as fake tensors, at one rank's local shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["FakeParameters"]


class FakeParameters:
    """What a trace swaps into the model for its parameters and buffers, refilled per trace.

    ``local``: a meta tensor per path at its compute shape on rank ``holder(path)``; `refill` makes
    ``state`` (the fake tensors the model runs with) and ``params`` (the parameters among them).

    Examples:
        >>> model = nn.Sequential(nn.Linear(4, 2))
        >>> plan = fs.shard(model, fs.Mesh(tp=2), fs.tp([("0", "colwise")], "tp"))
        >>> fake = FakeParameters(model, plan, holder=lambda path: 0, dtype=None, fake=FakeTensorMode())
        >>> fake.local["0.weight"].shape
        torch.Size([1, 4])
        >>> fake.refill(())
        >>> len(fake.params), sorted(fake.state)
        (2, ['0.bias', '0.weight'])
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Any,
        *,
        holder: Callable[[str], int],
        dtype: torch.dtype | None,
        fake: FakeTensorMode,
    ) -> None:
        self.fake = fake
        self.local: dict[str, torch.Tensor] = {}
        self.canonical_of: dict[str, str] = {}
        # shard() gives alike blocks' parameters one TensorSpec and one ParamSharding object:
        # their local shapes are worked out once (the plan holds the objects, so ids are stable)
        local_shapes: dict[tuple[int, int, int], tuple[int, ...]] = {}
        for path, param in model.named_parameters(remove_duplicate=False):
            canonical = plan.canonical(path) if path not in plan.params else path
            self.canonical_of[path] = canonical
            if canonical not in self.local:
                shape: Any = param.shape
                if canonical in plan.params:
                    at = holder(canonical)
                    spec_at = (id(plan.tensors[canonical]), id(plan.params[canonical]), at)
                    if spec_at not in local_shapes:
                        local_shapes[spec_at] = plan.local_shape(canonical, at, "compute")
                    shape = local_shapes[spec_at]
                self.local[canonical] = torch.empty(shape, dtype=dtype or param.dtype, device="meta")
            self.local[path] = self.local[canonical]
        self.buffers = dict(model.named_buffers(remove_duplicate=False))
        self.plan_tensors: dict[str, Any] = dict(plan.tensors)
        self.state: dict[str, torch.Tensor] = {}
        self.params: list[torch.Tensor] = []

    def refill(self, left_out: tuple[str, ...]) -> None:
        """New fake tensors in ``state`` and ``params``; those only ``left_out`` modules hold shared.

        The repeated layers no run reaches share one fake tensor per shape: a 70B model has many.
        """
        prefixes = tuple(f"{path}." for path in left_out)
        running = {
            canonical for path, canonical in self.canonical_of.items() if not path.startswith(prefixes)
        }
        shared: dict[tuple[Any, ...], torch.Tensor] = {}
        self.state.clear()
        self.params.clear()

        def new(like: torch.Tensor, grad: bool, share: bool) -> torch.Tensor:
            key = (tuple(like.shape), like.dtype, grad)
            if share and key in shared:
                return shared[key]
            tensor = torch.empty(like.shape, dtype=like.dtype, requires_grad=grad)
            if grad:
                self.params.append(tensor)
            if share:
                shared[key] = tensor
            return tensor

        plan_tensors = self.plan_tensors
        with self.fake:
            for path, canonical in self.canonical_of.items():
                if canonical not in self.state:
                    local = self.local[canonical]
                    # torch lets only float and complex tensors require a gradient (an integer
                    # parameter is always frozen), and a frozen one (requires_grad=False, as the
                    # plan read it) makes none: the trace holds either as a plain tensor
                    spec = plan_tensors.get(canonical)
                    trained = (
                        spec.differentiable
                        if spec is not None
                        else local.is_floating_point() or local.is_complex()
                    )
                    self.state[canonical] = new(local, trained, canonical not in running)
                self.state[path] = self.state[canonical]
            for path, buffer in self.buffers.items():
                self.state[path] = new(buffer, False, path.startswith(prefixes))
