"""``functional-shard``: plan a model from the shell, compare plans, run the demo, convert checkpoints.

Examples:
    functional-shard plan --model llama-70b --mesh dp=16,tp=8 --policy "fsdp(dp) + tp(llama, tp) + bf16"
    functional-shard plan --model path/to/config.json --mesh dp=8 --policy "zero(2, dp)" --json plan.json
    functional-shard plan --model llama-70b --auto --devices 64 --budget 80GiB --seq 8192
    functional-shard diff a.json b.json
    functional-shard demo --mesh dp=2,tp=2 --policy "fsdp(dp) + tp(llama, tp)"
    functional-shard checkpoint convert ckpt/ ckpt.pt

One module per command (`plan`, with its search in `plan_auto`; `diff`; `demo`;
`checkpoint`), the readers of the inputs they share (`inputs`), the tables they print
(`output`), and `program`: the argument parser and `main`. Every mistake in the input is
one line on stderr and exit code 2.
"""

from .inputs import load_model as load_model
from .inputs import parse_mesh as parse_mesh
from .program import main as main

__all__ = ["load_model", "main", "parse_mesh"]
