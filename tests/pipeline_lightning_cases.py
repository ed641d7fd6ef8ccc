"""Pipeline plans trained by Lightning's Fabric and Trainer on each rank of a LocalWorld."""

from __future__ import annotations

from typing import Any

import lightning as L  # noqa: N812 (the name Lightning documents)
import torch
import torch.distributed as dist

import functional_shard as fs
from functional_shard.adapters.lightning import (
    FabricShardStrategy,
    ShardStrategy,
    evaluation_loss,
    model_outputs,
    training_loss,
)

from . import pipeline_cases
from .dist_cases import full, mean_over_ranks
from .lightning_cases import join_as_lightning_rank, quiet_trainer

# pp=2 stages, each sharded by FSDP over dp=2: the representative pipeline plan
SPEC = pipeline_cases.case({"pp": 2, "dp": 2}, data="fsdp")
MESH = fs.Mesh(pp=2, dp=2)


class PipelinedLanguageModel(L.LightningModule):
    """A tiny Llama whose training_step runs under any plan; it names its loss for the schedule."""

    def __init__(self, spec: dict[str, Any] = SPEC) -> None:
        super().__init__()
        self.model = pipeline_cases.build(spec)
        self.losses: list[torch.Tensor] = []

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return pipeline_cases.lm_loss(outputs, targets)

    def training_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        loss = training_loss(self, batch[:, :-1], batch[:, 1:])
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=pipeline_cases.LR, eps=pipeline_cases.EPS)


