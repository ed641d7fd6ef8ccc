"""Optimizer state loads whole, whatever the optimizer is when the load begins.

A fresh optimizer of a module whose parameters hold gradients (a step's backward ran) gets
the saved state, from a folder as from a file, and keeps the gradients; a stateless
optimizer (SGD without momentum) gets its hyperparameters back. An optimizer the checkpoint
lacks, or one of another kind, is refused with the optimizer as it was.
"""

from __future__ import annotations

import re

import pytest
import torch

import functional_shard as fs
from functional_shard.zoo import Llama

from .. import dist_cases


def parallel_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = Llama(dist_cases.EVEN)
    return fs.apply(fs.shard(model, fs.Mesh(dp=1), fs.fsdp("dp")), model)


def backward(model: torch.nn.Module) -> None:
    model(torch.randint(0, dist_cases.EVEN.vocab_size, (2, 8))).sum().backward()


def trained(optimizer_of):
    model = parallel_model()
    optimizer = optimizer_of(model.parameters())
    for _ in range(2):
        backward(model)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        value.full_tensor() if hasattr(value, "full_tensor") else value
        for state in optimizer.state_dict()["state"].values()
        for value in state.values()
    ]


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_a_fresh_optimizer_with_gradients_gets_the_saved_state(one_rank, tmp_path, full):
    model, optimizer = trained(torch.optim.AdamW)
    path = fs.checkpoint.save(tmp_path / "ckpt", model, optimizer, full=full)
    loaded = parallel_model(seed=1)
    backward(loaded)
    gradients = [p.grad.full_tensor().clone() for p in loaded.parameters()]
    fresh = torch.optim.AdamW(loaded.parameters())
    fs.checkpoint.load(path, loaded, fresh)
    saved, got = moments(optimizer), moments(fresh)
    assert len(got) == len(saved) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, saved, strict=True))
    assert all(
        torch.equal(p.grad.full_tensor(), g) for p, g in zip(loaded.parameters(), gradients, strict=True)
    )


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_a_stateless_optimizer_gets_its_hyperparameters_back(one_rank, tmp_path, full):
    model, optimizer = trained(lambda parameters: torch.optim.SGD(parameters, lr=0.25))
    path = fs.checkpoint.save(tmp_path / "ckpt", model, optimizer, full=full)
    loaded = parallel_model(seed=1)
    fresh = torch.optim.SGD(loaded.parameters(), lr=0.5)
    fs.checkpoint.load(path, loaded, fresh)
    assert fresh.param_groups[0]["lr"] == 0.25
    assert not fresh.state


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_an_optimizer_the_checkpoint_lacks_is_refused(one_rank, tmp_path, full):
    model, optimizer = trained(torch.optim.AdamW)
    path = fs.checkpoint.save(tmp_path / "ckpt", model, full=full)
    missing = "optimizer: missing, the checkpoint was saved without it (load without it)"
    with pytest.raises(fs.ShardingError, match=re.escape(missing)):
        fs.checkpoint.load(path, model, optimizer)
    assert fs.checkpoint.load(path, model, optimizer, strict=False) == {}


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, object]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.25, momentum=0.9)


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
@pytest.mark.parametrize(
    ("saving", "loading", "kept"),
    [
        (
            torch.optim.AdamW,
            sgd,
            "exp_avg, exp_avg_sq, step for each parameter, this SGD keeps momentum_buffer",
        ),
        (
            sgd,
            torch.optim.AdamW,
            "momentum_buffer for each parameter, this AdamW keeps exp_avg, exp_avg_sq, step",
        ),
        (
            torch.optim.AdamW,
            lambda parameters: torch.optim.SGD(parameters, lr=0.25),
            "exp_avg, exp_avg_sq, step for each parameter, this SGD keeps nothing",
        ),
    ],
    ids=["adamw-to-sgd", "sgd-to-adamw", "adamw-to-stateless"],
)
def test_an_optimizer_of_another_kind_is_refused_by_name_and_kept(
    one_rank, tmp_path, full, saving, loading, kept
):
    model, optimizer = trained(saving)
    path = fs.checkpoint.save(tmp_path / "ckpt", model, optimizer, full=full)
    other, another = trained(loading)
    before = moments(another), hyperparameters(another)
    refused = (
        f"the checkpoint at {path} was saved by another kind of optimizer (or other options): optimizer: "
        f"the checkpoint's optimizer keeps {kept}"
    )
    fix = "Load it with an optimizer built as the one that saved it (its class and options), or load the"
    with pytest.raises(fs.ShardingError, match=re.escape(refused) + ".*" + re.escape(fix)):
        fs.checkpoint.load(path, other, another)
    assert hyperparameters(another) == before[1]
    assert all(torch.equal(a, b) for a, b in zip(moments(another), before[0], strict=True))


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_a_save_leaves_a_never_stepped_optimizer_as_it_was(one_rank, tmp_path, full):
    """Torch makes a fresh optimizer's state to read it (AdamW's step then counts 1): a save
    before the first step must not change the training that follows."""
    trained_after = []
    for save in (False, True):
        model = parallel_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        if save:
            fs.checkpoint.save(tmp_path / "ckpt", model, optimizer, full=full)
            assert not optimizer.state
        backward(model)
        optimizer.step()
        trained_after.append(full_parameters(model))
    unsaved, saved = trained_after
    assert all(torch.equal(unsaved[name], saved[name]) for name in unsaved)


