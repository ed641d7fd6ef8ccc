"""Mixture-of-experts plans measured on gloo ranks beside the cost model and the estimate.

Importable so that spawn can send the functions. Each case builds a tiny `moe_cases`
model under one of its strategies, optionally with every router forced to the balanced
pick (`force_uniform_routing`: token copy j of a rank goes to expert j mod E, so with
tokens × top-k a multiple of E every expert gets exactly as many copies and every rank
as many tokens to send), and measures one steady-state training step: the bytes each
collective sent (`fs.measure.CollectiveLog`), the bytes the forward saved for backward
(`activation_bytes_saved`) and the parameters, gradients and optimizer state held
(`fs.measure.resident_bytes`), beside `plan.cost` for that rank; `traced_bytes` gives
what the trace counts for a rank (run in the test's own process).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import functional_shard as fs

from .dist_cases import steady_state_comm
from .hf_cases import EPS, LR, MICRO_BATCH, SEQ, batches, loss_of
from .moe_cases import build, strategy


def _balanced_pick(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> Any:
    logits, scores, indices = output
    tokens, top_k = indices.shape
    experts = logits.shape[-1]
    forced = (torch.arange(tokens * top_k, device=indices.device) % experts).view(tokens, top_k)
    return logits, scores, forced


def force_uniform_routing(model: torch.nn.Module) -> int:
    """Every top-k router of ``model`` picks expert ``j mod E`` for token copy ``j``; how many were forced.

    The router still runs (its weights still get gradients through the kept scores); only
    its choice is replaced.
    """
    forced = 0
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(_balanced_pick)
            forced += 1
    return forced


def measure(family: str, experts: int, strategy_name: str, uniform: bool) -> dict[str, object]:
    """One training step of ``family`` under ``strategy_name`` on this rank: measured and predicted."""
    mesh, policy = strategy(strategy_name)
    model = build(family, experts)
    if uniform:
        assert force_uniform_routing(model) > 0
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR, eps=EPS)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    tokens = batches(data_parallel)[0][index * MICRO_BATCH : (index + 1) * MICRO_BATCH]
    comm = steady_state_comm(model, optimizer, plan, lambda: loss_of(model, tokens), tokens, warmups=1)
    cost = plan.cost("adamw", rank=dist.get_rank(), tokens=tokens[:, :-1].numel())
    resident = fs.measure.resident_bytes(model, optimizer)  # after the step, as cost counts it
    saved = activation_bytes_saved(model, tokens[:, :-1].clone())  # not a view of the whole batch
    return {
        "rank": dist.get_rank(),
        "measured": comm["measured"],
        "predicted": comm["predicted"],
        "resident": resident,
        "memory": {"params": cost.params_bytes, "grads": cost.grads_bytes, "optimizer": cost.optimizer_bytes},
        "saved_bytes": saved,
    }


def traced_bytes(family: str, experts: int, strategy_name: str, rank: int) -> int:
    """What the trace (`fs.estimate`'s) says ``rank`` of the strategy's plan keeps for backward."""
    from functional_shard.costing.trace.activations import trace_activations

    mesh, policy = strategy(strategy_name)
    model = build_meta(family, experts)
    plan = fs.shard(model, mesh, policy)
    return trace_activations(model, plan, batch=MICRO_BATCH, seq=SEQ, rank=rank).activation_bytes


def activation_bytes_saved(model: torch.nn.Module, input_ids: torch.Tensor) -> int:
    """Bytes the forward saves for backward, less the parameters' own (local, gathered) storages.

    `fs.saved_tensor_bytes` already leaves parameters out, but the experts engines save
    ``param.to_local()``, a non-leaf view of the rank's weights: held as parameters (or
    FSDP's gathered copies) whatever the activations are, so left out here too.
    """
    from torch.distributed.tensor import DTensor
    from torch.multiprocessing.reductions import StorageWeakRef

    saved: dict[Any, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        saved[StorageWeakRef(storage)] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=input_ids)
        # read while the forward's gathered parameters are still held
        weights = {
            StorageWeakRef((p.to_local() if isinstance(p, DTensor) else p).untyped_storage())
            for p in model.parameters()
        }
    return sum(storage.nbytes() for ref, storage in saved.items() if ref not in weights)


def build_meta(family: str, experts: int) -> torch.nn.Module:
    """The same model on the meta device (as `fs.estimate` gets it)."""
    with torch.device("meta"):
        return build(family, experts)


def run_cases(cases: tuple[tuple[str, str, str, str], ...]) -> list[dict[str, object]]:
    """(family, experts, strategy, "uniform"|"router") cases in turn, in one world run."""
    return [measure(f, int(e), s, how == "uniform") for f, e, s, how in cases]


def comparison_table(case: tuple[str, ...], results: list[dict[str, Any]]) -> str:
    """Predicted beside measured bytes per collective kind and axes, one row per rank."""
    lines = [f"{' '.join(case)}: bytes sent per step, predicted / measured"]
    for result in results:
        keys = sorted(
            {(k, a) for side in ("measured", "predicted") for k, by in result[side].items() for a in by}
        )
        cells = [
            f"{kind} over {axes}: {result['predicted'].get(kind, {}).get(axes, 0):,.0f} / "
            f"{result['measured'].get(kind, {}).get(axes, 0):,.0f}"
            for kind, axes in keys
        ]
        lines.append(f"  rank {result['rank']}: " + "; ".join(cells))
    return "\n".join(lines)


def traced_memory_bytes(forward: Any) -> int:
    """Memory-bound bytes the trace counts for ``forward()`` and the backward of its sum."""
    from functional_shard.costing.trace.counting import Flops

    flops = Flops()
    with flops:
        out = forward()
        flops.backward = True
        out.sum().backward()
    return flops.memory["forward"] + flops.memory["backward"]
