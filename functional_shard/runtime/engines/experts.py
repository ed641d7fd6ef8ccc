"""Mixture-of-experts layers: tensor parallel inside the experts, and expert parallelism.

An experts module is transformers' (Mixtral, Qwen-MoE: ``gate_up_proj [E, 2f, d]``,
``down_proj [E, d, f]``, ``forward(hidden_states, top_k_index, top_k_weights)``) or
torchtitan's ``GroupedExperts`` (``w1``/``w3`` ``[E, f, d]``, ``w2`` ``[E, d, f]``, or as its
main branch names them, ``w1_EFD``/``w3_EFD`` and ``w2_EDF``):

* **tensor parallel**: each rank runs every token through its slice of ``f`` and the partial
  outputs are all-reduced over tp; the whole input's gradient is all-reduced in backward, so
  the router learns as in one process.
* **expert parallelism** over a data-parallel axis: each rank holds ``E / ep`` experts whole;
  token copies go to their experts' ranks and back through autograd-aware
  ``all_to_all_single``. Expert gradients are divided by the data-parallel size, by FSDP2
  when it shards the experts, else inside the forward's graph (a hook on the parameter would
  be dropped by Lightning's ``module.to(device)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from functional_shard.planning.plan.plan import Plan
from functional_shard.planning.tp.styles import titan_expert_names

from .applied import axes_mesh
from .packed_pieces import rank_share

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def is_titan_experts(module: Any) -> bool:
    """Whether ``module`` holds torchtitan's grouped experts (`titan_expert_names`)."""
    return titan_expert_names(module) is not None


def expert_hidden(module: nn.Module) -> int:
    """Each expert's intermediate features ``f`` (either layout)."""
    titan = titan_expert_names(module)
    return int(module.get_parameter(titan[1] if titan else "down_proj").shape[2])


def expert_module_problems(path: str, module: Any, *, titan: bool = False) -> list[str]:
    """Why ``module`` is not an experts module this engine runs (empty when it is).

    With ``titan``, torchtitan's grouped experts (`is_titan_experts`) are taken too.
    """
    params = dict(module.named_parameters(recurse=False)) if isinstance(module, nn.Module) else {}
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    gate_up, down = shapes.get("gate_up_proj"), shapes.get("down_proj")
    fits = (
        set(shapes) == set(EXPERT_PARAMS)
        and gate_up is not None
        and down is not None
        and len(gate_up) == 3
        and len(down) == 3
        and gate_up[0] == down[0]
        and gate_up[1] == 2 * down[2]
        and gate_up[2] == down[1]
        and callable(getattr(module, "act_fn", None))
    )
    if fits or (titan and is_titan_experts(module)):
        return []
    titan_note = (
        " or torchtitan's (tensor parallel only): w1/w3 [E, f, d], w2 [E, d, f] (or w1_EFD/w3_EFD, w2_EDF),"
        if titan
        else ""
    )
    return [
        f"{path}: a {type(module).__name__} with parameters {shapes}; functional_shard splits experts "
        "modules shaped as transformers 5's (Mixtral, Qwen2-MoE, Qwen3-MoE): exactly gate_up_proj "
        "[E, 2f, d] and down_proj [E, d, f], an act_fn, and forward(hidden_states, top_k_index, "
        f"top_k_weights),{titan_note} Leave this module whole (data parallel), or name other experts with "
        "ep(experts=)"
    ]


