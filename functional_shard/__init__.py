"""functional_shard: sharding plans as data for PyTorch.

Pure functions map a model's parameters and a mesh to a `Plan`; `plan.explain()` and
`plan.cost()` say what it does and costs before anything runs.

Examples:
    >>> import torch.nn as nn, functional_shard as fs
    >>> plan = fs.shard(nn.Linear(64, 64), fs.Mesh(dp=4), fs.fsdp("dp"))
    >>> plan.local_shape("weight", rank=3)
    (16, 64)
"""

# Imports are lazy (PEP 562): `import functional_shard` loads no engine, checkpoint or
# launcher code until a name that needs it is touched. Type checkers and the docs read the
# same names from the TYPE_CHECKING block below. To export a name, add it to _EXPORTS,
# to the TYPE_CHECKING block and to __all__.
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core.errors import MeshError as MeshError
    from .core.errors import PlanError as PlanError
    from .core.errors import PolicyError as PolicyError
    from .core.errors import ShardingError as ShardingError
    from .core.errors import SpecError as SpecError
    from .core.layout import local_shape as local_shape
    from .core.layout import local_shape_and_offset as local_shape_and_offset
    from .core.layout import shard_tensor as shard_tensor
    from .core.layout import unshard_tensor as unshard_tensor
    from .core.mesh import Mesh as Mesh
    from .core.packing import PackedBatch as PackedBatch
    from .core.packing import pack as pack
    from .core.spec import Owned as Owned
    from .core.spec import P as P
    from .core.spec import ParamSharding as ParamSharding
    from .core.spec import PartitionSpec as PartitionSpec
    from .core.tree import TensorSpec as TensorSpec
    from .core.tree import read_model as read_model
    from .core.units import format_bytes as format_bytes
    from .core.units import parse_bytes as parse_bytes
    from .costing.cost.cost_model import cost as cost
    from .costing.estimate.estimate import Estimate as Estimate
    from .costing.estimate.estimate import compare_schedules as compare_schedules
    from .costing.estimate.estimate import estimate as estimate
    from .costing.time.hardware import Hardware as Hardware
    from .costing.time.hardware import hardware as hardware
    from .costing.time.kernels import Kernels as Kernels
    from .costing.trace.activations import ActivationTrace as ActivationTrace
    from .costing.trace.activations import trace_activations as trace_activations
    from .frontends import live_demo as demo
    from .planning.plan.config import Change as Change
    from .planning.plan.config import PlanConfig as PlanConfig
    from .planning.plan.cost_record import Cost as Cost
    from .planning.plan.plan import Plan as Plan
    from .planning.planner import shard as shard
    from .planning.policy.builders import checkpointing as checkpointing
    from .planning.policy.builders import cp as cp
    from .planning.policy.builders import ep as ep
    from .planning.policy.builders import fsdp as fsdp
    from .planning.policy.builders import hsdp as hsdp
    from .planning.policy.builders import mixed_precision as mixed_precision
    from .planning.policy.builders import offload as offload
    from .planning.policy.builders import pipeline as pipeline
    from .planning.policy.builders import replicate as replicate
    from .planning.policy.builders import tp as tp
    from .planning.policy.builders import zero as zero
    from .planning.policy.format import format_policy as format_policy
    from .planning.policy.parse import parse_policy as parse_policy
    from .planning.policy.types import Policy as Policy
    from .planning.tp import rules as rules
    from .planning.tp.rules import Rule as Rule
    from .planning.tp.rules import Rules as Rules
    from .planning.tp.styles import Packed as Packed
    from .planning.tp.styles import packed as packed
    from .runtime import measure as measure
    from .runtime.apply import apply as apply
    from .runtime.apply import check_optimizer as check_optimizer
    from .runtime.apply import check_runnable as check_runnable
    from .runtime.apply import clip_grad_norm_ as clip_grad_norm_
    from .runtime.apply import context_chunks as context_chunks
    from .runtime.apply import forward_backward as forward_backward
    from .runtime.apply import forward_loss as forward_loss
    from .runtime.apply import forward_only as forward_only
    from .runtime.apply import grad_scaler as grad_scaler
    from .runtime.apply import materialize as materialize
    from .runtime.apply import optimizer as optimizer
    from .runtime.apply import sequence_context as sequence_context
    from .runtime.checkpoint import api as checkpoint
    from .runtime.data_order import DataOrder as DataOrder
    from .runtime.data_order import ResumableLoader as ResumableLoader
    from .runtime.data_order import ResumableSampler as ResumableSampler
    from .runtime.launch import LocalWorld as LocalWorld
    from .runtime.launch import RankFailedError as RankFailedError
    from .runtime.launch import run_local as run_local
    from .runtime.measure import CollectiveLog as CollectiveLog
    from .runtime.measure import kept_activation_bytes as kept_activation_bytes
    from .runtime.measure import resident_bytes as resident_bytes
    from .runtime.measure import saved_tensor_bytes as saved_tensor_bytes
    from .runtime.measure_rates import MeasuredRates as MeasuredRates
    from .runtime.measure_rates import measure_rates as measure_rates
    from .runtime.timeouts import CollectiveTimeoutError as CollectiveTimeoutError
    from .runtime.timeouts import init_distributed as init_distributed
    from .runtime.timeouts import watch_collectives as watch_collectives
    from .search.auto import auto as auto
    from .search.auto import search_plans as search_plans
    from .search.report import AutoReport as AutoReport

