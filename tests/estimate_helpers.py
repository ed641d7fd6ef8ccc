"""Shared by the estimate, auto and step-ranking tests.

Until `functional_shard.activations` lands (another helper writes it), `use_tracer` swaps
in a stand-in with the same interface, built from the zoo Llama's sizes; once the real
tracer exists the tests run against it unchanged.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StandInTrace:
    rank: int
    activation_bytes: int
    output_bytes: int
    forward_flops: float
    backward_flops: float
    recompute_flops: float


def stand_in_trace(model, plan, *, batch, seq, rank=None, inputs=None):
    config = model.config
    tp_axes = plan.config.tensor_parallel_axes
    t = plan.mesh.axes_size(tp_axes) if tp_axes else 1
    dtype = getattr(torch, plan.config.param_dtype) if plan.config.param_dtype else torch.float32
    itemsize = dtype.itemsize
    tokens = batch * seq
    checkpointed = bool(plan.config.checkpointed)
    per_layer = tokens * config.hidden_size * itemsize * (1 if checkpointed else 16 // t)
    params = sum(p.numel() for p in model.parameters())
    forward = 2 * params * tokens / t
    return StandInTrace(
        rank=0,
        activation_bytes=config.num_layers * per_layer,
        output_bytes=tokens * config.vocab_size * itemsize,
        forward_flops=forward,
        backward_flops=2 * forward,
        recompute_flops=forward if checkpointed else 0.0,
    )


def tracer_is_real() -> bool:
    try:
        importlib.import_module("functional_shard.activations")
    except ImportError:
        return False
    return True


def use_tracer(monkeypatch) -> None:
    """Patch the stand-in tracer in when the real one is not there yet."""
    if tracer_is_real():
        return
    estimate_module = importlib.import_module("functional_shard.estimate")

    def trace(model, plan, batch, seq, rank, inputs):
        return stand_in_trace(model, plan, batch=batch, seq=seq, rank=rank, inputs=inputs)

    monkeypatch.setattr(estimate_module, "_trace", trace)


def measure_steps(plan, config, micro_batch, seq, steps, seed=0):
    """On a LocalWorld rank: train ``steps`` AdamW steps of the plan; seconds per step.

    Each step starts after a barrier, so the time is the slowest rank's.
    """
    import time
    import warnings
    from contextlib import nullcontext

    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812

    import functional_shard as fs
    from functional_shard.zoo import Llama

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    meta = plan.config.data_parallel not in ("ddp", "zero1")
    torch.manual_seed(seed)
    with torch.device("meta") if meta else nullcontext():
        model = Llama(config)
    fs.apply(plan, model)
    if meta:
        fs.materialize(plan, model, seed=seed)
    adamw = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (micro_batch, seq + 1), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        adamw.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        adamw.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times
