"""Context-parallel runs on every rank of a LocalWorld (importable, so spawn can send them).

Each case trains a model for a few AdamW steps through `fs.forward_backward` under a cp plan,
every rank of a cp group passing the same whole sequences, and returns what the test compares
with one process training on the whole batch: the losses, the first step's gradients and
the parameters after the last step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

import functional_shard as fs
from functional_shard.zoo import Attention, Llama, LlamaConfig

from .dist_cases import full, mean_over_ranks

STEPS = 3
LR = 1e-2
SEQ = 16  # 2·cp chunks for cp 2 and 4
BATCH = 2  # sequences per data-parallel rank

# tied embeddings, grouped-query attention (4 query heads, 2 key/value heads)
ZOO = LlamaConfig(128, 32, 64, num_layers=2, num_heads=4, num_kv_heads=2, tie_embeddings=True)
# the zoo's attention repeats its key/value heads before SDPA, so the engine gathers the
# repeated ones: traffic is checked on this one (and on Qwen2, whose heads stay grouped)
ZOO_MHA = LlamaConfig(128, 32, 64, num_layers=2, num_heads=4, num_kv_heads=4, tie_embeddings=True)


def build(kind: str) -> torch.nn.Module:
    """A model of ``kind``, the same on every rank (seed 0)."""
    torch.manual_seed(0)
    if kind == "zoo":
        return Llama(ZOO)
    if kind == "zoo_mha":
        return Llama(ZOO_MHA)
    if kind == "zoo_untied":  # a pipeline does not keep a tie between stages in step
        return Llama(dataclasses.replace(ZOO, tie_embeddings=False))
    import transformers

    config_class = {
        "hf_llama": transformers.LlamaConfig,
        "hf_qwen2": transformers.Qwen2Config,
        "hf_mixtral": transformers.MixtralConfig,
    }[kind]
    experts = {"num_local_experts": 4, "num_experts_per_tok": 2} if kind == "hf_mixtral" else {}
    config = config_class(
        **experts,
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False
    return model


def logits_of(outputs: Any) -> torch.Tensor:
    return outputs.logits if hasattr(outputs, "logits") else outputs


def loss_fn(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = logits_of(outputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(data_parallel: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [
        torch.randint(0, 128, (BATCH * data_parallel, SEQ + 1), generator=generator) for _ in range(STEPS)
    ]


def outcome(model: torch.nn.Module, losses: list[float], grads: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What a one-process reference returns: its losses, first gradients and last parameters."""
    return {
        "losses": losses,
        "grads": grads,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def reference(kind: str, data_parallel: int, *, shuffled: bool = False) -> dict[str, Any]:
    """One process on the whole batch: losses, first gradients, last parameters.

    ``shuffled``: the global batches Lightning's DistributedSampler makes (shuffled with seed
    0; rank r takes perm[r::n], so step s's batches together are one block of perm).
    """
    model = build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    steps = batches(data_parallel)
    if shuffled:
        every = torch.cat(steps)
        perm = torch.randperm(len(every), generator=torch.Generator().manual_seed(0))
        steps = list(every[perm].split(BATCH * data_parallel))
    for step, tokens in enumerate(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        if step == 0:
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return outcome(model, losses, grads)


def reference_bf16(kind: str, data_parallel: int) -> dict[str, Any]:
    """`reference` with mixed precision's casts made by hand, as FSDP2's bf16 policy makes them.

    The forward and backward run on a bfloat16 copy of the float32 parameters (inputs
    and activations bf16 too); the gradients come back to float32 for AdamW, which steps
    the float32 parameters, as `fs.mixed_precision(torch.bfloat16)` has FSDP2 do.
    """
    model = build(kind)
    low = build(kind).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step, tokens in enumerate(batches(data_parallel)):
        with torch.no_grad():
            for high_param, low_param in zip(model.parameters(), low.parameters(), strict=True):
                low_param.copy_(high_param)
        low.zero_grad()
        loss = loss_fn(low(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        for high_param, low_param in zip(model.parameters(), low.parameters(), strict=True):
            high_param.grad = low_param.grad.float()
        if step == 0:
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return outcome(model, losses, grads)


def planned(
    kind: str, mesh: dict[str, int], policy: str, *, applied: bool = True, device: torch.device | None = None
) -> tuple[Any, fs.Plan]:
    """The model of ``kind`` (on ``device``, else the CPU) and its plan (applied unless ``applied=False``)."""
    model = build(kind) if device is None else build(kind).to(device)
    plan = fs.shard(model, fs.Mesh(**mesh), fs.parse_policy(policy, model))
    if applied:
        fs.apply(plan, model)
    return model, plan


def _train_steps(model: Any, plan: fs.Plan, *, keep_grads: bool) -> dict[str, Any]:
    """`STEPS` AdamW steps through fs.forward_backward on this rank's data slice of the batches:
    the global losses, this rank's last loss and (``keep_grads``) the first step's full gradients
    (on the CPU). The batches go to the model's device."""
    device = next(model.parameters()).device
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR)
    step_fn = fs.forward_backward(plan, model, loss_fn)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    losses, grads = [], {}
    for step, tokens in enumerate(batches(data_parallel)):
        mine = tokens[index * BATCH : (index + 1) * BATCH].to(device)
        optimizer.zero_grad()
        loss = step_fn(mine[:, :-1], mine[:, 1:])
        if keep_grads and step == 0:
            grads = {name: full(p.grad) for name, p in model.named_parameters()}
        optimizer.step()
        losses.append(mean_over_ranks(loss).item())
    return {"losses": losses, "rank_loss": loss.item(), "grads": grads, "data_parallel": data_parallel}


def train(kind: str, mesh: dict[str, int], policy: str, device: torch.device | None = None) -> dict[str, Any]:
    """Train under the plan; rank 0 returns what `reference` does, every rank its losses."""
    model, plan = planned(kind, mesh, policy, device=device)
    result = _train_steps(model, plan, keep_grads=True)
    params = {k: full(v) for k, v in model.state_dict().items()}  # full_tensor: every rank takes part
    first = dist.get_rank() == 0
    return {**result, "grads": result["grads"] if first else None, "params": params if first else None}


def refused(kind: str, mesh: dict[str, int], policy: str, seq: int) -> str:
    """The error a step with ``seq`` tokens raises (the same on every rank)."""
    model, plan = planned(kind, mesh, policy)
    step_fn = fs.forward_backward(plan, model, loss_fn)
    tokens = torch.randint(0, 128, (BATCH, seq + 1))
    try:
        step_fn(tokens[:, :-1], tokens[:, 1:])
    except fs.ShardingError as error:
        return str(error)
    return ""


def _scores(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    # made in a helper, where the planner's reading of forward's syntax does not see the product:
    # the runtime's count of split calls is the net for attention so hidden
    return query @ key.transpose(-1, -2)


class _AttentionByHand(torch.nn.Module):
    """Causal attention computed by hand (softmax of scores), which cp cannot reach."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(128, 8)
        self.qkv = torch.nn.Linear(8, 24)
        self.head = torch.nn.Linear(8, 128)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        query, key, value = self.qkv(self.embed(tokens)).chunk(3, dim=-1)
        scores = _scores(query, key)
        hidden = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf)
        return self.head(hidden.softmax(-1) @ value)


def refused_by_hand(mesh: dict[str, int], policy: str) -> list[str]:
    """What a model computing attention by hand raises under a cp plan: through fs.forward_backward,
    then through fs.context_chunks and fs.sequence_context ("" where nothing is raised)."""
    torch.manual_seed(0)
    model = _AttentionByHand()
    plan = fs.shard(model, fs.Mesh(**mesh), fs.parse_policy(policy, model))
    fs.apply(plan, model)
    tokens = torch.randint(0, 128, (BATCH, SEQ + 1))
    errors = []
    for loop in ("forward_backward", "sequence_context"):
        try:
            if loop == "forward_backward":
                fs.forward_backward(plan, model, loss_fn)(tokens[:, :-1], tokens[:, 1:])
            else:
                inputs, targets, _ = fs.context_chunks(plan, tokens[:, :-1], tokens[:, 1:])
                with fs.sequence_context(plan, model, SEQ):
                    loss_fn(model(inputs), targets).backward()
            errors.append("")
        except fs.ShardingError as error:
            errors.append(str(error))
    return errors


class _ZooAttentionByHand(Attention):
    """The zoo's causal attention computed by hand (softmax of scores), which cp cannot reach."""

    def forward(self, x: torch.Tensor, **_: Any) -> torch.Tensor:
        batch, seq, _width = x.shape
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = _scores(q, k) * self.head_dim**-0.5
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf)
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1))


def refused_by_hand_pipelined(mesh: dict[str, int], policy: str) -> str:
    """What the zoo Llama whose layers compute attention by hand raises through fs.forward_backward
    under a pipeline + cp plan ("" where nothing is raised)."""
    model = build("zoo_untied")
    for layer in model.layers:
        layer.self_attn.__class__ = _ZooAttentionByHand
    plan = fs.shard(model, fs.Mesh(**mesh), fs.parse_policy(policy, model))
    fs.apply(plan, model)
    tokens = batches(1)[0][:BATCH]
    try:
        fs.forward_backward(plan, model, loss_fn)(tokens[:, :-1], tokens[:, 1:])
    except fs.ShardingError as error:
        return str(error)
    return ""


def refused_sequence_context(mesh: dict[str, int], policy: str) -> str:
    """What fs.sequence_context raises for the zoo Llama under the plan ("" where nothing is)."""
    model, plan = planned("zoo_untied", mesh, policy)
    try:
        fs.sequence_context(plan, model, SEQ)
    except fs.ShardingError as error:
        return str(error)
    return ""


def _smoothed_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = logits_of(outputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1)


def refused_smoothed_loss(kind: str, mesh: dict[str, int], policy: str) -> list[str]:
    """What a label-smoothed cross-entropy raises in a training step, then in an evaluation
    (torch's loss_parallel() does not take it; "" where nothing is raised)."""
    model, plan = planned(kind, mesh, policy)
    tokens = batches(1)[0][:BATCH]
    errors = []
    for loop in (fs.forward_backward, fs.forward_loss):
        try:
            loop(plan, model, _smoothed_loss)(tokens[:, :-1], tokens[:, 1:])
            errors.append("")
        except fs.ShardingError as error:
            errors.append(str(error))
    return errors


def refused_apply(kind: str, mesh: dict[str, int], policy: str) -> str:
    """The error `fs.apply` raises for the plan (the same on every rank)."""
    try:
        planned(kind, mesh, policy)
    except fs.ShardingError as error:
        return str(error)
    return ""


def measure_comm(kind: str, mesh: dict[str, int], policy: str) -> dict[str, Any]:
    """Bytes this rank sends in its third step, and the prediction (the first step builds lazy
    state, the second DDP's rebuilt buckets, whose layout it broadcasts once)."""
    model, plan = planned(kind, mesh, policy)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR)
    step_fn = fs.forward_backward(plan, model, loss_fn)
    tokens = batches(1)[0][:BATCH]
    for step in range(3):
        log = fs.measure.CollectiveLog(plan.mesh)
        with log if step == 2 else contextlib.nullcontext():
            optimizer.zero_grad()
            step_fn(tokens[:, :-1], tokens[:, 1:])
            optimizer.step()
    cost = plan.cost("adamw", tokens=tokens[:, :-1].numel())
    return {"measured": log.sent, "predicted": {k: dict(v) for k, v in cost.comm_bytes.items()}}


