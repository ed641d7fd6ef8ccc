"""A LightningModule and a Trainer.fit run on each rank of a LocalWorld."""

from __future__ import annotations

import os
from collections.abc import Callable

import lightning as L  # noqa: N812 (the name Lightning documents)
import torch
import torch.distributed as dist

import functional_shard as fs
from functional_shard.adapters.lightning import ShardStrategy, training_loss
from functional_shard.zoo import Llama, LlamaConfig

from . import cp_cases, dist_cases, load_hf_cases

# AdamW divides by sqrt(v) + eps: with torch's default eps (1e-8) a gradient element near
# zero turns the last-bit reordering of a cross-rank sum into a full-size update of either
# sign (seen: 2.2e-4 on one of 2048 elements on an AMD EPYC, 3.4e-5 elsewhere). An eps well
# above those rounding errors keeps the comparison about the training, not the CPU's sums.
ADAM_EPS = 1e-6


class LanguageModel(L.LightningModule):
    """A tiny Llama trained with AdamW; records its per-step loss."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Llama(config)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        loss = dist_cases.loss_of(self.model, batch)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=dist_cases.LR, eps=ADAM_EPS)


def join_as_lightning_rank() -> tuple[int, int]:
    """Tell Lightning this process is a rank of a group that exists already (LOCAL_RANK set:
    it joins instead of launching); returns (rank, world size)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    return rank, world


def quiet_trainer(strategy: str | ShardStrategy, **kwargs: object) -> L.Trainer:
    """A Trainer on every CPU rank of this world, without logging, checkpoints or bars."""
    _, world = join_as_lightning_rank()
    return L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def fit(
    strategy: str | ShardStrategy,
    config: LlamaConfig,
    data_parallel: int,
    accumulate: int = 1,
    clip: float | None = None,
    module: L.LightningModule | None = None,
    **trainer_options: object,
) -> dict[str, object]:
    """Trainer.fit on this rank (the LocalWorld's process group is reused); with the bytes
    this rank sent in reductions, counted from the collectives torch issued."""
    trainer = quiet_trainer(
        strategy,
        max_steps=dist_cases.STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        **trainer_options,
    )
    tokens = torch.cat(dist_cases.batches(config, data_parallel * accumulate))
    loader = torch.utils.data.DataLoader(tokens, batch_size=dist_cases.MICRO_BATCH, shuffle=False)
    module = module or LanguageModel(config)
    log = fs.CollectiveLog(fs.Mesh(dp=dist.get_world_size()))
    with log:
        trainer.fit(module, loader)
    reduced = sum(
        sum(by_axis.values())
        for kind, by_axis in log.sent.items()
        if kind in ("reduce_scatter", "all_reduce")
    )
    losses = torch.stack([dist_cases.full(loss) for loss in module.losses])
    # a step's loss: the mean of its micro-batch losses
    losses = dist_cases.mean_over_ranks(losses.view(-1, accumulate).mean(dim=1))
    params = {k.removeprefix("model."): dist_cases.full(v) for k, v in module.state_dict().items()}
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "losses": losses.tolist(),
        "params": params if dist.get_rank() == 0 else None,
        "reduced_bytes": reduced,
        "scaler": type(scaler).__name__ if scaler is not None else None,
    }


def fit_named(name: str, config: LlamaConfig, data_parallel: int) -> dict[str, object]:
    return fit(name, config, data_parallel)


