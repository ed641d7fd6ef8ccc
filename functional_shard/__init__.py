"""functional_shard: sharding plans as data for PyTorch.

Pure functions map a model's parameters and a mesh to a `Plan`; `plan.explain()` and
`plan.cost()` say what it does and costs before anything runs.

Examples:
    >>> import torch.nn as nn, functional_shard as fs
    >>> plan = fs.shard(nn.Linear(64, 64), fs.Mesh(dp=4), fs.fsdp("dp"))
    >>> plan.local_shape("weight", rank=3)
    (16, 64)
"""

# `_EXPORTS` maps each public name to (defining module, attribute; None: the module itself).
# Its lines look alike on purpose: one literal name -> definition entry each, which `__getattr__`
# looks up and docs/_hooks/architecture.py reads with ast.literal_eval, neither building an index.
# Names load on first use (PEP 562), so `import functional_shard` loads no engine,
# checkpoint or launcher code. Type checkers, IDEs and the API docs read `__init__.pyi`,
# written from this list by `python3 tests/unit/test_facade.py` (which fails when they differ).
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, tuple[str, str | None]] = {
    # meshes and specs
    "Mesh": ("core.mesh", "Mesh"),
    "PackedBatch": ("core.packing", "PackedBatch"),
    "pack": ("core.packing", "pack"),
    "collate_packed": ("core.packing", "collate_packed"),
    "packed_inputs": ("core.document_attention", "packed_inputs"),
    "Owned": ("core.spec", "Owned"),
    "P": ("core.spec", "P"),
    "ParamSharding": ("core.spec", "ParamSharding"),
    "PartitionSpec": ("core.spec", "PartitionSpec"),
    "TensorSpec": ("core.tree", "TensorSpec"),
    # policies
    "Policy": ("planning.policy.types", "Policy"),
    "Rule": ("planning.tp.rules", "Rule"),
    "Rules": ("planning.tp.rules", "Rules"),
    "Packed": ("planning.tp.styles", "Packed"),
    "packed": ("planning.tp.styles", "packed"),
    "checkpointing": ("planning.policy.builders", "checkpointing"),
    "cp": ("planning.policy.builders", "cp"),
    "ep": ("planning.policy.builders", "ep"),
    "fsdp": ("planning.policy.builders", "fsdp"),
    "hsdp": ("planning.policy.builders", "hsdp"),
    "mixed_precision": ("planning.policy.builders", "mixed_precision"),
    "offload": ("planning.policy.builders", "offload"),
    "pipeline": ("planning.policy.builders", "pipeline"),
    "replicate": ("planning.policy.builders", "replicate"),
    "rules": ("planning.tp.rules", None),
    "tp": ("planning.policy.builders", "tp"),
    "zero": ("planning.policy.builders", "zero"),
    "format_policy": ("planning.policy.format", "format_policy"),
    "parse_policy": ("planning.policy.parse", "parse_policy"),
    # plans
    "Change": ("planning.plan.config", "Change"),
    "Plan": ("planning.plan.plan", "Plan"),
    "PlanConfig": ("planning.plan.config", "PlanConfig"),
    "read_model": ("core.tree", "read_model"),
    "shard": ("planning.planner", "shard"),
    # layout and cost
    "Cost": ("planning.plan.cost_record", "Cost"),
    "cost": ("costing.cost.cost_model", "cost"),
    # will it fit, how fast, and which plan
    "ActivationTrace": ("costing.trace.results", "ActivationTrace"),
    "trace_activations": ("costing.trace.activations", "trace_activations"),
    "AutoReport": ("search.report", "AutoReport"),
    "Estimate": ("costing.estimate.record", "Estimate"),
    "Hardware": ("costing.time.hardware", "Hardware"),
    "Kernels": ("costing.time.kernels", "Kernels"),
    "auto": ("search.auto", "auto"),
    "compare_schedules": ("costing.estimate.estimate", "compare_schedules"),
    "estimate": ("costing.estimate.estimate", "estimate"),
    "format_bytes": ("core.units", "format_bytes"),
    "hardware": ("costing.time.hardware", "hardware"),
    "MeasuredRates": ("runtime.measure_rates", "MeasuredRates"),
    "measure_rates": ("runtime.measure_rates", "measure_rates"),
    "parse_bytes": ("core.units", "parse_bytes"),
    "search_plans": ("search.auto", "search_plans"),
    "local_shape": ("core.layout", "local_shape"),
    "local_shape_and_offset": ("core.layout", "local_shape_and_offset"),
    "shard_tensor": ("core.layout", "shard_tensor"),
    "unshard_tensor": ("core.layout", "unshard_tensor"),
    # running plans
    "LocalWorld": ("runtime.launch", "LocalWorld"),
    "RankFailedError": ("runtime.timeouts", "RankFailedError"),
    "CollectiveTimeoutError": ("runtime.timeouts", "CollectiveTimeoutError"),
    "init_distributed": ("runtime.timeouts", "init_distributed"),
    "watch_collectives": ("runtime.timeouts", "watch_collectives"),
    "apply": ("runtime.apply", "apply"),
    "check_optimizer": ("runtime.engines.optimizer", "check_optimizer"),
    "check_runnable": ("runtime.engines.checks", "check_runnable"),
    "clip_grad_norm_": ("runtime.engines.optimizer", "clip_grad_norm_"),
    "forward_backward": ("runtime.engines.step", "forward_backward"),
    "forward_loss": ("runtime.engines.evaluation", "forward_loss"),
    "forward_only": ("runtime.engines.evaluation", "forward_only"),
    "context_chunks": ("runtime.engines.context.parallel", "context_chunks"),
    "sequence_context": ("runtime.engines.context.parallel", "sequence_context"),
    "grad_scaler": ("runtime.engines.optimizer", "grad_scaler"),
    "materialize": ("runtime.engines.materialize", "materialize"),
    "optimizer": ("runtime.engines.optimizer", "optimizer"),
    "run_local": ("runtime.launch", "run_local"),
    "checkpoint": ("runtime.checkpoint.api", None),
    # the data order, resumable on any plan
    "DataOrder": ("runtime.data_order", "DataOrder"),
    "ResumableLoader": ("runtime.data_order", "ResumableLoader"),
    "ResumableSampler": ("runtime.data_order", "ResumableSampler"),
    # measuring running plans, beside plan.cost()
    "CollectiveLog": ("runtime.measure", "CollectiveLog"),
    "resident_bytes": ("runtime.measure", "resident_bytes"),
    "kept_activation_bytes": ("runtime.measure", "kept_activation_bytes"),
    "saved_tensor_bytes": ("runtime.measure", "saved_tensor_bytes"),
    "measure": ("runtime.measure", None),
    "demo": ("frontends.live_demo", None),
    # errors
    "MeshError": ("core.errors", "MeshError"),
    "PlanError": ("core.errors", "PlanError"),
    "PolicyError": ("core.errors", "PolicyError"),
    "ShardingError": ("core.errors", "ShardingError"),
    "SpecError": ("core.errors", "SpecError"),
    # not public: the work of a method that a lower layer's data offers and a higher layer
    # does (`plan.visualize()`, `mesh.device_mesh()`, the units in `plan.explain()`); the
    # method reaches it here, through the one door that sees every layer (docs/architecture.md)
    "_build_device_mesh": ("runtime.device_mesh", "build_device_mesh"),
    "_unit_gathered": ("costing.cost.cost_model", "unit_gathered"),
    "_visualize": ("frontends.pictures.visualize", "visualize"),
}

__all__ = [name for name in _EXPORTS if not name.startswith("_")]


def __getattr__(name: str) -> Any:
    import importlib

    try:
        module_name, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'functional_shard' has no attribute {name!r}") from None
    module = importlib.import_module(f".{module_name}", __name__)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
