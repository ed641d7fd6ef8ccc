"""Run by tests/e2e/test_wheel.py with an installed wheel's interpreter, outside the checkout.

Prints one JSON line: where the package was imported from, what is on ``sys.path`` and
``sys.meta_path`` (an editable finder would serve a package the wheel lacks), the modules
that need an optional extra this environment lacks, and the losses and parameter updates of
two local ranks that apply a pipeline plan and train one step with `fs.forward_backward`.
A module that fails to import for any other reason raises here, and the test fails.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import pathlib
import re
import sys

import torch
import torch.nn.functional as F  # noqa: N812

import functional_shard as fs
from functional_shard.zoo import llama


def optional_imports() -> set[str]:
    """The top-level import names of the extras' packages (lightning, transformers, ...)."""
    names = set()
    for requirement in importlib.metadata.requires("functional-shard") or []:
        if "extra ==" in requirement and 'extra == "dev"' not in requirement:
            names.add(re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].replace("-", "_"))
    return names


def import_every_module() -> dict[str, str]:
    """Import each installed module; returns module -> the missing extra it needs."""
    root = pathlib.Path(fs.__file__).parent
    optional = optional_imports()
    needs_extra = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__main__":  # importing it runs the command line
            continue
        name = ".".join(("functional_shard", *parts[: -1 if parts[-1] == "__init__" else None]))
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] not in optional:
                raise
            needs_extra[name] = error.name or ""
    return needs_extra


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def one_step() -> tuple[float, bool]:
    """On each rank: a tiny Llama in 2 pipeline stages, applied, materialized, one AdamW step."""
    model = llama("tiny")  # the meta device: every rank plans the same model without talking
    plan = fs.shard(model, fs.Mesh(pp=2), fs.parse_policy("pipeline(pp, microbatches=2)"))
    fs.apply(plan, model, plan.mesh.device_mesh("cpu"))
    fs.materialize(plan, model, torch.device("cpu"), seed=0)
    optimizer = fs.optimizer(plan, model, torch.optim.AdamW, lr=1e-2)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    tokens = (torch.arange(4)[:, None] + torch.arange(17)) % 64  # 4 sequences that count up
    loss = fs.forward_backward(plan, model, next_token_loss)(tokens[:, :-1], tokens[:, 1:])
    optimizer.step()
    moved = any(
        not torch.equal(old, new.detach()) for old, new in zip(before, model.parameters(), strict=True)
    )
    return float(loss), moved


def finder_name(finder: object) -> str:
    """``module.Class`` of an import finder (some are classes, some instances)."""
    kind = finder if isinstance(finder, type) else type(finder)
    return f"{kind.__module__}.{kind.__qualname__}"


def main() -> None:
    needs_extra = import_every_module()
    steps = fs.run_local(one_step, 2)
    report = {
        "package": fs.__file__,
        "sys_path": sys.path,
        "meta_path": [finder_name(finder) for finder in sys.meta_path],
        "needs_extra": needs_extra,
        "losses": [loss for loss, _ in steps],
        "moved": [moved for _, moved in steps],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