def fit(kind: str, mesh: dict[str, int], policy: str) -> dict[str, Any]:
    """`L.Trainer.fit` under a cp plan (ShardStrategy): the losses the module saw, and rank 0's
    parameters; the batches Lightning's sampler gives are whole sequences, cut by the strategy."""
    import lightning as L  # noqa: N812 (the name Lightning documents)

    from functional_shard.adapters.lightning import ShardStrategy, training_loss

    from .lightning_cases import quiet_trainer

    class LanguageModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build(kind)
            self.losses: list[float] = []

        def loss_fn(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
            return loss_fn(outputs, targets)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            loss = training_loss(self, batch[:, :-1], batch[:, 1:])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    module = LanguageModel()
    strategy = ShardStrategy(fs.parse_policy(policy, module.model), mesh=fs.Mesh(**mesh))
    trainer = quiet_trainer(strategy, max_steps=STEPS)
    data_parallel = mesh.get("dp", 1)  # the cases' batch axis
    loader = torch.utils.data.DataLoader(torch.cat(batches(data_parallel)), batch_size=BATCH)
    trainer.fit(module, loader)
    params = {k.removeprefix("model."): full(v) for k, v in module.state_dict().items()}
    return {
        "losses": module.losses,
        "params": params if dist.get_rank() == 0 else None,
        "data_parallel": data_parallel,
    }


def kept_bytes(kind: str, mesh: dict[str, int], policy: str, seq: int) -> dict[str, int]:
    """What this rank's forward keeps for backward (measured), and the trace's figure."""
    model, plan = planned(kind, mesh, policy, applied=False)
    trace = fs.trace_activations(model, plan, batch=BATCH, seq=seq, rank=dist.get_rank())
    fs.apply(plan, model)
    tokens = torch.randint(0, 128, (BATCH, seq))
    cut = plan.config.context is not None
    with fs.sequence_context(plan, model, seq) if cut else contextlib.nullcontext():
        mine = fs.context_chunks(plan, tokens)[0] if cut else tokens
        kept, output = fs.kept_activation_bytes(model, mine)
        logits_of(output).sum().backward()
    return {"measured": kept, "traced": trace.activation_bytes}


def train_pipelined(kind: str, mesh: dict[str, int], policy: str) -> dict[str, Any]:
    """Train a cp × pp plan; every rank returns the global losses and its stages' whole parameters."""
    model, plan = planned(kind, mesh, policy)
    result = _train_steps(model, plan, keep_grads=False)
    rank = dist.get_rank()
    params = {
        k: full(v)
        for k, v in model.state_dict().items()
        if k not in plan.params or rank in plan.ranks_of_stage(plan.stage_of(k))
    }
    return {"losses": result["losses"], "params": params, "data_parallel": result["data_parallel"]}


def head_memory(kind: str, mesh: dict[str, int], policy: str, seq: int) -> dict[str, int]:
    """The logits' bytes on this rank and what the forward keeps, measured and traced."""
    model, plan = planned(kind, mesh, policy, applied=False)
    trace = fs.trace_activations(model, plan, batch=BATCH, seq=seq, rank=dist.get_rank())
    fs.apply(plan, model)
    tokens = torch.randint(0, 128, (BATCH, seq))
    kept, output = fs.kept_activation_bytes(model, tokens)
    logits = logits_of(output)
    local = logits.to_local() if hasattr(logits, "to_local") else logits
    return {
        "logits": local.numel() * local.element_size(),
        "traced_logits": trace.output_bytes,
        "kept": kept,
        "traced_kept": trace.activation_bytes,
    }


def fabric_loop(kind: str, mesh: dict[str, int], policy: str) -> dict[str, Any]:
    """A Fabric loop with FabricShardStrategy.forward_backward under a cp plan: rank 0's
    parameters and every rank's global mean losses."""
    import lightning as L  # noqa: N812 (the name Lightning documents)

    from functional_shard.adapters.lightning import FabricShardStrategy

    from .lightning_cases import join_as_lightning_rank

    rank, world = join_as_lightning_rank()
    model = build(kind)
    strategy = FabricShardStrategy(fs.parse_policy(policy, model), mesh=fs.Mesh(**mesh))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    module = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=LR))
    step = strategy.forward_backward(module, loss_fn)
    index, data_parallel = strategy.plan.data_parallel_rank(rank)
    losses = []
    for tokens in batches(data_parallel):
        mine = tokens[index * BATCH : (index + 1) * BATCH]
        optimizer.zero_grad()
        loss = step(mine[:, :-1], mine[:, 1:])
        optimizer.step()
        losses.append(mean_over_ranks(loss).item())
    params = {k.removeprefix("_forward_module."): full(v) for k, v in module.state_dict().items()}
    return {"losses": losses, "params": params if rank == 0 else None, "data_parallel": data_parallel}


