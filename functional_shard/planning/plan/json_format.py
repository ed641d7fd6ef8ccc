"""A plan read from JSON, checked against the format `Plan.to_json` writes. Pure.

A plan file written by hand, cut short or edited is refused with every problem named (tensor path
and field), never half-read into a plan that fails later (`plan_problems`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from functional_shard.core.errors import PolicyError, ShardingError, bullets
from functional_shard.core.mesh import Mesh
from functional_shard.core.spec import P, ParamSharding, spec_from_json

from .config import FLAT_FIELDS, SECTIONS, PipelineConfig, PlanConfig, TpConfig

__all__ = [
    "FORMAT_VERSION",
    "config_value_problems",
    "modules_without_tensors",
    "nested_config",
    "plan_data",
    "plan_problems",
]

FORMAT_VERSION = 2
"""Version 2 holds a config per parallelism; version 1 (one flat config) is read through `nested_config`."""

_KINDS = ("param", "buffer")
_SPECS = tuple(field.name for field in dataclasses.fields(ParamSharding))
_CONFIG_TYPES = typing.get_type_hints(PlanConfig)
_SECTION_TYPES = {key: typing.get_type_hints(section) for key, section in SECTIONS.items()}
_SECTION_REQUIRED = {
    key: tuple(field.name for field in dataclasses.fields(section) if field.default is dataclasses.MISSING)
    for key, section in SECTIONS.items()
}
# version 1's flat config: each field of a parallelism -> (its config, its name there)
_FLAT_FIELDS = {flat: (key, name) for flat, key, name in FLAT_FIELDS if key is not None}
_DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
_LAYOUTS = ("linear", "embedding", "conv1d", "experts", "other")  # styles.layout_of's


def _is(value: Any, kind: Any) -> bool:
    """Whether JSON ``value`` is of the annotated ``kind`` (tuples are JSON lists)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, arg) for arg in args)
    if kind is type(None):
        return value is None
    if origin is tuple:
        if not isinstance(value, list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is(item, args[0]) for item in value)
        return len(value) == len(args) and all(_is(item, arg) for item, arg in zip(value, args, strict=True))
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _mesh_problems(data: Any) -> tuple[Mesh | None, list[str]]:
    axes = data.get("axes") if isinstance(data, Mapping) else None
    if not isinstance(axes, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and _is(pair[1], int)
        for pair in axes
    ):
        return None, ['mesh: "axes" must be a list of [name, size] pairs, e.g. [["dp", 8]]']
    unresolved = [f"{name}={size}" for name, size in axes if size < 1]
    if unresolved:  # a plan is made on a resolved mesh: every size is known
        return None, [f"mesh: every axis size is a positive count in a plan, not {', '.join(unresolved)}"]
    try:
        return Mesh({name: size for name, size in axes}), []
    except ShardingError as error:
        return None, [f"mesh: {error}"]


def _spec_problems(where: str, data: Any, shape: tuple[int, ...], mesh: Mesh | None) -> list[str]:
    try:
        spec = spec_from_json(data)
    except (ShardingError, TypeError, ValueError, KeyError) as error:
        return [f"{where}: not a spec ({error})"]
    if isinstance(spec, P):
        if spec.on is not None and not (
            isinstance(spec.on, tuple | list) and len(spec.on) == 2 and isinstance(spec.on[0], str)
        ):
            return [f"{where}: 'on' must be [axis, coordinate]"]
        if mesh is None:
            return []
        staged = [spec.on[0]] if spec.on is not None else []
        unknown = [axis for axis in (*spec.axes, *staged) if not isinstance(axis, str) or axis not in mesh]
        if unknown:
            return [f"{where}: axis {unknown[0]!r} is not an axis of {mesh!r}"]
        return [f"{where}: {problem}" for problem in spec.problems(shape, mesh)]
    if mesh is not None and (not isinstance(spec.axis, str) or spec.axis not in mesh):  # Owned
        return [f"{where}: axis {spec.axis!r} is not an axis of {mesh!r}"]
    return []


