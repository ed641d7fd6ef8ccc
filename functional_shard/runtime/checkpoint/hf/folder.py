"""A Hugging Face model folder, as ``save_pretrained`` writes it: what it must hold, and its files.

No process group here (`export_hf` gathers and decides who writes what): the tensors the
config's model class holds, their cut into shard files, and the writing of ``config.json``,
the safetensors files and their index. transformers and safetensors are imported when used.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import path as check_path
from functional_shard.runtime.checkpoint.integrity import blocked_problems, key_differences

__all__ = [
    "CONFIG",
    "INDEX",
    "SINGLE",
    "Expected",
    "ShardFile",
    "expected_tensors",
    "fit_problems",
    "hf_config",
    "shard_files",
    "target_problems",
    "tie_problems",
    "write_config",
    "write_index",
    "write_shard",
]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SAVE_PRETRAINED_SHARD_BYTES = 50 * 10**9  # save_pretrained's max_shard_size default ("50GB")
_EXPORT_FILES = (CONFIG, INDEX, "generation_config.json")


@dataclass(frozen=True)
class Expected:
    """What the config's model class holds: its class name, each exported tensor's shape, the ties.

    ``tied`` maps each name left out (``lm_head.weight``) to the name written for it
    (``model.embed_tokens.weight``), as ``save_pretrained`` leaves tied weights out.
    """

    architecture: str
    shapes: Mapping[str, tuple[int, ...]]
    tied: Mapping[str, str]


@dataclass(frozen=True)
class ShardFile:
    """One safetensors file: its name, its tensors (in order), and the rank that writes it."""

    name: str
    keys: tuple[str, ...]
    writer: int


def _config_from_dict(values: Mapping[str, Any], where: str) -> Any:
    import transformers

    model_type = values.get("model_type")
    if not isinstance(model_type, str):
        raise ShardingError(
            f"{where} names no model_type: a Hugging Face config.json says which model it "
            'configures ("model_type": "llama"). Pass the config.json save_pretrained wrote'
        )
    try:
        config_class = type(transformers.AutoConfig.for_model(model_type))
    except ValueError:
        raise ShardingError(
            f"{where}: model_type {model_type!r} is not one transformers "
            f"{transformers.__version__} knows; models with their own code are not exported"
        ) from None
    return config_class.from_dict(dict(values))


def hf_config(config: Any, model: nn.Module | None) -> Any:
    """``config`` as a ``PretrainedConfig`` (a copy): given as one, a dict or a config.json path.

    None takes the model's own (``model.config``, a Hugging Face model's).

    Raises:
        ShardingError: no config given and the model carries none; a path with no
            readable config.json; a dict or file that names no model type transformers knows.
    """
    import transformers

    if config is None:
        config = getattr(model, "config", None)
        if not isinstance(config, transformers.PretrainedConfig):
            kind = type(model).__name__
            raise ShardingError(
                f"config: the model ({kind}) carries no Hugging Face config (model.config), so the "
                "folder's config.json is unknown. Pass config= (a transformers PretrainedConfig, a "
                "dict, or the path of a config.json) describing the model"
            )
    if isinstance(config, transformers.PretrainedConfig):
        return copy.deepcopy(config)
    if isinstance(config, Mapping):
        return _config_from_dict(config, "config (a dict)")
    if isinstance(config, str | os.PathLike):
        path = check_path(config, "config")  # '' would be the folder here, and its config.json read
        path = path / CONFIG if path.is_dir() else path
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ShardingError(
                f"config: cannot read a config.json at {path} ({type(error).__name__}: {error}). "
                "Pass the path of the config.json save_pretrained wrote, or of its folder"
            ) from None
        if not isinstance(values, dict):
            raise ShardingError(f"config: {path} holds a JSON {type(values).__name__}, not an object")
        return _config_from_dict(values, f"config {path}")
    raise ShardingError(
        f"config: a {type(config).__name__}; pass a transformers PretrainedConfig, a dict, "
        "or the path of a config.json"
    )


def _model_class(config: Any, model: nn.Module | None) -> Any:
    # the model's own Hugging Face class, else the one config.architectures names, else
    # transformers' causal language model for the config (a builder: from_config)
    import transformers

    for kind in type(model).__mro__ if model is not None else ():
        # apply swaps the class (FSDPLlamaForCausalLM): the Hugging Face class is further up
        if issubclass(kind, transformers.PreTrainedModel) and kind.__module__.startswith("transformers"):
            return kind
    names = getattr(config, "architectures", None) or []
    if not names:
        return transformers.AutoModelForCausalLM.from_config
    found = getattr(transformers, names[0], None)
    if isinstance(found, type) and issubclass(found, transformers.PreTrainedModel):
        return found
    raise ShardingError(
        f"config: architectures names {names[0]!r}, which transformers {transformers.__version__} "
        "does not have; set config.architectures to the model's class name (e.g. ['LlamaForCausalLM'])"
    )


def expected_tensors(config: Any, model: nn.Module | None = None) -> Expected:
    """The tensors the config's model class holds, built on the meta device (no memory).

    The class is the model's own Hugging Face class, else the one ``config.architectures``
    names, else the config's causal language model.

    Raises:
        ShardingError: the config names a class transformers lacks, or cannot build it.
    """
    import transformers

    build = _model_class(config, model)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            built = build(copy.deepcopy(config))
    except (ValueError, TypeError, AttributeError, KeyError, RuntimeError) as error:
        raise ShardingError(
            f"config: transformers cannot build its model ({type(error).__name__}: {str(error)[:200]}); "
            "pass the config the model was built from, naming its class in config.architectures"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    targets = set(getattr(built, "all_tied_weights_keys", {}) or {})
    names: dict[int, list[str]] = {}
    for name, param in built.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    tied = {}
    for group in (group for group in names.values() if len(group) > 1):
        # save_pretrained keeps the name the tie does not point from (the embedding's)
        kept = next((name for name in group if name not in targets), group[0])
        tied.update({name: kept for name in group if name != kept})
    shapes = {k: tuple(v.shape) for k, v in built.state_dict().items() if k not in tied}
    return Expected(type(built).__name__, shapes, tied)


def fit_problems(
    held: Mapping[str, tuple[int, ...]], expected: Expected, *, holder: str = "the model"
) -> list[str]:
    """The tensors ``holder`` holds (by key, their whole shapes) that the config's class would not load."""
    known = {*expected.shapes, *expected.tied}  # a tied name is written once, under the other
    missing, unexpected, differing = key_differences(held, expected.shapes, known=known)
    problems = [f"{key}: missing from {holder}" for key in missing]
    problems += [f"{key}: in {holder}, not in {expected.architecture}" for key in unexpected]
    problems += [
        f"{key}: shape {list(held[key])} in {holder}, {list(expected.shapes[key])} for the config"
        for key in differing
    ]
    return problems