def train_ring_on_cpu(kind: str, mesh: dict[str, int], policy: str) -> dict[str, Any]:
    """`train` with torch's ring standing on CPU's flash kernel (`tests.ring_standin`)."""
    from .ring_standin import cpu_ring_kernels

    with cpu_ring_kernels():
        return train(kind, mesh, policy)


def train_on_cuda(kind: str, mesh: dict[str, int], policy: str) -> dict[str, Any]:
    """`train` with the model and batches on this rank's GPU; results come back on the CPU."""
    return train(kind, mesh, policy, device=torch.device("cuda", torch.cuda.current_device()))


PACKED_SEQ = 64  # a multiple of cp 2 and 4; the cut by work needs no 2·cp chunks


def packed_rows(count: int) -> fs.PackedBatch:
    """``count`` packed rows of ``PACKED_SEQ`` tokens: in each one long document (30 to 44 tokens)
    among short ones (1 to 6), somewhere in the row, then padding; the same rows on every call."""
    generator = torch.Generator().manual_seed(4321)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=generator))

    rows = []
    for _ in range(count):
        lengths = [draw(1, 6) for _ in range(draw(3, 6))]
        lengths.insert(draw(0, len(lengths)), draw(30, 44))
        while sum(lengths) + 6 <= PACKED_SEQ - draw(0, 4):
            lengths.append(draw(1, 6))
        docs = [torch.randint(1, 128, (n,), generator=generator) for n in lengths]
        rows.append(fs.pack(docs, PACKED_SEQ))
    return fs.collate_packed(rows)


