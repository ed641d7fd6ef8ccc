"""The estimate table of docs/moe.md: a Mixtral-8x7B-shaped model on 64 H100s, plan by plan.

The model is transformers' ``MixtralForCausalLM`` built from a ``MixtralConfig`` of
Mixtral-8x7B's shape (hidden 4096, intermediate 14336, 32 layers, 8 experts top-2, 32
query and 8 key/value heads, vocabulary 32000) on the meta device: no weights, no download.
Each candidate plan is made with ``fs.shard`` and estimated with ``fs.estimate`` (peak
memory per rank, step time, tokens/s); a plan the library refuses, or one the estimate
cannot count, keeps its row with the reason ("not estimated: ..."), never dropped.

    python bench/moe_table.py                 # the markdown table of the page
    python bench/moe_table.py --holds         # the explain()/cost() blocks of the page
    python bench/moe_table.py --arithmetic 8  # the fsdp-vs-ep bytes at ep 8
    python bench/moe_table.py --search        # fs.search_plans' report, ep candidates included
    python bench/moe_table.py --write-page docs/moe.md  # every generated block of the page
    python bench/moe_table.py --seq 8192 --batch 1 --devices 64
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import pathlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import functional_shard as fs

BUDGET = "80GiB"
BLOCK = "MixtralDecoderLayer"
EXTRAS = f" + bf16 + checkpointing({BLOCK})"


def mixtral_8x7b() -> Any:
    """Mixtral-8x7B's shape as a transformers model on the meta device (46.7 B parameters)."""
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
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            return transformers.MixtralForCausalLM(config)
    finally:
        transformers.logging.set_verbosity(verbosity)


@dataclass(frozen=True)
class Candidate:
    """One row: a name for the table, the mesh's axis sizes and the policy text."""

    name: str
    mesh: dict[str, int]
    policy: str

    def shard(self, model: Any) -> fs.Plan:
        """The plan (raises the library's ShardingError when it refuses it)."""
        return fs.shard(model, fs.Mesh(**self.mesh), fs.parse_policy(self.policy + EXTRAS, model))

    @property
    def mesh_text(self) -> str:
        return ", ".join(f"{axis}={size}" for axis, size in self.mesh.items())


