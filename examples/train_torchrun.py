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

Packed documents (each row holds one long document among short ones, end to end, each
attending only to itself; under cp the rows are cut over the ranks by attention work). Rank 0
then trains the same rows in one process, from the same first weights, and prints the
largest difference of the losses (a check for small models: it trains the model twice):

    torchrun --standalone --nproc-per-node 4 examples/train_torchrun.py \\
        --mesh dp=2,cp=2 --policy "fsdp(dp, cp) + cp(cp)" --seq 64 --steps 20 --packed

Two nodes of 8 GPUs (run the same line on each node; node 0's address is the rendezvous):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 \\
        --rdzv-id my-run examples/train_torchrun.py --mesh node=2,gpu=8 \\
        --policy "hsdp(node, gpu)" --model llama-1b

A long run (checkpoints every 50 steps; a restart resumes from the newest whole one, so a
rank killed in mid-step, or in mid-save, costs at most the steps since it; a hung or dead
peer ends the job within 60 s with the collective and the ranks named):

    torchrun --standalone --nproc-per-node 4 --max-restarts 3 examples/train_torchrun.py \\
        --mesh dp=4 --policy "fsdp(dp)" --steps 1000 \\
        --checkpoint-dir checkpoints --save-every 50 --timeout 60

Fine-tuning a published model (a Hugging Face folder: config.json and its safetensors): the
model is planned from the folder's config.json, and each rank reads its own shards from the
folder's weights instead of initialising them (a zoo model reads them through
`fs.checkpoint.zoo_llama`, a transformers model under its own names):

    torchrun --standalone --nproc-per-node 4 examples/train_torchrun.py \\
        --model Llama-3.2-1B --init-from Llama-3.2-1B --mesh dp=4 --policy "fsdp(dp)"

Every process plans the same model on the meta device (pure: all ranks agree without
talking), lets `fs.apply` parallelize it, then materializes only its own shards. The data
is a learnable toy task (each next token is the previous one plus one), split over the
data-parallel ranks as the plan says; the loss is averaged over them and printed by rank 0.
The loop is the same for every plan: `fs.forward_backward` runs a plain forward and backward,
or under a pipeline plan the schedule (each rank runs its stages on the micro-batches, the
last stage computes the loss, every rank of a pipeline gets it back).

With ``--checkpoint-dir``, every ``--save-every`` steps and at the end the model, the
optimizer and the step are saved (``step-000050``, ...: written aside and renamed, so a crash
in mid-save leaves the previous one whole), and at start the script resumes from
`fs.checkpoint.latest` of the folder: weights, optimizer state and step. The step alone
decides which batches come next (each step's batch is drawn from a generator seeded by the
step), so a resumed run sees the batches an uninterrupted one would have, and ends with
the same weights.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import pathlib
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.distributed.elastic.multiprocessing.errors import record

import functional_shard as fs
from functional_shard.cli import load_model, parse_mesh
from functional_shard.zoo import Llama


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
    parser.add_argument(
        "--checkpoint-dir", type=pathlib.Path, help="save here, and resume from the newest whole checkpoint"
    )
    parser.add_argument(
        "--save-every", type=int, default=0, help="steps between checkpoints (default: only at the end)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a collective waits for a hung or dead peer"
    )
    parser.add_argument(
        "--init-from", type=pathlib.Path, help="a Hugging Face folder whose weights the model starts from"
    )
    parser.add_argument(
        "--packed",
        action="store_true",
        help="pack documents of mixed lengths into the rows (a zoo model), then check against one process",
    )
    return parser.parse_args()