PACKED_FIELDS = ("tokens", "labels", "positions", "document_ids")


def packed_batches(data_parallel: int) -> list[dict[str, torch.Tensor]]:
    """`STEPS` batches of `packed_rows`, ``BATCH`` a data-parallel rank, as dicts of tensors."""
    rows = packed_rows(STEPS * BATCH * data_parallel)
    step = BATCH * data_parallel
    return [
        {name: getattr(rows[i * step : (i + 1) * step], name) for name in PACKED_FIELDS} for i in range(STEPS)
    ]


def packed_loss(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean loss of ``model`` on packed rows (`run_packed`), each document attending only to itself."""
    return loss_fn(run_packed(model, rows), rows["labels"])


def run_packed(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> Any:
    """``model`` on packed ``rows`` in one process: the zoo Llama given them as they are, a Hugging
    Face model as transformers takes packed documents (position_ids, no cache), written out here."""
    if isinstance(model, Llama):
        return model(rows["tokens"], positions=rows["positions"], document_ids=rows["document_ids"])
    return model(input_ids=rows["tokens"], position_ids=rows["positions"], use_cache=False)


def reference_packed(data_parallel: int, kind: str = "zoo") -> dict[str, Any]:
    """One process on the whole packed batches: each data-parallel slice's mean loss, averaged
    (data parallel averages its ranks' gradients), as `reference`."""
    model = build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step, batch in enumerate(packed_batches(data_parallel)):
        optimizer.zero_grad()
        slices = [{k: v[i * BATCH : (i + 1) * BATCH] for k, v in batch.items()} for i in range(data_parallel)]
        loss = sum(packed_loss(model, part) for part in slices) / data_parallel
        loss.backward()
        if step == 0:
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return outcome(model, losses, grads)


def train_packed(mesh: dict[str, int], policy: str, kind: str = "zoo") -> dict[str, Any]:
    """`train` on `packed_batches`: the model through fs.forward_backward with positions= and
    document_ids=; rank 0 returns what `reference_packed` does, of the parameters it holds (under a
    pipeline, every rank returns those of its stages)."""
    model, plan = planned(kind, mesh, policy)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=LR)
    step_fn = fs.forward_backward(plan, model, loss_fn)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    losses, grads = [], {}
    for step, batch in enumerate(packed_batches(data_parallel)):
        mine = {k: v[index * BATCH : (index + 1) * BATCH] for k, v in batch.items()}
        optimizer.zero_grad()
        loss = step_fn(
            mine["tokens"], mine["labels"], positions=mine["positions"], document_ids=mine["document_ids"]
        )
        if step == 0:
            grads = {name: full(p.grad) for name, p in model.named_parameters()}
        optimizer.step()
        losses.append(mean_over_ranks(loss).item())
    params = {k: full(v) for k, v in model.state_dict().items()}
    keep = dist.get_rank() == 0 or plan.config.pipeline is not None
    return {
        "losses": losses,
        "grads": grads if keep else None,
        "params": params if keep else None,
        "data_parallel": data_parallel,
    }


def packed_evaluation_batches(data_parallel: int) -> list[dict[str, torch.Tensor]]:
    """`packed_batches`, then one whose second row in each data-parallel slice is padding alone (no
    target: under a pipeline of 2 micro-batches, a micro-batch whose mean loss is nan, weighted 0)."""
    steps = packed_batches(data_parallel)
    padded = {k: v.clone() for k, v in steps[-1].items()}
    for row in range(1, BATCH * data_parallel, BATCH):
        padded["tokens"][row] = 0
        padded["labels"][row] = -100
        padded["positions"][row] = torch.arange(PACKED_SEQ)
        padded["document_ids"][row] = 0
    return [*steps, padded]


def evaluate_packed(mesh: dict[str, int], policy: str, kind: str) -> dict[str, Any]:
    """fs.forward_loss and fs.forward_only on this rank's slice of `packed_evaluation_batches`:
    its data-parallel index, the losses and the logits."""
    model, plan = planned(kind, mesh, policy)
    evaluate = fs.forward_loss(plan, model, loss_fn)
    forward = fs.forward_only(plan, model)
    index, data_parallel = plan.data_parallel_rank(dist.get_rank())
    losses, logits = [], []
    for batch in packed_evaluation_batches(data_parallel):
        mine = {k: v[index * BATCH : (index + 1) * BATCH] for k, v in batch.items()}
        packed = {"positions": mine["positions"], "document_ids": mine["document_ids"]}
        losses.append(float(evaluate(mine["tokens"], mine["labels"], **packed)))
        logits.append(full(logits_of(forward(mine["tokens"], **packed))))
    return {"index": index, "data_parallel": data_parallel, "losses": losses, "logits": logits}


def assert_packed_evaluation_as_one_process(results: list[dict[str, Any]], kind: str) -> None:
    """`evaluate_packed`'s results equal one process's on each data-parallel slice."""
    import pytest

    model = build(kind)
    batches = packed_evaluation_batches(results[0]["data_parallel"])
    for result in results:
        index = result["index"]
        with torch.no_grad():
            for step, batch in enumerate(batches):
                mine = {k: v[index * BATCH : (index + 1) * BATCH] for k, v in batch.items()}
                logits = logits_of(run_packed(model, mine))
                assert result["losses"][step] == pytest.approx(
                    loss_fn(logits, mine["labels"]).item(), abs=1e-5
                )
                torch.testing.assert_close(result["logits"][step], logits, atol=1e-5, rtol=1e-4)


def loss_of_a_row_mostly_padding(mesh: dict[str, int], policy: str) -> float:
    """fs.forward_backward's loss on one packed row, a 5-token document then padding: the cp ranks
    holding padding alone count no target."""
    model, plan = planned("zoo", mesh, policy)
    row = fs.pack([torch.arange(1, 6)], PACKED_SEQ)
    step = fs.forward_backward(plan, model, loss_fn)
    loss = step(row.tokens, row.labels, positions=row.positions, document_ids=row.document_ids)
    return float(loss)


def reference_row_mostly_padding() -> float:
    """`loss_of_a_row_mostly_padding` in one process."""
    row = fs.pack([torch.arange(1, 6)], PACKED_SEQ)
    logits = build("zoo")(row.tokens, positions=row.positions, document_ids=row.document_ids)
    return loss_fn(logits, row.labels).item()


def _masked_prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """Whole sequences whose first 6 targets are ignored (-100, a masked prompt): the cp chunks
    hold uneven counts of counted targets."""
    tokens = batches(1)[0][:BATCH]
    targets = tokens[:, 1:].clone()
    targets[:, :6] = -100
    return tokens[:, :-1], targets


def step_on_masked_prompt(mesh: dict[str, int], policy: str) -> dict[str, Any]:
    """fs.forward_backward's loss on `_masked_prompt` and the gradients (rank 0's, whole)."""
    model, plan = planned("zoo", mesh, policy)
    loss = fs.forward_backward(plan, model, loss_fn)(*_masked_prompt())
    grads = {name: full(p.grad) for name, p in model.named_parameters()}
    return {"loss": float(loss), "grads": grads if dist.get_rank() == 0 else None}


def reference_masked_prompt() -> dict[str, Any]:
    """`step_on_masked_prompt` in one process."""
    return _one_step("zoo", *_masked_prompt())


def _one_step(kind: str, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """One process's loss on ``inputs`` and ``targets`` and its gradients, by parameter path."""
    model = build(kind)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return {"loss": loss.item(), "grads": {name: p.grad for name, p in model.named_parameters()}}


def _ignored_chunk() -> tuple[torch.Tensor, torch.Tensor]:
    """Two whole sequences: the first's first half of targets ignored (-100), the second's first 3,
    so cut into halves (cp 2, no balancing) and one row a micro-batch (2), one part counts no
    target and the others unevenly many."""
    tokens = batches(1)[0][:BATCH]
    targets = tokens[:, 1:].clone()
    targets[0, : SEQ // 2] = -100
    targets[1, :3] = -100
    return tokens[:, :-1], targets


def step_on_ignored_chunk(mesh: dict[str, int], policy: str) -> dict[str, Any]:
    """fs.forward_backward's loss on `_ignored_chunk` under a pipeline plan, and the whole gradients
    of this rank's stages."""
    model, plan = planned("zoo_untied", mesh, policy)
    loss = fs.forward_backward(plan, model, loss_fn)(*_ignored_chunk())
    return {"loss": float(loss), "grads": {name: full(p.grad) for name, p in model.named_parameters()}}


def reference_ignored_chunk() -> dict[str, Any]:
    """`step_on_ignored_chunk` in one process."""
    return _one_step("zoo_untied", *_ignored_chunk())


def assert_packed_as_one_process(results: list[dict[str, Any]], kind: str = "zoo") -> None:
    """`train_packed`'s results equal `reference_packed`'s: the losses, the first gradients and the
    last parameters, each parameter's from the first rank that holds it."""
    import pytest

    expected = reference_packed(results[0]["data_parallel"], kind)
    assert results[0]["losses"] == pytest.approx(expected["losses"], abs=1e-5)
    for field, atol in (("grads", 1e-6), ("params", LR / 100)):
        held = {name: value for result in reversed(results) for name, value in (result[field] or {}).items()}
        assert held.keys() == expected[field].keys(), field
        for name, value in expected[field].items():
            torch.testing.assert_close(held[name], value, atol=atol, rtol=1e-4, msg=f"{field} {name}")


def refused_packed(mesh: dict[str, int], policy: str, kind: str, how: str) -> str:
    """The error a step on packed rows raises: ``how`` is "straddling" (row 1, the second
    micro-batch's first, goes on with row 0's last document) or "rows" (as packed)."""
    model, plan = planned(kind, mesh, policy)
    step_fn = fs.forward_backward(plan, model, loss_fn)
    batch = fs.pack([[5, 6, 7], [8, 9, 10], [11, 12, 13, 14]], seq_len=4)  # rows of 3, 3 and 4 tokens
    tokens, labels, positions, ids = (
        batch.tokens[:2],
        batch.labels[:2],
        batch.positions[:2],
        batch.document_ids[:2],
    )
    if how == "straddling":
        positions = positions.clone()
        positions[1] = torch.arange(3, 7)
        ids = torch.zeros_like(ids)
    try:
        step_fn(tokens, labels, positions=positions, document_ids=ids)
    except fs.ShardingError as error:
        return str(error)
    return ""


# the ops that read a tensor's value to the host: on a GPU each one waits for the device
HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero")


@contextlib.contextmanager
def counting_host_reads() -> Iterator[collections.Counter[str]]:
    """Within it, the ops of `HOST_READS` that run, and each ``Tensor.tolist``, counted by name.

    ``.item()``, ``bool()``, ``int()`` and ``float()`` of a tensor dispatch ``_local_scalar_dense``;
    ``nonzero`` waits for its count; ``tolist`` reads a CPU tensor without dispatching anything.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter[str] = collections.Counter()

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if str(func.overloadpacket) in HOST_READS:
                counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted_tolist(tensor: torch.Tensor) -> Any:
        counts["Tensor.tolist"] += 1
        return tolist(tensor)

    torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
    try:
        with Reads():
            yield counts
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]


def host_reads_of_packed_pipeline_steps(microbatches: int) -> dict[str, collections.Counter[str]]:
    """The host reads (`counting_host_reads`) of a training step, a `forward_loss` and a `forward_only`
    on 4 packed rows under a pipeline of ``microbatches`` on this one rank, each run once before."""
    model, plan = planned("zoo_untied", {"pp": 1}, f"pipeline(pp, microbatches={microbatches})")
    rows = packed_rows(4)
    packed = {"positions": rows.positions, "document_ids": rows.document_ids}
    step = fs.forward_backward(plan, model, loss_fn)
    evaluate = fs.forward_loss(plan, model, loss_fn)
    forward = fs.forward_only(plan, model)
    runs = {
        "fs.forward_backward": lambda: step(rows.tokens, rows.labels, **packed),
        "fs.forward_loss": lambda: evaluate(rows.tokens, rows.labels, **packed),
        "fs.forward_only": lambda: forward(rows.tokens, **packed),
    }
    reads = {}
    for name, run in runs.items():
        run()  # torch's schedule sets its stages up at its first step and at its first eval
        with counting_host_reads() as counts:
            run()
        reads[name] = counts
    return reads
