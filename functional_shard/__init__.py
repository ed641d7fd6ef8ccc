"""functional_shard: sharding plans as data for PyTorch.

Pure functions map a model's parameters and a mesh to a `Plan`; `plan.explain()` and
`plan.cost()` say what it does and costs before anything runs.

Examples:
    >>> import torch.nn as nn, functional_shard as fs
    >>> plan = fs.shard(nn.Linear(64, 64), fs.Mesh(dp=4), fs.fsdp("dp"))
    >>> plan.local_shape("weight", rank=3)
    (16, 64)
"""

# `_DEFINITIONS` is the one list of public names: each defining module, with the names it gives,
# read as `from functional_shard.<module> import <name>` reads them (an attribute of the module,
# else its submodule of that name; "a as b" gives `a` as `b`). `__getattr__` looks the names up
# there, and docs/_hooks/architecture.py reads the list with ast.literal_eval. Names load on first
# use (PEP 562), so `import functional_shard` loads no engine, checkpoint or launcher code. Type
# checkers, IDEs and the API docs read `__init__.pyi`, written from this list by
# `python3 tests/unit/test_facade.py` (which fails when they differ). A name starting with "_" is
# not public: the work of a method that a lower layer's data offers and a higher layer does
# (`mesh.device_mesh()`, the units in `plan.explain()`, `plan.visualize()`); the method reaches it
# here, through the one door that sees every layer (docs/architecture.md).
from typing import Any

__version__ = "0.1.0"

_DEFINITIONS: dict[str, tuple[str, ...]] = {
    # meshes, specs and layouts
    "core.mesh": ("Mesh",),
    "core.spec": ("Owned", "P", "ParamSharding", "PartitionSpec"),
    "core.tree": ("TensorSpec", "read_model"),
    "core.layout": ("local_shape", "local_shape_and_offset", "shard_tensor", "unshard_tensor"),
    "core.packing": ("PackedBatch", "pack", "collate_packed"),
    "core.document_attention": ("packed_inputs",),
    "core.units": ("format_bytes", "parse_bytes"),
    "core.errors": ("MeshError", "PlanError", "PolicyError", "ShardingError", "SpecError"),
    # policies and plans
    "planning.policy.types": ("Policy",),
    "planning.policy.builders": (
        "checkpointing",
        "cp",
        "ep",
        "fsdp",
        "hsdp",
        "mixed_precision",
        "offload",
        "pipeline",
        "replicate",
        "tp",
        "zero",
    ),
    "planning.policy.format": ("format_policy",),
    "planning.policy.parse": ("parse_policy",),
    "planning.tp": ("rules",),
    "planning.tp.rules": ("Rule", "Rules"),
    "planning.tp.styles": ("Packed", "packed"),
    "planning.plan.config": ("Change", "PlanConfig"),
    "planning.plan.plan": ("Plan",),
    "planning.plan.cost_record": ("Cost",),
    "planning.planner": ("shard",),
    # what a plan costs, will it fit, how fast, and which plan
    "costing.cost.cost_model": ("cost", "unit_gathered as _unit_gathered"),
    "costing.trace.results": ("ActivationTrace",),
    "costing.trace.activations": ("trace_activations",),
    "costing.estimate.record": ("Estimate",),
    "costing.estimate.estimate": ("compare_schedules", "estimate"),
    "costing.time.hardware": ("Hardware", "hardware"),
    "costing.time.kernels": ("Kernels",),
    "search.report": ("AutoReport",),
    "search.auto": ("auto", "search_plans"),
    # running plans
    "runtime.apply": ("apply",),
    "runtime.device_mesh": ("build_device_mesh as _build_device_mesh",),
    "runtime.engines.checks": ("check_runnable",),
    "runtime.engines.materialize": ("materialize",),
    "runtime.engines.optimizer": ("optimizer", "check_optimizer", "clip_grad_norm_", "grad_scaler"),
    "runtime.engines.step": ("forward_backward",),
    "runtime.engines.evaluation": ("forward_loss", "forward_only"),
    "runtime.engines.context.parallel": ("context_chunks", "sequence_context"),
    "runtime.checkpoint": ("api as checkpoint",),
    "runtime.data_order": ("DataOrder", "ResumableLoader", "ResumableSampler"),
    "runtime.launch": ("LocalWorld", "run_local"),
    "runtime.timeouts": (
        "RankFailedError",
        "CollectiveTimeoutError",
        "init_distributed",
        "watch_collectives",
    ),
    # measuring running plans, beside plan.cost()
    "runtime": ("measure",),
    "runtime.measure": ("CollectiveLog", "resident_bytes", "kept_activation_bytes", "saved_tensor_bytes"),
    "runtime.measure_rates": ("MeasuredRates", "measure_rates"),
    # what people run and look at
    "frontends": ("live_demo as demo",),
    "frontends.pictures.visualize": ("visualize as _visualize",),
}

# public name -> (defining module, what it is there), looked up by `__getattr__`
_EXPORTS: dict[str, tuple[str, str]] = {
    given or defined: (module, defined)
    for module, names in _DEFINITIONS.items()
    for defined, _, given in (name.partition(" as ") for name in names)
}

__all__ = sorted(name for name in _EXPORTS if not name.startswith("_"))


def __getattr__(name: str) -> Any:
    import importlib

    try:
        module_name, defined = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'functional_shard' has no attribute {name!r}") from None
    module = importlib.import_module(f".{module_name}", __name__)
    try:
        value = getattr(module, defined)
    except AttributeError:  # a submodule not loaded yet, as `from package import name` finds it
        value = importlib.import_module(f".{module_name}.{defined}", __name__)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
