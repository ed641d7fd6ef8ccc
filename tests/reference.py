"""The same FSDP + TP layout written by hand with torch's own APIs, as a reference.

Used by the fake-process-group test (local shapes must match the plan) and by
bench/plan_speed.py (how long torch takes to lay it out). Not the library's apply().
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def llama_tp_plan(model: nn.Module) -> dict[str, object]:
    """Megatron-style projections, vocabulary-split embedding, colwise head with gathered
    logits: the layout fs.rules.llama gives."""
    plan: dict[str, object] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),  # the loss needs whole logits
    }
    for index, _ in enumerate(model.layers):
        prefix = f"layers.{index}"
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{prefix}.{name}"] = RowwiseParallel()
    return plan


def fsdp_tp_by_hand(model: nn.Module, mesh: DeviceMesh, dp: str = "dp", tp: str = "tp") -> nn.Module:
    """torchtitan's order: tensor parallel first, then FSDP2 per block and on the root."""
    parallelize_module(model, mesh[tp], llama_tp_plan(model))
    for block in model.layers:
        fully_shard(block, mesh=mesh[dp])
    fully_shard(model, mesh=mesh[dp])
    return model