class Evaluates(PipelinedLanguageModel):
    """Validates, tests and predicts through the helpers that run under any plan."""

    def __init__(self, spec: dict[str, Any] = SPEC) -> None:
        super().__init__(spec)
        self.evaluated: list[torch.Tensor] = []

    def validation_step(self, batch: torch.Tensor, batch_index: int) -> None:
        loss = evaluation_loss(self, batch[:, :-1], batch[:, 1:])
        self.evaluated.append(loss)
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_index: int) -> None:
        self.log("test_loss", evaluation_loss(self, batch[:, :-1], batch[:, 1:]), sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        return model_outputs(self, batch[:, :-1])


class ManuallyOptimized(PipelinedLanguageModel):
    """Manual optimization: zero, training_loss, manual_backward, step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_index: int) -> None:
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)
        optimizer.zero_grad()
        loss = training_loss(self, batch[:, :-1], batch[:, 1:])
        self.manual_backward(loss)
        optimizer.step()
        self.losses.append(loss.detach())


def tokens(data_parallel: int) -> torch.Tensor:
    return torch.cat(pipeline_cases.batches(data_parallel))


def reference(data_parallel: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the global batches Lightning's DistributedSampler makes (shuffled with
    seed 0; rank r takes perm[r::n], so step s's batches together are one block of perm)."""
    every = tokens(data_parallel)
    perm = torch.randperm(len(every), generator=torch.Generator().manual_seed(0))
    model = pipeline_cases.build(SPEC)
    optimizer = torch.optim.AdamW(model.parameters(), lr=pipeline_cases.LR, eps=pipeline_cases.EPS)
    losses = []
    for batch in every[perm].split(pipeline_cases.BATCH * data_parallel):
        optimizer.zero_grad()
        loss = pipeline_cases.lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit(
    policy_or_plan: Any = None, module: L.LightningModule | None = None, **options: Any
) -> dict[str, Any]:
    """Trainer.fit of the pipelined Llama on this rank; every rank returns the global losses and
    its own stage's whole parameters."""
    save_to = options.pop("save_to", None)
    policy = policy_or_plan or pipeline_cases.policy_of(SPEC)
    strategy = ShardStrategy(policy, mesh=MESH)
    trainer = quiet_trainer(strategy, max_steps=pipeline_cases.STEPS, **options)
    loader = torch.utils.data.DataLoader(tokens(2), batch_size=pipeline_cases.BATCH)
    module = module or PipelinedLanguageModel()
    trainer.fit(module, loader)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    losses = mean_over_ranks(torch.stack(module.losses))
    params = {k.removeprefix("model."): full(v) for k, v in module.state_dict().items()}
    return {"losses": losses.tolist(), "params": params}


def resume_without_pp(path: str) -> dict[str, torch.Tensor]:
    """Resume a pipelined fit's checkpoint under FSDP over every rank (the fit is already at
    max_steps, so nothing trains): the loaded whole parameters, by path (every rank)."""
    strategy = ShardStrategy(fs.fsdp("dp"), mesh=fs.Mesh(dp=dist.get_world_size()))
    trainer = quiet_trainer(strategy, max_steps=pipeline_cases.STEPS)
    loader = torch.utils.data.DataLoader(tokens(4), batch_size=pipeline_cases.BATCH)
    module = PipelinedLanguageModel()
    trainer.fit(module, loader, ckpt_path=path)
    assert not module.losses, "a fit resumed at max_steps trains no more"
    return {k.removeprefix("model."): full(v) for k, v in module.state_dict().items()}


def fit_manually() -> dict[str, Any]:
    """fit with manual optimization (zero_grad, training_loss, manual_backward, step)."""
    return fit(module=ManuallyOptimized())


def fit_refused(**options: Any) -> str:
    """The ShardingError a pipelined fit raises before training (or '')."""
    try:
        fit(**options)
    except fs.ShardingError as error:
        return str(error)
    return ""


def fit_refused_averaging() -> str:
    """The ShardingError a pipelined fit with StochasticWeightAveraging raises (or '')."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    return fit_refused(callbacks=[StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)])


# evaluation data: 16 rows, 8 per data-parallel rank, 2 batches each (unshuffled)
def evaluation_tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(99)
    return torch.randint(0, 128, (16, pipeline_cases.SEQ + 1), generator=generator)


def training_tokens(steps: int, accumulate: int) -> torch.Tensor:
    """``steps`` optimizer steps of 2 data-parallel slices of ``accumulate`` batches each."""
    generator = torch.Generator().manual_seed(1234)
    rows = pipeline_cases.BATCH * 2 * accumulate * steps
    return torch.randint(0, 128, (rows, pipeline_cases.SEQ + 1), generator=generator)


def fit_evaluate_predict(
    policy: Any = None, mesh: fs.Mesh = MESH, accumulate: int = 2, steps: int = 2
) -> dict[str, Any]:
    """One epoch of fit with accumulation and validation (a sanity check before, a loop after),
    then trainer.predict on the same Trainer. Every rank returns its data-parallel index, the
    logged and per-batch validation losses, its predictions and its stages' whole parameters."""
    strategy = ShardStrategy(policy or pipeline_cases.policy_of(SPEC), mesh=mesh)
    trainer = quiet_trainer(strategy, max_steps=steps, accumulate_grad_batches=accumulate)
    module = Evaluates()
    batch = pipeline_cases.BATCH
    train = torch.utils.data.DataLoader(training_tokens(steps, accumulate), batch_size=batch)
    evaluation = torch.utils.data.DataLoader(evaluation_tokens(), batch_size=batch)
    trainer.fit(module, train, evaluation)
    logged = float(trainer.callback_metrics["val_loss"])
    predictions = trainer.predict(module, evaluation)
    assert predictions is not None
    return {
        "index": strategy.plan.data_parallel_rank(dist.get_rank())[0],
        "val_loss": logged,
        "evaluated": [float(x) for x in module.evaluated],
        "predictions": torch.cat([p for p in predictions if isinstance(p, torch.Tensor)]),
        "params": {k.removeprefix("model."): full(v) for k, v in module.state_dict().items()},
    }


def validate_and_test() -> dict[str, float]:
    """trainer.validate then trainer.test of a fresh pipelined module: the logged losses."""
    trainer = quiet_trainer(ShardStrategy(pipeline_cases.policy_of(SPEC), mesh=MESH))
    module = Evaluates()
    evaluation = torch.utils.data.DataLoader(evaluation_tokens(), batch_size=pipeline_cases.BATCH)
    validated = trainer.validate(module, evaluation)[0]["val_loss"]
    tested = trainer.test(module, evaluation)[0]["test_loss"]
    return {"val_loss": validated, "test_loss": tested}


def evaluation_reference(
    steps: int = 2, accumulate: int = 2
) -> tuple[dict[str, torch.Tensor], list[float], list[float], torch.Tensor]:
    """One process: the parameters after fit_evaluate_predict's training, the per-batch
    validation losses of data-parallel slice 0 and 1 before and after it (sanity check:
    two batches each), and the trained model's outputs on every evaluation row."""
    every = training_tokens(steps, accumulate)
    perm = torch.randperm(len(every), generator=torch.Generator().manual_seed(0))
    model = pipeline_cases.build(SPEC)
    optimizer = torch.optim.AdamW(model.parameters(), lr=pipeline_cases.LR, eps=pipeline_cases.EPS)
    rows = evaluation_tokens()

    def per_batch() -> list[float]:  # each slice's two batches of 4 rows: slice d takes rows d::2
        with torch.no_grad():
            mine = [rows[d::2][b * 4 : (b + 1) * 4] for d in (0, 1) for b in (0, 1)]
            return [pipeline_cases.lm_loss(model(x[:, :-1]), x[:, 1:]).item() for x in mine]

    before = per_batch()
    for batch in every[perm].split(pipeline_cases.BATCH * 2 * accumulate):
        optimizer.zero_grad()
        pipeline_cases.lm_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        optimizer.step()
    after = per_batch()
    with torch.no_grad():
        outputs = model(rows[:, :-1])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, before, after, outputs


def fabric_loop() -> dict[str, Any]:
    """A Fabric loop with strategy.forward_backward under the pp x fsdp plan; every rank returns
    the global losses and its own stage's whole parameters."""
    rank, world = join_as_lightning_rank()
    strategy = FabricShardStrategy(pipeline_cases.policy_of(SPEC), mesh=MESH)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(pipeline_cases.build(SPEC))
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=pipeline_cases.LR, eps=pipeline_cases.EPS)
    )
    step = strategy.forward_backward(model, pipeline_cases.lm_loss)
    index, data_parallel = strategy.plan.data_parallel_rank(rank)
    rows = pipeline_cases.BATCH
    losses = []
    for batch in pipeline_cases.batches(data_parallel):
        mine = batch[index * rows : (index + 1) * rows]
        optimizer.zero_grad()
        loss = step(mine[:, :-1], mine[:, 1:])
        optimizer.step()
        losses.append(mean_over_ranks(loss).item())
    refused = ""
    try:
        fabric.backward(loss)
    except fs.ShardingError as error:
        refused = str(error)
    params = {k.removeprefix("_forward_module."): full(v) for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "backward_refused": refused, "rank": dist.get_rank()}


def evaluated_under_cp() -> list[str]:
    """trainer.validate, then trainer.predict, of the pipelined module under pp=2 x cp=2: what each
    raises ('' where nothing is)."""
    said = []
    for evaluation in ("validate", "predict"):
        policy = fs.pipeline("pp", microbatches=2) + fs.fsdp("cp") + fs.cp("cp")
        trainer = quiet_trainer(ShardStrategy(policy, mesh=fs.Mesh(pp=2, cp=2)))
        rows = torch.utils.data.DataLoader(evaluation_tokens(), batch_size=pipeline_cases.BATCH)
        try:
            getattr(trainer, evaluation)(Evaluates(), rows)
            said.append("")
        except Exception as error:  # a stage's plain forward once failed deep in torch
            said.append(f"{type(error).__name__}: {error}")
    return said
