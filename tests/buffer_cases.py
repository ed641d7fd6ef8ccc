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


def deep_gpt2() -> torch.nn.Module:
    """A GPT-2 on the meta device deep enough that its residual projections' std, 0.02 / sqrt(2 * 4),
    which its ``_init_weights`` sets from their parent modules, is far from the 0.02 of its other weights.

    Untied: a pipeline keeps a tied embedding and head in one stage.
    """
    import transformers

    sizes = {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 128, "n_positions": 64}
    ids = {"bos_token_id": 1, "eos_token_id": 2}  # GPT-2's own lie outside a vocabulary of 128
    config = transformers.GPT2Config(**sizes, **ids, tie_word_embeddings=False)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)


def initialised_by_transformers(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, built on the meta device, on the CPU with the values transformers draws with the seed.

    As ``post_init`` on the CPU, less the draws of construction: ``initialize_weights`` (each
    module's ``_init_weights``, children first), then the ties.
    """
    model.to_empty(device="cpu")  # a tied parameter becomes one per name, as before the ties
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(SEED)
    model.initialize_weights()
    model.tie_weights()
    return model


def materialized_model(model: torch.nn.Module, strategy_name: str) -> dict[str, torch.Tensor]:
    """``model`` (on meta) sharded by a strategy of `strategy`, applied, materialized with the seed:
    this rank's whole parameters."""
    mesh, policy = strategy("", strategy_name, dist.get_world_size())
    plan = fs.shard(model, mesh, policy)
    fs.apply(plan, model)
    fs.materialize(plan, model, seed=SEED)
    return {k: full(v) for k, v in model.named_parameters()}


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


def run_deep_gpt2(strategies: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
    """`deep_gpt2` materialized under each strategy in turn: this rank's whole parameters."""
    return [materialized_model(deep_gpt2(), name) for name in strategies]
