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
    from . import checkpoint as checkpoint
    from . import demo as demo
    from . import measure as measure
    from . import rules as rules
    from .activations import ActivationTrace as ActivationTrace
    from .activations import trace_activations as trace_activations
    from .apply import apply as apply
    from .apply import check_optimizer as check_optimizer
    from .apply import check_runnable as check_runnable
    from .apply import clip_grad_norm_ as clip_grad_norm_
    from .apply import forward_backward as forward_backward
    from .apply import grad_scaler as grad_scaler
    from .apply import materialize as materialize
    from .apply import optimizer as optimizer
    from .auto import AutoReport as AutoReport
    from .auto import auto as auto
    from .auto import search_plans as search_plans
    from .cost import Cost as Cost
    from .cost import cost as cost
    from .errors import MeshError as MeshError
    from .errors import PlanError as PlanError
    from .errors import PolicyError as PolicyError
    from .errors import ShardingError as ShardingError
    from .errors import SpecError as SpecError
    from .estimate import Estimate as Estimate
    from .estimate import compare_schedules as compare_schedules
    from .estimate import estimate as estimate
    from .estimate import parse_bytes as parse_bytes
    from .hardware import Hardware as Hardware
    from .hardware import hardware as hardware
    from .launch import LocalWorld as LocalWorld
    from .launch import RankFailedError as RankFailedError
    from .launch import run_local as run_local
    from .layout import local_shape as local_shape
    from .layout import local_shape_and_offset as local_shape_and_offset
    from .layout import shard_tensor as shard_tensor
    from .layout import unshard_tensor as unshard_tensor
    from .measure import CollectiveLog as CollectiveLog
    from .measure import kept_activation_bytes as kept_activation_bytes
    from .measure import resident_bytes as resident_bytes
    from .measure import saved_tensor_bytes as saved_tensor_bytes
    from .mesh import Mesh as Mesh
    from .plan import Change as Change
    from .plan import Plan as Plan
    from .plan import PlanConfig as PlanConfig
    from .planner import shard as shard
    from .policy import Policy as Policy
    from .policy import checkpointing as checkpointing
    from .policy import ep as ep
    from .policy import fsdp as fsdp
    from .policy import hsdp as hsdp
    from .policy import mixed_precision as mixed_precision
    from .policy import offload as offload
    from .policy import pipeline as pipeline
    from .policy import replicate as replicate
    from .policy import tp as tp
    from .policy import zero as zero
    from .policy_text import format_policy as format_policy
    from .policy_text import parse_policy as parse_policy
    from .rules import Rule as Rule
    from .rules import Rules as Rules
    from .spec import Owned as Owned
    from .spec import P as P
    from .spec import ParamSharding as ParamSharding
    from .spec import PartitionSpec as PartitionSpec
    from .tree import TensorSpec as TensorSpec
    from .tree import read_model as read_model

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None means the module itself
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "checkpoint": ("checkpoint", None),
    "demo": ("demo", None),
    "measure": ("measure", None),
    "rules": ("rules", None),
    "apply": ("apply", "apply"),
    "check_optimizer": ("apply", "check_optimizer"),
    "check_runnable": ("apply", "check_runnable"),
    "clip_grad_norm_": ("apply", "clip_grad_norm_"),
    "forward_backward": ("apply", "forward_backward"),
    "grad_scaler": ("apply", "grad_scaler"),
    "materialize": ("apply", "materialize"),
    "optimizer": ("apply", "optimizer"),
    "Cost": ("cost", "Cost"),
    "cost": ("cost", "cost"),
    "Estimate": ("estimate", "Estimate"),
    "estimate": ("estimate", "estimate"),
    "compare_schedules": ("estimate", "compare_schedules"),
    "parse_bytes": ("estimate", "parse_bytes"),
    "Hardware": ("hardware", "Hardware"),
    "hardware": ("hardware", "hardware"),
    "AutoReport": ("auto", "AutoReport"),
    "auto": ("auto", "auto"),
    "search_plans": ("auto", "search_plans"),
    "MeshError": ("errors", "MeshError"),
    "PlanError": ("errors", "PlanError"),
    "PolicyError": ("errors", "PolicyError"),
    "ShardingError": ("errors", "ShardingError"),
    "SpecError": ("errors", "SpecError"),
    "LocalWorld": ("launch", "LocalWorld"),
    "RankFailedError": ("launch", "RankFailedError"),
    "run_local": ("launch", "run_local"),
    "local_shape": ("layout", "local_shape"),
    "local_shape_and_offset": ("layout", "local_shape_and_offset"),
    "shard_tensor": ("layout", "shard_tensor"),
    "unshard_tensor": ("layout", "unshard_tensor"),
    "CollectiveLog": ("measure", "CollectiveLog"),
    "resident_bytes": ("measure", "resident_bytes"),
    "kept_activation_bytes": ("measure", "kept_activation_bytes"),
    "saved_tensor_bytes": ("measure", "saved_tensor_bytes"),
    "ActivationTrace": ("activations", "ActivationTrace"),
    "trace_activations": ("activations", "trace_activations"),
    "Mesh": ("mesh", "Mesh"),
    "Change": ("plan", "Change"),
    "Plan": ("plan", "Plan"),
    "PlanConfig": ("plan", "PlanConfig"),
    "shard": ("planner", "shard"),
    "Policy": ("policy", "Policy"),
    "checkpointing": ("policy", "checkpointing"),
    "ep": ("policy", "ep"),
    "fsdp": ("policy", "fsdp"),
    "hsdp": ("policy", "hsdp"),
    "mixed_precision": ("policy", "mixed_precision"),
    "offload": ("policy", "offload"),
    "pipeline": ("policy", "pipeline"),
    "replicate": ("policy", "replicate"),
    "tp": ("policy", "tp"),
    "zero": ("policy", "zero"),
    "format_policy": ("policy_text", "format_policy"),
    "parse_policy": ("policy_text", "parse_policy"),
    "Rule": ("rules", "Rule"),
    "Rules": ("rules", "Rules"),
    "Owned": ("spec", "Owned"),
    "P": ("spec", "P"),
    "ParamSharding": ("spec", "ParamSharding"),
    "PartitionSpec": ("spec", "PartitionSpec"),
    "TensorSpec": ("tree", "TensorSpec"),
    "read_model": ("tree", "read_model"),
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
    "checkpointing",
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
    "auto",
    "compare_schedules",
    "estimate",
    "hardware",
    "parse_bytes",
    "search_plans",
    "local_shape",
    "local_shape_and_offset",
    "shard_tensor",
    "unshard_tensor",
    # running plans
    "LocalWorld",
    "RankFailedError",
    "apply",
    "check_optimizer",
    "check_runnable",
    "clip_grad_norm_",
    "forward_backward",
    "grad_scaler",
    "materialize",
    "optimizer",
    "run_local",
    "checkpoint",
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
