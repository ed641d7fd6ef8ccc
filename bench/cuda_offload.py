"""FSDP2 with CPU offload on a model built on the meta device: two steps train, or the error, by name.

A one-rank NCCL mesh (as the other CUDA benches): the zoo's tiny Llama on meta, planned with
``fs.fsdp() + fs.offload()``, materialized on "cuda" (its shards must land in host memory: FSDP2
refuses others at the first forward), then two steps with ``fs.clip_grad_norm_`` (whose norms
are reduced on the mesh's device: NCCL reduces no host tensors); and the same in float16 with
``fs.grad_scaler("cpu")``. Prints ``OK <check>`` or ``FAILED <check>: <error>`` for each; exits 1
if any failed. Under 30 s.

Run: python bench/cuda_offload.py [--device cpu]   (cpu: gloo, a dry run of the same code)
"""

from __future__ import annotations

import argparse
import math
import os
import traceback
import warnings

import torch
import torch.distributed as dist

import functional_shard as fs
from functional_shard.zoo import llama


def _train(device: torch.device, policy: fs.Policy, scaler_device: str | None) -> str:
    model = llama("tiny")  # the meta device
    plan = fs.shard(model, fs.Mesh(dp=1), policy)
    fs.apply(plan, model, plan.mesh.device_mesh(device.type))
    fs.materialize(plan, model, device, seed=0)
    where = {p.to_local().device.type for p in model.parameters()}
    if where != {"cpu"}:
        return f"materialize left the offloaded shards on {sorted(where)}, not the CPU"
    adamw = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-3)
    scaler = fs.grad_scaler(scaler_device) if scaler_device else None
    generator = torch.Generator(device=device).manual_seed(0)
    vocab = model.config.vocab_size
    notes = []
    for _ in range(2):
        tokens = torch.randint(0, vocab, (2, 33), generator=generator, device=device)
        adamw.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
        )
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(adamw)
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        expected = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
        norm = float(fs.clip_grad_norm_(model.parameters(), 1.0))
        if not math.isclose(norm, expected, rel_tol=1e-4):
            return f"clip_grad_norm_ returned {norm}, the gradients' norm is {expected}"
        if scaler:
            scaler.step(adamw)
            scaler.update()
        else:
            adamw.step()
        notes.append(f"loss {float(loss):.4f} norm {norm:.4f} grads on {grads[0].device.type}")
    return "; ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29536")
    device = torch.device(arguments.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    checks = {
        "fsdp+offload, materialize, clip_grad_norm_": (fs.fsdp() + fs.offload(), None),
        "fsdp+offload+float16, grad_scaler('cpu'), clip_grad_norm_": (
            fs.fsdp() + fs.offload() + fs.mixed_precision(torch.float16),
            "cpu",
        ),
    }
    failed = 0
    try:
        for name, (policy, scaler_device) in checks.items():
            try:
                found = _train(device, policy, scaler_device)
            except Exception as error:  # every check runs; its error printed by name
                traceback.print_exc()
                found = f"{type(error).__name__}: {error}"
            problem = not found.startswith("loss ")
            failed += problem
            print(f"{'FAILED' if problem else 'OK'} {name}: {found}", flush=True)
    finally:
        dist.destroy_process_group()
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
