"""Step times measured on 4 gloo ranks, for the step-ranking test."""

from __future__ import annotations

import torch


def measure_steps(plan, config, micro_batch, seq, steps, seed=0):
    """On a LocalWorld rank: train ``steps`` AdamW steps of any plan; seconds per step.

    Steps go through `fs.forward_backward`, so a pipeline plan runs its schedule (every
    rank then reads the same ``micro_batch`` sequences). Each step starts after a barrier
    and ends after one, so the time is the slowest rank's.
    """
    import time
    import warnings
    from contextlib import nullcontext

    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812

    import functional_shard as fs
    from functional_shard.zoo import Llama

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    meta = plan.config.data_parallel not in ("ddp", "zero1") and plan.config.pipeline is None
    torch.manual_seed(seed)
    with torch.device("meta") if meta else nullcontext():
        model = Llama(config)
    fs.apply(plan, model)
    if meta:
        fs.materialize(plan, model, seed=seed)
    adamw = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-3)

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    step = fs.forward_backward(plan, model, loss_fn)
    generator = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (micro_batch, seq + 1), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        adamw.zero_grad()
        step(tokens[:, :-1], tokens[:, 1:])
        adamw.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times