def candidates(devices: int, experts: int = 8) -> list[Candidate]:
    """fsdp alone; fsdp + ep for every ep size dividing the experts; tp inside the experts."""
    rows = [Candidate("fsdp", {"dp": devices}, "fsdp(dp)")]
    # ep borrowed from the one data-parallel axis: refused unless the axis divides the experts
    rows.append(Candidate("fsdp + ep over all of dp", {"dp": devices}, "fsdp(dp) + ep(dp)"))
    for size in (2, 4, 8):
        if experts % size == 0 and devices % size == 0:
            rows.append(
                Candidate(f"fsdp + ep {size}", {"dp": devices // size, "ep": size}, "fsdp(dp, ep) + ep(ep)")
            )
    for size in (2, 4, 8):
        if devices % size == 0:
            rows.append(
                Candidate(
                    f"fsdp + tp {size} (inside the experts)",
                    {"dp": devices // size, "tp": size},
                    "fsdp(dp) + tp(hf, tp)",
                )
            )
    return rows


@dataclass(frozen=True)
class Row:
    """What the cost model and the estimate say of one candidate, or why they say nothing."""

    candidate: Candidate
    estimate: Any = None
    expert_bytes: int | None = None
    sent_bytes: float | None = None
    reason: str = ""


def _one_line(error: BaseException, limit: int = 200) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 1].rsplit(" ", 1)[0] + " …"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # torch and transformers print warnings while tracing on fake tensors; the table is the output
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def estimate(model: Any, candidate: Candidate, batch: int, seq: int, hardware: str) -> Row:
    """Shard, cost and estimate one candidate; a refusal becomes the row's reason."""
    try:
        plan = candidate.shard(model)
    except fs.ShardingError as error:
        return Row(candidate, reason=f"refused: {_one_line(error)}")
    experts = expert_weight_bytes(model, plan)
    try:
        sent: float | None = plan.cost(tokens=batch * seq).comm_total_bytes
    except fs.ShardingError:
        sent = None  # the estimate below fails too, and says why
    try:
        with _quiet():
            found = fs.estimate(model, plan, batch=batch, seq=seq, hardware=hardware)
    except fs.ShardingError as error:
        return Row(candidate, None, experts, sent, f"not estimated: {_one_line(error)}")
    return Row(candidate, found, experts, sent)


def expert_weight_bytes(model: Any, plan: fs.Plan, rank: int = 0) -> int:
    """Bytes of expert weights ``rank`` stores (rank 0 holds the largest chunk of every split)."""
    return sum(
        math.prod(plan.local_shape(path, rank=rank)) * param.element_size()
        for path, param in model.named_parameters()
        if ".experts." in path
    )


def _gib(value: float) -> str:
    return f"{value / 2**30:,.1f} GiB"


def markdown(rows: list[Row], devices: int) -> str:
    """The page's table: one line per candidate, refused and unestimated ones included."""
    lines = [
        "| plan | mesh | expert weights / rank | sent / rank / step | peak / rank | fits 80 GiB | step "
        "| tokens/s (all ranks) | MFU |",
        "|---|---|---:|---:|---:|:---:|---:|---:|---:|",
    ]
    for row in rows:
        c = row.candidate
        experts = "—" if row.expert_bytes is None else _gib(row.expert_bytes)
        sent = "—" if row.sent_bytes is None else _gib(row.sent_bytes)
        head = f"| {c.name} | {c.mesh_text} | {experts} | {sent} "
        if row.estimate is None:
            lines.append(f"{head}| {row.reason} | | | | |")
            continue
        e = row.estimate
        # tokens/s per device counts a tensor-parallel group's shared tokens once
        total = e.tokens_per_second * devices
        lines.append(
            f"{head}| {_gib(e.peak_bytes)} | {'yes' if e.fits(BUDGET) else 'no'} "
            f"| {e.step_seconds * 1e3:,.0f} ms | {total:,.0f} | {e.mfu:.1%} |"
        )
    return "\n".join(lines)


def holds(model: Any, seq: int, batch: int) -> str:
    """The explain() and cost() blocks of the page's "what each rank holds and sends"."""
    out = []
    for candidate in (
        Candidate("fsdp", {"dp": 64}, "fsdp(dp)"),
        Candidate("fsdp + ep 8", {"dp": 8, "ep": 8}, "fsdp(dp, ep) + ep(ep)"),
        Candidate("fsdp + tp 8", {"dp": 8, "tp": 8}, "fsdp(dp) + tp(hf, tp)"),
    ):
        plan = candidate.shard(model)
        rows = [
            line
            for line in plan.explain().splitlines()
            if ".experts." in line or ".gate." in line or line.startswith(("Plan on", "path", "at rest"))
        ]
        out.append(f"# {candidate.policy + EXTRAS} on Mesh({candidate.mesh_text})")
        out.append("# plan.explain(): the router and expert rows")
        out.extend(rows)
        out.append(f"# plan.cost(tokens={batch * seq})")
        try:
            out.append(str(plan.cost(tokens=batch * seq)))
        except fs.ShardingError as error:
            out.append(f"ShardingError: {_one_line(error)}")
            out.append("# plan.cost()")
            out.append(str(plan.cost()))
        out.append("")
    return "\n".join(out)


def arithmetic(model: Any, devices: int, tokens: int, ep: int) -> str:
    """The page's "when ep beats fsdp alone" numbers, from the model's config.

    Per rank and step, bf16 parameters and activations, fp32 gradient reduction (the ``bf16``
    policy), balanced routing, FSDP2 without padding (the expert count divides the ranks
    sharding it); what torch really moves is ``plan.cost()``'s, padding included.
    """
    config = model.config
    d, f, experts, k = (
        config.hidden_size,
        config.intermediate_size,
        config.num_local_experts,
        config.num_experts_per_tok,
    )
    layers = config.num_hidden_layers
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * d * f  # gate and up (2f x d), down (d x f)
    per_layer = experts * per_expert
    bf16, fp32 = 2, 4
    data = devices // ep
    # FSDP: every layer's experts all-gathered in forward and again in backward, their
    # gradients reduce-scattered once; a rank receives (n - 1)/n of what is gathered
    fsdp_gather = 2 * layers * per_layer * bf16 * (devices - 1) / devices
    fsdp_reduce = layers * per_layer * fp32 * (devices - 1) / devices
    ep_gather = 2 * layers * (per_layer // ep) * bf16 * (data - 1) / data
    ep_reduce = layers * (per_layer // ep) * fp32 * (data - 1) / data
    # ep: each token copy (k per token) goes to its expert's rank and its result comes back,
    # forward and backward; (ep - 1)/ep of the copies leave the rank under balanced routing
    one_way = tokens * k * d * bf16 * (ep - 1) / ep
    dispatch = 4 * layers * one_way
    recompute = 6 * layers * one_way  # checkpointed blocks run their forward all-to-alls again
    weights_saved = fsdp_gather + fsdp_reduce - ep_gather - ep_reduce
    even = weights_saved / (4 * layers * k * d * bf16 * (ep - 1) / ep)
    # FSDP2 splits dim 0 (the expert index) in torch.chunk pieces padded to the largest: with
    # more ranks than experts, every rank's shard is one whole expert, real or padding
    fsdp_padding = devices * math.ceil(experts / devices) / experts
    ep_padding = data * math.ceil(experts // ep / data) / (experts // ep)

    def gib(value: float) -> str:
        return f"{value / 2**30:,.2f} GiB"

    return "\n".join(
        [
            f"d = {d}, f = {f}, E = {experts}, top-{k}, {layers} layers; {devices} ranks, "
            f"{tokens} tokens per rank per step",
            f"parameters per expert              3·d·f        = {per_expert:,}",
            f"parameters per expert layer        E·3·d·f      = {per_layer:,} "
            f"({gib(per_layer * bf16)} in bf16)",
            f"expert parameters, all layers                   = {layers * per_layer:,} "
            f"of {total:,} ({layers * per_layer / total:.1%})",
            "",
            f"fsdp over {devices}: expert bytes a rank receives and sends per step",
            f"  all-gather, forward and backward  2·L·E·3df·2 B·(n-1)/n = {gib(fsdp_gather)}",
            f"  reduce-scatter of fp32 gradients  L·E·3df·4 B·(n-1)/n   = {gib(fsdp_reduce)}",
            f"ep {ep} × fsdp over {data}: the same for the rank's {experts // ep} expert(s) per layer",
            f"  all-gather                                              = {gib(ep_gather)}",
            f"  reduce-scatter                                          = {gib(ep_reduce)}",
            f"  all-to-all of token copies, 4 per layer  4·L·T·k·d·2 B·(ep-1)/ep = {gib(dispatch)}",
            f"  ... 6 per layer when the blocks are checkpointed (recomputed)   = {gib(recompute)}",
            f"ep sends less while tokens per rank per step < {even:,.0f} (without recomputation)",
            "",
            "FSDP2 shards the expert index (dim 0), padding each rank's shard to the largest:",
            f"  fsdp over {devices}: {experts} experts in {devices} shards, weight bytes × "
            f"{fsdp_padding:g} = {gib((fsdp_gather + fsdp_reduce) * fsdp_padding)}",
            f"  ep {ep} × fsdp over {data}: {experts // ep} expert(s) in {data} shards, weight bytes × "
            f"{ep_padding:g} = {gib((ep_gather + ep_reduce) * ep_padding)}, "
            f"plus {gib(dispatch)} of token copies",
        ]
    )


def table(model: Any, devices: int, batch: int, seq: int, hardware: str) -> str:
    """The heading line and the markdown table of every candidate."""
    rows = [estimate(model, c, batch, seq, hardware) for c in candidates(devices)]
    heading = (
        f"Mixtral-8x7B shape (MixtralConfig, meta device), {devices} × {hardware}, "
        f"{batch} × {seq} tokens per data-parallel rank, policy + bf16 + "
        f"checkpointing({BLOCK}), AdamW"
    )
    return f"{heading}\n\n{markdown(rows, devices)}"


def search(model: Any, devices: int, batch: int, seq: int, hardware: str) -> str:
    """`fs.search_plans`' report for the model: ``batch`` sequences per data-parallel rank."""
    with _quiet():
        report = fs.search_plans(
            model, devices=devices, memory_budget=BUDGET, batch=batch * devices, seq=seq, hardware=hardware
        )
    return str(report)


def write_page(path: pathlib.Path, blocks: dict[str, str]) -> None:
    """Replace each ``<!-- moe_table NAME -->`` ... ``<!-- end -->`` block of the page."""
    text = path.read_text()
    for name, body in blocks.items():
        pattern = re.compile(rf"(<!-- moe_table {name} -->\n)(.*?)(<!-- end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{path} has no '<!-- moe_table {name} -->' ... '<!-- end -->' block")
        text = pattern.sub(lambda m, body=body: m.group(1) + body.rstrip("\n") + "\n" + m.group(3), text)
    path.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank per step")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--holds", action="store_true", help="print the explain()/cost() blocks instead")
    parser.add_argument(
        "--arithmetic", type=int, metavar="EP", help="print the fsdp-vs-ep bytes at this ep size"
    )
    parser.add_argument("--search", action="store_true", help="print fs.search_plans' report instead")
    parser.add_argument("--write-page", type=pathlib.Path, metavar="PAGE", help="refresh the page's blocks")
    args = parser.parse_args(argv)
    model = mixtral_8x7b()
    if args.write_page:
        tokens = args.batch * args.seq
        write_page(
            args.write_page,
            {
                "arithmetic": f"```text\n{arithmetic(model, args.devices, tokens, 8)}\n```",
                "holds": f"```text\n{holds(model, args.seq, args.batch)}\n```",
                "table": table(model, args.devices, args.batch, args.seq, args.hardware),
                # one node: no FSDP2 padding (8 experts over at most 8 ranks), NVLink only
                "table-one-node": table(model, 8, args.batch, args.seq, args.hardware),
                "search": f"```text\n{search(model, args.devices, args.batch, args.seq, args.hardware)}\n```",
            },
        )
        print(f"refreshed {args.write_page}")
        return
    if args.arithmetic:
        print(arithmetic(model, args.devices, args.batch * args.seq, args.arithmetic))
        return
    if args.search:
        print(search(model, args.devices, args.batch, args.seq, args.hardware))
        return
    if args.holds:
        print(holds(model, args.seq, args.batch))
        return
    started = time.perf_counter()
    print(table(model, args.devices, args.batch, args.seq, args.hardware))
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
