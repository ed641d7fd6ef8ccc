"""Hugging Face folders written by save_pretrained (tiny configs, no download), loaded on every rank.

Importable so that spawn can send the functions; transformers is imported when a model is built.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import functional_shard as fs
from functional_shard.runtime.checkpoint.hf import slices as hf_read
from functional_shard.runtime.checkpoint.integrity import every_rank

from . import titan_models, unit_models
from .dist_cases import full

SEQ = 8
BATCH = 2
VOCAB = 64

_DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {**_DECODER, "tie_word_embeddings": False}),
    "qwen2_tied": ("Qwen2Config", {**_DECODER, "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}),
    # grouped-query (8 query heads of 4, 4 key/value heads), read into a fused wqkv and w13
    "fused": ("LlamaConfig", {**_DECODER, "num_attention_heads": 8, "tie_word_embeddings": False}),
}
FUSED = unit_models.TitanConfig(vocab=VOCAB, dim=32, hidden=48, layers=2, heads=8)
# torchtitan 0.3.0's Llama 3 (grouped-query wqkv laid by key/value group, interleaved rotary)
# and the Hugging Face Llama of its sizes: rope theta, norm eps and width as torchtitan's
_TITAN = titan_models.SIZES["tiny"]
FAMILIES["titan"] = (
    "LlamaConfig",
    {
        **_DECODER,
        "vocab_size": _TITAN.vocab_size,
        "hidden_size": _TITAN.dim,
        "intermediate_size": _TITAN.hidden_dim,
        "num_attention_heads": _TITAN.n_heads,
        "num_key_value_heads": _TITAN.kv_heads,
        "rms_norm_eps": _TITAN.norm_eps,
        "rope_theta": _TITAN.rope_theta,
        "max_position_embeddings": _TITAN.max_seq_len,
        "tie_word_embeddings": False,
    },
)

# (mesh, policy, built on the meta device) of each plan family on 4 ranks
_EXPERTS_WHOLE = fs.Rules([("*.experts", "replicate")], name="experts_whole")


def plans(family: str) -> dict[str, tuple[dict[str, int], fs.Policy, bool]]:
    """Every plan family a folder loads under; tensor parallel by the model's own plan."""
    tp = fs.tp(unit_models.fused_rules(FUSED, 4), "tp") if family == "fused" else fs.tp("auto", "tp")
    found = {
        "ddp": ({"dp": 4}, fs.replicate("dp"), False),
        "zero1": ({"dp": 4}, fs.zero(1, "dp"), False),
        "zero2": ({"dp": 4}, fs.zero(2, "dp"), True),
        "zero3": ({"dp": 4}, fs.zero(3, "dp"), True),
        "fsdp": ({"dp": 4}, fs.fsdp("dp"), True),
        "hsdp": ({"node": 2, "gpu": 2}, fs.hsdp("node", "gpu"), True),
        "tp": ({"tp": 4}, tp, True),
        "fsdp_tp": ({"dp": 2, "tp": 2}, fs.fsdp("dp") + tp, False),
        "fsdp_tp_meta": ({"dp": 2, "tp": 2}, fs.fsdp("dp") + tp, True),
        "pp": ({"pp": 2, "dp": 2}, fs.pipeline("pp", microbatches=2) + fs.fsdp("dp"), True),
        "cp": ({"dp": 2, "cp": 2}, fs.fsdp(("dp", "cp")) + fs.cp("cp"), True),
    }
    if family != "fused":
        found["sp"] = ({"dp": 2, "tp": 2}, fs.fsdp("dp") + fs.tp("auto", "tp", sequence_parallel=True), True)
        found["cp_tp"] = ({"cp": 2, "tp": 2}, fs.fsdp("cp") + fs.cp("cp") + fs.tp("auto", "tp"), True)
    if family == "titan":  # whole key/value groups per rank: tp 2 of its 2 groups
        return {
            "fsdp_tp_meta": ({"dp": 2, "tp": 2}, fs.fsdp("dp") + fs.tp("auto", "tp"), True),
            "fsdp": ({"dp": 4}, fs.fsdp("dp"), True),
            "pp": ({"pp": 2, "dp": 2}, fs.pipeline("pp", microbatches=2) + fs.fsdp("dp"), True),
        }
    if family == "fused":  # a packed split inside FSDP2's is refused (engines.checks)
        del found["fsdp_tp"], found["fsdp_tp_meta"]
    if family == "qwen2_tied":  # a tie across stages is refused (pipeline engine)
        del found["pp"]
    if family == "mixtral":
        found = {k: v for k, v in found.items() if k in ("fsdp", "fsdp_tp", "pp", "ddp")}
        found["ep"] = ({"dp": 2, "ep": 2}, fs.fsdp(("dp", "ep")) + fs.ep("ep"), True)
        found["ep_tp"] = (
            {"dp": 2, "tp": 2},
            fs.fsdp("dp") + fs.ep("dp") + fs.tp(_EXPERTS_WHOLE + fs.rules.llama, "tp"),
            True,
        )
        found["ep_pp"] = (
            {"pp": 2, "dp": 2},
            fs.pipeline("pp", microbatches=2) + fs.fsdp("dp") + fs.ep("dp"),
            True,
        )
    return found


def build(
    family: str, *, meta: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.nn.Module:
    """The family's model from its config, seeded (on the meta device: shapes only)."""
    import transformers

    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        if family == "fused":
            return unit_models.FusedLlama(FUSED, kv_heads=4).to(dtype)
        if family == "titan":
            titan = titan_models.titan_llama3("tiny", rope_scaling=False)
            return titan.to(dtype) if dtype != torch.float32 else titan  # its rotary table is complex
        kind, options = FAMILIES[family]
        config = getattr(transformers, kind)(**options)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)


def write_folder(folder: Path, family: str, dtype: torch.dtype = torch.float32, **save: Any) -> Path:
    """``save_pretrained`` of the family's Hugging Face model (the fused family: a Llama of its sizes)."""
    import transformers

    kind, options = FAMILIES[family]
    torch.manual_seed(3)
    config = getattr(transformers, kind)(**options)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder, **save)
    return folder


def tokens() -> torch.Tensor:
    """The batch every run sees (in every family's vocabulary)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    """The model's logits on `tokens`, whole."""
    with torch.no_grad():
        output = model(tokens())
    return full(output if isinstance(output, torch.Tensor) else output.logits)


@contextlib.contextmanager
def counted_reads() -> Iterator[list[int]]:
    """The elements this process reads from the folder's files while inside."""
    count = [0]
    original = hf_read.Folder.read

    def read(self: hf_read.Folder, key: str, window: Any, into: torch.Tensor | None = None) -> torch.Tensor:
        value = original(self, key, window, into)
        count[0] += value.numel()
        return value

    hf_read.Folder.read = read  # type: ignore[method-assign]
    try:
        yield count
    finally:
        hf_read.Folder.read = original  # type: ignore[method-assign]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _logits(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of `tokens` under ``logits``."""
    targets = tokens()[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets)


def mapping_of(family: str) -> Any:
    """torchtitan's names, and Hugging Face's fused gate_up_proj (the fused family's odd layers)."""
    if family == "titan":
        return fs.checkpoint.torchtitan_llama
    if family != "fused":
        return None
    titan = dict(fs.checkpoint.torchtitan_llama)
    extra = {
        "mlp.gate_proj": fs.checkpoint.Piece("layers.*.mlp.gate_up_proj.weight", 0),
        "mlp.up_proj": fs.checkpoint.Piece("layers.*.mlp.gate_up_proj.weight", 1),
        "mlp.down_proj": "layers.*.mlp.down_proj.weight",
    }
    for name, target in extra.items():
        key = f"model.layers.*.{name}.weight"
        titan[key] = [*titan[key], target]  # type: ignore[misc]
    return titan


def reference(
    folder: Path, family: str, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """The whole state, the logits and the buffers one process gets: ``from_pretrained``, or (a model of
    other names) `load_hf` into a plain module."""
    if family in ("fused", "titan"):
        model = build(family, dtype=dtype)
        fs.checkpoint.load_hf(folder, model, mapping=mapping_of(family))
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation="sdpa"
        )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, logits_of(model), {k: v.detach().clone() for k, v in model.named_buffers()}


def load_under(
    folder: str, family: str, plan_name: str, dtype: torch.dtype = torch.float32
) -> dict[str, Any] | None:
    """Build (meta or seeded on the CPU), plan, apply, load; rank 0: the whole state and the logits."""
    mesh, policy, meta = plans(family)[plan_name]
    model = build(family, meta=meta, dtype=dtype, seed=11 + dist.get_rank())
    plan = fs.shard(model, fs.Mesh(**mesh), policy)
    fs.apply(plan, model)
    with counted_reads() as read:
        fs.checkpoint.load_hf(folder, model, mapping=mapping_of(family))
    persistent = model.state_dict().keys()
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if n in persistent)]
    held = sum(_local(t).numel() for t in tensors)
    reads = every_rank((read[0], held))
    state = fs.checkpoint.model_state(model, full=True)
    # under cp a rank's tokens are its chunks (fs.sequence_context): its weights are checked
    logits = None if "cp" in mesh else full(_logits(fs.forward_only(plan, model)(tokens())))
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    if dist.get_rank() != 0:
        return None
    return {
        "state": {k: full(v) for k, v in state.items()},
        "logits": logits,
        "buffers": buffers,
        "reads": reads,
    }


def load_all(folders: dict[str, str], cases: list[tuple[str, str, str]]) -> list[Any]:
    """`load_under` for each (family, plan, dtype name) case, in one world."""
    return [load_under(folders[family], family, plan, getattr(torch, dtype)) for family, plan, dtype in cases]


def load_then_export(folder: str, family: str, plan_name: str, target: str, config: str) -> None:
    """Load under one plan and write the model back as a Hugging Face folder through the same map."""
    mesh, policy, meta = plans(family)[plan_name]
    model = build(family, meta=meta, seed=11 + dist.get_rank())
    plan = fs.shard(model, fs.Mesh(**mesh), policy)
    fs.apply(plan, model)
    fs.checkpoint.load_hf(folder, model, mapping=mapping_of(family))
    fs.checkpoint.export_hf(target, model, config if family == "fused" else None, mapping=mapping_of(family))


# 84 MB in fp32 (largest tensor 4.2 MB): a rank's half stands far above the noise of
# Python and the allocator, and the folder is written and loaded in a few seconds
MEMORY_LLAMA: dict[str, Any] = {
    **_DECODER,
    "vocab_size": 2048,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}


def write_memory_folder(folder: Path) -> Path:
    """``save_pretrained`` of a Llama of `MEMORY_LLAMA`'s sizes (its values left uninitialised)."""
    import transformers

    # the values do not matter here: skipping transformers' random init saves seconds
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MEMORY_LLAMA))
    model.to_empty(device="cpu").save_pretrained(folder)
    return folder


def _resident(key: str) -> int:
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(f"{key}:"))


def _load_fsdp(folder: str) -> torch.nn.Module:
    # the zoo's Llama (Hugging Face's names, fs.checkpoint.zoo_llama): the same reads as
    # transformers' model, without importing transformers on the ranks (half the test's time)
    from functional_shard.zoo import Llama, LlamaConfig

    sizes = MEMORY_LLAMA
    config = LlamaConfig(
        sizes["vocab_size"],
        sizes["hidden_size"],
        sizes["intermediate_size"],
        sizes["num_hidden_layers"],
        sizes["num_attention_heads"],
        sizes["num_key_value_heads"],
    )
    with torch.device("meta"):
        model = Llama(config)
    fs.apply(fs.shard(model, fs.Mesh(dp=dist.get_world_size()), fs.fsdp("dp")), model)
    return fs.checkpoint.load_hf(folder, model, mapping=fs.checkpoint.zoo_llama)


def peak_during_load(folder: str) -> dict[str, int]:
    """On a rank: resident bytes at the peak of building on meta, ``fsdp``, `load_hf`, above
    the start; and the bytes of the storages the model then holds (its shards, padding and
    buffers included)."""
    from torch.distributed.tensor import DTensor

    # once first, so that the code it runs is paged in and its lazy imports are done: what
    # the second load adds is the model's memory alone
    _load_fsdp(folder)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the first load freed goes back to the system
    start = _resident("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak (VmHWM) starts again from the current resident size
    model = _load_fsdp(folder)
    peak = _resident("VmHWM") - start
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return {"peak": peak, "held": sum(storages.values())}
