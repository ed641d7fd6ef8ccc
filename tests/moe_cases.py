"""Mixture-of-experts models (tiny transformers 5 configs, no download) trained on every rank of a LocalWorld.

Importable so that spawn can send the functions; transformers is imported when a model is built.
Mixtral, Qwen2-MoE (with its shared expert and its gate) and Qwen3-MoE (head norms), 2
layers, top-2 routing of 4 or 8 experts; every strategy is compared with one process
training on the whole global batch, as `hf_cases` does for dense models.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import functional_shard as fs

from .dist_cases import adamw_steps, full, mean_over_ranks
from .hf_cases import EPS, LR, MICRO_BATCH, STEPS, VOCAB, batches, loss_of, train_alone

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}


def config(family: str, experts: int, layers: int = 2) -> object:
    import transformers

    common = {**_COMMON, "num_hidden_layers": layers}
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=48, num_local_experts=experts, **common)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=experts,
            **common,
        )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=24, num_experts=experts, head_dim=8, **common
        )
    raise ValueError(family)


def build(family: str, experts: int, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """The tiny model (``layers`` decoder layers), initialised on the CPU with ``seed``."""
    import transformers

    torch.manual_seed(seed)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        built = config(family, experts, layers)
        return transformers.AutoModelForCausalLM.from_config(built, attn_implementation="sdpa")
    finally:
        transformers.logging.set_verbosity(verbosity)


_EXPERTS_WHOLE = fs.Rules([("*.experts", "replicate")], name="experts_whole")


def strategy(name: str) -> tuple[fs.Mesh, fs.Policy]:
    """Mesh and policy of each strategy (4 ranks); tensor parallel by the model's own plan."""
    return {
        "fsdp": (fs.Mesh(dp=4), fs.fsdp("dp")),
        "tp": (fs.Mesh(tp=4), fs.tp("hf", "tp")),
        "fsdp_tp": (fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp("hf", "tp")),
        "ep_dp": (fs.Mesh(dp=4), fs.fsdp("dp") + fs.ep("dp")),
        "ep_2d": (fs.Mesh(dp=2, ep=2), fs.fsdp(("dp", "ep")) + fs.ep("ep")),
        # expert parallelism beside tensor parallel on the attention (the experts left to ep)
        "ep_tp": (
            fs.Mesh(dp=2, tp=2),
            fs.fsdp("dp") + fs.ep("dp") + fs.tp(_EXPERTS_WHOLE + fs.rules.llama, "tp"),
        ),
        # two pipeline stages, each one's experts split over its two data-parallel ranks
        "ep_pp": (fs.Mesh(pp=2, dp=2), pipeline_policy(MICRO_BATCH)),
    }[name]


def reference(
    family: str, experts: int, data_parallel: int
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process training on the whole global batch: losses, parameters, first gradients."""
    return train_alone(build(family, experts), data_parallel)


def train(family: str, experts: int, strategy_name: str) -> dict[str, object]:
    """Train under one strategy on this rank; rank 0 returns losses, full parameters and first grads."""
    mesh, policy = strategy(strategy_name)
    model = build(family, experts)
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    _, data_parallel = plan.data_parallel_rank(dist.get_rank())
    losses, grads = adamw_steps(
        plan, model, loss_of, batches(data_parallel), micro_batch=MICRO_BATCH, lr=LR, eps=EPS
    )
    params = {k: full(v) for k, v in model.state_dict().items()}
    first = dist.get_rank() == 0
    return {
        "losses": losses,
        "params": params if first else None,
        "grads": grads if first else None,
        "data_parallel": data_parallel,
        "placements": {
            k: str(getattr(v, "placements", None)) for k, v in model.named_parameters() if "experts" in k
        },
    }


def pipeline_policy(microbatches: int, schedule: str = "1f1b", beside: str = "") -> fs.Policy:
    """pipeline(pp) + fsdp(dp) + ep(dp) (two stages per rank for a looped schedule); ``beside="tp"``:
    with tensor parallel on the attention."""
    looped = 2 if schedule in ("interleaved1f1b", "looped_bfs") else 1
    pipeline = fs.pipeline("pp", microbatches=microbatches, schedule=schedule, stages_per_rank=looped)
    policy = pipeline + fs.fsdp("dp") + fs.ep("dp")
    if beside == "tp":
        policy = policy + fs.tp(_EXPERTS_WHOLE + fs.rules.llama, "tp")
    return policy


def pipeline_reference(
    family: str, experts: int, layers: int, data_parallel: int
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`reference` of a model with ``layers`` decoder layers."""
    return train_alone(build(family, experts, layers=layers), data_parallel)


class _CountsTokens:
    """Wraps an experts module's forward: the number of tokens of each call, while counting."""

    def __init__(self, experts: torch.nn.Module) -> None:
        self.forward = experts.forward
        self.counting = False
        self.tokens: list[int] = []
        experts.forward = self  # type: ignore[method-assign]

    def __call__(self, hidden_states: torch.Tensor, *args: object) -> torch.Tensor:
        if self.counting:
            self.tokens.append(hidden_states.shape[0])
        return self.forward(hidden_states, *args)


def pipeline_train(
    family: str,
    experts: int,
    layers: int,
    mesh_axes: dict[str, int],
    microbatches: int,
    schedule: str = "1f1b",
    beside: str = "",
) -> dict[str, object]:
    """Train ``pipeline_policy`` through fs.forward_backward on this rank: the losses, this rank's
    stage's whole parameters and first gradients, the tokens each local experts module received
    per call in the last step, and this rank's bytes of parameters, gradients and AdamW state."""
    from torch.distributed.tensor import DTensor

    mesh = fs.Mesh(**mesh_axes)
    model = build(family, experts, layers=layers)
    plan = fs.shard(model, mesh, pipeline_policy(microbatches, schedule, beside))
    fs.apply(plan, model)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR, eps=EPS)
    step = fs.forward_backward(plan, model, _logits_loss)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    local_experts = {
        name: _CountsTokens(module)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "gate_up_proj", None), DTensor)
    }
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for number, tokens in enumerate(batches(data_parallel)):
        mine = tokens[index * MICRO_BATCH : (index + 1) * MICRO_BATCH]
        optimizer.zero_grad()
        for counter in local_experts.values():
            counter.counting = number == STEPS - 1
        loss = step(mine[:, :-1], mine[:, 1:])
        if not grads:
            grads = {k: full(v.grad) for k, v in model.named_parameters() if v.grad is not None}
        optimizer.step()
        losses.append(mean_over_ranks(loss).item())

    def local_bytes(tensor: torch.Tensor) -> int:
        value = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return value.numel() * value.element_size()

    params = list(model.parameters())
    return {
        "losses": losses,
        "params": {k: full(v) for k, v in model.state_dict().items()},
        "grads": grads,
        "data_parallel": data_parallel,
        "tokens_per_call": {name: counter.tokens for name, counter in local_experts.items()},
        "placements": {
            k: str(getattr(v, "placements", None)) for k, v in model.named_parameters() if "experts" in k
        },
        "param_bytes": sum(local_bytes(p) for p in params),
        "grad_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": sum(
            local_bytes(value)
            for p in params
            for key, value in optimizer.state[p].items()
            if isinstance(value, torch.Tensor)
        ),
    }