def tie_problems(values: Mapping[str, torch.Tensor], expected: Expected) -> list[str]:
    """Ties of the config that the model's values break: only one of the two is written.

    ``values`` may be one rank's shards: two tied names hold the same shard on every rank.
    """
    return [
        f"{name}: the config ties it to {kept} (tie_word_embeddings), so only {kept} would be "
        "written, but the model holds other values in it. Pass a config that does not tie them"
        for name, kept in expected.tied.items()
        if name in values and kept in values and not torch.equal(values[name], values[kept])
    ]


def shard_files(
    sizes: Sequence[tuple[str, int, frozenset[int]]], *, shard_bytes: int, writers: int
) -> list[ShardFile]:
    """Cut ``(key, bytes, holders)`` into files of about ``shard_bytes``, one writer each.

    A file takes consecutive tensors that the same ranks hold (under a pipeline plan, a
    stage's), so its writer, the holder with the fewest bytes so far, can gather them all.
    ``writers`` (the ranks) spread the work: files are cut at most at total / writers.

    Examples:
        >>> [f.keys for f in shard_files([("a", 4, frozenset({0, 1})), ("b", 4, frozenset({0, 1}))],
        ...                                shard_bytes=100, writers=2)]
        [('a',), ('b',)]
    """
    total = sum(size for _, size, _ in sizes)
    limit = max(1, min(shard_bytes, -(-total // max(1, writers))))
    groups: list[list[tuple[str, int, frozenset[int]]]] = []
    filled = 0  # bytes in the last group
    for entry in sizes:
        if not groups or groups[-1][0][2] != entry[2] or filled + entry[1] > limit:
            groups.append([entry])
            filled = entry[1]
        else:
            groups[-1].append(entry)
            filled += entry[1]
    assigned: dict[int, int] = {}
    files = []
    for number, group in enumerate(groups, 1):
        writer = min(sorted(group[0][2]), key=lambda rank: assigned.get(rank, 0))
        assigned[writer] = assigned.get(writer, 0) + sum(size for _, size, _ in group)
        name = SINGLE if len(groups) == 1 else f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        files.append(ShardFile(name, tuple(key for key, _, _ in group), writer))
    return files


def is_earlier_export(path: Path) -> bool:
    """A folder holding only what an export writes: config.json and safetensors weights."""
    if not path.is_dir():
        return False
    names = {entry.name for entry in path.iterdir()}
    weights = {name for name in names if name.startswith("model") and name.endswith(".safetensors")}
    return CONFIG in names and bool(weights) and names <= weights | set(_EXPORT_FILES)


def target_problems(path: Path) -> list[str]:
    """Why an export may not replace ``path``: something else is there, or a file or checkpoint around it."""
    blocked = blocked_problems(path)
    if blocked:
        return [f"path: {blocked[0]}. Choose another path"]
    if not path.exists() or is_earlier_export(path) or (path.is_dir() and not any(path.iterdir())):
        return []
    what = "a file" if not path.is_dir() else "a folder that is not a Hugging Face export"
    return [
        f"path: {path} exists and is {what}; an export replaces only an earlier export (config.json "
        "and safetensors weights) or an empty folder. Choose another path, or move it away"
    ]


def write_shard(folder: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file, with the metadata save_pretrained gives it."""
    from safetensors.torch import save_file

    save_file(tensors, str(folder / name), metadata={"format": "pt"})


def write_index(folder: Path, files: Sequence[ShardFile], sizes: Mapping[str, tuple[int, int]]) -> None:
    """``model.safetensors.index.json`` for more than one file; ``sizes``: key -> (bytes, elements)."""
    if len(files) < 2:
        return
    index = {
        "metadata": {
            "total_parameters": sum(elements for _, elements in sizes.values()),
            "total_size": sum(size for size, _ in sizes.values()),
        },
        "weight_map": {key: file.name for file in files for key in file.keys},
    }
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_config(folder: Path, config: Any, architecture: str, dtype: torch.dtype, generation: Any) -> None:
    """``config.json``, naming the model's class and dtype as save_pretrained does.

    ``generation``: the model's ``GenerationConfig``, written beside if it has one.
    """
    config = copy.deepcopy(config)
    config.architectures = [architecture]
    config.dtype = str(dtype).removeprefix("torch.")
    config.to_json_file(str(folder / CONFIG), use_diff=True)
    if generation is not None:
        generation.save_pretrained(str(folder))