NEVER_STEPPED = ("norm.weight", "layers.1.mlp.down_proj.weight")


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_parameters_that_never_stepped_load_without_state(one_rank, tmp_path, full):
    """A parameter that got no gradient has no optimizer state: the checkpoint loads (it was
    refused as missing state), the parameter gets none, and the next step is the uninterrupted one's."""
    model = parallel_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    backward(model)
    for name in NEVER_STEPPED:
        model.get_parameter(name).grad = None
    optimizer.step()
    optimizer.zero_grad()
    path = fs.checkpoint.save(tmp_path / "ckpt", model, optimizer, full=full)
    loaded = parallel_model(seed=1)
    fresh = torch.optim.AdamW(loaded.parameters(), lr=0.01)
    fs.checkpoint.load(path, loaded, fresh)
    assert {loaded.get_parameter(name) in fresh.state for name in NEVER_STEPPED} == {False}
    assert len(fresh.state) == len(optimizer.state)
    for resumed, its_optimizer in ((model, optimizer), (loaded, fresh)):
        torch.manual_seed(2)  # the same tokens
        backward(resumed)
        its_optimizer.step()
    uninterrupted, got = full_parameters(model), full_parameters(loaded)
    assert all(torch.equal(uninterrupted[name], got[name]) for name in uninterrupted)


def halving(step: int) -> float:
    return 0.5**step


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
@pytest.mark.parametrize("policy", [fs.fsdp("dp"), fs.zero(1)], ids=["fsdp", "zero1"])
def test_an_optimizer_loaded_before_its_scheduler_gets_the_saved_hyperparameters(
    one_rank, tmp_path, full, policy
):
    """A scheduler adds initial_lr to the groups: a file's load failed on it (KeyError), a folder's
    dropped it, and a scheduler made after the load to resume (last_epoch=) could not start."""
    optimizers = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Llama(dist_cases.EVEN)
        plan = fs.shard(model, fs.Mesh(dp=1), policy)
        fs.apply(plan, model)
        optimizers.append((model, fs.optimizer(plan, model, torch.optim.AdamW, lr=0.01)))
    (model, optimizer), (loaded, fresh) = optimizers
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, halving)
    backward(model)
    optimizer.step()
    scheduler.step()
    path = fs.checkpoint.save(tmp_path / "ckpt", model, optimizer, full=full)
    fs.checkpoint.load(path, loaded, fresh)

    def learning_rates(optimizer):
        return [(group["lr"], group["initial_lr"]) for group in optimizer.param_groups]

    assert learning_rates(fresh) == learning_rates(optimizer) == [(0.005, 0.01)]
    resumed = torch.optim.lr_scheduler.LambdaLR(fresh, halving, last_epoch=0)
    assert resumed.get_last_lr() == [0.005]


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
@pytest.mark.parametrize("policy", [fs.fsdp("dp"), fs.zero(1)], ids=["fsdp", "zero1"])
def test_an_optimizer_rolled_back_to_before_its_first_step_keeps_no_state(one_rank, tmp_path, full, policy):
    """Loading a checkpoint whose optimizer never stepped into one that has (ZeRO-1 kept its state)."""
    torch.manual_seed(0)
    model = Llama(dist_cases.EVEN)
    plan = fs.shard(model, fs.Mesh(dp=1), policy)
    fs.apply(plan, model)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=0.01)
    path = fs.checkpoint.save(tmp_path / "ckpt", model, optimizer, full=full)
    backward(model)
    optimizer.step()
    fs.checkpoint.load(path, model, optimizer)
    assert not getattr(optimizer, "optim", optimizer).state