def fit_with(
    plan_or_policy: object,
    mesh: fs.Mesh | None,
    config: LlamaConfig,
    data_parallel: int,
    float16_autocast: bool = False,
):
    """`fit` under ``ShardStrategy(plan_or_policy)``; ``float16_autocast``: Lightning's
    16-mixed plugin on the CPU (its flag turns 16-mixed into bf16-mixed there)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugins = [MixedPrecision("16-mixed", "cpu")] if float16_autocast else []
    return fit(ShardStrategy(plan_or_policy, mesh=mesh), config, data_parallel, plugins=plugins)


def reference(
    config: LlamaConfig,
    data_parallel: int,
    accumulate: int = 1,
    clip: float | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the global batches Lightning's DistributedSampler makes (shuffled
    with seed 0; rank r takes perm[r::n], so step s's batches together are one block)."""
    tokens = torch.cat(dist_cases.batches(config, data_parallel * accumulate))
    perm = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(0))
    global_batches = tokens[perm].split(dist_cases.MICRO_BATCH * data_parallel * accumulate)
    torch.manual_seed(0)
    model = Llama(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=dist_cases.LR, eps=ADAM_EPS)
    losses = []
    for batch in global_batches[: dist_cases.STEPS]:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = dist_cases.loss_of(model, batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def optimizer_kinds(name: str, config: LlamaConfig, data_parallel: int) -> list[str]:
    """The optimizer classes the Trainer ended up stepping."""
    captured: list[str] = []
    original = L.Trainer.fit

    def fit_and_look(trainer, *args, **kwargs):
        original(trainer, *args, **kwargs)
        captured.extend(type(o).__name__ for o in trainer.strategy.optimizers)

    L.Trainer.fit = fit_and_look
    try:
        fit(name, config, data_parallel)
    finally:
        L.Trainer.fit = original
    return captured


class EarlyOptimizer(LanguageModel):
    """Builds its optimizer in __init__, before sharding replaces the parameters."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.early = torch.optim.AdamW(self.parameters(), lr=dist_cases.LR, eps=ADAM_EPS)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.early


def fit_early_optimizer(config: LlamaConfig) -> None:
    trainer = quiet_trainer("fs_fsdp", max_steps=1)
    loader = torch.utils.data.DataLoader(
        torch.cat(dist_cases.batches(config, dist.get_world_size())), batch_size=2
    )
    trainer.fit(EarlyOptimizer(config), loader)


def fit_accumulating(
    name: str, config: LlamaConfig, data_parallel: int, accumulate: int
) -> dict[str, object]:
    return fit(name, config, data_parallel, accumulate)


def fit_in_precision(name: str, config: LlamaConfig, data_parallel: int, precision: str):
    """``precision`` as the Trainer flag, or ``"16-mixed-cpu"``: Lightning's float16 AMP
    plugin on the CPU (its flag turns 16-mixed into bf16-mixed there). The registered
    strategy ``name`` is built here, as a user would: Lightning checks instances, not names."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = ShardStrategy(**StrategyRegistry[name]["init_params"])
    if precision == "16-mixed-cpu":
        return fit(strategy, config, data_parallel, plugins=[MixedPrecision("16-mixed", "cpu")])
    return fit(strategy, config, data_parallel, precision=precision)


def fit_clipped(name: str, config: LlamaConfig, data_parallel: int, clip: float) -> dict[str, object]:
    return fit(name, config, data_parallel, clip=clip)


def fit_epochs(
    name: str,
    config: LlamaConfig,
    epochs: int,
    resume_from: str | None,
    save_to: str | None,
    full: bool = False,
):
    """Fit for ``epochs`` under a registered strategy (``"auto"``: Lightning's own, one
    device), optionally resuming from / saving a checkpoint (``full``: one file); rank 0
    returns the per-step losses of this run, the full parameters and optimizer state."""
    from lightning.pytorch.strategies import StrategyRegistry

    strategy: str | ShardStrategy = name
    if full:
        strategy = ShardStrategy(**StrategyRegistry[name]["init_params"], save_distributed_checkpoint=False)
    trainer = quiet_trainer(strategy, max_epochs=epochs)
    world = dist.get_world_size()
    tokens = torch.cat(dist_cases.batches(config, world))[: 2 * dist_cases.MICRO_BATCH * world]
    loader = torch.utils.data.DataLoader(tokens, batch_size=dist_cases.MICRO_BATCH, shuffle=True)
    module = LanguageModel(config)
    trainer.fit(module, loader, ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    recorded = [dist_cases.full(loss) for loss in module.losses]
    losses = dist_cases.mean_over_ranks(torch.stack(recorded)) if recorded else torch.zeros(0)
    params = {k: dist_cases.full(v) for k, v in module.state_dict().items()}
    optimizer = trainer.optimizers[0]
    if name == "auto":
        names = [n for n, _ in module.named_parameters()]
        state = {names[i]: s for i, s in optimizer.state_dict()["state"].items()}
    else:
        state = fs.checkpoint.optimizer_state(module, optimizer, full=True).get("state", {})
    result = {"losses": losses.tolist(), "params": params, "optimizer": state}
    return result if dist.get_rank() == 0 else None


def fabric_loop(
    name: str,
    config: LlamaConfig,
    early_optimizer: bool = False,
    steps: int = dist_cases.STEPS,
    resume_from: str | None = None,
    save_to: str | None = None,
    full: bool = False,
    precision: str = "32-true",
) -> dict[str, object] | None:
    """A Fabric training loop under a strategy of dist_cases.strategy(), optionally resumed
    with fabric.load and saved with fabric.save (``full``: one file), in ``precision`` (or
    ``"16-mixed-cpu"``: Fabric's float16 AMP plugin on the CPU); rank 0 returns losses,
    full parameters, the step it started at, and the loss scaler's class."""
    from lightning.fabric.plugins.precision import MixedPrecision

    from functional_shard.adapters.lightning import FabricShardStrategy

    rank, world = join_as_lightning_rank()
    mesh, policy = dist_cases.strategy(name, world)
    strategy = FabricShardStrategy(policy, mesh=mesh, save_distributed_checkpoint=not full)
    options: dict[str, object] = {"precision": precision}
    if precision == "16-mixed-cpu":
        options = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, **options)
    fabric.launch()
    torch.manual_seed(0)
    model = Llama(config)
    early = torch.optim.AdamW(model.parameters(), lr=dist_cases.LR, eps=ADAM_EPS)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(
        early if early_optimizer else torch.optim.AdamW(model.parameters(), lr=dist_cases.LR, eps=ADAM_EPS)
    )
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume_from:
        fabric.load(resume_from, state)
    plan, start = fabric.strategy.plan, state["step"]
    losses = dist_cases.train_steps(
        model, optimizer, config, plan, range(start, start + steps), fabric.backward
    )
    if save_to:
        state["step"] = start + steps
        fabric.save(save_to, state)
    data_parallel = plan.data_parallel_rank(rank)[1]
    params = {k.removeprefix("_forward_module."): dist_cases.full(v) for k, v in model.state_dict().items()}
    result = {
        "losses": losses,
        "params": params,
        "data_parallel": data_parallel,
        "start": start,
        "optimizer": type(optimizer.optimizer).__name__,
        "scaler": type(getattr(fabric.strategy.precision, "scaler", None)).__name__,
    }
    return result if rank == 0 else None


def launched_fabric(name: str) -> tuple[L.Fabric, int, int]:
    """This rank in a launched Fabric under dist_cases.strategy(name), with its rank and world size."""
    from functional_shard.adapters.lightning import FabricShardStrategy

    rank, world = join_as_lightning_rank()
    mesh, policy = dist_cases.strategy(name, world)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=FabricShardStrategy(policy, mesh=mesh))
    fabric.launch()
    return fabric, rank, world


