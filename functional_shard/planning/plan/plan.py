"""`Plan`: the mesh, a `ParamSharding` per tensor, FSDP units and options. Pure data."""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import functional_shard as fs
from functional_shard.core import pytree as _pytree
from functional_shard.core.errors import PolicyError, ShardingError
from functional_shard.core.layout import flattened_local_shape_and_offset, local_numel, local_shape_and_offset
from functional_shard.core.mesh import Mesh
from functional_shard.core.spec import P, ParamSharding
from functional_shard.core.tree import TensorSpec, owner_paths
from functional_shard.core.units import format_bytes as _bytes

from .config import Change, PlanConfig, first_rank, group_name
from .cost_record import Cost, OptimizerKind
from .explain import context_parallel_line, packed_lines, units_section, where_at_rest
from .json_format import FORMAT_VERSION, modules_without_tensors

__all__ = ["Change", "Plan", "PlanConfig"]

_SPECS = tuple(f.name for f in fields(ParamSharding))  # storage, compute, grad, optim: the table's columns


@functools.lru_cache(maxsize=64)
def _unit_set(units: tuple[str, ...], groups: tuple[tuple[str, ...], ...]) -> Mapping[str, str]:
    # Plan.unit_of runs per parameter in the cost model and the search: one map per plan's
    # units, module path -> the unit it makes (itself, or its group)
    return {**{unit: unit for unit in units}, **{m: group_name(g) for g in groups for m in g}}