def _tensor_problems(path: str, entry: Any, mesh: Mesh | None) -> list[str]:
    if not isinstance(entry, Mapping):
        return [f"tensors[{path!r}]: must be an object with shape, dtype, module, kind, aliases, sharding"]
    needed = ("shape", "dtype", "module", "kind", "aliases", "sharding")
    found = [f"tensors[{path!r}]: missing {key!r}" for key in needed if key not in entry]
    if found:
        return found
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is(size, int) and size >= 0 for size in shape):
        return [f"tensors[{path!r}].shape: must be a list of sizes (integers >= 0), got {shape!r}"]
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        found.append(f"tensors[{path!r}].dtype: {dtype!r} is not a torch dtype (e.g. 'float32')")
    if entry["kind"] not in _KINDS:
        found.append(f"tensors[{path!r}].kind: {entry['kind']!r} is neither 'param' nor 'buffer'")
    if not isinstance(entry["module"], str | None):
        found.append(f"tensors[{path!r}].module: must be a class name or null")
    if not isinstance(entry.get("frozen", False), bool):  # written only when true
        found.append(f"tensors[{path!r}].frozen: must be true or false, got {entry['frozen']!r}")
    if not _is(entry["aliases"], tuple[str, ...]):  # a JSON list of paths
        found.append(f"tensors[{path!r}].aliases: must be a list of paths")
    sharding = entry["sharding"]
    if not isinstance(sharding, Mapping) or set(sharding) != set(_SPECS):
        return [*found, f"tensors[{path!r}].sharding: must hold exactly {', '.join(_SPECS)}"]
    for name in _SPECS:
        found += _spec_problems(f"tensors[{path!r}].sharding.{name}", sharding[name], tuple(shape), mesh)
    return found


def _config_problems(
    config: Any, mesh: Mesh | None, paths: set[str], params: set[str], untensored: set[str]
) -> list[str]:
    if not isinstance(config, Mapping):
        return ["config: must be an object"]
    found = _config_type_problems(config)
    if found:
        return found
    read = PlanConfig.from_json(config)
    found += config_value_problems(read)
    if mesh is not None:
        found += [
            f"config.{key}: axis {axis!r} is not an axis of {mesh!r}"
            for key, axis in _named_axes(read)
            if axis not in mesh
        ]
    modules = _tensor_modules(paths) | untensored
    found += _pieces_problems(read.tp, mesh)
    found += [
        f"config.{key}: {module!r} is no module of the plan's tensors"
        for key, module in _named_modules(read)
        if module not in modules
    ]
    return found + _pipeline_problems(read.pipeline, mesh, params)


def _config_type_problems(config: Mapping[str, Any]) -> list[str]:
    found = []
    for key, value in config.items():
        if key not in _CONFIG_TYPES:
            found.append(f"config.{key}: not a field of a plan's config")
        elif key in _SECTION_TYPES and value is not None:
            found += _section_type_problems(key, value)
        elif key not in _SECTION_TYPES and not _is(value, _CONFIG_TYPES[key]):
            found.append(f"config.{key}: {value!r} is not a {_CONFIG_TYPES[key]}".replace("typing.", ""))
    return found


def _section_type_problems(key: str, section: Any) -> list[str]:
    # one parallelism's config: an object of its fields (null when the plan does not use it)
    if not isinstance(section, Mapping):
        return [f"config.{key}: must be an object, or null when the plan does not use it"]
    kinds = _SECTION_TYPES[key]
    found = [f"config.{key}.{name}: not a field of the {key} config" for name in section if name not in kinds]
    found += [f"config.{key}.{name}: missing" for name in _SECTION_REQUIRED[key] if name not in section]
    for name, value in section.items():
        if name in kinds and not _is(value, kinds[name]):
            found.append(f"config.{key}.{name}: {value!r} is not a {kinds[name]}".replace("typing.", ""))
    return found


def _named_axes(config: PlanConfig) -> list[tuple[str, str]]:
    """(config key, axis) of every mesh axis the config names."""
    named = []
    if config.fsdp is not None:
        named += [("fsdp.replicate_axes", axis) for axis in config.fsdp.replicate_axes]
        named += [("fsdp.shard_axes", axis) for axis in config.fsdp.shard_axes]
    if config.tp is not None:
        named += [("tp.axes", axis) for axis in config.tp.axes]
    for key, section in (
        ("pipeline", config.pipeline),
        ("experts", config.experts),
        ("context", config.context),
    ):
        axis = getattr(section, "axis", None)
        if axis is not None:
            named.append((f"{key}.axis", axis))
    return named