def fabric_setup_together(name: str, config: LlamaConfig, optimizer_first: bool = False) -> None:
    """``fabric.setup(model, optimizer)`` under a strategy of dist_cases.strategy(), the optimizer
    built on the model before sharding; or (``optimizer_first``) ``fabric.setup_optimizers``
    of it, then ``fabric.setup_module``."""
    fabric, _, _ = launched_fabric(name)
    model = Llama(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=dist_cases.LR)
    if optimizer_first:
        fabric.setup_optimizers(optimizer)
        fabric.setup_module(model)
    else:
        fabric.setup(model, optimizer)


def fabric_no_backward_sync(name: str, config: LlamaConfig) -> dict[str, object] | None:
    """Two micro-batches in a Fabric loop under a strategy of dist_cases.strategy(): the first
    inside ``fabric.no_backward_sync``, the second outside; then the same two both synced.
    Rank 0 returns the bytes reduced inside, and the largest difference of the full gradients."""
    fabric, _, world = launched_fabric(name)
    torch.manual_seed(0)
    model = fabric.setup_module(Llama(config))
    first, second = dist_cases.batches(config, world)[:2]
    log = fs.CollectiveLog(fabric.strategy.plan.mesh)
    with log, fabric.no_backward_sync(model):
        fabric.backward(dist_cases.loss_of(model, first))
    fabric.backward(dist_cases.loss_of(model, second))
    accumulated = [dist_cases.full(p.grad) for p in model.parameters()]
    model.zero_grad()
    for batch in (first, second):
        fabric.backward(dist_cases.loss_of(model, batch))
    synced = [dist_cases.full(p.grad) for p in model.parameters()]
    reduced = sum(
        sum(by_axis.values())
        for kind, by_axis in log.sent.items()
        if kind in ("reduce_scatter", "all_reduce")
    )
    difference = max(float((a - b).abs().max()) for a, b in zip(accumulated, synced, strict=True))
    return {"reduced_inside": reduced, "difference": difference} if dist.get_rank() == 0 else None