from .core import providers as _providers

__version__ = "0.1.0"

# methods of the vocabulary whose work lives in a higher layer (core/providers.py): the
# façade sees every layer, so it says where; each module loads on its method's first call
_providers.provide(
    {
        "mesh.device_mesh": ("functional_shard.runtime.device_mesh", "build_device_mesh"),
        "plan.cost": ("functional_shard.costing.cost.cost_model", "cost"),
        "plan.unit_gathered": ("functional_shard.costing.cost.cost_model", "unit_gathered"),
        "plan.visualize": ("functional_shard.frontends.pictures.visualize", "visualize"),
        "hardware.local": ("functional_shard.runtime.measure", "local_hardware"),
    }
)

# public name -> (module, attribute); attribute None means the module itself
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "checkpoint": ("runtime.checkpoint.api", None),
    "demo": ("frontends.live_demo", None),
    "measure": ("runtime.measure", None),
    "rules": ("planning.tp.rules", None),
    "apply": ("runtime.apply", "apply"),
    "context_chunks": ("runtime.apply", "context_chunks"),
    "sequence_context": ("runtime.apply", "sequence_context"),
    "check_optimizer": ("runtime.apply", "check_optimizer"),
    "check_runnable": ("runtime.apply", "check_runnable"),
    "clip_grad_norm_": ("runtime.apply", "clip_grad_norm_"),
    "forward_backward": ("runtime.apply", "forward_backward"),
    "forward_loss": ("runtime.apply", "forward_loss"),
    "forward_only": ("runtime.apply", "forward_only"),
    "grad_scaler": ("runtime.apply", "grad_scaler"),
    "materialize": ("runtime.apply", "materialize"),
    "optimizer": ("runtime.apply", "optimizer"),
    "Cost": ("planning.plan.cost_record", "Cost"),
    "cost": ("costing.cost.cost_model", "cost"),
    "Estimate": ("costing.estimate.estimate", "Estimate"),
    "estimate": ("costing.estimate.estimate", "estimate"),
    "compare_schedules": ("costing.estimate.estimate", "compare_schedules"),
    "format_bytes": ("core.units", "format_bytes"),
    "parse_bytes": ("core.units", "parse_bytes"),
    "Hardware": ("costing.time.hardware", "Hardware"),
    "hardware": ("costing.time.hardware", "hardware"),
    "MeasuredRates": ("runtime.measure_rates", "MeasuredRates"),
    "measure_rates": ("runtime.measure_rates", "measure_rates"),
    "Kernels": ("costing.time.kernels", "Kernels"),
    "AutoReport": ("search.report", "AutoReport"),
    "auto": ("search.auto", "auto"),
    "search_plans": ("search.auto", "search_plans"),
    "MeshError": ("core.errors", "MeshError"),
    "PlanError": ("core.errors", "PlanError"),
    "PolicyError": ("core.errors", "PolicyError"),
    "ShardingError": ("core.errors", "ShardingError"),
    "SpecError": ("core.errors", "SpecError"),
    "DataOrder": ("runtime.data_order", "DataOrder"),
    "ResumableLoader": ("runtime.data_order", "ResumableLoader"),
    "ResumableSampler": ("runtime.data_order", "ResumableSampler"),
    "LocalWorld": ("runtime.launch", "LocalWorld"),
    "RankFailedError": ("runtime.launch", "RankFailedError"),
    "run_local": ("runtime.launch", "run_local"),
    "CollectiveTimeoutError": ("runtime.timeouts", "CollectiveTimeoutError"),
    "init_distributed": ("runtime.timeouts", "init_distributed"),
    "watch_collectives": ("runtime.timeouts", "watch_collectives"),
    "local_shape": ("core.layout", "local_shape"),
    "local_shape_and_offset": ("core.layout", "local_shape_and_offset"),
    "shard_tensor": ("core.layout", "shard_tensor"),
    "unshard_tensor": ("core.layout", "unshard_tensor"),
    "CollectiveLog": ("runtime.measure", "CollectiveLog"),
    "resident_bytes": ("runtime.measure", "resident_bytes"),
    "kept_activation_bytes": ("runtime.measure", "kept_activation_bytes"),
    "saved_tensor_bytes": ("runtime.measure", "saved_tensor_bytes"),
    "ActivationTrace": ("costing.trace.activations", "ActivationTrace"),
    "trace_activations": ("costing.trace.activations", "trace_activations"),
    "Mesh": ("core.mesh", "Mesh"),
    "Change": ("planning.plan.config", "Change"),
    "Plan": ("planning.plan.plan", "Plan"),
    "PlanConfig": ("planning.plan.config", "PlanConfig"),
    "shard": ("planning.planner", "shard"),
    "Policy": ("planning.policy.types", "Policy"),
    "checkpointing": ("planning.policy.builders", "checkpointing"),
    "cp": ("planning.policy.builders", "cp"),
    "ep": ("planning.policy.builders", "ep"),
    "fsdp": ("planning.policy.builders", "fsdp"),
    "hsdp": ("planning.policy.builders", "hsdp"),
    "mixed_precision": ("planning.policy.builders", "mixed_precision"),
    "offload": ("planning.policy.builders", "offload"),
    "pipeline": ("planning.policy.builders", "pipeline"),
    "replicate": ("planning.policy.builders", "replicate"),
    "tp": ("planning.policy.builders", "tp"),
    "zero": ("planning.policy.builders", "zero"),
    "format_policy": ("planning.policy.format", "format_policy"),
    "parse_policy": ("planning.policy.parse", "parse_policy"),
    "Rule": ("planning.tp.rules", "Rule"),
    "Rules": ("planning.tp.rules", "Rules"),
    "Packed": ("planning.tp.styles", "Packed"),
    "packed": ("planning.tp.styles", "packed"),
    "Owned": ("core.spec", "Owned"),
    "P": ("core.spec", "P"),
    "ParamSharding": ("core.spec", "ParamSharding"),
    "PartitionSpec": ("core.spec", "PartitionSpec"),
    "TensorSpec": ("core.tree", "TensorSpec"),
    "read_model": ("core.tree", "read_model"),
    "PackedBatch": ("core.packing", "PackedBatch"),
    "pack": ("core.packing", "pack"),
}

