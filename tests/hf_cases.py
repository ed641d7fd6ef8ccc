"""Hugging Face transformers models (tiny configs, no download) trained on every rank of a LocalWorld.

Importable so that spawn can send the functions; transformers is imported when a model is built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

import functional_shard as fs

from . import dist_cases
from .dist_cases import full, mean_over_ranks

STEPS = 3
LR = 1e-2
# AdamW divides by sqrt(v) + eps: with the default 1e-8 a near-zero gradient, whose sum over ranks is
# reordered, turns its rounding noise into a full-size step; 1e-6 keeps that noise small
EPS = 1e-6
MICRO_BATCH = 2
SEQ = 8
VOCAB = 128

_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2}
_DECODER = {
    **_COMMON,
    "intermediate_size": 64,
    "num_key_value_heads": 4,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CONFIGS: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("LlamaConfig", {**_DECODER, "tie_word_embeddings": False}),
    "llama_tied": ("LlamaConfig", {**_DECODER, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {**_DECODER, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {**_DECODER, "tie_word_embeddings": False}),
    "gemma": ("GemmaConfig", {**_DECODER, "head_dim": 8, "pad_token_id": 0}),
    "qwen3": ("Qwen3Config", {**_DECODER, "head_dim": 8, "tie_word_embeddings": False}),
    "phi3": ("Phi3Config", {**_DECODER, "pad_token_id": 0, "tie_word_embeddings": False}),
    # GPT-2 defaults to dropout 0.1 in three places: parity needs none
    "gpt2": (
        "GPT2Config",
        {
            "vocab_size": VOCAB,
            "n_embd": 32,
            "n_head": 4,
            "n_layer": 2,
            "n_positions": 16,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}


# encoders with a masked-LM head tied to the token embedding (the loss of `loss_of` serves parity)
MASKED: dict[str, tuple[str, dict[str, object]]] = {
    "bert": (
        "BertConfig",
        {
            **_COMMON,
            "intermediate_size": 64,
            "max_position_embeddings": 16,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
        },
    ),
}


_SWEPT = {**_DECODER, "tie_word_embeddings": False}
_DROPLESS = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
# more families, for the tp("auto") sweep alone (one step's loss and gradients against one process)
SWEEP: dict[str, tuple[str, dict[str, object]]] = {
    "gemma2": ("Gemma2Config", {**_SWEPT, "head_dim": 8}),
    "gemma3": ("Gemma3TextConfig", {**_SWEPT, "head_dim": 8}),
    "olmo2": ("Olmo2Config", _SWEPT),
    "gpt_neox": ("GPTNeoXConfig", {**_SWEPT, **_DROPLESS}),
    "opt": (
        "OPTConfig",
        {**_COMMON, "ffn_dim": 64, "word_embed_proj_dim": 32, "dropout": 0.0, "max_position_embeddings": 16},
    ),
    "phi": ("PhiConfig", {**_SWEPT, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    "falcon": ("FalconConfig", {**_COMMON, **_DROPLESS}),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            **_SWEPT,
            "moe_intermediate_size": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
        },
    ),
    "mixtral": ("MixtralConfig", {**_SWEPT, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            **_SWEPT,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {**_SWEPT, "moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 8},
    ),
}
# transformers runs Gemma 2's soft-capped attention eagerly only
_EAGER = ("gemma2",)


def config(name: str) -> object:
    import transformers

    class_name, values = {**CONFIGS, **MASKED, **SWEEP}[name]
    return getattr(transformers, class_name)(**values)


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model, initialised on the CPU with ``seed``."""
    import transformers

    torch.manual_seed(seed)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        auto = transformers.AutoModelForMaskedLM if name in MASKED else transformers.AutoModelForCausalLM
        attention = "eager" if name in _EAGER else "sdpa"
        return auto.from_config(config(name), attn_implementation=attention)
    finally:
        transformers.logging.set_verbosity(verbosity)


def strategy(name: str, world: int) -> tuple[fs.Mesh, fs.Policy]:
    """Mesh (resolved for ``world``) and policy of each strategy; tensor parallel by the model's own rules."""
    mesh, policy = {
        "ddp": (fs.Mesh(dp=-1), fs.replicate()),
        "zero1": (fs.Mesh(dp=-1), fs.zero(1)),
        "fsdp": (fs.Mesh(dp=-1), fs.fsdp()),
        "fsdp_tp": (fs.Mesh(dp=2, tp=-1), fs.fsdp("dp") + fs.tp("auto", "tp")),
        "tp": (fs.Mesh(tp=-1), fs.tp("auto", "tp")),
        # the named Llama rules instead of the model's own plan (Qwen3's head norms by name)
        "tp_llama_rules": (fs.Mesh(tp=-1), fs.tp(fs.rules.llama, "tp")),
        # sequence parallel: tp = 4 alone, tp = 2 under FSDP (on 4 ranks)
        "sp": (fs.Mesh(tp=-1), fs.tp("auto", "tp", sequence_parallel=True)),
        "fsdp_sp": (fs.Mesh(dp=2, tp=-1), fs.fsdp("dp") + fs.tp("auto", "tp", sequence_parallel=True)),
    }[name]
    return mesh.resolve(world), policy


def batches(data_parallel: int, vocab: int = VOCAB) -> list[torch.Tensor]:
    """The run's global batches: ``MICRO_BATCH`` rows per data-parallel rank, tokens below ``vocab``."""
    generator = torch.Generator().manual_seed(1234)
    return [
        torch.randint(0, vocab, (MICRO_BATCH * data_parallel, SEQ + 1), generator=generator)
        for _ in range(STEPS)
    ]


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def reference(
    model_name: str, data_parallel: int
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process training on the whole global batch: losses, parameters, first gradients."""
    return train_alone(build(model_name), data_parallel)


def train_alone(
    model: torch.nn.Module,
    data_parallel: int,
    *,
    loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
    vocab: int = VOCAB,
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`reference` of a model already built: the losses, parameters and first gradients.

    ``loss_fn``: the model's next-token loss (`loss_of`, for a Hugging Face model, by default).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for tokens in batches(data_parallel, vocab):
        optimizer.zero_grad()
        loss = (loss_fn or loss_of)(model, tokens)
        loss.backward()
        if not grads:
            grads = {k: v.grad.clone() for k, v in model.named_parameters() if v.grad is not None}
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads


def _built(model_name: str, strategy_name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, fs.Plan]:
    """The model (seed 0) under a strategy on this rank, with its AdamW."""
    mesh, policy = strategy(strategy_name, dist.get_world_size())
    model = build(model_name)
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    return model, fs.optimizer(plan, model, torch.optim.AdamW, lr=LR, eps=EPS), plan


def train(model_name: str, strategy_name: str) -> dict[str, object]:
    """Train under one strategy on this rank; rank 0 returns losses and full parameters."""
    model, optimizer, plan = _built(model_name, strategy_name)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for tokens in batches(data_parallel):
        optimizer.zero_grad()
        loss = loss_of(model, tokens[index * MICRO_BATCH : (index + 1) * MICRO_BATCH])
        loss.backward()
        if not grads:  # AdamW steps hide a gradient off by a factor: compare the first ones
            grads = {k: full(v.grad) for k, v in model.named_parameters() if v.grad is not None}
        optimizer.step()
        losses.append(mean_over_ranks(loss).item())
    params = {k: full(v) for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "params": params if dist.get_rank() == 0 else None,
        "grads": grads if dist.get_rank() == 0 else None,
        "data_parallel": data_parallel,
    }


def train_all(model_name: str, strategies: tuple[str, ...]) -> dict[str, dict[str, object]]:
    """`train` under each strategy in turn (one world run for many cases)."""
    return {name: train(model_name, name) for name in strategies}


def measure_comm(model_name: str, strategy_name: str) -> dict[str, object]:
    """Bytes this rank sends in a steady-state training step (c10d ops), and the prediction."""
    model, optimizer, plan = _built(model_name, strategy_name)
    tokens = batches(1)[0][:MICRO_BATCH]
    # one warm-up step builds lazy state
    return dist_cases.steady_state_comm(model, optimizer, plan, lambda: loss_of(model, tokens), tokens, 1)


def distinct_values(module: torch.nn.Module) -> None:
    """An init (for fs.materialize) giving every element of every parameter its own value."""
    with torch.no_grad():
        for index, (_, param) in enumerate(module.named_parameters(recurse=False)):
            param.copy_(torch.arange(param.numel(), dtype=param.dtype).reshape(param.shape) + 1000 * index)


def materialize_gap(model_name: str, strategy_name: str) -> dict[str, object]:
    """Build on the meta device, apply, materialize: how far each whole parameter is from a CPU build."""
    import transformers

    mesh, policy = strategy(strategy_name, dist.get_world_size())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config(model_name))
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    fs.materialize(plan, model, init=distinct_values)
    expected = build(model_name)
    for module in expected.modules():
        distinct_values(module)
    wanted = dict(expected.named_parameters())
    gaps = {k: (full(v) - wanted[k]).abs().max().item() for k, v in model.named_parameters()}
    return {"gaps": gaps}


def checkpoint_round_trip(model_name: str, strategies: str) -> dict[str, object]:
    """Train a step under one strategy, save a full file, load it under another ("tp>fsdp"):
    the largest gap between the saved and the loaded whole parameters, and the refusal of a
    sharded save."""
    import tempfile

    saved_under, loaded_under = strategies.split(">")
    path = f"{tempfile.gettempdir()}/fs-hf-{model_name}-{saved_under}-{loaded_under}.pt"
    states, refused = [], ""
    for seed, name in ((0, saved_under), (7, loaded_under)):
        mesh, policy = strategy(name, dist.get_world_size())
        model = build(model_name, seed=seed)
        plan = fs.shard(model, mesh, policy)
        fs.apply(plan, model)
        optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR, eps=EPS)
        if name == saved_under and not states:
            optimizer.zero_grad()
            loss_of(model, batches(1)[0][:MICRO_BATCH]).backward()
            optimizer.step()
            try:
                fs.checkpoint.save(path + ".sharded", model, optimizer)
            except fs.ShardingError as error:
                refused = str(error)
            fs.checkpoint.save(path, model, optimizer, full=True)
        else:
            fs.checkpoint.load(path, model, optimizer)
        states.append({k: full(v) for k, v in model.state_dict().items()})
    gap = max((states[0][k] - states[1][k]).abs().max().item() for k in states[0])
    return {"gap": gap, "refused": refused}


def activations(model_name: str, strategy_name: str) -> dict[str, object]:
    """This rank's traced activation bytes (meta, no process group) and those a real forward keeps."""
    import transformers

    mesh, policy = strategy(strategy_name, dist.get_world_size())
    model = build(model_name)
    plan = fs.shard(model, mesh, policy)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config(model_name), attn_implementation="sdpa")
    trace = fs.trace_activations(meta, plan, batch=MICRO_BATCH, seq=SEQ, rank=dist.get_rank())
    fs.apply(plan, model)
    tokens = batches(1)[0][:MICRO_BATCH, :SEQ]
    kept, output = fs.kept_activation_bytes(model, tokens, use_cache=False)
    output.logits.sum().backward()
    saved, output = fs.saved_tensor_bytes(model, tokens, use_cache=False)
    output.logits.sum().backward()
    return {"traced": trace.activation_bytes, "kept": kept, "saved": saved}


def uneven_sequence(model_name: str, strategy_name: str) -> dict[str, object]:
    """A forward at a sequence length the tensor-parallel size does not divide (refused on
    every rank before any collective), then a whole training step on the same process group."""
    model, optimizer, plan = _built(model_name, strategy_name)
    tp = plan.mesh["tp"]
    tokens = batches(1)[0][:MICRO_BATCH]
    refused = ""
    try:
        model(input_ids=tokens[:, : SEQ - 1])
    except fs.ShardingError as error:
        refused = str(error)
    loss = loss_of(model, tokens)  # SEQ tokens: the group still works
    loss.backward()
    optimizer.step()
    return {"refused": refused, "tp": tp, "loss": mean_over_ranks(loss).item()}


def tp_auto_step(model_name: str, strategy_name: str) -> dict[str, object]:
    """One step under ``tp("auto")`` ("tp", or "sp" with sequence parallel) on every rank's batch.

    Rank 0 returns where it was refused by name ("shard", "apply", "forward") with the refusal, or
    the loss and whole gradients; any other error propagates.
    """
    model = build(model_name)
    tokens = batches(1)[0][:MICRO_BATCH]
    policy = fs.tp("auto", "tp", sequence_parallel=strategy_name == "sp")
    stage = "shard"
    try:
        plan = fs.shard(model, fs.Mesh(tp=dist.get_world_size()), policy)
        stage = "apply"
        fs.apply(plan, model)
        stage = "forward"
        loss = loss_of(model, tokens)
        loss.backward()
    except fs.ShardingError as error:
        return {"refused": stage, "why": str(error)}
    grads = {k: full(v.grad) for k, v in model.named_parameters() if v.grad is not None}
    return {"refused": None, "loss": full(loss).item(), "grads": grads if dist.get_rank() == 0 else None}


def run_cases(cases: tuple[tuple[str, str, str], ...]) -> list[dict[str, object]]:
    """(kind, model, strategy) cases in turn, kind "train", "comm", "materialize", "checkpoint",
    "activations", "uneven" or "tp_auto": many cases in one world run."""
    kinds = {
        "train": train,
        "comm": measure_comm,
        "materialize": materialize_gap,
        "checkpoint": checkpoint_round_trip,
        "activations": activations,
        "uneven": uneven_sequence,
        "tp_auto": tp_auto_step,
    }
    return [kinds[kind](model_name, strategy_name) for kind, model_name, strategy_name in cases]
