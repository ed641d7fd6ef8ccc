"""What a GPU really does in a training step: rates, step times, peaks and profiled kernels.

Measures on the GPU it runs on, and writes JSON for the CPU tests and docs to hold the
estimate to (``bench/data/``):

- ``rates.json``: `fs.measure_rates` (matmul rate, fused attention rate, memory bandwidth);
- ``steps.json``: for each row (the zoo's Llama 3.2 1B at 4k-32k tokens under none,
  selective and full checkpointing; Hugging Face models of other families at batch > 1),
  the median step of timed steps after two warm-ups, each phase's time (forward and loss,
  backward, optimizer), ``max_memory_allocated`` and ``max_memory_reserved`` with the
  allocator's statistics, and one profiled step: every kernel's device time and count, and
  every aten op's own device time by input shapes;
- with ``--rows llama-3-8b``, the scale rows instead: half of Llama 3 8B at the published
  runs' micro-batch, on one GPU (``SCALE_ROWS``); with ``--rows "llama-1b 8k none"``, that row
  eager and with each block torch.compile'd (``COMPILE_ROWS``).

Each row trains under a plan on a 1-rank NCCL mesh: FSDP2 with bf16 compute and fp32
reduction, AdamW. ``--dry`` runs tiny rows on the CPU (gloo) to try the script out.

Run: python bench/cuda_step_kernels.py --out bench/data/h200 [--rows NAME ...] [--dry]
With ``--compare bench/data/h200/steps.json`` (no GPU needed) it prints the estimate beside
each committed row instead: step, each kind of kernel, peak, reserved over allocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import pathlib
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import functional_shard as fs
from functional_shard.runtime.measure_rates import kernel_kind
from functional_shard.zoo import CONFIGS, Block, Llama, LlamaConfig

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    family: str  # "zoo" or a transformers config class
    batch: int
    seq: int
    checkpointing: str | None
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    compiled: bool = False  # each block torch.compile'd after fs.apply (estimated with Kernels(compile=True))


QWEN2_1_5B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1e6,
    "max_position_embeddings": 32768,
}
GEMMA_2B = {
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "num_hidden_layers": 18,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
}
PHI3_MINI = {
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32064,
    "max_position_embeddings": 4096,
    "sliding_window": 2047,
    "pad_token_id": 32000,
}
ROWS = [
    *(
        Row(f"llama-1b {seq // 1024}k {ckpt or 'none'}", "zoo", 1, seq, ckpt)
        for seq in (4096, 8192, 16384, 32768)
        for ckpt in (None, "selective", "full")
    ),
    Row("qwen2-1.5b b2 4k none", "Qwen2Config", 2, 4096, None, QWEN2_1_5B),
    Row("qwen2-1.5b b4 2k selective", "Qwen2Config", 4, 2048, "selective", QWEN2_1_5B),
    Row("gemma-2b b4 2k selective", "GemmaConfig", 4, 2048, "selective", GEMMA_2B),
    Row("phi3-mini b4 2k selective", "Phi3Config", 4, 2048, "selective", PHI3_MINI),
]
# rows the time model was not first checked on: other batches, lengths and families
# each SDPA kernel's own rate: the default pick is cuDNN on an H200 (torch 2.11); flash is what
# torch picked on H100s before, and the memory-efficient kernel runs masked attention (sliding windows)
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
HELD_OUT_ROWS = [
    Row("llama-1b b2 8k none", "zoo", 2, 8192, None),
    Row("llama-1b b4 2k selective", "zoo", 4, 2048, "selective"),
    Row("llama-1b b8 1k none", "zoo", 8, 1024, None),
    Row("qwen2-1.5b b1 16k full", "Qwen2Config", 1, 16384, "full", QWEN2_1_5B),
    Row("gemma-2b b1 8k none", "GemmaConfig", 1, 8192, None, GEMMA_2B),
    Row("qwen2-1.5b b8 1k none", "Qwen2Config", 8, 1024, None, QWEN2_1_5B),
]
# Llama 3 8B's shapes on one GPU, run only when asked (``--rows llama-3-8b``): the published 8B
# runs (torchtitan, 8-64 GPUs) are 1.6-1.8x slower than the estimate, while the 1B rows above hold.
# Half the model with the published micro-batch (2 x 8k) and checkpointing, and no peers, tells
# whether the kernels of 8B's shapes run at the rates measured on 1B's, or the gap is elsewhere
# (the collectives, the power limit, torchtitan's own code).
SCALE_ROWS = [
    Row(
        "llama-3-8b 16 layers b2 8k torchtitan",
        "zoo",
        2,
        8192,
        "torchtitan",
        {"like": "llama-3-8b", "num_layers": 16},
    ),
    Row("llama-3-8b 8 layers b1 8k none", "zoo", 1, 8192, None, {"like": "llama-3-8b", "num_layers": 8}),
]
# torch.compile of each block, run only when asked (``--rows "llama-1b 8k none"`` runs it beside its
# eager twin): the model speeds all work but attention by compile_speedup (1.21, from torchtitan's
# eager and compiled rows), matmuls included, though Inductor leaves cuBLAS's GEMMs as they are. The
# profile by kernel kind says whether compile shortens the matmuls or only the memory-bound work
# (and by how much), which decides how compile_speedup should divide (docs/will-it-fit.md, "Kernels")
COMPILE_ROWS = [
    Row("llama-1b 8k none compiled", "zoo", 1, 8192, None, compiled=True),
    Row("llama-1b 4k full compiled", "zoo", 1, 4096, "full", compiled=True),
]
DRY_ROWS = [
    Row("llama-tiny 128 none", "zoo", 1, 128, None),
    Row("llama-tiny 128 full", "zoo", 1, 128, "full"),
    Row(
        "llama-tiny 128 one layer torchtitan", "zoo", 1, 128, "torchtitan", {"like": "tiny", "num_layers": 1}
    ),
    Row("llama-tiny 128 none compiled", "zoo", 1, 128, None, compiled=True),
    Row(
        "qwen2-tiny b2 64 selective",
        "Qwen2Config",
        2,
        64,
        "selective",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
        },
    ),
]
STATS = (
    "allocated_bytes.all.peak",
    "reserved_bytes.all.peak",
    "reserved_bytes.large_pool.peak",
    "reserved_bytes.small_pool.peak",
    "active_bytes.all.peak",
    "requested_bytes.all.peak",
    "inactive_split_bytes.all.peak",
    "segment.all.peak",
    "num_alloc_retries",
    "num_device_alloc",
)


def zoo_config(row: Row, dry: bool = False) -> LlamaConfig:
    """A zoo row's sizes: ``config["like"]`` (llama-1b, tiny when dry) with the rest of ``config`` changed."""
    sizes = dict(row.config)
    like = sizes.pop("like", "tiny" if dry else "llama-1b")
    return dataclasses.replace(CONFIGS[like], **sizes)