def counting_batch(step: int, rows: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """``rows`` sequences that count up from random starts: easy to learn, never the same twice."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(0, vocab, (rows, 1), generator=generator)
    return (starts + torch.arange(seq + 1)) % vocab


def packed_batch(step: int, rows: int, seq: int, vocab: int, seed: int) -> fs.PackedBatch:
    """``rows`` packed rows of counting documents: in each one long (1/2 to 3/4 of a row) among short ones.

    Each document counts up from its own random start, so the task is learnt only within
    documents; the step alone decides the rows, as for `counting_batch`.
    """
    generator = torch.Generator().manual_seed(seed * 100_003 + step)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=generator))

    short = max(2, seq // 8)
    packed = []
    for _ in range(rows):
        lengths = [draw(max(1, seq // 2), max(1, 3 * seq // 4))]
        while sum(lengths) + short <= seq:
            lengths.append(draw(2, short))
        lengths.insert(draw(0, len(lengths) - 1), lengths.pop(0))  # the long one anywhere in the row
        documents = [(draw(0, vocab - 1) + torch.arange(n)) % vocab for n in lengths]
        packed.append(fs.pack(documents, seq))
    return fs.collate_packed(packed)


def step_rows(
    args: argparse.Namespace, step: int, rows: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A step's global rows: inputs, targets and (packed) the rows' layout, by keyword."""
    if args.packed:
        batch = packed_batch(step, rows, args.seq, vocab, args.seed)
        return batch.tokens, batch.labels, {"positions": batch.positions, "document_ids": batch.document_ids}
    tokens = counting_batch(step, rows, args.seq, vocab, args.seed)
    return tokens[:, :-1], tokens[:, 1:], {}


def data_slice(
    rows: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], index: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Data-parallel slice ``index`` (``batch`` rows) of a step's rows."""
    cut = slice(index * batch, (index + 1) * batch)
    inputs, targets, layout = rows
    return inputs[cut], targets[cut], {name: value[cut] for name, value in layout.items()}


def next_token_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits (a model's output, or a Hugging Face output's) against the next tokens."""
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@record  # torchrun's summary of a failed run shows this rank's error, not only its exit code
def main() -> int:
    args = arguments()
    # FSDP2 warns that the logits are a view (of the tensor-parallel gather); nothing here
    # writes into them in place, so the warning would only bury the losses
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    # torchrun's environment (rank, world size, rendezvous); NCCL on GPUs, gloo on CPUs
    device = fs.init_distributed(timeout=args.timeout)
    rank = dist.get_rank()
    if args.init_from is not None and not args.init_from.is_dir():
        # refused before any work (every rank sees the same path), through refuse's barrier
        # so that rank 0's message is out before torchrun stops the job
        wrong = f"--init-from {str(args.init_from)!r}: not a folder; pass a Hugging Face model's folder"
        return refuse(fs.ShardingError(f"{wrong} (config.json and its safetensors)"), rank)
    try:
        model = load_model(args.model)  # the meta device: shapes only, the same on every rank
        mesh = parse_mesh(args.mesh).resolve(dist.get_world_size())
        plan = fs.shard(model, mesh, fs.parse_policy(args.policy, model))
        if rank == 0:
            print(plan.explain().split("\n\n")[0], flush=True)
            print(plan.cost("adamw", tokens=args.batch * args.seq), flush=True)
        fs.apply(plan, model, mesh.device_mesh(device.type))
        if args.init_from is not None:
            # the zoo's Llama has Hugging Face's names without the "model." prefix
            mapping = fs.checkpoint.zoo_llama if isinstance(model, Llama) else None
            fs.checkpoint.load_hf(args.init_from, model, mapping=mapping, device=device)
            if rank == 0:
                print(f"weights from {args.init_from}", flush=True)
        else:
            # each rank its shards; a Hugging Face model initialised by its own _init_weights
            fs.materialize(plan, model, device, seed=args.seed)
        optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=args.lr)
    except fs.ShardingError as error:
        return refuse(error, rank)

    start = resume(args.checkpoint_dir, model, optimizer, rank)
    vocab = plan.tensors[next(n for n in plan.tensors if "embed" in n or "wte" in n)].shape[0]
    forward_backward = fs.forward_backward(plan, model, next_token_loss)
    index, slices = plan.data_parallel_rank(rank)
    # the one-process check starts from the same weights: rank 0 keeps them whole
    first_weights = fs.checkpoint.model_state(model, full=True) if args.packed and start == 0 else None
    first = last = math.nan
    history = []
    for step in range(start, args.steps):
        # the step alone decides the batch: a resumed run reads what an uninterrupted one would
        rows = step_rows(args, step, args.batch * slices, vocab)
        inputs, targets, layout = data_slice(rows, index, args.batch)
        inputs, targets = inputs.to(device), targets.to(device)
        layout = {name: value.to(device) for name, value in layout.items()}
        optimizer.zero_grad()
        # a peer that hangs or died ends the step within --timeout, naming the collective and it
        with fs.watch_collectives():
            try:
                loss = forward_backward(inputs, targets, **layout)
            except fs.ShardingError as error:  # a batch the micro-batches do not divide
                return refuse(error, rank)
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # ranks of one data-parallel slice (tp, pp) hold the same loss
        mean = mean.item() / dist.get_world_size()
        first = mean if step == start else first
        last = mean
        history.append(mean)
        if rank == 0:
            print(f"step {step + 1:>4}  loss {mean:.4f}", flush=True)
        done = step + 1
        if args.checkpoint_dir is not None and (
            done == args.steps or (args.save_every > 0 and done % args.save_every == 0)
        ):
            with fs.watch_collectives():
                fs.checkpoint.save(
                    args.checkpoint_dir / f"step-{done:06d}", model, optimizer, extra={"step": done}
                )
    # every rank past its last collective before any tears gloo down: a rank leaving while a
    # peer's pair is still open can abort in gloo's threads ("terminate called without an
    # active exception", seen once under load on 4 CPU ranks)
    dist.barrier()
    # and the groups the model's shards hold are freed now, not while the interpreter exits
    # (seen after a restart, under load: the same abort at exit)
    del model, optimizer, forward_backward
    gc.collect()
    dist.destroy_process_group()
    if rank == 0 and start < args.steps:
        print(f"loss {first:.4f} -> {last:.4f} over {args.steps - start} steps on {mesh!r}", flush=True)
    matches = True
    if rank == 0 and first_weights is not None:
        alone = one_process_losses(args, first_weights, vocab, slices)
        matches = say_parity(history, alone, plan)
    return 0 if (start == args.steps or math.isfinite(last)) and matches else 1


def one_process_losses(
    args: argparse.Namespace, weights: dict[str, torch.Tensor], vocab: int, slices: int
) -> list[float]:
    """One process (on the CPU) training the same rows from ``weights``: each step's loss.

    Data parallel averages its ranks' gradients, so a step's loss is the mean of the data-parallel
    slices' means: a packed slice's targets are its own count, not the whole batch's mean.
    """
    model = load_model(args.model).to_empty(device="cpu")
    model.load_state_dict(weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        rows = step_rows(args, step, args.batch * slices, vocab)
        optimizer.zero_grad()
        parts = [
            next_token_loss(model(inputs, **layout), targets)
            for inputs, targets, layout in (data_slice(rows, i, args.batch) for i in range(slices))
        ]
        loss = torch.stack(parts).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# against one float32 process: float32 reordering of sharded reductions is ~1e-6 here; a
# low-precision plan computes in its dtype (bfloat16's relative step is 7.8e-3)
LOSS_TOLERANCE = {None: 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def say_parity(losses: list[float], alone: list[float], plan: fs.Plan) -> bool:
    """Print the largest difference of the run's losses from one process's; whether it is within tolerance."""
    worst = max(abs(a - b) for a, b in zip(losses, alone, strict=True))
    allowed = LOSS_TOLERANCE[plan.config.param_dtype]
    verdict = "ok" if worst <= allowed else "DIFFERS"
    dtype = plan.config.param_dtype or "float32"
    print(
        f"one process on the same packed rows: largest loss difference {worst:.2e} over {len(losses)} "
        f"steps ({dtype} against float32; tolerance {allowed:g})  {verdict}",
        flush=True,
    )
    return worst <= allowed


def resume(
    folder: pathlib.Path | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> int:
    """The step to start from: 0, or that of the newest whole checkpoint in ``folder``, loaded.

    A save a crash cut short is passed over (`fs.checkpoint.latest`), so a restart after a
    rank died in mid-save resumes from the checkpoint before it.
    """
    if folder is None or not folder.is_dir():
        return 0
    found = fs.checkpoint.latest(folder)
    if found is None:
        return 0
    step = int(fs.checkpoint.load(found, model, optimizer)["step"])
    if rank == 0:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(f"resumed from {found} at step {step} (restart {restart})", flush=True)
    return step


def refuse(error: fs.ShardingError, rank: int) -> int:
    """Say why on rank 0 and leave with 2, every rank together.

    Every rank refuses the same input; the others wait for rank 0's message, or torchrun,
    seeing a first rank fail, could stop rank 0 before it is written.
    """
    if rank == 0:
        print(f"train_torchrun: {error}", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 2


if __name__ == "__main__":
    code = main()
    # The run is over: every rank is past its last collective, its output written and its
    # process group destroyed. gloo's threads can still abort the interpreter's own exit
    # ("terminate called without an active exception", seen under load in CI and after
    # torchrun restarts), turning a good run into a failed one; so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
