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
        from functional_shard.schedules import simulate
        from functional_shard.visualize import draw_schedule_figure

        return draw_schedule_figure(simulate(name, 4, 8, stages_per_rank))

    return draw


PICTURES: dict[str, Callable[[], Any]] = {
    "llama-7b-fsdp-tp": _llama_7b_fsdp_tp,
    "tiny-fsdp-tp-colwise": _tiny_fsdp_tp_colwise,
    "tiny-zero1-optimizer": _tiny_zero1_optimizer,
    "tiny-pipeline": _tiny_pipeline,
    "schedule-1f1b": _schedule("1f1b", 1),
    "schedule-zbv": _schedule("zbv", 2),
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