@_pytree.dataclass
class Plan:
    """A sharding plan: pure data, made by `shard`, run by `apply`.

    Its pytree leaves (namespace ``functional_shard``) are each tensor's `ParamSharding`.

    Examples:
        >>> import torch.nn as nn, functional_shard as fs
        >>> plan = fs.shard(nn.Linear(8, 4), fs.Mesh(dp=2), fs.fsdp("dp"))
        >>> plan.params["weight"].storage, plan.local_shape("weight", rank=1)
        (P('dp', None), (2, 8))
        >>> fs.Plan.from_json(plan.to_json()) == plan
        True
    """

    params: dict[str, ParamSharding]
    buffers: dict[str, ParamSharding]
    mesh: Mesh = _pytree.static_field()
    tensors: dict[str, TensorSpec] = _pytree.static_field()
    aliases: dict[str, tuple[str, ...]] = _pytree.static_field()
    config: PlanConfig = _pytree.static_field()

    # ---- lookups -------------------------------------------------------------------
    def sharding(self, path: str) -> ParamSharding:
        """The sharding of a parameter or buffer, by any of its names.

        Raises:
            ShardingError: no tensor has that path.
        """
        canonical = self.canonical(path)
        if canonical in self.params:
            return self.params[canonical]
        return self.buffers[canonical]

    def canonical(self, path: str) -> str:
        """The plan's name for a tensor reached under ``path`` (tied weights have several).

        Raises:
            ShardingError: no tensor has that path.
        """
        if path in self.tensors:
            return path
        for canonical, names in self.aliases.items():
            if path in names:
                return canonical
        # a module's tensors (lm_head for lm_head.weight), or tensors of the same name elsewhere
        close = [
            p
            for p in self.tensors
            if p.startswith(f"{path}.") or p.rpartition(".")[2] == path.rpartition(".")[2]
        ][:3]
        raise ShardingError(
            f"the plan has no tensor {path!r}" + (f"; did you mean {close}?" if close else "")
        )

    def local_shape(self, path: str, rank: int, spec: str = "storage") -> tuple[int, ...]:
        """``rank``'s local shape of a tensor under one of its four specs (default: at rest).

        Follows torch.chunk, as DTensor reports it; FSDP2's padding is not included.
        """
        return self.local_shape_and_offset(path, rank, spec)[0]

    def local_shape_and_offset(
        self, path: str, rank: int, spec: str = "storage"
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``rank``'s local shape and global offset of a tensor under one of its specs.

        Raises:
            ShardingError: no tensor has that path, or ``spec`` is not one of its specs.
            MeshError: ``rank`` is not a place on the plan's mesh.
        """
        canonical = self.canonical(path)
        specs = self.sharding(canonical).specs()
        if spec not in specs:
            raise ShardingError(f"{path}: spec={spec!r} is not one of {', '.join(map(repr, specs))}")
        chosen = specs[spec]
        if not isinstance(chosen, P):
            raise ShardingError(f"{path}: the {spec} spec {chosen!r} keeps whole tensors on owner ranks")
        shape, fsdp_axes = self.tensors[canonical].shape, self.config.shard_axes
        return flattened_local_shape_and_offset(shape, chosen, self.mesh, rank, fsdp_axes)

    def padded_axes(self, path: str) -> frozenset[str]:
        """The axes over which FSDP2 pads this tensor (split at rest, not for compute)."""
        return self.sharding(path).at_rest_axes

    def data_parallel_rank(self, rank: int) -> tuple[int, int]:
        """Which slice of the global batch ``rank`` reads: (index, number of slices).

        Ranks differing only along model axes or the cp axis read the same slice.

        Examples:
            >>> import torch.nn as nn, functional_shard as fs
            >>> policy = fs.fsdp("dp") + fs.tp([("*", "colwise")], "tp")
            >>> plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2, tp=2), policy)
            >>> [plan.data_parallel_rank(r) for r in range(4)]
            [(0, 2), (0, 2), (1, 2), (1, 2)]
        """
        coords = self.mesh.coords(rank)
        index, count = 0, 1
        for axis in self.config.batch_axes:
            index = index * self.mesh[axis] + coords[axis]
            count *= self.mesh[axis]
        return index, count

    def unit_of(self, path: str) -> str:
        """The FSDP unit (module path, "" for the root) that gathers this parameter.

        A tied parameter: the innermost unit holding all its names; a group's unit is named ``"norm+output"``.
        """
        canonical = self.canonical(path)
        names = self.aliases.get(canonical, (canonical,))
        fsdp = self.config.fsdp
        units = _unit_set(fsdp.units, fsdp.unit_groups) if fsdp is not None else {}
        for module in owner_paths(names[0]):
            unit = units.get(module)
            if unit is not None and all(module == "" or name.startswith(module + ".") for name in names):
                return unit
        return ""

    def stage_of(self, path: str) -> int:
        """The pipeline stage that holds a parameter or buffer (0 for a plan without pp).

        Any of a tied parameter's names will do; ``plan.sharding(path).on`` gives the pp coordinate.

        Raises:
            ShardingError: no tensor has that path.
            PolicyError: a tensor in no stage (a buffer every stage keeps).

        Examples:
            >>> import functional_shard as fs
            >>> from functional_shard import zoo
            >>> plan = fs.shard(zoo.llama("tiny"), fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2))
            >>> plan.stage_of("embed_tokens.weight"), plan.stage_of("lm_head.weight")
            (0, 1)
        """
        from functional_shard.planning.pipeline.stages import stage_finder

        pipeline = self.config.pipeline
        if pipeline is None:
            return 0
        self.canonical(path)  # raises for a path that is no tensor of the plan
        stage = stage_finder(pipeline.stages)(path)
        if stage is None:
            raise PolicyError(f"parameter {path!r} is in no pipeline stage")
        return stage

    def ranks_of_stage(self, stage: int) -> tuple[int, ...]:
        """The global ranks that hold and run pipeline ``stage`` (every rank without pp).

        Raises:
            PolicyError: no such stage.

        Examples:
            >>> import functional_shard as fs
            >>> from functional_shard import zoo
            >>> policy = fs.pipeline("pp", microbatches=4, schedule="zbv", stages_per_rank=2) + fs.fsdp("dp")
            >>> plan = fs.shard(zoo.llama("tiny"), fs.Mesh(pp=2, dp=2), policy)
            >>> plan.ranks_of_stage(0), plan.ranks_of_stage(1), plan.ranks_of_stage(3)
            ((0, 1), (2, 3), (0, 1))
        """
        pipeline = self.config.pipeline
        if pipeline is None:
            if stage != 0:
                raise PolicyError(f"stage {stage} does not exist: the plan has no pipeline (one stage, 0)")
            return tuple(range(self.mesh.size))
        return pipeline.ranks(self.mesh, pipeline.coordinate_of(stage, self.mesh))

    # ---- views -------------------------------------------------------------------
    def cost(self, optimizer: OptimizerKind = "adamw", **kwargs: Any) -> Cost:
        """Memory per device and bytes sent per step; see `functional_shard.costing.cost.cost_model.cost`."""
        # the cost model is a layer above: reached through the façade (docs/architecture.md)
        return fs.cost(self, optimizer, **kwargs)

    def visualize(self, param: str | None = None, **kwargs: Any) -> Any:
        """A matplotlib figure: memory per device, and ``param``'s blocks over the ranks.

        See `functional_shard.frontends.pictures.visualize.visualize` (needs the ``plot`` extra).
        """
        # a front end, reached through the façade; matplotlib loads only when a picture is drawn
        return fs._visualize(self, param, **kwargs)

    def _holder(self, sharding: ParamSharding) -> int:
        """The first rank holding a tensor: rank 0, or the first of its stage's ranks."""
        if sharding.on is None:
            return 0
        return first_rank(self.mesh, *sharding.on)

    def _stage_label(self, path: str) -> str:
        sharding = self.sharding(path)
        if sharding.on is None:
            return "all"
        return f"{self.stage_of(path)} ({sharding.on[0]}={sharding.on[1]})"

    def _rows(self) -> list[tuple[str, ...]]:
        rows = []
        staged = self.config.pipeline is not None
        for group in (self.params, self.buffers):
            for path, sharding in group.items():
                tensor = self.tensors[path]
                storage = sharding.storage
                local = local_shape_and_offset(tensor.shape, storage, self.mesh, self._holder(sharding))[0]
                tied = [a for a in self.aliases.get(path, ()) if a != path]
                name = (
                    path
                    + (f" (= {', '.join(tied)})" if tied else "")
                    + ("  [buffer]" if tensor.kind == "buffer" else "")
                    + ("  [frozen]" if tensor.frozen else "")
                )
                specs = sharding.normalized(tensor.ndim)
                rows.append(
                    (
                        name,
                        *((self._stage_label(path),) if staged else ()),
                        "×".join(map(str, tensor.shape)) or "()",
                        str(tensor.dtype).removeprefix("torch."),
                        # the stage column says where along pp: the specs show the split
                        *(repr(s.unstaged) for s in specs.specs().values()),
                        "×".join(map(str, local)) or "()",
                        str(self._local_bytes(path)),
                    )
                )
        return rows

    def explain(self, collapse: bool = True) -> str:
        """A table of every tensor: shape, dtype, the four specs, rank 0's local shape, bytes.

        Under a pipeline a stage column is added, the local shape being the first holding rank's.

        Args:
            collapse: fold rows that differ only in a layer index into one row with a count.

        Examples:
            >>> import torch.nn as nn, functional_shard as fs
            >>> print(fs.shard(nn.Linear(8, 4), fs.Mesh(dp=2), fs.fsdp()).explain())  # doctest: +ELLIPSIS
            Plan on Mesh(dp=2): data parallel fsdp over ('dp',); ...
        """
        c = self.config
        rows = self._rows()
        if collapse:
            grouped: dict[tuple[str, ...], list[Any]] = {}
            for row in rows:
                key = (re.sub(r"(?<=\.)\d+(?=\.)", "*", row[0]), *row[1:])
                grouped.setdefault(key, [key, 0])[1] += 1
            rows = [
                (key[0] + (f" ×{count}" if count > 1 else ""), *key[1:-1], str(int(key[-1]) * count))
                for key, count in grouped.values()
            ]
        pipe = c.pipeline
        staged = pipe is not None
        local = "local (first holder)" if staged else "local (rank 0)"
        total_local, largest = self._largest_local()
        column, resting = where_at_rest(c.offload_params, largest)
        header = ("path", *(("stage",) if staged else ()), "shape", "dtype", *_SPECS, local, column)
        body = [(*row[:-1], _bytes(int(row[-1]))) for row in rows]
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        line = "  ".join(f"{{:<{w}}}" for w in widths)
        total_global = sum(t.nbytes for t in self.tensors.values())
        summary = [
            f"Plan on {self.mesh!r}: data parallel {c.data_parallel} over {c.data_axes}; "
            f"tensor parallel over {c.tp.axes if c.tp else ()}"
            + (" with sequence parallel" if c.sequence_parallel else "")
            + (" and loss parallel" if c.loss_parallel else ""),
            f"{len(self.params)} parameters, {len(self.buffers)} buffers, "
            f"{len(c.fsdp.units if c.fsdp else ())} FSDP units, "
            f"{len(c.checkpointed)} checkpointed modules; mixed precision: "
            f"{c.param_dtype or 'off'} (reduce {c.reduce_dtype or 'as params'}); offload: "
            + (", ".join(k for k in ("params", "grads", "optimizer") if getattr(c, f"offload_{k}")) or "off"),
            *((context_parallel_line(c.context, self.mesh, pipelined=staged),) if c.context else ()),
            *(
                (
                    f"pipeline over {pipe.axis!r}: {len(pipe.stages)} stages, "
                    f"{pipe.stages_per_rank} per rank, schedule {pipe.schedule}, "
                    f"{pipe.microbatches} micro-batches",
                )
                if pipe
                else ()
            ),
            *packed_lines(c.tp),
            "",
            line.format(*header),
            *(line.format(*row) for row in body),
            "",
            *self._units_lines(),
            f"at rest: {_bytes(total_global)} in all, {_bytes(total_local)} on the largest {resting}",
        ]
        whole = [p for p, t in self.tensors.items() if t.ndim == 0 and p in self.params]
        if whole and c.data_parallel in ("zero2", "zero3", "fsdp", "hsdp"):
            summary.append(
                "0-d parameters, which FSDP2 cannot shard, stay whole on every rank; their gradients "
                f"are all-reduced over {c.data_axes}: {', '.join(whole)}"
            )
        return "\n".join(s.rstrip() for s in summary)

    def _units_lines(self) -> list[str]:
        fsdp = self.config.fsdp
        if fsdp is None or not fsdp.unit_names:
            return []
        # what each unit gathers is the cost model's, a layer above: reached through the façade
        lines = units_section(fsdp, fs._unit_gathered(self))
        return [*lines, ""]

    def __str__(self) -> str:
        return self.explain()

    # ---- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data."""
        data = {
            "format": "functional_shard.plan",
            "version": FORMAT_VERSION,
            "mesh": self.mesh.to_json(),
            "config": self.config.to_json(),
            "tensors": {
                path: {
                    **self.tensors[path].to_json(),
                    "aliases": list(self.aliases.get(path, ())),
                    "sharding": sharding.to_json(),
                }
                for group in (self.params, self.buffers)
                for path, sharding in group.items()
            },
        }
        names = [*self.tensors, *(name for names in self.aliases.values() for name in names)]
        if untensored := modules_without_tensors(self.config, names):
            data["modules_without_tensors"] = untensored
        return data

    def to_json(self, indent: int | None = None) -> str:
        """The plan as a JSON string; `Plan.from_json` reads it back exactly."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str] | Mapping[str, Any]) -> Plan:
        """Read a plan written by `to_json`: its text, a `pathlib.Path` to its file, or the parsed dict.

        A ``str`` is always JSON text; a file is read from a ``Path``.

        Raises:
            ShardingError: unreadable, not JSON, not our plan, a newer format, or `json_format.plan_problems`.

        Examples:
            >>> import pathlib, tempfile, torch.nn as nn
            >>> plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp())
            >>> path = pathlib.Path(tempfile.mkdtemp(), "plan.json")
            >>> _ = path.write_text(plan.to_json())
            >>> fs.Plan.from_json(path) == fs.Plan.from_json(path.read_text()) == plan
            True
            >>> fs.Plan.from_json(str(path))  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            functional_shard.ShardingError: not a plan file: ... looks like a path; pass Path(...) ...
        """
        from .json_format import plan_data

        data = plan_data(source)
        params: dict[str, ParamSharding] = {}
        buffers: dict[str, ParamSharding] = {}
        tensors: dict[str, TensorSpec] = {}
        aliases: dict[str, tuple[str, ...]] = {}
        for path, entry in data["tensors"].items():
            tensor = TensorSpec.from_json(entry)
            tensors[path] = tensor
            (buffers if tensor.kind == "buffer" else params)[path] = ParamSharding.from_json(
                entry["sharding"]
            )
            if entry["aliases"]:
                aliases[path] = tuple(entry["aliases"])
        return cls(
            params=params,
            buffers=buffers,
            mesh=Mesh.from_json(data["mesh"]),
            tensors=tensors,
            aliases=aliases,
            config=PlanConfig.from_json(data["config"]),
        )

    def diff(self, other: Plan) -> list[Change]:
        """What changes, tensor by tensor, from this plan to ``other``: specs and bytes.

        Raises:
            ShardingError: ``other`` is not a `Plan` (JSON text is read with `Plan.from_json`).

        Examples:
            >>> import torch.nn as nn, functional_shard as fs
            >>> m, mesh = nn.Linear(8, 8, bias=False), fs.Mesh(dp=2)
            >>> changes = fs.shard(m, mesh, fs.replicate()).diff(fs.shard(m, mesh, fs.fsdp()))
            >>> [str(c) for c in changes if c.path == "weight" and c.what in ("storage", "bytes/device")]
            ["weight: storage P(None, None) -> P('dp', None)", 'weight: bytes/device 256 -> 128']

            A tensor that moves to another stage is reported once, as a stage change:

            >>> from functional_shard import zoo
            >>> llama, mesh = zoo.llama("tiny"), fs.Mesh(pp=2)
            >>> even = fs.shard(llama, mesh, fs.pipeline("pp", microbatches=2))
            >>> late = fs.shard(llama, mesh, fs.pipeline("pp", microbatches=2, split=[
            ...     ["embed_tokens"], ["layers.0", "layers.1", "norm", "lm_head"]]))
            >>> [str(c) for c in even.diff(late) if c.path == "layers.0.mlp.up_proj.weight"]
            ['layers.0.mlp.up_proj.weight: stage 0 (pp=0) -> 1 (pp=1)']
        """
        if not isinstance(other, Plan):
            raise ShardingError(
                f"plan.diff({type(other).__name__}): compares two Plans; load a plan file first with "
                "fs.Plan.from_json(its text or Path(...))"
            )
        changes = []
        if self.mesh != other.mesh:
            changes.append(Change("<plan>", "mesh", self.mesh, other.mesh))
        # why a unit is one says nothing the units do not: not a difference of its own
        was, becomes = self.config.flat(), other.config.flat()
        for name in (name for name in was if name != "unit_reasons"):
            if was[name] != becomes[name]:
                changes.append(Change("<plan>", name, was[name], becomes[name]))
        for path in dict.fromkeys([*self.tensors, *other.tensors]):
            if path not in other.tensors or path not in self.tensors:
                changes.append(Change(path, "presence", path in self.tensors, path in other.tensors))
                continue
            ndim = self.tensors[path].ndim
            before_stage, after_stage = self._stage_label(path), other._stage_label(path)
            if before_stage != after_stage:
                changes.append(Change(path, "stage", before_stage, after_stage))
            mine, theirs = self.sharding(path).normalized(ndim), other.sharding(path).normalized(ndim)
            for name, spec in mine.specs().items():
                other_spec = theirs.specs()[name]
                if spec.unstaged != other_spec.unstaged or (
                    spec != other_spec and before_stage == after_stage
                ):
                    changes.append(Change(path, name, spec, other_spec))
            before, after = self._local_bytes(path), other._local_bytes(path)
            if before != after:
                changes.append(Change(path, "bytes/device", before, after))
        return changes

    def _local_bytes(self, path: str) -> int:
        """Bytes at rest on the first rank holding the tensor."""
        tensor = self.tensors[path]
        sharding = self.sharding(path)
        rank = self._holder(sharding)
        return (
            local_numel(tensor.shape, sharding.storage, self.mesh, rank, sharding.at_rest_axes)
            * tensor.itemsize
        )

    def _largest_local(self) -> tuple[int, int]:
        """(bytes at rest, rank) of the heaviest among each pp coordinate's first rank."""
        pipeline = self.config.pipeline
        totals: dict[int, int] = {}
        for group in (self.params, self.buffers):
            for path, sharding in group.items():
                holder = self._holder(sharding)
                if sharding.on is None and pipeline is not None:  # on every stage's ranks
                    for index in range(pipeline.size(self.mesh)):
                        rank = pipeline.first_rank(self.mesh, index)
                        totals[rank] = totals.get(rank, 0) + self._local_bytes(path)
                else:
                    totals[holder] = totals.get(holder, 0) + self._local_bytes(path)
        if not totals:
            return 0, 0
        rank = max(totals, key=lambda r: (totals[r], -r))
        return totals[rank], rank