def _logits_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    # a pipeline's last stage hands on the logits, a whole model its Hugging Face output
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _Experts(torch.nn.Module):
    """transformers 5's experts layout (gate_up_proj [E, 2f, d], down_proj [E, d, f])."""

    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * intermediate, hidden))
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, intermediate))
        self.act_fn = torch.nn.functional.silu


def dispatch(routing: str, experts: int = 8) -> dict[str, object]:
    """The dispatching forward of `engines.experts` on hand-made routing over the whole world,
    against the same experts run in one process on every rank's tokens: this rank's output,
    the gradients of its input and routing weights, and its local expert gradients.

    ``routing``: "skewed" sends every token copy of every rank to experts 0 and 1 (one
    rank receives everything, the others nothing; experts without tokens), "random"
    draws top-2 choices, "ragged" gives each rank a different number of tokens.
    """
    from torch.distributed.tensor import DTensor

    from functional_shard.runtime.engines.experts import _dispatching_forward, _run_experts

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    whole = _Experts(experts, 6, 4)
    generator = torch.Generator().manual_seed(7)
    counts = [5, 0, 3, 9] if routing == "ragged" else [6] * world
    inputs, indices, weights = [], [], []
    for count in counts:
        inputs.append(torch.randn(count, 6, generator=generator))
        if routing == "skewed":
            indices.append(torch.tensor([[0, 1]] * count, dtype=torch.long).reshape(count, 2))
        else:
            picks = [torch.randperm(experts, generator=generator)[:2] for _ in range(count)]
            indices.append(torch.stack(picks) if picks else torch.zeros(0, 2, dtype=torch.long))
        weights.append(torch.rand(count, 2, generator=generator))

    # the reference: every rank's tokens through the whole experts, one process
    def local(x: torch.Tensor, index: torch.Tensor, w: torch.Tensor, module: _Experts) -> torch.Tensor:
        token = torch.arange(x.shape[0]).repeat_interleave(2)
        y = _run_experts(x[token], index.reshape(-1), module.gate_up_proj, module.down_proj, module.act_fn)
        return torch.zeros_like(x).index_add(0, token, y * w.reshape(-1, 1))

    xs = [x.clone().requires_grad_() for x in inputs]
    ws = [w.clone().requires_grad_() for w in weights]
    expected = [local(x, i, w, whole) for x, i, w in zip(xs, indices, ws, strict=True)]
    sum(((e * (r + 1)).sum() for r, e in enumerate(expected)), torch.zeros(())).backward()

    mesh = fs.Mesh(ep=world).device_mesh("cpu")
    from torch.distributed.tensor import Shard

    from functional_shard.runtime.engines.experts import _as_dtensor

    mine = _Experts(experts, 6, 4)
    with torch.no_grad():
        mine.gate_up_proj.copy_(whole.gate_up_proj)
        mine.down_proj.copy_(whole.down_proj)
    for name in ("gate_up_proj", "down_proj"):
        _as_dtensor(mine, name, getattr(mine, name).detach().chunk(world, 0)[rank].clone(), mesh, Shard(0))
    forward = _dispatching_forward(mine, mesh, experts)
    x = inputs[rank].clone().requires_grad_()
    w = weights[rank].clone().requires_grad_()
    out = forward(x, indices[rank], w)
    (out * (rank + 1)).sum().backward()
    gate_up_grad, down_grad = mine.gate_up_proj.grad, mine.down_proj.grad
    assert isinstance(gate_up_grad, DTensor)
    assert isinstance(down_grad, DTensor)
    mine_part = slice(rank * (experts // world), (rank + 1) * (experts // world))

    def gap(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
        # relative to the largest value: the reference sums in another order. A rank with no
        # token gets an empty gradient, the reference none
        if want is None or got is None or want.numel() == 0:
            return 0.0 if (got is None or got.numel() == 0) and (want is None or want.numel() == 0) else 1.0
        return (got - want).abs().max().item() / max(1.0, want.abs().max().item())

    return {
        "out": gap(out, expected[rank]),
        "x_grad": gap(x.grad, xs[rank].grad),
        "w_grad": gap(w.grad, ws[rank].grad),
        "gate_up_grad": gap(gate_up_grad.to_local(), whole.gate_up_proj.grad[mine_part]),
        "down_grad": gap(down_grad.to_local(), whole.down_proj.grad[mine_part]),
    }


def checkpoint_round_trip(family: str, experts: int, strategies: str, full_file: bool) -> dict[str, object]:
    """Train a step under one strategy, save (sharded, or one full file), load under another
    ("ep_2d>fsdp") into a model built with another seed: the largest gap between the saved and
    the loaded whole parameters and optimizer states, and whether the values moved at all."""
    import tempfile

    saved_under, loaded_under = strategies.split(">")
    kind = "full" if full_file else "sharded"
    path = f"{tempfile.gettempdir()}/fs-moe-{family}-{experts}-{saved_under}-{loaded_under}-{kind}"
    path += ".pt" if full_file else ""
    states = []
    for seed, name in ((0, saved_under), (7, loaded_under)):
        mesh, policy = strategy(name)
        model = build(family, experts, seed=seed)
        plan = fs.shard(model, mesh, policy)
        fs.apply(plan, model)
        optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR, eps=EPS)
        index, data_parallel = plan.data_parallel_rank(dist.get_rank())
        optimizer.zero_grad()
        mine = batches(data_parallel)[0][index * MICRO_BATCH : (index + 1) * MICRO_BATCH]
        fs.forward_backward(plan, model, _logits_loss)(mine[:, :-1], mine[:, 1:])
        optimizer.step()  # both have optimizer state: the load must replace it
        before = {k: full(v) for k, v in model.state_dict().items()}
        if name == saved_under:
            fs.checkpoint.save(path, model, optimizer, full=full_file)
        else:
            fs.checkpoint.load(path, model, optimizer)
        moment = {
            path_: full(optimizer.state[param]["exp_avg"])
            for path_, param in model.named_parameters()
            if "experts" in path_
        }
        states.append(({k: full(v) for k, v in model.state_dict().items()}, moment, before))
    (saved, saved_moment, _), (loaded, loaded_moment, loaded_before) = states
    # under a pipeline a rank holds its stage's tensors only: compared where both runs hold them
    both, both_moments = saved.keys() & loaded.keys(), saved_moment.keys() & loaded_moment.keys()
    return {
        "gap": max((saved[k] - loaded[k]).abs().max().item() for k in both),
        "moment_gap": max((saved_moment[k] - loaded_moment[k]).abs().max().item() for k in both_moments),
        "moved": max((loaded_before[k] - loaded[k]).abs().max().item() for k in loaded),
        "experts": sorted(both_moments),
    }


# pp=2 stages, each run by the data-parallel ranks that split its experts (and tp=2 beside: 8 ranks)
_PIPELINE_MESHES = {"": {"pp": 2, "dp": 2}, "tp": {"pp": 2, "dp": 2, "tp": 2}}


def run_cases(cases: tuple[tuple[str, ...], ...]) -> list[dict[str, object]]:
    """("train", family, experts, strategy), ("dispatch", routing) and ("checkpoint", family,
    experts, "saved>loaded", "full"|"sharded") cases in turn, in one world run."""
    results = []
    for kind, *args in cases:
        if kind == "train":
            family, experts, name = args
            results.append(train(family, int(experts), name))
        elif kind == "pipeline":
            family, experts, layers, microbatches, schedule, beside = args
            results.append(
                pipeline_train(
                    family,
                    int(experts),
                    int(layers),
                    _PIPELINE_MESHES[beside],
                    int(microbatches),
                    schedule,
                    beside,
                )
            )
        elif kind == "checkpoint":
            family, experts, pair, how = args
            results.append(checkpoint_round_trip(family, int(experts), pair, how == "full"))
        else:
            results.append(dispatch(*args))
    return results