def _named_modules(config: PlanConfig) -> list[tuple[str, str]]:
    """(config key, module path) of every module the config names."""
    named = [("checkpointed", module) for module in config.checkpointed]
    if config.fsdp is not None:
        named += [("fsdp.units", module) for module in config.fsdp.units]
        named += [("fsdp.unit_groups", module) for group in config.fsdp.unit_groups for module in group]
    if config.tp is not None:
        named += [("tp.styles", entry[0]) for entry in config.tp.styles]
    if config.experts is not None:
        named += [("experts.modules", module) for module in config.experts.modules]
    if config.pipeline is not None:
        named += [("pipeline.stages", module) for stage in config.pipeline.stages for module in stage]
    return named


def _tensor_modules(paths: Iterable[str]) -> set[str]:
    """Every module that holds one of ``paths`` or a module that does, the root ``""`` included."""
    modules = {""} | {path.rpartition(".")[0] for path in paths}
    return modules | {prefix for module in list(modules) for prefix in _prefixes(module)}


def modules_without_tensors(config: PlanConfig, paths: Iterable[str]) -> list[str]:
    """The modules ``config`` names that hold none of ``paths``: a plan file lists them.

    The reader knows a module by the tensors under it; a dropout or an activation, checkpointed or
    given to a pipeline stage, it knows only from this list.

    Examples:
        >>> modules_without_tensors(PlanConfig(checkpointed=("0", "1")), ["0.weight", "2.weight"])
        ['1']
    """
    known = _tensor_modules(paths)
    return list(dict.fromkeys(module for _, module in _named_modules(config) if module not in known))


def config_value_problems(config: PlanConfig) -> list[str]:
    """What in ``config`` names nothing that exists, or counts below one: a line each, by field.

    The one check of a config's values, for a plan read from JSON and for one built by hand alike
    (`apply` and `trace_activations` run it too).

    Examples:
        >>> config_value_problems(PlanConfig(checkpoint_policy="some"))
        ["config.checkpoint_policy: 'some' is not one of ['full', 'selective', 'torchtitan']"]
    """
    from functional_shard.core.sequence import CONTEXT_ENGINES
    from functional_shard.planning.policy.builders import CHECKPOINT_POLICIES, MIXED_PRECISION_DTYPES

    found = []
    if config.fsdp is not None and config.fsdp.kind not in _DATA_PARALLEL:
        found.append(
            f"config.fsdp.kind: {config.fsdp.kind!r} is not one of {list(_DATA_PARALLEL)} "
            '(a plan without data parallelism has "fsdp": null)'
        )
    policy = config.checkpoint_policy
    if policy not in CHECKPOINT_POLICIES:
        found.append(f"config.checkpoint_policy: {policy!r} is not one of {list(CHECKPOINT_POLICIES)}")
    if config.context is not None and config.context.engine not in CONTEXT_ENGINES:
        found.append(
            f"config.context.engine: {config.context.engine!r} is not one of {list(CONTEXT_ENGINES)}"
        )
    for key in ("param_dtype", "reduce_dtype"):
        name = getattr(config, key)
        if name is not None and getattr(torch, name, None) not in MIXED_PRECISION_DTYPES:
            found.append(
                f"config.{key}: {name!r} is not a floating torch dtype layers compute in (e.g. 'bfloat16')"
            )
    if config.pipeline is not None:
        for key in ("microbatches", "stages_per_rank"):
            if getattr(config.pipeline, key) < 1:
                found.append(f"config.pipeline.{key}: {getattr(config.pipeline, key)!r}; a positive count")
    return found + _tp_value_problems(config.tp)