def build(row: Row, dry: bool) -> tuple[torch.nn.Module, type[torch.nn.Module]]:
    """The row's model on the meta device and its repeated block's class."""
    if row.family == "zoo":
        with torch.device("meta"):
            return Llama(zoo_config(row, dry)), Block
    import transformers

    config = getattr(transformers, row.family)(**row.config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model, type(model.model.layers[0])


def forward(model: torch.nn.Module, tokens: torch.Tensor, family: str) -> torch.Tensor:
    if family == "zoo":
        return model(tokens)
    # no KV cache in training: a cache filled by the forward changes what a recompute sees
    return model(input_ids=tokens, use_cache=False).logits


class Phases:
    """CUDA events between a step's phases (forward and loss, backward, optimizer)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def step(
    model: torch.nn.Module, adamw: torch.optim.Optimizer, tokens: torch.Tensor, family: str
) -> list[float]:
    phases = Phases(tokens.device)
    phases.mark()
    adamw.zero_grad()
    logits = forward(model, tokens[:, :-1], family)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    del logits
    phases.mark()
    loss.backward()
    phases.mark()
    adamw.step()
    phases.mark()
    return phases.seconds()


def _device_us(event: Any, total: bool = False) -> float:
    names = (
        ("device_time_total", "cuda_time_total")
        if total
        else ("self_device_time_total", "self_cuda_time_total")
    )
    for name in names:
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profiled(run: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """One profiled run: kernels by name, aten ops' own device time by input shapes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    kernels, ops = [], []
    for event in prof.key_averages():
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            kernels.append({"name": event.key, "count": event.count, "us": _device_us(event, total=True)})
    for event in prof.key_averages(group_by_input_shape=True):
        own = _device_us(event) if device.type == "cuda" else float(event.self_cpu_time_total)
        if own > 0 and not str(getattr(event, "device_type", "")).endswith("CUDA"):
            ops.append(
                {"name": event.key, "shapes": str(event.input_shapes), "count": event.count, "us": own}
            )
    kernels.sort(key=lambda k: -k["us"])
    ops.sort(key=lambda k: -k["us"])
    return {"kernels": kernels, "ops": ops}


def measure(row: Row, steps: int, device: torch.device, dry: bool) -> dict[str, Any]:
    model, block = build(row, dry)
    policy = fs.fsdp("dp") + fs.mixed_precision()
    if row.checkpointing:
        policy = policy + fs.checkpointing(block, policy=row.checkpointing)
    plan = fs.shard(model, fs.Mesh(dp=1), policy)
    fs.apply(plan, model, plan.mesh.device_mesh(device.type))
    fs.materialize(plan, model, device.type, seed=0)
    if row.compiled:  # as torchtitan compiles: block by block, after the parallelisms are applied
        for module in model.modules():
            if isinstance(module, block):
                module.compile()
    adamw = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-4)
    vocab = model.get_output_embeddings().weight.shape[0] if row.family != "zoo" else model.config.vocab_size
    generator = torch.Generator(device=device).manual_seed(0)

    def tokens() -> torch.Tensor:
        return torch.randint(0, vocab, (row.batch, row.seq + 1), generator=generator, device=device)

    times, phases = [], []
    stats: dict[str, int] = {}
    for number in range(steps + 2):  # two warm-ups: lazy optimizer state, cuBLAS and flash autotuning
        batch = tokens()
        if number == steps + 1 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        phase = step(model, adamw, batch, row.family)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        phases.append(phase)
    if device.type == "cuda":
        every = torch.cuda.memory_stats()
        stats = {key: every.get(key, 0) for key in STATS}
    batch = tokens()
    profile = profiled(functools.partial(step, model, adamw, batch, row.family), device)
    result = {
        "row": dataclasses.asdict(row),
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_seconds": statistics.median(times[2:]),
        "steps": times,
        "phase_seconds": [statistics.median(p[i] for p in phases[2:]) for i in range(3)],
        "allocated_peak": stats.get("allocated_bytes.all.peak", 0),
        "reserved_peak": stats.get("reserved_bytes.all.peak", 0),
        "memory_stats": stats,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        **profile,
    }
    del model, adamw, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def join_one_rank_group(device: torch.device, port: int) -> None:
    """This process as the one rank of a process group: NCCL on the GPU, gloo on the CPU (``--dry``)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def summary(result: dict[str, Any]) -> str:
    kinds = {"attention": 0.0, "matmul": 0.0, "memory-bound": 0.0}
    for kernel in result["kernels"]:
        if (kind := kernel_kind(kernel["name"])) is not None:
            kinds[kind] += kernel["us"] / 1e3
    row = result["row"]
    return (
        f"| {row['name']} | {result['step_seconds'] * 1e3:.0f} ms | "
        f"{' / '.join(f'{p * 1e3:.0f}' for p in result['phase_seconds'])} | "
        f"{result['allocated_peak'] / GIB:.2f} | {result['reserved_peak'] / GIB:.2f} | "
        f"{kinds['attention']:.0f} | {kinds['matmul']:.0f} | {kinds['memory-bound']:.0f} |"
    )


def compare(steps: pathlib.Path) -> None:
    """Print `fs.estimate` (``hardware="h200"``) beside each measured row of ``steps``."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests" / "unit"))
    from test_gpu_truth import estimate_of, measured_kinds  # the test's own reading of the data

    print(
        "| row | measured step | GPU busy | estimate | est./measured | matmul est./meas. ms | attention "
        "| memory-bound + optimizer | peak est./allocated | reserved/allocated |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in json.loads(steps.read_text())["rows"]:
        if "error" in row:
            continue
        found, kinds = estimate_of(row), measured_kinds(row)
        parts, ms = found.compute_parts, 1e3
        memory = parts["memory-bound"] + found.exposed_seconds.get("optimizer step", 0.0)
        print(
            f"| {row['row']['name']} | {row['step_seconds'] * ms:.0f} ms | {sum(kinds.values()) * ms:.0f} ms "
            f"| {found.step_seconds * ms:.0f} ms | {found.step_seconds / row['step_seconds']:.2f} "
            f"| {parts['matmul'] * ms:.0f} / {kinds['matmul'] * ms:.0f} "
            f"| {parts['attention'] * ms:.0f} / {kinds['attention'] * ms:.0f} "
            f"| {memory * ms:.0f} / {(kinds['memory-bound'] + kinds['optimizer']) * ms:.0f} "
            f"| {_ratio(found.peak_bytes, row['allocated_peak'])} "
            f"| {_ratio(row['reserved_peak'], row['allocated_peak'])} |"
        )


def _ratio(part: float, whole: float) -> str:
    return f"{part / whole:.2f}" if whole else "-"  # a CPU row (--dry) has no CUDA peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/data"))
    parser.add_argument("--steps", type=int, default=3, help="timed steps after two warm-ups")
    parser.add_argument("--rows", nargs="*", help="names of rows to run (a prefix is enough)")
    parser.add_argument("--no-rates", action="store_true", help="skip fs.measure_rates")
    parser.add_argument("--tag", default="", help="a suffix for steps.json (steps-TAG.json)")
    parser.add_argument("--dry", action="store_true", help="tiny rows on the CPU, to try the script out")
    parser.add_argument("--compare", type=pathlib.Path, help="a steps.json to print the estimate beside")
    arguments = parser.parse_args()
    if arguments.compare:
        compare(arguments.compare)
        return
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    device = torch.device("cpu" if arguments.dry else "cuda")
    arguments.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    environment = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
    }
    print(environment, flush=True)
    if not arguments.no_rates:
        began = time.perf_counter()
        if arguments.dry:
            rates = fs.measure_rates(
                "cpu", size=256, seqs=(256,), elements=2**20, repeats=2, backends=SDPA_BACKENDS
            )
        else:
            rates = fs.measure_rates("cuda", backends=SDPA_BACKENDS)
        data = {"environment": environment, **rates.as_dict()}
        (arguments.out / "rates.json").write_text(json.dumps(data, indent=1) + "\n")
        print(
            f"rates ({time.perf_counter() - began:.0f} s): matmul {rates.matmul_flops / 1e12:.0f} TFLOP/s, "
            f"attention {rates.attention_flops / 1e12:.0f} TFLOP/s, "
            f"bandwidth {rates.memory_bandwidth / 1e12:.2f} TB/s",
            flush=True,
        )
        print(f"    host seconds per op: {rates.host}")
        groups = {group: getattr(rates, group) for group in ("matmuls", "attention", "bandwidth")}
        groups |= {f"attention {backend}": cases for backend, cases in rates.attention_kernels.items()}
        for group, cases in groups.items():
            for case, values in cases.items():
                if "rate" not in values:  # a backend with no kernel here, and why
                    print(f"    {group}: {case}: {values}")
                    continue
                print(
                    f"    {group}: {case}: {values['rate'] / 1e12:.3g} T/s ({values['seconds'] * 1e3:.3f} ms)"
                )
    join_one_rank_group(device, port=29533)
    rows = DRY_ROWS if arguments.dry else ROWS + HELD_OUT_ROWS
    if arguments.rows:
        every = DRY_ROWS if arguments.dry else ROWS + HELD_OUT_ROWS + SCALE_ROWS + COMPILE_ROWS
        rows = [r for r in every if any(r.name.startswith(p) for p in arguments.rows)]
    results: list[dict[str, Any]] = []
    target = arguments.out / f"steps{'-' + arguments.tag if arguments.tag else ''}.json"
    print(
        "| row | step | fwd / bwd / opt ms | allocated GiB | reserved GiB "
        "| attention | matmul | memory-bound (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for row in rows:
            began = time.perf_counter()
            try:
                result = measure(row, arguments.steps, device, arguments.dry)
            except Exception as error:  # a row that fails must not cost the others
                traceback.print_exc()
                results.append(
                    {"row": dataclasses.asdict(row), "error": f"{type(error).__name__}: {error}"[:2000]}
                )
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            results.append(result)
            print(summary(result), f"({time.perf_counter() - began:.0f} s)", flush=True)
            target.write_text(json.dumps({"environment": environment, "rows": results}) + "\n")
    finally:
        target.write_text(json.dumps({"environment": environment, "rows": results}) + "\n")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