class RecordsClipping(LanguageModel):
    """Records the full gradients before and after Lightning clips them."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.clipped: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        before = [dist_cases.full(p.grad) for p in self.parameters()]
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clipped.append((before, [dist_cases.full(p.grad) for p in self.parameters()]))


def trainer_clip_by_value(name: str, config: LlamaConfig, clip: float) -> dict[str, object] | None:
    """One Trainer step under a strategy of dist_cases.strategy() with
    ``gradient_clip_algorithm="value"``; rank 0 returns the full gradients before and after."""
    mesh, policy = dist_cases.strategy(name, dist.get_world_size())
    strategy = ShardStrategy(policy, mesh=mesh)
    trainer = quiet_trainer(strategy, max_steps=1, gradient_clip_val=clip, gradient_clip_algorithm="value")
    module = RecordsClipping(config)
    tokens = torch.cat(dist_cases.batches(config, dist.get_world_size()))
    trainer.fit(module, torch.utils.data.DataLoader(tokens, batch_size=dist_cases.MICRO_BATCH))
    (before, after), *_ = module.clipped
    return {"before": before, "after": after} if dist.get_rank() == 0 else None


def fabric_clip_by_value(name: str, config: LlamaConfig, clip: float) -> dict[str, object] | None:
    """One backward in a Fabric loop under a strategy of dist_cases.strategy(), then
    ``fabric.clip_gradients(clip_val=clip)``; rank 0 returns the full gradients before and after."""
    fabric, rank, _ = launched_fabric(name)
    torch.manual_seed(0)
    model = fabric.setup_module(Llama(config))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=dist_cases.LR))
    index, data_parallel = fabric.strategy.plan.data_parallel_rank(rank)
    rows = dist_cases.batches(config, data_parallel)[0].split(dist_cases.MICRO_BATCH)[index]
    fabric.backward(dist_cases.loss_of(model, rows))
    before = [dist_cases.full(p.grad) for p in model.parameters()]
    fabric.clip_gradients(model, optimizer, clip_val=clip)
    after = [dist_cases.full(p.grad) for p in model.parameters()]
    return {"before": before, "after": after} if rank == 0 else None


def fit_averaging_weights(name: str, config: LlamaConfig) -> list[float]:
    """Two epochs under a strategy of dist_cases.strategy() with StochasticWeightAveraging from
    the second; this rank's losses."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    mesh, policy = dist_cases.strategy(name, dist.get_world_size())
    averaging = StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)
    trainer = quiet_trainer(
        ShardStrategy(policy, mesh=mesh), max_epochs=2, limit_train_batches=1, callbacks=[averaging]
    )
    module = LanguageModel(config)
    tokens = torch.cat(dist_cases.batches(config, dist.get_world_size()))
    trainer.fit(module, torch.utils.data.DataLoader(tokens, batch_size=dist_cases.MICRO_BATCH))
    return [loss.item() for loss in module.losses]


