"""mkdocs hook: draw the pictures the docs embed, from plans computed at build time.

The PNGs go to ``docs/generated/`` (git-ignored) before mkdocs collects the files, so a
page shows ``![...](generated/NAME.png)`` of the library as it is now. A file is
rewritten only when its bytes change, so ``mkdocs serve`` does not rebuild in a loop.

The home page and each parallelism's page show the plan their main example builds;
`EXAMPLES` lists, per page, what of its example the picture draws. The build stops if a
page's first ``python`` block no longer says it, or if a page embeds a picture no hook drew
(an error, not a warning: ``mkdocs build --quiet`` drops warnings, ``--strict`` or not).
Every plan is built on the meta device, with no process: a picture takes a second or two.
"""

from __future__ import annotations

import io
import pathlib
import re
from collections.abc import Callable
from typing import Any

import torch

import functional_shard as fs
from functional_shard.zoo import Block, llama

GIB = 2**30


# ---- the pages' own examples ----------------------------------------------------------


def _home() -> Any:
    # docs/index.md: its first example, and the weight FSDP splits inside each TP shard
    plan = fs.shard(llama("llama-7b"), fs.Mesh(dp=8, tp=4), fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"))
    return plan.visualize("layers.0.mlp.down_proj.weight")


def _policies() -> Any:
    # docs/policies.md's policy has no model or mesh: the home page's Llama-7B on dp=8 × tp=4,
    # Block for its DecoderLayer; a colwise weight shows rule 1, FSDP nested inside TP
    policy = (
        fs.fsdp("dp")
        + fs.tp(fs.rules.llama, "tp", sequence_parallel=True)
        + fs.mixed_precision(torch.bfloat16)
        + fs.checkpointing(Block)
    )
    plan = fs.shard(llama("llama-7b"), fs.Mesh(dp=8, tp=4), policy)
    return plan.visualize("layers.0.mlp.up_proj.weight")


def _will_it_fit() -> Any:
    model = llama("llama-70b")
    plan = fs.shard(
        model,
        fs.Mesh(dp=8, tp=8),
        fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp") + fs.mixed_precision() + fs.checkpointing(Block),
    )
    estimate = fs.estimate(model, plan, batch=1, seq=8192, hardware="h100")
    return plan.visualize("layers.0.mlp.down_proj.weight", estimate=estimate, budget=fs.parse_bytes("80GB"))


def _pipelines() -> Any:
    model = llama("llama-3-8b")
    policy = fs.pipeline("pp", microbatches=8) + fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")
    plan = fs.shard(model, fs.Mesh(pp=4, dp=2, tp=8), policy)
    # layer 20 is in stage 2, as the page says; its colwise weight is the spec the page reads
    return plan.visualize("layers.20.mlp.up_proj.weight")


def _moe() -> Any:
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
    )
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    plan = fs.shard(model, fs.Mesh(dp=8, ep=8), fs.parse_policy("fsdp(dp, ep) + ep(ep) + bf16", model))
    # the page's tables judge it against 80 GiB
    return plan.visualize("model.layers.0.mlp.experts.gate_up_proj", budget=80 * GIB)


# ---- more pictures -------------------------------------------------------------------


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


def _packed_cp_cut() -> Any:
    # docs/packed-documents.md, "Balance under cp": one long document among short ones, cp=4
    from functional_shard.frontends.pictures.document_chart import draw_document_cut

    short = [2 + (7 * i) % 5 for i in range(48)]  # short turns of 2 to 6 tokens
    lengths = [*short[:20], 200, *short[20:]]
    lengths[-1] += -sum(lengths) % 4  # cp divides the row
    return draw_document_cut(lengths, cp=4)


PICTURES: dict[str, Callable[[], Any]] = {
    "home-llama-7b": _home,
    "policies-llama-7b": _policies,
    "will-it-fit-llama-70b": _will_it_fit,
    "pipelines-llama-3-8b": _pipelines,
    "moe-mixtral-8x7b": _moe,
    "llama-7b-fsdp-tp": _llama_7b_fsdp_tp,
    "tiny-fsdp-tp-colwise": _tiny_fsdp_tp_colwise,
    "tiny-zero1-optimizer": _tiny_zero1_optimizer,
    "schedule-1f1b": _schedule("1f1b", 1),
    "schedule-zbv": _schedule("zbv", 2),
    "tiny-mixtral-ep": _tiny_mixtral_ep,
    "expert-dispatch": _expert_dispatch,
    "llama-8b-cp": _llama_8b_cp,
    "packed-cp-cut": _packed_cp_cut,
}