def _tp_value_problems(tp: TpConfig | None) -> list[str]:
    from functional_shard.planning.tp.styles import STYLES

    if tp is None:
        return []
    found = []
    if not tp.axes:
        found.append('config.tp.axes: empty; a plan without tensor parallelism has "tp": null')
    heads = [module for module, style, _ in tp.styles if style == "colwise_gather"]
    if tp.loss_parallel and not heads:  # as the tp builder refuses it (config_builder)
        found.append(
            "config.tp.loss_parallel: true, but no module is a tensor-parallel head (style 'colwise_gather' "
            "in config.tp.styles), so no vocabulary-split logits exist for the loss; set it false"
        )
    for module, style, layout in tp.styles:
        if style not in STYLES or layout not in _LAYOUTS:
            found.append(
                f"config.tp.styles: {module!r} has style {style!r} and layout {layout!r}; "
                f"styles are {list(STYLES)}, layouts {list(_LAYOUTS)}"
            )
    return found


def _pieces_problems(tp: TpConfig | None, mesh: Mesh | None) -> list[str]:
    # each sized packed projection: a packed_colwise module, two or more positive pieces, each
    # split evenly over the tensor-parallel axis
    if tp is None:
        return []
    packed = {entry[0] for entry in tp.styles if entry[1] == "packed_colwise"}
    axes = tp.axes
    size = mesh[axes[0]] if mesh is not None and axes and axes[0] in mesh else 1
    found = []
    for module, pieces in tp.pieces:
        if module not in packed:
            found.append(f"config.tp.pieces: {module!r} is no 'packed_colwise' module of config.tp.styles")
        elif len(pieces) < 2 or any(n < 1 for n in pieces):
            found.append(f"config.tp.pieces: {module!r} has pieces {pieces}; two or more positive sizes")
        elif any(n % size for n in pieces):
            found.append(
                f"config.tp.pieces: {module!r} has pieces {pieces}, which {axes[0]!r} (size {size}) "
                "does not split evenly"
            )
    return found


def _pipeline_problems(pipeline: PipelineConfig | None, mesh: Mesh | None, paths: set[str]) -> list[str]:
    if pipeline is None or mesh is None or pipeline.axis not in mesh:
        return []
    from functional_shard.planning.pipeline.stages import SCHEDULES, stage_finder

    axis, per_rank, pp = pipeline.axis, pipeline.stages_per_rank, pipeline.size(mesh)
    found = []
    if len(pipeline.stages) != pp * per_rank:
        found.append(
            f"config.pipeline.stages: {len(pipeline.stages)} stages, but {axis!r} (size {pp}) × "
            f"{per_rank} stages per rank makes {pp * per_rank}"
        )
    if pipeline.schedule not in SCHEDULES:
        found.append(f"config.pipeline.schedule: {pipeline.schedule!r} is not one of {list(SCHEDULES)}")
    elif pipeline.microbatches >= 1 and per_rank >= 1:
        from functional_shard.planning.pipeline.schedules import (
            check_pipeline,  # the builder's check: what torch's schedule runs
        )

        try:
            check_pipeline(pipeline.schedule, pp, per_rank, pipeline.microbatches)
        except PolicyError as error:
            found.append(f"config: {error}")
    stage_of = stage_finder(pipeline.stages)
    found += [f"tensors[{path!r}]: in no pipeline stage" for path in sorted(paths) if stage_of(path) is None][
        :5
    ]
    return found


