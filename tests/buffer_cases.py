"""Models built on the meta device and materialized without ``init=``: their parameters and buffers.

Importable, so that spawn can send the rank functions; transformers is imported when a model is built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import functional_shard as fs
from functional_shard.zoo import llama

from . import hf_cases, moe_cases
from .dist_cases import full

# the HF test matrix, Mixtral (its experts as 3-d tensors), and the zoo's Llamas (reset_parameters)
MODELS = (*hf_cases.CONFIGS, "mixtral", "zoo_tiny", "zoo_tiny_tied")
SEED = 0
# tensor parallel leaves Mixtral's experts whole: fs.materialize does not fill split expert tensors
_EXPERTS_WHOLE = fs.Rules([("*.experts", "replicate")], name="experts_whole")


def build(name: str) -> torch.nn.Module:
    """The model as one process builds it on the CPU with seed 0."""
    if name in hf_cases.CONFIGS:
        return hf_cases.build(name, seed=SEED)
    if name == "mixtral":
        return moe_cases.build("mixtral", experts=4, seed=SEED)
    torch.manual_seed(SEED)
    return llama(name.removeprefix("zoo_").replace("_", "-"), device="cpu")


def build_on_meta(name: str) -> torch.nn.Module:
    """The same model built under ``torch.device("meta")``."""
    with torch.device("meta"):
        return build(name)


def strategy(model_name: str, name: str, world: int) -> tuple[fs.Mesh, fs.Policy]:
    """Plain FSDP over every rank; tensor parallel (the model's own rules); two pipeline stages."""
    if name == "fsdp":
        return fs.Mesh(dp=world), fs.fsdp()
    if name == "pp":
        return fs.Mesh(pp=world), fs.pipeline("pp", microbatches=2)
    rules = {"mixtral": _EXPERTS_WHOLE + fs.rules.llama}.get(model_name, "auto")
    if model_name.startswith("zoo_"):
        rules = fs.rules.llama
    return fs.Mesh(tp=world), fs.tp(rules, "tp")


def materialized(model_name: str, strategy_name: str) -> dict[str, dict[str, torch.Tensor]]:
    """Built on meta, sharded, applied, materialized with the seed and no ``init=``: this rank's
    whole parameters and its buffers."""
    model = build_on_meta(model_name)
    mesh, policy = strategy(model_name, strategy_name, dist.get_world_size())
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    fs.materialize(plan, model, seed=SEED)
    return {
        "params": {k: full(v) for k, v in model.named_parameters()},
        "buffers": {k: full(v) for k, v in model.named_buffers(remove_duplicate=False)},
    }


def run_cases(cases: tuple[tuple[str, str], ...]) -> list[dict[str, dict[str, torch.Tensor]]]:
    """(model, strategy) cases in turn, in one world run (starting ranks dominates)."""
    return [materialized(model_name, strategy_name) for model_name, strategy_name in cases]