# page -> (its example's picture, what the page's first ``python`` block says that the picture
# draws): edit the example and the build stops here until the picture follows it
EXAMPLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "index.md": (
        "home-llama-7b",
        ('llama("llama-7b")', "fs.Mesh(dp=8, tp=4)", 'fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")'),
    ),
    "policies.md": (
        "policies-llama-7b",
        (
            'fs.fsdp("dp")',
            '+ fs.tp(fs.rules.llama, "tp", sequence_parallel=True)',
            "+ fs.mixed_precision(torch.bfloat16)",
            "+ fs.checkpointing(DecoderLayer)",
        ),
    ),
    "will-it-fit.md": (
        "will-it-fit-llama-70b",
        (
            'llama("llama-70b")',
            "fs.Mesh(dp=8, tp=8)",
            'fs.fsdp("dp") + fs.tp(rules.llama, "tp") + fs.mixed_precision() + fs.checkpointing(Block)',
            'batch=1, seq=8192, hardware="h100"',
            'memory_budget="80GB"',
        ),
    ),
    "pipelines.md": (
        "pipelines-llama-3-8b",
        (
            'zoo.llama("llama-3-8b")',
            'fs.pipeline("pp", microbatches=8) + fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")',
            "fs.Mesh(pp=4, dp=2, tp=8)",
            'plan.stage_of("layers.20.mlp.down_proj.weight")  # 2',
        ),
    ),
    "moe.md": (
        "moe-mixtral-8x7b",
        (
            "hidden_size=4096,",
            "intermediate_size=14336,",
            "num_hidden_layers=32,",
            "num_local_experts=8,",
            "num_experts_per_tok=2,",
            "num_attention_heads=32,",
            "num_key_value_heads=8,",
            "vocab_size=32000,",
            'fs.Mesh(dp=8, ep=8), fs.parse_policy("fsdp(dp, ep) + ep(ep) + bf16", model)',
        ),
    ),
    # the example's policy on the model and setting of the page's table (Llama 3 8B, 128k
    # tokens, bf16)
    "long-context.md": (
        "llama-8b-cp",
        ("fs.Mesh(dp=2, cp=4)", 'fs.fsdp(("dp", "cp")) + fs.cp("cp") + fs.checkpointing(Block)'),
    ),
}

EMBEDDED = re.compile(r"\]\(generated/([\w.-]+)\.png\)")
FIRST_PYTHON = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def problems(docs: pathlib.Path, drawn: set[str]) -> list[str]:
    """What is wrong with the pages in ``docs``, given the pictures ``drawn`` (names, no suffix).

    A page embeds a picture nobody drew, a page of `EXAMPLES` does not embed its example's
    picture, or its first ``python`` block no longer says what the picture draws.
    """
    found = []
    for page in sorted(docs.glob("*.md")):
        text = page.read_text()
        for name in EMBEDDED.findall(text):
            if name not in drawn:
                found.append(f"{page.name} embeds generated/{name}.png, which no hook in docs/_hooks draws")
        if page.name not in EXAMPLES:
            continue
        picture, quotes = EXAMPLES[page.name]
        if picture not in EMBEDDED.findall(text):
            found.append(f"{page.name} does not embed its example's picture, generated/{picture}.png")
        block = FIRST_PYTHON.search(text)
        for quote in quotes:
            if block is None or quote not in block.group(1):
                found.append(
                    f"{page.name}'s example no longer says {quote!r}, which generated/{picture}.png "
                    "draws: draw the new example in docs/_hooks/pictures.py"
                )
    return found


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


def on_files(files: Any, config: Any) -> Any:
    """Once every hook has drawn: stop the build on a missing picture or a stale example."""
    from mkdocs.exceptions import PluginError

    docs = pathlib.Path(config["docs_dir"])
    # what the hooks draw (``PICTURES`` here, ``PICTURE`` in architecture.py) and is there:
    # a file left from an older build, which no hook draws any more, does not count
    named = set()
    for hook in config["hooks"].values():
        named |= {name.removesuffix(".png") for name in getattr(hook, "PICTURES", {})}
        named |= {getattr(hook, "PICTURE", ".png").removesuffix(".png")} - {""}
    drawn = {name for name in named if (docs / "generated" / f"{name}.png").is_file()}
    found = problems(docs, drawn)
    if found:
        raise PluginError("pictures:\n" + "\n".join(f"* {problem}" for problem in found))
    return files
