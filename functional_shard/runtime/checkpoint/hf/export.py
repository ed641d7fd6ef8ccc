"""Out to the ecosystem: a parallelized model, or a saved checkpoint, as a Hugging Face folder.

`export_hf` runs on every rank under any plan: tensors are gathered one by one, in the same
order everywhere, and the files are spread over the ranks, so no rank ever holds the whole
model. `convert_to_hf` does the same offline, in one process, from a checkpoint of `save` (or
of the Lightning adapters), one file's tensors at a time. Both write aside and rename.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from functional_shard.core.errors import ShardingError
from functional_shard.core.validate import entry_point, instance_of, positive_int
from functional_shard.core.validate import path as check_path
from functional_shard.runtime.checkpoint.integrity import (
    META_FIX,
    Described,
    agreed,
    aside,
    distributed,
    every_rank,
    index_tensors,
    meta_problems,
    put_in_place,
    raise_problems,
)
from functional_shard.runtime.checkpoint.read import checked_file, checked_folder, refusals_raised
from functional_shard.runtime.checkpoint.safety import SafeLoadPlanner, SafeReader
from functional_shard.runtime.engines.packed_pieces import piece_major, unequal_packed

from .folder import (
    SAVE_PRETRAINED_SHARD_BYTES,
    Expected,
    ShardFile,
    expected_tensors,
    fit_problems,
    hf_config,
    shard_files,
    target_problems,
    tie_problems,
    write_config,
    write_index,
    write_shard,
)
from .names import Mapping_, checked_mapping, name_map, piece_of_whole, reverse_map

__all__ = ["HfConversion", "convert_to_hf", "export_hf"]

_FIX = (
    "Pass the config the model was built from (its class, sizes, layer count and "
    "tie_word_embeddings), and a path that is new, empty, or an earlier export"
)
_MODULE_KEYS = ("model", "state_dict")  # save's and Fabric's module; the Trainer's LightningModule


def _barrier() -> None:
    if distributed():
        dist.barrier()


def _whole(value: torch.Tensor, *, kept: bool) -> torch.Tensor | None:
    """The whole tensor if ``kept`` (else None), on the CPU; a collective for a DTensor."""
    from torch.distributed.tensor import DTensor

    # full_tensor is a collective over the tensor's own mesh: every rank holding it calls it,
    # the writer of its file or not
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().to("cpu").contiguous() if kept else None


def _local(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _sizes(shapes: dict[str, Described], expected: Expected) -> dict[str, tuple[int, int]]:
    # bytes and elements of each tensor written, in the order of the config's model class
    elements = {key: torch.Size(shapes[key][0]).numel() for key in expected.shapes}
    return {key: (count * shapes[key][1].itemsize, count) for key, count in elements.items()}


def _dtype(shapes: dict[str, Described]) -> torch.dtype:
    # save_pretrained's config.dtype: the model's (its first floating tensor's)
    return next((dtype for _, dtype in shapes.values() if dtype.is_floating_point), torch.float32)


@entry_point
def export_hf(
    path: str | os.PathLike[str],
    model: nn.Module,
    config: Any = None,
    *,
    max_shard_bytes: int | None = None,
    mapping: Mapping_ | None = None,
) -> Path:
    """Write the model as a Hugging Face folder, called on every rank under any plan.

    The folder is what ``save_pretrained`` writes (``config.json`` and safetensors files, tied
    weights once), so ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads it. No
    rank holds the whole model; everything is checked before anything is written.

    Args:
        path: the folder to write (replaced if it is an earlier export or empty).
        model: the module `apply` parallelized, under any plan.
        config: a ``PretrainedConfig``, a dict, or a config.json path; None takes ``model.config``.
        max_shard_bytes: the largest file (save_pretrained's 50 GB by default).
        mapping: the name map `load_hf` would read the folder with, run the other way.

    Returns:
        The folder written.

    Raises:
        ShardingError: no config; a config whose model does not match this one (names, shapes,
            ties); a path that is not an earlier export; ``mapping`` not a dict, function or None. On
            every rank, before anything is written.

    Examples:
        >>> # fs.checkpoint.export_hf("out/llama-hf", model)    # on every rank, after training
        >>> # transformers.AutoModelForCausalLM.from_pretrained("out/llama-hf")
    """
    path = check_path(path, "path")
    instance_of(model, nn.Module, "model", meaning="the model fs.apply parallelized")
    if max_shard_bytes is not None:
        positive_int(max_shard_bytes, "max_shard_bytes", meaning="bytes per file, or None for one file")
    checked_mapping(mapping)
    hf = hf_config(config, model)
    expected = expected_tensors(hf, model)
    # this rank's shards, keyed as the model names them
    state = {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
    orders = unequal_packed(model)
    ours, holders = _every_ranks_tensors({k: (tuple(v.shape), v.dtype) for k, v in state.items()})
    if mapping is None:
        sources: dict[str, tuple[str, Any]] = {key: (key, None) for key in ours}
        problems = tie_problems({k: _local(v) for k, v in state.items()}, expected)
    else:
        sources, problems = _mapped(mapping, model, set(ours), expected, hf)
    shapes = {key: _cut_shape(ours[our], cut) for key, (our, cut) in sources.items() if our in ours}
    empty = meta_problems(model)
    problems = (
        target_problems(path)
        + empty
        + fit_problems({k: s for k, (s, _) in shapes.items()}, expected)
        + problems
    )
    fix = META_FIX if empty else _FIX
    raise_problems(agreed(problems), f"fs.checkpoint.export_hf wrote nothing to {path}", fix)
    sizes = _sizes(shapes, expected)
    files = shard_files(
        [(key, size, holders[sources[key][0]]) for key, (size, _) in sizes.items()],
        shard_bytes=max_shard_bytes or SAVE_PRETRAINED_SHARD_BYTES,
        writers=dist.get_world_size() if distributed() else 1,
    )
    temporary = aside(path)
    me = dist.get_rank() if distributed() else 0
    for file in files:
        kept = {}
        gathered: tuple[str, torch.Tensor | None] | None = None  # a model tensor several keys cut
        for key in file.keys:
            our, cut = sources[key]
            if our not in state:
                continue
            if gathered is None or gathered[0] != our:
                whole = _whole(state[our], kept=file.writer == me)
                if whole is not None and our in orders:  # gathered in the ranks' order
                    whole = piece_major(whole, *orders[our])
                gathered = (our, whole)
            if gathered[1] is not None:
                kept[key] = gathered[1] if cut is None else cut(gathered[1])
        if file.writer == me:
            temporary.mkdir(parents=True, exist_ok=True)
            write_shard(temporary, file.name, kept)
    _barrier()
    if me == 0:
        generation = getattr(model, "generation_config", None)
        _finish(
            temporary,
            path,
            files,
            sizes,
            config=hf,
            expected=expected,
            dtype=_dtype(shapes),
            generation=generation if mapping is None else None,
        )
    _barrier()
    return path


def _mapped(
    mapping: Mapping_, model: nn.Module, ours: set[str], expected: Expected, hf: Any
) -> tuple[dict[str, tuple[str, Any]], list[str]]:
    """Each of the config's tensors: the model tensor it is cut from, and how; what cannot be cut."""
    resolve = name_map(mapping, model, ours)
    keys = [*expected.shapes, *expected.tied]
    filled = reverse_map(resolve, keys)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    sources: dict[str, tuple[str, Any]] = {}
    problems = []
    for our, pieces in filled.items():
        if our not in ours:
            problems += [f"{key}: the map names {our}, which the model lacks" for key, _ in pieces]
            continue
        written = [(key, piece) for key, piece in pieces if key in expected.shapes]
        groups = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        cuts = piece_of_whole(written, expected.shapes, head_dim, groups)
        sources.update({key: (our, cuts[key]) for key, _ in written})
    for name, kept in expected.tied.items():
        apart = [resolve(n) for n in (name, kept)]
        if all(isinstance(t, str) and t in ours for t in apart) and apart[0] != apart[1]:
            problems.append(
                f"{name}: the config ties it to {kept} (tie_word_embeddings), but the model holds "
                f"{apart[0]} and {apart[1]} apart. Pass a config that does not tie them"
            )
    return sources, problems


def _cut_shape(described: Described, cut: Any) -> Described:
    # the shape a cut gives, found on the meta device (no memory)
    shape, dtype = described
    if cut is None:
        return shape, dtype
    return tuple(cut(torch.empty(shape, dtype=dtype, device="meta")).shape), dtype


def _every_ranks_tensors(
    listing: dict[str, Described],
) -> tuple[dict[str, Described], dict[str, frozenset[int]]]:
    # every rank's tensors (a pipeline rank holds its stages' only): shapes, and who holds each
    shapes: dict[str, Described] = {}
    holders: dict[str, set[int]] = {}
    for rank, held in enumerate(every_rank(listing)):
        shapes.update(held)
        for key in held:
            holders.setdefault(key, set()).add(rank)
    return shapes, {key: frozenset(ranks) for key, ranks in holders.items()}


def _finish(
    temporary: Path,
    path: Path,
    files: list[ShardFile],
    sizes: dict[str, tuple[int, int]],
    *,
    config: Any,
    expected: Expected,
    dtype: torch.dtype,
    generation: Any,
) -> None:
    # the config and the index beside the weights, then the folder into place
    temporary.mkdir(parents=True, exist_ok=True)
    write_config(temporary, config, expected.architecture, dtype, generation)
    write_index(temporary, files, sizes)
    put_in_place(temporary, path)


@dataclass(frozen=True)
class HfConversion:
    """What `convert_to_hf` wrote, and the prefix it stripped from the checkpoint's keys."""

    path: Path
    prefix: str
    left_out: tuple[str, ...]  # keys of the checkpoint's module outside the prefix


@dataclass(frozen=True)
class _Checkpoint:
    """A checkpoint's module state, read as data: its key and its tensors' shapes by name.

    A full file's contents are at hand (``saved``); a folder's tensors load when asked for.
    """

    source: Path
    trust: bool
    key: str
    shapes: dict[str, Described]
    saved: dict[str, Any] | None

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors of the module state, whole, loading only those from a folder."""
        if self.saved is not None:
            return {name: self.saved[self.key][name] for name in names}
        wanted = {name: torch.empty(self.shapes[name][0], dtype=self.shapes[name][1]) for name in names}
        with refusals_raised(self.source):
            dcp.load(
                {self.key: wanted},
                storage_reader=SafeReader(self.source, trust=self.trust),
                planner=SafeLoadPlanner(where=self.source, trust=self.trust, allow_partial_load=True),
                no_dist=True,
            )
        return wanted


def _checkpoint(source: Path, *, trust: bool) -> _Checkpoint:
    # checked as a load checks it: digests first, then the index or the file through the allowlist
    saved = None
    if source.is_dir():
        checked_folder(source, trust=trust, alone=True)
        stored = index_tensors(SafeReader(source, trust=trust).read_metadata())
    else:
        saved = checked_file(source, trust=trust, alone=True)
        stored = {
            f"{top}.{k}": (tuple(v.shape), v.dtype)
            for top, states in saved.items()
            if isinstance(states, dict)
            for k, v in states.items()
            if torch.is_tensor(v)
        }
    tops = {name.partition(".")[0] for name in stored}
    key = next((key for key in _MODULE_KEYS if key in tops), "")
    if not key:
        raise ShardingError(
            f"the checkpoint at {source} holds no module state under {' or '.join(_MODULE_KEYS)} "
            f"(it holds {sorted(tops)}): it is not a checkpoint of fs.checkpoint.save or of the "
            "Lightning adapters"
        )
    start = len(key) + 1
    shapes = {name[start:]: described for name, described in stored.items() if name[:start] == f"{key}."}
    return _Checkpoint(source, trust, key, shapes, saved)


def _prefix(names: list[str], expected: Expected, given: str | None) -> str:
    # the LightningModule's attribute ("model.") before the model's own names: given, or the
    # one prefix (none, or a first name shared by keys) under which every expected key is found
    if given is not None:
        return given if not given or given.endswith(".") else given + "."
    candidates = ["", *sorted({name.partition(".")[0] + "." for name in names if "." in name})]
    known = set(names)
    fits = [p for p in candidates if all(p + key in known for key in expected.shapes)]
    return fits[0] if fits else ""


@entry_point
def convert_to_hf(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    config: Any,
    *,
    prefix: str | None = None,
    trust: bool = False,
) -> HfConversion:
    """Write a saved checkpoint, of any plan, as a Hugging Face folder; offline, one process.

    The checkpoint is `save`'s or the Lightning adapters' (a Trainer's keys carry the
    LightningModule's prefix, such as ``model.``), checked and read as `load` reads it. The
    folder written is `export_hf`'s.

    Args:
        source: the checkpoint folder or file.
        target: the folder to write (replaced if it is an earlier export or empty).
        config: the model's config (a ``PretrainedConfig``, a dict, or a config.json path).
        prefix: what to strip from the checkpoint's keys; None finds the one under which every tensor is.
        trust: rebuild any object the checkpoint names, running its code (your own files only).

    Returns:
        The folder, the prefix stripped and the keys left out (those outside the prefix).

    Raises:
        ShardingError: no checkpoint at ``source``, or one damaged or holding code; no or a
            mismatched ``config``; a ``target`` that is not an earlier export; ``trust`` not a
            bool. Nothing is written then.

    Examples:
        >>> # fs.checkpoint.convert_to_hf("ckpt", "llama-hf", "config.json").prefix
    """
    # a str ("no", "false" from a config file) is truthy: it would rebuild the objects a file names
    instance_of(
        trust, bool, "trust", meaning="True rebuilds any object the checkpoint names, running its code"
    )
    source, target = Path(source), Path(target)
    if config is None:
        raise ShardingError(
            "config: a checkpoint holds tensors, not the model's config: pass the config.json the "
            "model was built from (--config)"
        )
    if not source.exists():
        raise ShardingError(f"no checkpoint at {source}")
    hf = hf_config(config, None)
    expected = expected_tensors(hf)
    checkpoint = _checkpoint(source, trust=trust)
    names = list(checkpoint.shapes)
    stripped = _prefix(names, expected, prefix)
    held = {name[len(stripped) :]: checkpoint.shapes[name] for name in names if name.startswith(stripped)}
    problems = target_problems(target) + fit_problems(
        {k: s for k, (s, _) in held.items()}, expected, holder="the checkpoint"
    )
    header = f"nothing converted from {source} (its keys without {stripped!r}) to {target}"
    raise_problems(problems, header, f"{_FIX}; --prefix says what to strip from the keys")
    ties = [pair for pair in expected.tied.items() if all(name in held for name in pair)]
    pairs = checkpoint.tensors([stripped + name for pair in ties for name in pair])
    raise_problems(tie_problems({k[len(stripped) :]: v for k, v in pairs.items()}, expected), header, _FIX)
    sizes = _sizes(held, expected)
    files = shard_files(
        [(key, size, frozenset({0})) for key, (size, _) in sizes.items()],
        shard_bytes=SAVE_PRETRAINED_SHARD_BYTES,
        writers=1,
    )
    temporary = aside(target, alone=True)
    temporary.mkdir(parents=True)
    for file in files:
        loaded = checkpoint.tensors([stripped + key for key in file.keys])
        write_shard(temporary, file.name, {key: loaded[stripped + key].contiguous() for key in file.keys})
    _finish(
        temporary, target, files, sizes, config=hf, expected=expected, dtype=_dtype(held), generation=None
    )
    left_out = tuple(name for name in names if not name.startswith(stripped))
    return HfConversion(target, stripped, left_out)