def nested_config(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A version-1 config (one flat object of 31 fields) as version 2 writes it: a config per parallelism.

    A parallelism's object is null where the flat config left it off; unknown fields stay, to be refused.

    Examples:
        >>> nested_config({"data_parallel": "ddp", "shard_axes": [], "pipeline_axis": None,
        ...     "microbatches": 1, "checkpointed": []})
        {'checkpointed': [], 'fsdp': {'kind': 'ddp', 'shard_axes': []}, 'pipeline': None}
    """
    nested: dict[str, Any] = {key: value for key, value in flat.items() if key not in _FLAT_FIELDS}
    sections: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key in _FLAT_FIELDS:
            section, name = _FLAT_FIELDS[key]
            sections.setdefault(section, {})[name] = value
    for section, values in sections.items():
        used = {
            "fsdp": values.get("kind", "none") != "none",
            "tp": bool(values.get("axes")),
            "experts": values.get("axis") is not None or bool(values.get("top_k")),
        }.get(section, values.get("axis") is not None)  # pipeline and context: their axis
        nested[section] = values if used else None
    return nested


def _prefixes(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def plan_problems(data: Any) -> list[str]:
    """Everything wrong with ``data`` (a parsed plan file) for `Plan.from_json`, one line each.

    Examples:
        >>> import functional_shard as fs, torch.nn as nn
        >>> good = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp("dp")).to_dict()
        >>> plan_problems(good)
        []
        >>> good["tensors"]["weight"]["sharding"]["storage"] = ["tp", None]
        >>> plan_problems(good)
        ["tensors['weight'].sharding.storage: axis 'tp' is not an axis of Mesh(dp=2)"]
    """
    if not isinstance(data, Mapping):
        return [f"a plan file holds one JSON object, not a {type(data).__name__}"]
    missing = [key for key in ("mesh", "config", "tensors") if key not in data]
    if missing:
        return [f"missing {', '.join(repr(key) for key in missing)}"]
    mesh, found = _mesh_problems(data["mesh"])
    tensors = data["tensors"]
    if not isinstance(tensors, Mapping) or not tensors:
        return [*found, "tensors: must be an object of tensor path -> entry, not empty"]
    for path, entry in tensors.items():
        found += _tensor_problems(path, entry, mesh)
    params = {
        path for path, entry in tensors.items() if isinstance(entry, Mapping) and entry.get("kind") == "param"
    }
    # a tied tensor's other names are paths too (a tied lm_head is styled by its own name)
    names = set(tensors) | {
        name
        for entry in tensors.values()
        if isinstance(entry, Mapping) and isinstance(entry.get("aliases"), list)
        for name in entry["aliases"]
        if isinstance(name, str)
    }
    untensored = data.get("modules_without_tensors", [])
    if not isinstance(untensored, list) or not all(isinstance(module, str) for module in untensored):
        return [*found, "modules_without_tensors: must be a list of module paths"]
    found += _config_problems(data["config"], mesh, names, params, set(untensored))
    return found


def _parsed(source: Any) -> Any:
    """The JSON value of ``source``: text, a path to a file of it, or the parsed value itself."""
    if isinstance(source, os.PathLike):
        try:
            source = pathlib.Path(source).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ShardingError(f"Plan.from_json({str(source)!r}): cannot read the file ({error})") from None
    elif isinstance(source, Mapping):
        return source
    elif not isinstance(source, str):
        raise ShardingError(
            f"Plan.from_json({type(source).__name__}): pass the JSON text (a str), a pathlib.Path to a "
            "plan file, or the parsed dict"
        )
    try:
        return json.loads(source)
    except json.JSONDecodeError as error:
        if _looks_like_path(source):
            raise ShardingError(
                f"not a plan file: Plan.from_json({source!r}) reads a str as the JSON text itself, and "
                f"this one looks like a path; pass Path({source!r}) to read the file, or its text"
            ) from None
        raise ShardingError(f"not a plan file: the JSON is malformed ({error})") from None


def _looks_like_path(text: str) -> bool:
    if not text or "\n" in text or "{" in text or len(text) > 4096:
        return False
    try:
        return text.endswith(".json") or pathlib.Path(text).exists()
    except (OSError, ValueError):  # a name the file system cannot even look up
        return False


def plan_data(source: Any) -> Mapping[str, Any]:
    """The parsed plan file ``source`` (JSON text, a `pathlib.Path`, or the parsed dict), checked.

    Raises:
        ShardingError: not readable, not JSON, not our plan, a newer format, or `plan_problems`.

    Examples:
        >>> plan_data("[1, 2]")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: not a plan file: it holds a JSON list, not an object
    """
    data = _parsed(source)
    if not isinstance(data, Mapping):
        raise ShardingError(f"not a plan file: it holds a JSON {type(data).__name__}, not an object")
    version = data.get("version")
    if (
        data.get("format") != "functional_shard.plan"
        or type(version) is not int
        or version not in (1, FORMAT_VERSION)
    ):
        raise ShardingError(
            f"not a functional_shard plan of format version 1 to {FORMAT_VERSION} "
            f"(format={data.get('format')!r}, version={data.get('version')!r})"
        )
    if version == 1 and isinstance(data.get("config"), Mapping):
        data = {**data, "config": nested_config(data["config"])}
    problems = plan_problems(data)
    if problems:
        raise ShardingError(
            bullets(
                "the plan file does not hold together:", problems[:20], "Write it again with plan.to_json()."
            )
        )
    return data
