"""A plan read from JSON, checked against the format `Plan.to_json` writes. Pure.

Plan files travel between people and jobs: one written by hand, cut short or edited must be
refused with every problem named (the tensor path and the field), never half-read into a
plan that fails later. `plan_problems` walks the parsed data once and lists what is wrong:
types, shapes, dtypes, tensor kinds, the mesh, every spec's axes (known, used once, fitting
the tensor) and the config's fields (their types, the axes and modules they name).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import types
import typing
from collections.abc import Mapping
from typing import Any

import torch

from functional_shard.core.errors import PolicyError, ShardingError, bullets
from functional_shard.core.mesh import Mesh
from functional_shard.core.spec import P, ParamSharding, spec_from_json

from .config import PlanConfig

__all__ = ["FORMAT_VERSION", "plan_data", "plan_problems"]

FORMAT_VERSION = 1

_KINDS = ("param", "buffer")
_SPECS = tuple(field.name for field in dataclasses.fields(ParamSharding))
_CONFIG_TYPES = typing.get_type_hints(PlanConfig)
_CONFIG_AXES = ("replicate_axes", "shard_axes", "tensor_parallel_axes")
_CONFIG_AXIS = ("pipeline_axis", "expert_axis", "context_parallel_axis")
_CONFIG_MODULES = ("units", "checkpointed", "expert_modules")
_DATA_PARALLEL = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
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
    aliases = entry["aliases"]
    if not isinstance(aliases, list) or not all(isinstance(name, str) for name in aliases):
        found.append(f"tensors[{path!r}].aliases: must be a list of paths")
    sharding = entry["sharding"]
    if not isinstance(sharding, Mapping) or set(sharding) != set(_SPECS):
        return [*found, f"tensors[{path!r}].sharding: must hold exactly {', '.join(_SPECS)}"]
    for name in _SPECS:
        found += _spec_problems(f"tensors[{path!r}].sharding.{name}", sharding[name], tuple(shape), mesh)
    return found


def _config_problems(config: Any, mesh: Mesh | None, paths: set[str], params: set[str]) -> list[str]:
    if not isinstance(config, Mapping):
        return ["config: must be an object"]
    found = [f"config.{key}: not a field of a plan's config" for key in config if key not in _CONFIG_TYPES]
    for key, value in config.items():
        if key in _CONFIG_TYPES and not _is(value, _CONFIG_TYPES[key]):
            found.append(f"config.{key}: {value!r} is not a {_CONFIG_TYPES[key]}".replace("typing.", ""))
    if found:
        return found
    found += _config_value_problems(config)
    if mesh is not None:
        named = [axis for key in _CONFIG_AXES for axis in config.get(key, [])]
        named += [config[key] for key in _CONFIG_AXIS if config.get(key) is not None]
        found += [f"config: axis {axis!r} is not an axis of {mesh!r}" for axis in named if axis not in mesh]
    modules = {""} | {path.rpartition(".")[0] for path in paths}
    modules |= {prefix for module in list(modules) for prefix in _prefixes(module)}
    named_modules = [(key, module) for key in _CONFIG_MODULES for module in config.get(key, [])]
    named_modules += [("tp_styles", entry[0]) for entry in config.get("tp_styles", [])]
    found += _pieces_problems(config, mesh)
    named_modules += [("pipeline_stages", m) for stage in config.get("pipeline_stages", []) for m in stage]
    named_modules += [("unit_groups", m) for group in config.get("unit_groups", []) for m in group]
    found += [
        f"config.{key}: {module!r} is no module of the plan's tensors"
        for key, module in named_modules
        if module not in modules
    ]
    return found + _pipeline_problems(config, mesh, params)


def _config_value_problems(config: Mapping[str, Any]) -> list[str]:
    # the config's names the plan's readers look up: each must name what exists
    from functional_shard.core.sequence import CONTEXT_ENGINES
    from functional_shard.planning.policy.builders import CHECKPOINT_POLICIES
    from functional_shard.planning.tp.styles import STYLES

    found = []
    kind = config.get("data_parallel", "none")
    if kind not in _DATA_PARALLEL:
        found.append(f"config.data_parallel: {kind!r} is not one of {list(_DATA_PARALLEL)}")
    policy = config.get("checkpoint_policy", "full")
    if policy not in CHECKPOINT_POLICIES:
        found.append(f"config.checkpoint_policy: {policy!r} is not one of {list(CHECKPOINT_POLICIES)}")
    engine = config.get("context_engine", "auto")
    if engine not in CONTEXT_ENGINES:
        found.append(f"config.context_engine: {engine!r} is not one of {list(CONTEXT_ENGINES)}")
    for key in ("param_dtype", "reduce_dtype"):
        name = config.get(key)
        if name is not None and not isinstance(getattr(torch, name, None), torch.dtype):
            found.append(f"config.{key}: {name!r} is not a torch dtype (e.g. 'bfloat16')")
    for key in ("microbatches", "stages_per_rank"):  # counts, with a pipeline or without
        if config.get(key, 1) < 1:
            found.append(f"config.{key}: {config[key]!r}; a positive count (1 without a pipeline)")
    heads = [module for module, style, _ in config.get("tp_styles", []) if style == "colwise_gather"]
    if config.get("loss_parallel") and not heads:  # as the tp builder refuses it (config_builder)
        found.append(
            "config.loss_parallel: true, but no module is a tensor-parallel head (style 'colwise_gather' "
            "in config.tp_styles), so no vocabulary-split logits exist for the loss; set it false"
        )
    for module, style, layout in config.get("tp_styles", []):
        if style not in STYLES or layout not in _LAYOUTS:
            found.append(
                f"config.tp_styles: {module!r} has style {style!r} and layout {layout!r}; "
                f"styles are {list(STYLES)}, layouts {list(_LAYOUTS)}"
            )
    return found


def _pieces_problems(config: Mapping[str, Any], mesh: Mesh | None) -> list[str]:
    # each sized packed projection: a packed_colwise module, two or more positive pieces, each
    # split evenly over the tensor-parallel axis
    packed = {entry[0] for entry in config.get("tp_styles", []) if entry[1] == "packed_colwise"}
    axes = config.get("tensor_parallel_axes", [])
    size = mesh[axes[0]] if mesh is not None and axes and axes[0] in mesh else 1
    found = []
    for module, pieces in config.get("tp_pieces", []):
        if module not in packed:
            found.append(f"config.tp_pieces: {module!r} is no 'packed_colwise' module of config.tp_styles")
        elif len(pieces) < 2 or any(n < 1 for n in pieces):
            found.append(f"config.tp_pieces: {module!r} has pieces {pieces}; two or more positive sizes")
        elif any(n % size for n in pieces):
            found.append(
                f"config.tp_pieces: {module!r} has pieces {pieces}, which {axes[0]!r} (size {size}) "
                "does not split evenly"
            )
    return found


def _pipeline_problems(config: Mapping[str, Any], mesh: Mesh | None, paths: set[str]) -> list[str]:
    axis = config.get("pipeline_axis")
    if axis is None or mesh is None or axis not in mesh:
        return []
    from functional_shard.planning.pipeline.stages import SCHEDULES, stage_finder

    stages = tuple(tuple(stage) for stage in config.get("pipeline_stages", []))
    per_rank = config.get("stages_per_rank", 1)
    found = []
    if len(stages) != mesh[axis] * per_rank:
        found.append(
            f"config.pipeline_stages: {len(stages)} stages, but {axis!r} (size {mesh[axis]}) × "
            f"{per_rank} stages per rank makes {mesh[axis] * per_rank}"
        )
    if config.get("pipeline_schedule", "1f1b") not in SCHEDULES:
        found.append(
            f"config.pipeline_schedule: {config.get('pipeline_schedule')!r} is not one of {list(SCHEDULES)}"
        )
    schedule, microbatches = config.get("pipeline_schedule", "1f1b"), config.get("microbatches", 1)
    if schedule in SCHEDULES and microbatches >= 1 and per_rank >= 1:
        from functional_shard.planning.pipeline.schedules import (
            check_pipeline,  # the builder's check: what torch's schedule runs
        )

        try:
            check_pipeline(schedule, mesh[axis], per_rank, microbatches)
        except PolicyError as error:
            found.append(f"config: {error}")
    stage_of = stage_finder(stages)
    found += [f"tensors[{path!r}]: in no pipeline stage" for path in sorted(paths) if stage_of(path) is None][
        :5
    ]
    return found


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
    found += _config_problems(data["config"], mesh, names, params)
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
        ShardingError: not readable, not JSON, not a functional_shard plan, a newer
            format, or a plan that does not hold together (`plan_problems`: every problem
            named, by tensor path and field).

    Examples:
        >>> plan_data("[1, 2]")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: not a plan file: it holds a JSON list, not an object
    """
    data = _parsed(source)
    if not isinstance(data, Mapping):
        raise ShardingError(f"not a plan file: it holds a JSON {type(data).__name__}, not an object")
    if data.get("format") != "functional_shard.plan" or data.get("version") != FORMAT_VERSION:
        raise ShardingError(
            f"not a functional_shard plan of format version {FORMAT_VERSION} "
            f"(format={data.get('format')!r}, version={data.get('version')!r})"
        )
    problems = plan_problems(data)
    if problems:
        raise ShardingError(
            bullets(
                "the plan file does not hold together:", problems[:20], "Write it again with plan.to_json()."
            )
        )
    return data