__all__ = [
    # meshes and specs
    "Mesh",
    "Owned",
    "P",
    "ParamSharding",
    "PartitionSpec",
    "TensorSpec",
    # policies
    "Policy",
    "Rule",
    "Rules",
    "Packed",
    "packed",
    "checkpointing",
    "cp",
    "ep",
    "fsdp",
    "hsdp",
    "mixed_precision",
    "offload",
    "pipeline",
    "replicate",
    "rules",
    "tp",
    "zero",
    "format_policy",
    "parse_policy",
    # plans
    "Change",
    "Plan",
    "PlanConfig",
    "read_model",
    "shard",
    # layout and cost
    "Cost",
    "cost",
    # will it fit, how fast, and which plan
    "ActivationTrace",
    "trace_activations",
    "AutoReport",
    "Estimate",
    "Hardware",
    "Kernels",
    "auto",
    "compare_schedules",
    "estimate",
    "format_bytes",
    "hardware",
    "measure_rates",
    "MeasuredRates",
    "parse_bytes",
    "search_plans",
    "local_shape",
    "local_shape_and_offset",
    "shard_tensor",
    "unshard_tensor",
    # running plans
    "LocalWorld",
    "RankFailedError",
    "CollectiveTimeoutError",
    "init_distributed",
    "watch_collectives",
    "apply",
    "check_optimizer",
    "check_runnable",
    "clip_grad_norm_",
    "forward_backward",
    "forward_loss",
    "forward_only",
    "context_chunks",
    "sequence_context",
    "grad_scaler",
    "materialize",
    "optimizer",
    "run_local",
    "checkpoint",
    # the data order, resumable on any plan
    "PackedBatch",
    "pack",
    "DataOrder",
    "ResumableLoader",
    "ResumableSampler",
    # measuring running plans, beside plan.cost()
    "CollectiveLog",
    "resident_bytes",
    "kept_activation_bytes",
    "saved_tensor_bytes",
    "measure",
    "demo",
    # errors
    "MeshError",
    "PlanError",
    "PolicyError",
    "ShardingError",
    "SpecError",
]


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


class _Facade(types.ModuleType):
    """This package's module type: a public function keeps its name when its module loads.

    Importing a submodule binds it on its package (``functional_shard.apply`` becomes the
    package's ``apply``), which would hide the function of the same name (`apply`, `cost`)
    from every later ``fs.apply``; that binding is skipped, so `__getattr__` answers.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name, ("", None))[1] is not None:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade
