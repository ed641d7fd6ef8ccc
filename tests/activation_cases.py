"""Per-rank activation measurements on a LocalWorld, beside the trace's prediction (spawnable)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import functional_shard as fs
from functional_shard.costing.trace.activations import trace_activations
from functional_shard.runtime.measure import kept_activation_bytes, saved_tensor_bytes
from functional_shard.zoo import Block, Llama, LlamaConfig

from . import dist_cases

CONFIG = LlamaConfig(128, 32, 64, num_layers=2, num_heads=4, num_kv_heads=4, tie_embeddings=True)
BATCH = 2
SEQ = 12


def policy(name: str) -> tuple[fs.Mesh, fs.Policy]:
    """Mesh and policy of each measured case, for 4 ranks."""
    rules = fs.rules.llama
    return {
        "tp": (fs.Mesh(tp=4), fs.tp(rules, "tp")),
        "tp_sp": (fs.Mesh(tp=4), fs.tp(rules, "tp", sequence_parallel=True)),
        "fsdp_tp": (fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp(rules, "tp")),
        "fsdp_tp_sp": (fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp(rules, "tp", sequence_parallel=True)),
        "fsdp_tp_full": (fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp(rules, "tp") + fs.checkpointing(Block)),
        "fsdp_tp_selective": (
            fs.Mesh(dp=2, tp=2),
            fs.fsdp("dp") + fs.tp(rules, "tp") + fs.checkpointing(Block, policy="selective"),
        ),
        "fsdp_tp_bf16": (
            fs.Mesh(dp=2, tp=2),
            fs.fsdp("dp") + fs.tp(rules, "tp") + fs.mixed_precision(torch.bfloat16, torch.float32),
        ),
    }[name]


def train(name: str) -> dict[str, object]:
    """Train the tiny Llama under a case's plan (fs.apply); rank 0 returns losses and full parameters."""
    mesh, chosen = policy(name)
    torch.manual_seed(0)
    model = Llama(CONFIG)
    plan = fs.shard(model, mesh, chosen)
    fs.apply(plan, model)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=dist_cases.LR)
    losses = dist_cases.train_steps(model, optimizer, CONFIG, plan, range(dist_cases.STEPS))
    params = {k: dist_cases.full(v) for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "params": params if dist.get_rank() == 0 else None,
        "data_parallel": plan.data_parallel_rank(dist.get_rank())[1],
    }


def hf_llama(device: str = "cpu") -> torch.nn.Module:
    """A tiny Hugging Face LlamaForCausalLM (3 layers, SDPA attention), seed 0."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def hf_policy(name: str) -> tuple[fs.Mesh, fs.Policy]:
    """Mesh and policy of each measured Hugging Face case (its own TP plan), for 4 ranks."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {
        "hf_tp": (fs.Mesh(tp=4), fs.tp("hf", "tp")),
        "hf_fsdp_tp": (fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp("hf", "tp")),
        "hf_sp": (fs.Mesh(tp=4), fs.tp("hf", "tp", sequence_parallel=True)),
        "hf_fsdp_sp": (fs.Mesh(dp=2, tp=2), fs.fsdp("dp") + fs.tp("hf", "tp", sequence_parallel=True)),
        "hf_fsdp_sp_selective": (
            fs.Mesh(dp=2, tp=2),
            fs.fsdp("dp")
            + fs.tp("hf", "tp", sequence_parallel=True)
            + fs.checkpointing(LlamaDecoderLayer, policy="selective"),
        ),
        "hf_fsdp_tp_selective": (
            fs.Mesh(dp=2, tp=2),
            fs.fsdp("dp") + fs.tp("hf", "tp") + fs.checkpointing(LlamaDecoderLayer, policy="selective"),
        ),
    }[name]


def _logits(output: object) -> torch.Tensor:
    return getattr(output, "logits", output)  # type: ignore[return-value]


def measure(names: list[str]) -> dict[str, dict[str, int]]:
    """For each case: this rank's traced and measured activation bytes."""
    results = {}
    for name in names:
        hf = name.startswith("hf_")
        mesh, chosen = hf_policy(name) if hf else policy(name)
        torch.manual_seed(0)
        model = hf_llama() if hf else Llama(CONFIG)
        plan = fs.shard(model, mesh, chosen)
        with torch.device("meta"):
            meta = hf_llama("meta") if hf else Llama(CONFIG)
        trace = trace_activations(meta, plan, batch=BATCH, seq=SEQ, rank=dist.get_rank())
        fs.apply(plan, model)
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        extra = {"use_cache": False} if hf else {}
        kept, output = kept_activation_bytes(model, tokens, **extra)
        _logits(output).sum().backward()
        saved, output = saved_tensor_bytes(model, tokens, **extra)
        logits = _logits(output)
        logits.sum().backward()
        results[name] = {
            "traced": trace.activation_bytes,
            "kept": kept,
            "saved": saved,
            "traced_output": trace.output_bytes,
            "output": dist_cases.full(logits).numel() * logits.element_size(),
        }
    return results


def fit_selective() -> dict[str, object]:
    """A Lightning Trainer.fit under fsdp + selective checkpointing (ShardStrategy); with the
    modules the strategy checkpointed and how many times the selective policy was asked for."""
    import functional_shard.costing.trace.checkpointing as trace_checkpointing
    from functional_shard.adapters.lightning import ShardStrategy
    from functional_shard.runtime.engines.activation_checkpointing import is_checkpointed

    from . import lightning_cases

    calls = []
    original = trace_checkpointing.selective_context

    def counted() -> tuple[object, object]:
        calls.append(1)
        return original()

    trace_checkpointing.selective_context = counted  # fs.apply looks it up when it checkpoints
    try:
        module = lightning_cases.LanguageModel(CONFIG)
        policy = fs.fsdp("dp") + fs.checkpointing(Block, policy="selective")
        result = lightning_cases.fit(ShardStrategy(policy, mesh=fs.Mesh(dp=2)), CONFIG, 2, module=module)
    finally:
        trace_checkpointing.selective_context = original
    result["checkpointed"] = [
        path for path, sub in module.named_modules() if isinstance(sub, Block) and is_checkpointed(sub)
    ]
    result["selective_calls"] = len(calls)
    return result


def mixed_precision_grads(checkpoint_policy: str) -> dict[str, torch.Tensor] | None:
    """One step of fsdp with bf16 compute (fp32 reduction) under a checkpoint policy ("none",
    "full", "selective" or "torchtitan"); rank 0 returns the full fp32 gradients."""
    policy = fs.fsdp("dp") + fs.mixed_precision()
    if checkpoint_policy != "none":
        policy = policy + fs.checkpointing(Block, policy=checkpoint_policy)
    torch.manual_seed(0)
    model = Llama(CONFIG)
    plan = fs.shard(model, fs.Mesh(dp=dist.get_world_size()), policy)
    fs.apply(plan, model)
    tokens = dist_cases.batches(CONFIG, dist.get_world_size())[0]
    rank = dist.get_rank()
    dist_cases.loss_of(
        model, tokens[rank * dist_cases.MICRO_BATCH : (rank + 1) * dist_cases.MICRO_BATCH]
    ).backward()
    grads = {name: dist_cases.full(p.grad) for name, p in model.named_parameters()}
    return grads if rank == 0 else None
