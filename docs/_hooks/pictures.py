"""mkdocs hook: draw the pictures the docs embed, from plans computed at build time.

The PNGs go to ``docs/generated/`` (git-ignored) before mkdocs collects the files, so a
page shows ``![...](generated/NAME.png)`` of the library as it is now. A file is
rewritten only when its bytes change, so ``mkdocs serve`` does not rebuild in a loop.
"""

from __future__ import annotations

import io
import pathlib
from collections.abc import Callable
from typing import Any

import torch

import functional_shard as fs
from functional_shard.zoo import llama


def _llama_7b_fsdp_tp() -> Any:
    model = llama("llama-7b")
    policy = fs.parse_policy("fsdp(dp) + tp(llama, tp) + bf16 + checkpointing(Block)", model)
    plan = fs.shard(model, fs.Mesh(dp=8, tp=4), policy)
    estimate = fs.estimate(model, plan, batch=1, seq=4096, hardware="h100")
    return plan.visualize("layers.0.mlp.down_proj.weight", estimate=estimate)


def _tiny_fsdp_tp_colwise() -> Any:
    plan = fs.shard(llama("tiny"), fs.Mesh(dp=2, tp=2), fs.parse_policy("fsdp(dp) + tp(llama, tp)"))
    return plan.visualize("layers.0.mlp.up_proj.weight")


def _tiny_zero1_optimizer() -> Any:
    plan = fs.shard(llama("tiny"), fs.Mesh(dp=4), fs.zero(1, "dp"))
    return plan.visualize("lm_head.weight", spec="optim")


def _tiny_pipeline() -> Any:
    plan = fs.shard(
        llama("tiny"), fs.Mesh(pp=2, dp=2), fs.parse_policy("pipeline(pp, microbatches=4) + fsdp(dp)")
    )
    return plan.visualize()


def _schedule(name: str, stages_per_rank: int) -> Callable[[], Any]:
    def draw() -> Any:
        from functional_shard.frontends.pictures.visualize import draw_schedule_figure
        from functional_shard.planning.pipeline.schedules import simulate

        return draw_schedule_figure(simulate(name, 4, 8, stages_per_rank))

    return draw


def _tiny_mixtral() -> Any:
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config)


def _tiny_mixtral_ep() -> Any:
    model = _tiny_mixtral()
    plan = fs.shard(model, fs.Mesh(dp=2, ep=2), fs.parse_policy("fsdp(dp, ep) + ep(ep)", model))
    return plan.visualize("model.layers.0.mlp.experts.gate_up_proj")


def _expert_dispatch() -> Any:
    # what the expert engine's forward exchanges, for one layer on ep=4 ranks, 8 experts
    # (2 per rank), 12 tokens per rank routed top-2 by random router scores
    import matplotlib.pyplot as plt

    ranks, experts, tokens, top_k = 4, 8, 12, 2
    local = experts // ranks
    generator = torch.Generator().manual_seed(3)
    counts = torch.stack(
        [
            torch.bincount(
                torch.randn(tokens, experts, generator=generator).topk(top_k).indices.reshape(-1),
                minlength=experts,
            )
            for _ in range(ranks)
        ]
    )  # counts[i, e]: copies rank i sends to expert e
    sent = counts.view(ranks, ranks, local).sum(2)  # sent[i, j]: copies rank i sends rank j
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.get_cmap("tab10").colors
    bottom = torch.zeros(experts)
    for source in range(ranks):
        left.bar(
            range(experts), counts[source], bottom=bottom, color=colors[source], label=f"from rank {source}"
        )
        bottom += counts[source]
    left.set_xticks(range(experts), [f"e{e}\nrank {e // local}" for e in range(experts)], fontsize=8)
    left.set_ylabel("token copies")
    left.set_title("token copies each expert receives (one layer)", fontsize=10)
    left.legend(fontsize=8)
    right.imshow(sent.numpy(), cmap="Blues")
    for i in range(ranks):
        for j in range(ranks):
            dark = sent[i, j] > 0.6 * sent.max()
            right.text(
                j, i, str(int(sent[i, j])), ha="center", va="center", color="white" if dark else "black"
            )
    right.set_xticks(range(ranks), [f"rank {j}" for j in range(ranks)])
    right.set_yticks(range(ranks), [f"rank {i}" for i in range(ranks)])
    right.set_xlabel("receives (holds the experts)")
    right.set_ylabel("sends (read the tokens)")
    right.set_title(
        f"dispatch all-to-all: {tokens} tokens × top-{top_k} per rank\n"
        "combine sends the results back (the transpose)",
        fontsize=10,
    )
    figure.tight_layout()
    return figure


def _llama_8b_cp() -> Any:
    with torch.device("meta"):
        model = llama("llama-3-8b")
    policy = fs.parse_policy("fsdp(dp, cp) + cp(cp) + bf16 + checkpointing(Block)", model)
    plan = fs.shard(model, fs.Mesh(dp=2, cp=4), policy)
    estimate = fs.estimate(model, plan, batch=1, seq=131072, hardware="h100")
    return plan.visualize("lm_head.weight", estimate=estimate, budget=80 * 10**9)


PICTURES: dict[str, Callable[[], Any]] = {
    "llama-7b-fsdp-tp": _llama_7b_fsdp_tp,
    "tiny-fsdp-tp-colwise": _tiny_fsdp_tp_colwise,
    "tiny-zero1-optimizer": _tiny_zero1_optimizer,
    "tiny-pipeline": _tiny_pipeline,
    "schedule-1f1b": _schedule("1f1b", 1),
    "schedule-zbv": _schedule("zbv", 2),
    "tiny-mixtral-ep": _tiny_mixtral_ep,
    "expert-dispatch": _expert_dispatch,
    "llama-8b-cp": _llama_8b_cp,
}


def draw(folder: pathlib.Path) -> list[pathlib.Path]:
    """Write every picture into ``folder``; returns the files whose bytes changed."""
    folder.mkdir(parents=True, exist_ok=True)
    changed = []
    torch.manual_seed(0)
    for name, make in PICTURES.items():
        buffer = io.BytesIO()
        # no timestamps or software versions in the file: the same plan gives the same bytes
        make().savefig(buffer, format="png", dpi=100, metadata={"Software": None})
        target = folder / f"{name}.png"
        if not target.exists() or target.read_bytes() != buffer.getvalue():
            target.write_bytes(buffer.getvalue())
            changed.append(target)
    return changed


def on_pre_build(config: Any) -> None:
    """Before mkdocs reads ``docs/``: draw the pictures into ``docs/generated/``."""
    draw(pathlib.Path(config["docs_dir"]) / "generated")