def _run_experts(
    rows: torch.Tensor,
    expert_of_row: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each row through its expert's MLP: ``down[e] @ (act(gate[e] @ x) * (up[e] @ x))``.

    The rows are gathered once in expert order and split, the experts taken by ``unbind`` and
    the outputs added in place: in backward that is one gradient of ``rows``, of ``gate_up``
    and of ``down`` each, where indexing per expert would make a full-size zero-filled one per
    expert and an out-of-place add would copy the whole output per expert.
    """
    experts = gate_up.shape[0]
    with torch.no_grad():
        order = torch.argsort(expert_of_row, stable=True)
        counts = torch.bincount(expert_of_row, minlength=experts).tolist()
    out = rows.new_zeros(rows.shape[0], down.shape[1])
    pieces = zip(
        rows[order].split(counts), order.split(counts), gate_up.unbind(0), down.unbind(0), strict=True
    )
    for piece, index, expert_gate_up, expert_down in pieces:
        if index.numel() == 0:
            continue
        gate, up = nn.functional.linear(piece, expert_gate_up).chunk(2, dim=-1)
        # under autocast the linears compute in the autocast dtype; the sum stays in the
        # hidden states' dtype, as transformers' own experts keep it
        y = nn.functional.linear(act(gate) * up, expert_down)
        # in place on a buffer autograd never saves: index_add_'s backward needs only the index
        out.index_add_(0, index, y.to(out.dtype))
    return out


def _tie(out: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    # ``out`` plus zero times each of ``weights``: a rank whose experts see no token must
    # still produce a (zero) gradient for them, since FSDP2 reduce-scatters every rank's
    # gradient together and a missing one would leave the ranks' collectives unmatched
    return out + sum(0 * w.reshape(-1)[:1].sum() for w in weights)


def _as_dtensor(module: nn.Module, name: str, local: torch.Tensor, mesh: DeviceMesh, placement: Any) -> None:
    from torch.distributed.tensor import DTensor

    full = getattr(module, name)
    value = DTensor.from_local(
        local, mesh, [placement], run_check=False, shape=full.shape, stride=full.stride()
    )
    module.register_parameter(name, nn.Parameter(value, requires_grad=full.requires_grad))


def apply_expert_tensor_parallel(plan: Plan, module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Split each experts module the tensor-parallel styles reach (3-D weights), in place."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    tp = plan.config.tp
    paths = tp.experts if tp else ()
    if tp is None or not paths:
        return
    tp_mesh = device_mesh[tp.axes[0]]
    size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    for path in paths:
        experts: Any = module.get_submodule(path)
        if is_titan_experts(experts):
            _split_titan_experts(plan, path, experts, tp_mesh)
            continue
        gate_up = experts.gate_up_proj.detach()
        down = experts.down_proj.detach()
        packed = rank_share(gate_up, 1, 2, size, rank)
        _as_dtensor(experts, "gate_up_proj", packed, tp_mesh, _StridedShard(1, split_factor=2))
        _as_dtensor(experts, "down_proj", down.chunk(size, 2)[rank].contiguous(), tp_mesh, Shard(2))
        # as for GPT-2's packed c_attn: torch's DCP cannot describe the strided gate/up split,
        # so fs.checkpoint refuses a sharded save of it by name (full saves work)
        experts._fs_packed = (1, 2)
        experts.forward = _tensor_parallel_forward(experts, tp_mesh)


def _split_titan_experts(plan: Plan, path: str, experts: Any, tp_mesh: DeviceMesh) -> None:
    # each weight placed on the dim its plan spec splits (w1/w3 dim 1, w2 dim 2); the module's
    # own forward reads them locally; whole input in, partial output all-reduced out
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    assert plan.config.tp is not None  # (its caller splits experts only under tensor parallel)
    axis = plan.config.tp.axes[0]
    for name in titan_expert_names(experts) or ():
        full = getattr(experts, name).detach()
        spec = plan.sharding(plan.canonical(f"{path}.{name}")).compute
        dim = next(d for d, axes in enumerate(spec.dim_axes(full.ndim)) if axis in axes)
        _as_dtensor(experts, name, full.chunk(size, dim)[rank].contiguous(), tp_mesh, Shard(dim))
    original = experts.forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        whole = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()]
        )
        out = original(whole, *args, **kwargs)
        partial = DTensor.from_local(out, tp_mesh, [Partial()], run_check=False)
        return partial.redistribute(tp_mesh, [Replicate()]).to_local()

    experts.forward = forward


def _tensor_parallel_forward(experts: Any, tp_mesh: DeviceMesh) -> Callable[..., torch.Tensor]:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def whole_with_reduced_grad(tensor: torch.Tensor) -> torch.Tensor:
        # identity forward; backward all-reduces the gradient (each rank's is a partial sum)
        return DTensor.from_local(tensor, tp_mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()]
        )

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        x = whole_with_reduced_grad(hidden_states)
        weights = whole_with_reduced_grad(top_k_weights)
        gate_up, down = experts.gate_up_proj.to_local(), experts.down_proj.to_local()
        tokens, k = top_k_index.shape
        token = torch.arange(tokens, device=x.device).repeat_interleave(k)
        y = _run_experts(x[token], top_k_index.reshape(-1), gate_up, down, experts.act_fn)
        y = y * weights.reshape(-1, 1).to(y.dtype)
        out = _tie(torch.zeros_like(x).index_add(0, token, y.to(x.dtype)), gate_up, down)
        partial = DTensor.from_local(out, tp_mesh, [Partial()], run_check=False)
        return partial.redistribute(tp_mesh, [Replicate()]).to_local()

    return forward


def apply_expert_parallel(plan: Plan, module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Split each experts module by expert index over the plan's expert axis; tokens dispatched."""
    from torch.distributed.tensor import Shard

    experts_config = plan.config.experts
    if experts_config is None or experts_config.axis is None:
        return
    ep_mesh = device_mesh[experts_config.axis]
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for path in experts_config.modules:
        experts: Any = module.get_submodule(path)
        total = experts.gate_up_proj.shape[0]
        for name in EXPERT_PARAMS:
            full = getattr(experts, name).detach()
            # a copy, not a view: a view would keep every expert's storage alive on every rank
            _as_dtensor(experts, name, full.chunk(size, 0)[rank].clone(), ep_mesh, Shard(0))
        experts.forward = _dispatching_forward(experts, ep_mesh, total, grad_divisor=_grad_divisor(plan))


def _grad_divisor(plan: Plan) -> int:
    # FSDP2 divides the experts' gradients when it shards them over the other data axes
    # (shard_experts); with no such axis nothing else averages them: the forward does
    return 1 if expert_data_axes(plan) else plan.mesh.axes_size(plan.config.data_axes)


class _GradDividedBy(torch.autograd.Function):
    """Identity forward; the backward divides the gradient by ``divisor``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, divisor: int) -> torch.Tensor:  # type: ignore[override]
        ctx.divisor = divisor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad / ctx.divisor, None


def _dispatching_forward(
    experts: Any, ep_mesh: DeviceMesh, total: int, grad_divisor: int = 1
) -> Callable[..., torch.Tensor]:
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    group = ep_mesh.get_group()
    size = ep_mesh.size()
    local = total // size

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        gate_up, down = experts.gate_up_proj.to_local(), experts.down_proj.to_local()
        if grad_divisor > 1:
            gate_up = _GradDividedBy.apply(gate_up, grad_divisor)
            down = _GradDividedBy.apply(down, grad_divisor)
        k = top_k_index.shape[1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # token copies grouped by expert, so by rank
        token = order // k
        with torch.no_grad():
            counts = torch.bincount(chosen, minlength=total)
            received_counts = torch.empty_like(counts)
            # counts first: every rank learns how many copies of each of its experts arrive
            dist.all_to_all_single(received_counts, counts, group=group)
        send = counts.view(size, local).sum(1).tolist()
        receive = received_counts.view(size, local).sum(1).tolist()
        arrived = all_to_all_single_autograd(hidden_states[token].contiguous(), receive, send, group)
        expert_of_row = torch.arange(local, device=counts.device).repeat(size)
        expert_of_row = expert_of_row.repeat_interleave(received_counts)
        # tied to what arrived and to the weights even when nothing arrived: every rank then
        # runs both all-to-alls' backward, as the ranks that did receive tokens do
        done = _tie(
            _run_experts(arrived, expert_of_row, gate_up, down, experts.act_fn), arrived, gate_up, down
        )
        back = all_to_all_single_autograd(done, send, receive, group)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))

    return forward


def expert_data_axes(plan: Plan) -> tuple[str, ...]:
    """The data-parallel axes FSDP2 shards the expert tensors over: all but the expert axis."""
    config = plan.config
    expert_axis = config.experts.axis if config.experts else None
    return tuple(axis for axis in config.shard_axes if axis != expert_axis)


def shard_experts(
    plan: Plan, module: nn.Module, device_mesh: DeviceMesh, options: dict[str, Any]
) -> set[Any]:
    """FSDP2 on each expert-parallel experts module, before the other units; the parameters to ignore.

    The experts are sharded over the data axes other than the expert axis (as units of
    their own, dividing their summed gradients by the whole data-parallel size); with no
    such axis FSDP2 leaves them alone and the dispatching forward averages their gradients.
    """
    config = plan.config
    if config.experts is None or config.experts.axis is None:
        return set()
    from torch.distributed.fsdp import fully_shard

    data_size = plan.mesh.axes_size(config.data_axes)
    axes = expert_data_axes(plan)
    experts = [module.get_submodule(path) for path in config.experts.modules]
    if axes:
        mesh = axes_mesh(device_mesh, axes)
        for unit in experts:
            fully_shard(unit, **{**options, "mesh": mesh}, reshard_after_forward=config.reshard_after_forward)
            unit.set_gradient_divide_factor(float(data_size))  # type: ignore[operator]
            # gloo has no pre-multiplied sum (NCCL's PreMulSum): sum, then scale
            unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        return set()
    return {param for unit in experts for param in unit.parameters()}
