"""What `import functional_shard` exports, for type checkers, IDEs and the API docs.

Written from `_DEFINITIONS` in ``__init__.py`` (the one list) by
``python3 tests/unit/test_facade.py``, which fails when the two differ. Do not edit by hand.
"""

from .core.document_attention import packed_inputs as packed_inputs
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
from .core.packing import collate_packed as collate_packed
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
from .costing.cost.cost_model import unit_gathered as _unit_gathered_definition
from .costing.estimate.estimate import compare_schedules as compare_schedules
from .costing.estimate.estimate import estimate as estimate
from .costing.estimate.record import Estimate as Estimate
from .costing.time.hardware import Hardware as Hardware
from .costing.time.hardware import hardware as hardware
from .costing.time.kernels import Kernels as Kernels
from .costing.trace.activations import trace_activations as trace_activations
from .costing.trace.results import ActivationTrace as ActivationTrace
from .frontends import live_demo as demo
from .frontends.pictures.visualize import visualize as _visualize_definition
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
from .runtime.checkpoint import api as checkpoint
from .runtime.data_order import DataOrder as DataOrder
from .runtime.data_order import ResumableLoader as ResumableLoader
from .runtime.data_order import ResumableSampler as ResumableSampler
from .runtime.device_mesh import build_device_mesh as _build_device_mesh_definition
from .runtime.engines.checks import check_runnable as check_runnable
from .runtime.engines.context.parallel import context_chunks as context_chunks
from .runtime.engines.context.parallel import sequence_context as sequence_context
from .runtime.engines.evaluation import forward_loss as forward_loss
from .runtime.engines.evaluation import forward_only as forward_only
from .runtime.engines.materialize import materialize as materialize
from .runtime.engines.optimizer import check_optimizer as check_optimizer
from .runtime.engines.optimizer import clip_grad_norm_ as clip_grad_norm_
from .runtime.engines.optimizer import grad_scaler as grad_scaler
from .runtime.engines.optimizer import optimizer as optimizer
from .runtime.engines.step import forward_backward as forward_backward
from .runtime.launch import LocalWorld as LocalWorld
from .runtime.launch import run_local as run_local
from .runtime.measure import CollectiveLog as CollectiveLog
from .runtime.measure import kept_activation_bytes as kept_activation_bytes
from .runtime.measure import resident_bytes as resident_bytes
from .runtime.measure import saved_tensor_bytes as saved_tensor_bytes
from .runtime.measure_rates import MeasuredRates as MeasuredRates
from .runtime.measure_rates import measure_rates as measure_rates
from .runtime.timeouts import CollectiveTimeoutError as CollectiveTimeoutError
from .runtime.timeouts import RankFailedError as RankFailedError
from .runtime.timeouts import init_distributed as init_distributed
from .runtime.timeouts import watch_collectives as watch_collectives
from .search.auto import auto as auto
from .search.auto import search_plans as search_plans
from .search.report import AutoReport as AutoReport

# not public: the work of methods whose work lives above (docs/architecture.md)
_unit_gathered = _unit_gathered_definition
_build_device_mesh = _build_device_mesh_definition
_visualize = _visualize_definition

__version__: str

__all__ = [
    "ActivationTrace",
    "AutoReport",
    "Change",
    "CollectiveLog",
    "CollectiveTimeoutError",
    "Cost",
    "DataOrder",
    "Estimate",
    "Hardware",
    "Kernels",
    "LocalWorld",
    "MeasuredRates",
    "Mesh",
    "MeshError",
    "Owned",
    "P",
    "Packed",
    "PackedBatch",
    "ParamSharding",
    "PartitionSpec",
    "Plan",
    "PlanConfig",
    "PlanError",
    "Policy",
    "PolicyError",
    "RankFailedError",
    "ResumableLoader",
    "ResumableSampler",
    "Rule",
    "Rules",
    "ShardingError",
    "SpecError",
    "TensorSpec",
    "apply",
    "auto",
    "check_optimizer",
    "check_runnable",
    "checkpoint",
    "checkpointing",
    "clip_grad_norm_",
    "collate_packed",
    "compare_schedules",
    "context_chunks",
    "cost",
    "cp",
    "demo",
    "ep",
    "estimate",
    "format_bytes",
    "format_policy",
    "forward_backward",
    "forward_loss",
    "forward_only",
    "fsdp",
    "grad_scaler",
    "hardware",
    "hsdp",
    "init_distributed",
    "kept_activation_bytes",
    "local_shape",
    "local_shape_and_offset",
    "materialize",
    "measure",
    "measure_rates",
    "mixed_precision",
    "offload",
    "optimizer",
    "pack",
    "packed",
    "packed_inputs",
    "parse_bytes",
    "parse_policy",
    "pipeline",
    "read_model",
    "replicate",
    "resident_bytes",
    "rules",
    "run_local",
    "saved_tensor_bytes",
    "search_plans",
    "sequence_context",
    "shard",
    "shard_tensor",
    "tp",
    "trace_activations",
    "unshard_tensor",
    "watch_collectives",
    "zero",
]