def fabric_load_asking_for_more(name: str, config: LlamaConfig, path: str, full: bool) -> dict[str, object]:
    """fabric.save of a model, its optimizer and "step", then fabric.load of those and an
    "epoch" the checkpoint lacks: strictly (the refusal), then with strict=False."""
    from functional_shard.adapters.lightning import FabricShardStrategy

    _, world = join_as_lightning_rank()
    mesh, policy = dist_cases.strategy(name, world)
    strategy = FabricShardStrategy(policy, mesh=mesh, save_distributed_checkpoint=not full)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(Llama(config))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=dist_cases.LR))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    state = {"model": model, "optimizer": optimizer, "step": 0, "epoch": 7}
    try:
        fabric.load(path, state)
        refusal = ""
    except fs.ShardingError as error:
        refusal = str(error)
    untouched = dict(state)
    fabric.load(path, state, strict=False)
    return {"refusal": refusal, "untouched": untouched["step"], "loose": (state["step"], state["epoch"])}


def fit_again_with_a_new_trainer(first: str, second: str, config: LlamaConfig) -> list[float] | None:
    """One step of Trainer.fit under the registered strategy ``first``, then one more step of
    the same module by a new Trainer under ``second``; rank 0 returns the two steps' losses."""
    module = LanguageModel(config)
    tokens = torch.cat(dist_cases.batches(config, dist.get_world_size()))
    for name in (first, second):
        loader = torch.utils.data.DataLoader(tokens, batch_size=dist_cases.MICRO_BATCH)
        quiet_trainer(name, max_steps=1).fit(module, loader)
    losses = dist_cases.mean_over_ranks(torch.stack([dist_cases.full(x) for x in module.losses]))
    return losses.tolist() if dist.get_rank() == 0 else None


def fit_with_model_checkpoint(name: str, config: LlamaConfig, folder: str, resume_from: str | None):
    """Lightning's ModelCheckpoint saving every 2 steps, keeping the latest only; or a fit
    resumed from one of its checkpoints. Rank 0 returns what the folder holds, and the
    global step the fit ended at."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _, world = join_as_lightning_rank()
    keep_latest = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=name,
        max_steps=dist_cases.STEPS if resume_from is None else dist_cases.STEPS + 1,
        callbacks=[keep_latest],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    tokens = torch.cat(dist_cases.batches(config, world))
    loader = torch.utils.data.DataLoader(tokens, batch_size=dist_cases.MICRO_BATCH)
    trainer.fit(LanguageModel(config), loader, ckpt_path=resume_from)
    held = sorted(p.name for p in os.scandir(folder)) if dist.get_rank() == 0 else None
    return {"held": held, "step": trainer.global_step, "best": keep_latest.best_model_path}


class AppliesItsPlan(LanguageModel):
    """What Lightning's ModelParallelStrategy asks of a module: parallelize in configure_model."""

    def __init__(self, config: LlamaConfig, plan: fs.Plan) -> None:
        super().__init__(config)
        self.plan = plan

    def configure_model(self) -> None:
        fs.apply(self.plan, self, root="model")


def fit_under_lightnings_model_parallel(config: LlamaConfig) -> dict[str, object]:
    """A 2D plan handed to Lightning's own ModelParallelStrategy by to_lightning."""
    from functional_shard.adapters.lightning import to_lightning

    policy = fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")
    plan = fs.shard(LanguageModel(config), fs.Mesh(dp=2, tp=2), policy)
    module = AppliesItsPlan(config, plan)
    result = fit(to_lightning(plan), config, 2, module=module)
    result["strategy"] = type(to_lightning(plan)).__name__
    return result


def strategy_collectives(name: str, config: LlamaConfig) -> dict[str, object]:
    """After a one-step fit: the strategy's reduce, all_gather, broadcast and barrier, as
    Lightning's loggers and callbacks call them."""
    trainer = quiet_trainer(name, max_steps=1)
    tokens = torch.cat(dist_cases.batches(config, dist.get_world_size()))
    module = LanguageModel(config)
    trainer.fit(module, torch.utils.data.DataLoader(tokens, batch_size=dist_cases.MICRO_BATCH))
    strategy, rank = trainer.strategy, float(dist.get_rank())
    strategy.barrier()
    return {
        "mean": strategy.reduce(torch.tensor(rank)).item(),
        "sum": strategy.reduce(torch.tensor(rank), reduce_op="sum").item(),
        "gathered": strategy.all_gather(torch.tensor([rank])).flatten().tolist(),
        "broadcast": strategy.broadcast(f"from {rank}", src=2),
        "decision": strategy.reduce_boolean_decision(rank == 3, all=False),
        "a_weight": _gathered_or_refused(module.all_gather, module.model.embed_tokens.weight.detach()),
    }


