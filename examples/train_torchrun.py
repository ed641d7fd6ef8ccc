"""Train a model under torchrun with a plan given on the command line.

One node, 4 processes (CPU and gloo here; on GPUs the same line runs on NCCL, one GPU per
process, picked by LOCAL_RANK):

    torchrun --standalone --nproc-per-node 4 examples/train_torchrun.py \\
        --mesh dp=2,tp=2 --policy "fsdp(dp) + tp(llama, tp)" --steps 20

A pipeline plan (2 stages, each sharded by FSDP over 2 ranks; 4 micro-batches per step):

    torchrun --standalone --nproc-per-node 4 examples/train_torchrun.py \\
        --mesh pp=2,dp=2 --policy "pipeline(pp, microbatches=4) + fsdp(dp)" --steps 20

Context parallel (each sequence cut in 4 chunks over cp=2, load-balanced; FSDP over dp and cp
together; every rank passes whole sequences, `fs.forward_backward` cuts them):

    torchrun --standalone --nproc-per-node 4 examples/train_torchrun.py \\
        --mesh dp=2,cp=2 --policy "fsdp(dp, cp) + cp(cp)" --seq 64 --steps 20

Two nodes of 8 GPUs (run the same line on each node; node 0's address is the rendezvous):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 \\
        --rdzv-id my-run examples/train_torchrun.py --mesh dp=2,tp=8 \\
        --policy "hsdp(dp, tp)" --model llama-1b

Every process plans the same model on the meta device (pure: all ranks agree without
talking), lets `fs.apply` parallelize it, then materializes only its own shards. The data
is a learnable toy task (each next token is the previous one plus one), split over the
data-parallel ranks as the plan says; the loss is averaged over them and printed by rank 0.
The loop is the same for every plan: `fs.forward_backward` runs a plain forward and backward,
or under a pipeline plan the schedule (each rank runs its stages on the micro-batches, the
last stage computes the loss, every rank of a pipeline gets it back).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

import functional_shard as fs
from functional_shard.cli import load_model, parse_mesh


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="as `functional-shard plan --model` (default: tiny)")
    parser.add_argument(
        "--mesh", default="dp=2,tp=2", help="axis=size pairs; their product is the world size"
    )
    parser.add_argument("--policy", default="fsdp(dp) + tp(auto, tp)", help="a policy expression")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--batch", type=int, default=4, help="sequences per data-parallel rank (a multiple of micro-batches)"
    )
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def counting_batch(step: int, rows: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """``rows`` sequences that count up from random starts: easy to learn, never the same twice."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(0, vocab, (rows, 1), generator=generator)
    return (starts + torch.arange(seq + 1)) % vocab


def next_token_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits (a model's output, or a Hugging Face output's) against the next tokens."""
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def main() -> int:
    args = arguments()
    # FSDP2 warns that the logits are a view (of the tensor-parallel gather); nothing here
    # writes into them in place, so the warning would only bury the losses
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)  # torchrun's environment: rank, world size, rendezvous
    rank = dist.get_rank()
    try:
        model = load_model(args.model)  # the meta device: shapes only, the same on every rank
        mesh = parse_mesh(args.mesh).resolve(dist.get_world_size())
        plan = fs.shard(model, mesh, fs.parse_policy(args.policy, model))
        if rank == 0:
            print(plan.explain().split("\n\n")[0], flush=True)
            print(plan.cost("adamw", tokens=args.batch * args.seq), flush=True)
        fs.apply(plan, model, mesh.device_mesh(device.type))
        # Hugging Face models initialise through their own _init_weights; zoo models by reset_parameters
        init = getattr(model, "_init_weights", None)
        fs.materialize(plan, model, device, seed=args.seed, init=init)
        if init is not None:
            # materialize initialises modules that hold parameters; a rotary embedding holds
            # only buffers (inv_freq), which to_empty left unset
            for sub in model.modules():
                if (
                    next(sub.buffers(recurse=False), None) is not None
                    and next(sub.parameters(recurse=False), None) is None
                ):
                    init(sub)
        optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=args.lr)
    except fs.ShardingError as error:
        if rank == 0:
            print(f"train_torchrun: {error}", file=sys.stderr)
        dist.destroy_process_group()
        return 2

    vocab = plan.tensors[next(n for n in plan.tensors if "embed" in n or "wte" in n)].shape[0]
    forward_backward = fs.forward_backward(plan, model, next_token_loss)
    index, slices = plan.data_parallel_rank(rank)
    first = last = math.nan
    for step in range(args.steps):
        tokens = counting_batch(step, args.batch * slices, args.seq, vocab, args.seed)
        mine = tokens[index * args.batch : (index + 1) * args.batch].to(device)
        optimizer.zero_grad()
        try:
            loss = forward_backward(mine[:, :-1], mine[:, 1:])
        except fs.ShardingError as error:  # a batch the micro-batches do not divide
            if rank == 0:
                print(f"train_torchrun: {error}", file=sys.stderr)
            dist.destroy_process_group()
            return 2
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # ranks of one data-parallel slice (tp, pp) hold the same loss
        mean = mean.item() / dist.get_world_size()
        first = mean if step == 0 else first
        last = mean
        if rank == 0:
            print(f"step {step + 1:>4}  loss {mean:.4f}", flush=True)
    # every rank past its last collective before any tears gloo down: a rank leaving while a
    # peer's pair is still open can abort in gloo's threads ("terminate called without an
    # active exception", seen once under load on 4 CPU ranks)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps on {mesh!r}", flush=True)
    return 0 if math.isfinite(last) else 1


if __name__ == "__main__":
    raise SystemExit(main())