def _gathered_or_refused(collective: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor) -> object:
    """The shape ``collective(tensor)`` returns, or the message of the ShardingError it raises."""
    try:
        return tuple(collective(tensor).shape)
    except fs.ShardingError as error:
        return str(error)


def fabric_collectives_of_a_weight(name: str, config: LlamaConfig) -> dict[str, object]:
    """fabric.all_gather and fabric.all_reduce of the embedding weight (a DTensor under a
    sharding plan), set up under a strategy of dist_cases.strategy(): shapes or refusals."""
    fabric, _, _ = launched_fabric(name)
    model = fabric.setup_module(Llama(config))
    weight = model.embed_tokens.weight.detach()
    return {
        "gathered": _gathered_or_refused(fabric.all_gather, weight),
        "reduced": _gathered_or_refused(fabric.all_reduce, weight),
    }


class HFLanguageModelOnMeta(L.LightningModule):
    """A tiny Hugging Face Llama built on the meta device in configure_model (no init=: the
    strategy materializes it); records its per-step loss and its first parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []
        self.first: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        from . import buffer_cases

        if not hasattr(self, "model"):
            self.model = buffer_cases.build_on_meta("llama")

    def on_train_start(self) -> None:
        self.first = {k.removeprefix("model."): dist_cases.full(v) for k, v in self.named_parameters()}

    def training_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        from . import hf_cases

        loss = hf_cases.loss_of(self.model, batch)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        from . import hf_cases

        return torch.optim.AdamW(self.parameters(), lr=hf_cases.LR, eps=hf_cases.EPS)


def fit_hf_built_on_meta() -> dict[str, object]:
    """Trainer.fit of `HFLanguageModelOnMeta` under FSDP over every rank: the global-batch losses,
    the first parameters (rank 0) and the rotary buffers."""
    from . import hf_cases

    trainer = quiet_trainer(ShardStrategy(fs.fsdp("dp"), seed=0), max_steps=hf_cases.STEPS)
    tokens = torch.cat(hf_cases.batches(dist.get_world_size()))
    module = HFLanguageModelOnMeta()
    trainer.fit(module, torch.utils.data.DataLoader(tokens, batch_size=hf_cases.MICRO_BATCH, shuffle=False))
    rotary = module.model.model.rotary_emb
    return {
        "losses": dist_cases.mean_over_ranks(torch.stack(module.losses)).tolist(),
        "first": module.first if dist.get_rank() == 0 else None,
        "buffers": {
            "inv_freq": rotary.inv_freq.clone(),
            "original_inv_freq": rotary.original_inv_freq.clone(),
        },
    }


def hf_reference(first: dict[str, torch.Tensor], data_parallel: int) -> list[float]:
    """One process training the CPU-built tiny HF Llama from ``first`` on the global batches
    Lightning's DistributedSampler makes (see `reference`): its losses."""
    from . import buffer_cases, hf_cases

    model = buffer_cases.build("llama")
    model.load_state_dict(first, strict=False)  # the buffers stay the CPU build's
    tokens = torch.cat(hf_cases.batches(data_parallel))
    perm = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=hf_cases.LR, eps=hf_cases.EPS)
    losses = []
    for batch in tokens[perm].split(hf_cases.MICRO_BATCH * data_parallel)[: hf_cases.STEPS]:
        optimizer.zero_grad()
        loss = hf_cases.loss_of(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _loaded_at_fit_start(module: L.LightningModule) -> dict[str, torch.Tensor]:
    # every rank: gathering a whole state is a collective
    state = fs.checkpoint.model_state(module, full=True)
    return {k.removeprefix("model."): dist_cases.full(v) for k, v in state.items()}


class FromHuggingFace(L.LightningModule):
    """A tiny Hugging Face model built in ``configure_model`` (on the meta device, or seeded
    on the CPU); at the start of fit it records what the strategy's ``weights=`` loaded."""

    def __init__(self, family: str, meta: bool) -> None:
        super().__init__()
        self.family, self.meta = family, meta
        self.model: torch.nn.Module | None = None
        self.losses: list[torch.Tensor] = []
        self.loaded: dict[str, object] = {}

    def configure_model(self) -> None:
        if self.model is None:
            self.model = load_hf_cases.build(self.family, meta=self.meta, seed=11 + dist.get_rank())

    def on_fit_start(self) -> None:
        self.loaded = {"state": _loaded_at_fit_start(self), "logits": load_hf_cases.logits_of(self.model)}

    def training_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        assert self.model is not None
        loss = hf_next_token_loss(self.model, batch)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=dist_cases.LR, eps=ADAM_EPS)


class ZooFromFolder(LanguageModel):
    """`LanguageModel` (the zoo's Llama, built seeded), recording what ``weights=`` loaded."""

    def on_fit_start(self) -> None:
        self.loaded = {"state": _loaded_at_fit_start(self), "logits": None}


def hf_next_token_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _tokens(rows: int) -> torch.Tensor:
    return torch.randint(
        0, load_hf_cases.VOCAB, (rows, load_hf_cases.SEQ + 1), generator=torch.Generator().manual_seed(0)
    )


def fit_from_folder(
    folder: str, family: str, meta: bool, policy: fs.Policy, mesh: fs.Mesh, mapping: object = None
) -> dict[str, object] | None:
    """One step of Trainer.fit under ``ShardStrategy(policy, weights=folder)`` (``family``
    ``"zoo"``: `ZooFromFolder`); rank 0 returns the whole state and the logits at the start
    of fit, and the step's loss."""
    strategy = ShardStrategy(policy, mesh=mesh, weights=folder, weights_mapping=mapping)
    trainer = quiet_trainer(strategy, max_steps=1)
    module = ZooFromFolder(dist_cases.EVEN) if family == "zoo" else FromHuggingFace(family, meta)
    trainer.fit(module, torch.utils.data.DataLoader(_tokens(8), batch_size=2))
    loss = dist_cases.mean_over_ranks(torch.stack([dist_cases.full(x) for x in module.losses]))
    return {**module.loaded, "losses": loss.tolist()} if dist.get_rank() == 0 else None


def fabric_from_folder(
    folder: str, family: str, meta: bool, policy: fs.Policy, mesh: fs.Mesh
) -> dict[str, object] | None:
    """``fabric.setup_module`` under ``FabricShardStrategy(policy, weights=folder)``, then one
    step; rank 0 returns the whole state and logits after setup, and the step's loss."""
    from functional_shard.adapters.lightning import FabricShardStrategy

    _, world = join_as_lightning_rank()
    strategy = FabricShardStrategy(policy, mesh=mesh, weights=folder)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(load_hf_cases.build(family, meta=meta, seed=11 + dist.get_rank()))
    state = fs.checkpoint.model_state(model.module, full=True)
    loaded = {
        "state": {k: dist_cases.full(v) for k, v in state.items()},
        "logits": load_hf_cases.logits_of(model),
    }
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=dist_cases.LR))
    loss = hf_next_token_loss(model, _tokens(2))
    fabric.backward(loss)
    optimizer.step()
    return {**loaded, "losses": [loss.item()]} if dist.get_rank() == 0 else None


class PackedLanguageModel(L.LightningModule):
    """The zoo Llama on packed rows (`cp_cases.packed_rows`, a `fs.PackedBatch` each step) through
    `training_loss`: each document attends only to itself, under cp cut by attention work."""

    def __init__(self, kind: str = "zoo") -> None:
        super().__init__()
        self.model = cp_cases.build(kind)
        self.losses: list[float] = []

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cp_cases.loss_fn(outputs, targets)

    def training_step(self, batch: fs.PackedBatch, index: int) -> torch.Tensor:
        loss = training_loss(
            self, batch.tokens, batch.labels, positions=batch.positions, document_ids=batch.document_ids
        )
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=cp_cases.LR)


def packed_data_parallel(mesh: dict[str, int]) -> int:
    return mesh.get("dp", 1)  # the cases' batch axis


def fit_packed(mesh: dict[str, int], policy: str, kind: str = "zoo") -> dict[str, object]:
    """Trainer.fit of `PackedLanguageModel` under ``ShardStrategy``: a DataLoader of packed rows
    (collated by `fs.collate_packed`), each rank's sampler taking its data-parallel rows; the
    losses each rank saw (its data-parallel group's) and rank 0's parameters."""
    module = PackedLanguageModel(kind)
    strategy = ShardStrategy(fs.parse_policy(policy, module.model), mesh=fs.Mesh(**mesh))
    trainer = quiet_trainer(strategy, max_steps=cp_cases.STEPS)
    rows = cp_cases.packed_rows(cp_cases.STEPS * cp_cases.BATCH * packed_data_parallel(mesh))
    trainer.fit(
        module, torch.utils.data.DataLoader(rows, batch_size=cp_cases.BATCH, collate_fn=fs.collate_packed)
    )
    params = {k.removeprefix("model."): dist_cases.full(v) for k, v in module.state_dict().items()}
    index = strategy.plan.data_parallel_rank(dist.get_rank())[0]
    return {"losses": module.losses, "params": params, "index": index}  # a pipeline stage's params alone


def fabric_packed(mesh: dict[str, int], policy: str) -> dict[str, object]:
    """A Fabric loop on packed rows through ``FabricShardStrategy.forward_backward``: each rank
    reads its data-parallel rows in order from ``fabric.setup_dataloaders``; as `fit_packed`."""
    from functional_shard.adapters.lightning import FabricShardStrategy

    rank, world = join_as_lightning_rank()
    model = cp_cases.build("zoo")
    strategy = FabricShardStrategy(fs.parse_policy(policy, model), mesh=fs.Mesh(**mesh))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    module = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=cp_cases.LR))
    step = strategy.forward_backward(module, cp_cases.loss_fn)
    rows = cp_cases.packed_rows(cp_cases.STEPS * cp_cases.BATCH * packed_data_parallel(mesh))
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(rows, batch_size=cp_cases.BATCH, collate_fn=fs.collate_packed),
        use_distributed_sampler=False,
    )
    index, data_parallel = strategy.plan.data_parallel_rank(rank)
    losses = []
    for number, batch in enumerate(loader):
        if number % data_parallel != index:
            continue  # another data-parallel rank's rows
        optimizer.zero_grad()
        loss = step(batch.tokens, batch.labels, positions=batch.positions, document_ids=batch.document_ids)
        optimizer.step()
        losses.append(loss.item())
    params = {k.removeprefix("_forward_module."): dist_cases.full(v) for k, v in module.state_dict().items()}
    return {"losses": losses, "params": params if rank == 0 else None, "index": index}


def packed_reference(data_parallel: int, *, shuffled: bool, kind: str = "zoo") -> dict[str, object]:
    """One process on the packed rows: each step the mean of the data-parallel slices' mean losses
    (data parallel averages its ranks' gradients); each slice's loss too (``slice_losses``).

    ``shuffled``: the slices Lightning's DistributedSampler makes (a permutation with seed 0;
    data-parallel rank r reads perm[r::n] in batches); otherwise the rows in order, batch after
    batch dealt to the ranks in turn (`fabric_packed`).
    """
    count = cp_cases.STEPS * cp_cases.BATCH * data_parallel
    rows = cp_cases.packed_rows(count)
    order = torch.arange(count)
    if shuffled:
        perm = torch.randperm(count, generator=torch.Generator().manual_seed(0))
        order = torch.cat([perm[r::data_parallel].view(-1, cp_cases.BATCH) for r in range(data_parallel)], 1)
    # one row of order per step, its data-parallel slices side by side
    order = order.reshape(cp_cases.STEPS, data_parallel, cp_cases.BATCH)
    model = cp_cases.build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cp_cases.LR)
    losses, slice_losses = [], []
    for step in order:
        optimizer.zero_grad()
        parts = [
            cp_cases.packed_loss(
                model, {name: getattr(rows[part.tolist()], name) for name in cp_cases.PACKED_FIELDS}
            )
            for part in step
        ]
        loss = sum(parts) / data_parallel
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        slice_losses.append([part.item() for part in parts])
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "slice_losses": slice_losses, "params": params}
