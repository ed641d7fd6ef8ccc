"""Hypothesis strategies: meshes, shapes, specs, module trees and policies."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs

AXIS_NAMES = ("dp", "tp", "cp", "ep")


@st.composite
def meshes(draw: st.DrawFn, max_axes: int = 3, max_size: int = 4, max_devices: int = 64) -> fs.Mesh:
    n = draw(st.integers(1, max_axes))
    names = draw(st.permutations(AXIS_NAMES))[:n]
    sizes = [draw(st.integers(1, max_size)) for _ in names]
    while math.prod(sizes) > max_devices:
        sizes[sizes.index(max(sizes))] //= 2
    return fs.Mesh(dict(zip(names, sizes, strict=True)))


def shapes(max_dims: int = 3, max_size: int = 20, min_dims: int = 0) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(0, max_size), min_size=min_dims, max_size=max_dims).map(tuple)


@st.composite
def specs(draw: st.DrawFn, mesh: fs.Mesh, ndim: int) -> fs.P:
    """Any valid spec: each axis splits at most one dim, in any order within a dim."""
    dims: list[list[str]] = [[] for _ in range(ndim)]
    for axis in draw(st.permutations(mesh.axis_names)):
        if ndim and draw(st.booleans()):
            dims[draw(st.integers(0, ndim - 1))].append(axis)
    return fs.P(*(tuple(d) or None for d in dims))


@st.composite
def mesh_shape_spec(draw: st.DrawFn, max_size: int = 20) -> tuple[fs.Mesh, tuple[int, ...], fs.P]:
    mesh = draw(meshes())
    shape = draw(shapes(max_size=max_size))
    return mesh, shape, draw(specs(mesh, len(shape)))


@st.composite
def module_trees(draw: st.DrawFn, tie: bool | None = None) -> nn.Module:
    """Nested Sequential/ModuleList trees of Linear, Embedding and LayerNorm, on meta."""

    def leaf() -> nn.Module:
        kind = draw(st.sampled_from(["linear", "embedding", "norm"]))
        a, b = draw(st.integers(1, 24)), draw(st.integers(1, 24))
        if kind == "linear":
            return nn.Linear(a, b, bias=draw(st.booleans()))
        if kind == "embedding":
            return nn.Embedding(a, b)
        return nn.LayerNorm(a)

    def node(depth: int) -> nn.Module:
        if depth == 0 or draw(st.booleans()):
            return leaf()
        children = [node(depth - 1) for _ in range(draw(st.integers(1, 3)))]
        return nn.ModuleList(children) if draw(st.booleans()) else nn.Sequential(*children)

    with torch.device("meta"):
        root = nn.Sequential(*(node(2) for _ in range(draw(st.integers(1, 3)))))
        if tie if tie is not None else draw(st.booleans()):
            embedding = nn.Embedding(draw(st.integers(1, 30)), draw(st.integers(1, 16)))
            head = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False)
            head.weight = embedding.weight
            root.append(embedding)
            root.append(head)
    return root


def data_policies(axis: str) -> st.SearchStrategy[fs.Policy]:
    return st.sampled_from(
        [fs.replicate(axis), fs.zero(1, axis), fs.zero(2, axis), fs.zero(3, axis), fs.fsdp(axis)]
    )


def linear_colwise(path: str, tensor: fs.TensorSpec, mesh: fs.Mesh) -> fs.ParamSharding | None:
    """A hand-written policy function: split every Linear's output features over 'tp'."""
    if tensor.module_is(nn.Linear) and tensor.ndim in (1, 2):
        return fs.ParamSharding.uniform(fs.P("tp"))
    return None


@st.composite
def uneven_llama_plans(draw: st.DrawFn) -> tuple[nn.Module, fs.Plan]:
    """A tiny zoo Llama on meta whose vocabulary and MLP width the tensor-parallel size seldom
    divides, under dp, tp or dp x tp (sequence parallel or not, FSDP or not, the embedding
    split over the vocabulary or the features); heads are whole multiples of tp, as the
    attention needs."""
    from functional_shard.zoo import Llama, LlamaConfig

    dp, tp = draw(st.sampled_from([(2, 1), (1, 2), (1, 3), (1, 4), (2, 2)]))
    kv_heads = tp * draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 2))
    config = LlamaConfig(
        vocab_size=draw(st.integers(1, 150).map(lambda n: 2 * n + 1)),
        hidden_size=heads * draw(st.sampled_from([2, 4])),
        intermediate_size=draw(st.integers(1, 40)),
        num_layers=draw(st.integers(1, 3)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        tie_embeddings=draw(st.booleans()),
    )
    with torch.device("meta"):
        model = Llama(config)
    policy = draw(data_policies("dp"))
    if tp > 1:
        # ZeRO-1 keeps optimizer state whole per rank: the planner refuses it with tensor parallel
        allowed = [fs.replicate("dp"), fs.zero(2, "dp"), fs.zero(3, "dp"), fs.fsdp("dp")]
        policy = draw(st.sampled_from(allowed))
        rules = fs.rules.llama
        # the embedding split over its features rather than the vocabulary (untied: a tied
        # lm_head splits the vocabulary)
        if not config.tie_embeddings and draw(st.booleans()):
            rules = fs.Rules([("*embed_tokens", "colwise"), *((r.pattern, r.target) for r in rules.rules)])
        policy = policy + fs.tp(rules, "tp", sequence_parallel=draw(st.booleans()))
    return model, fs.shard(model, fs.Mesh(dp=dp, tp=tp), policy)


@st.composite
def staged_mesh_shape_spec(draw: st.DrawFn, max_size: int = 12) -> tuple[fs.Mesh, tuple[int, ...], fs.P]:
    """A mesh with a ``pp`` axis, a shape, and a spec over the other axes, often placed on one
    pp coordinate (``on=("pp", i)``), sometimes not (a tensor on every stage)."""
    others = draw(meshes(max_axes=2, max_size=3, max_devices=9))
    pp = draw(st.integers(1, 4))
    position = draw(st.integers(0, len(others)))
    axes = list(others.axes)
    axes.insert(position, ("pp", pp))
    mesh = fs.Mesh(dict(axes))
    shape = draw(shapes(max_size=max_size))
    spec = draw(specs(others, len(shape)))
    if draw(st.integers(0, 3)):
        spec = spec.staged(("pp", draw(st.integers(0, pp - 1))))
    return mesh, shape, spec


@st.composite
def pipelined_llamas(draw: st.DrawFn) -> tuple[nn.Module, fs.Mesh, fs.Policy, fs.Policy]:
    """A tiny untied zoo Llama on meta, a mesh with ``pp`` and ``dp`` (and sometimes ``tp``), a
    pipeline policy (any schedule its stage count allows) with a data-parallel policy over dp,
    and the same policy without the pipeline."""
    from functional_shard.zoo import Llama, LlamaConfig

    pp = draw(st.integers(1, 3))
    schedule, per_rank = draw(
        st.sampled_from(
            [
                ("1f1b", 1),
                ("gpipe", 1),
                ("interleaved1f1b", 2),
                ("looped_bfs", 2),
                ("zbv", 2),
                ("dualpipev", 2),
            ]
        )
    )
    layers = draw(st.integers(max(1, pp * per_rank - 1), pp * per_rank + 3))
    dp = draw(st.integers(1, 3))
    tp = draw(st.sampled_from([1, 1, 2]))
    config = LlamaConfig(
        vocab_size=draw(st.integers(8, 40)),
        hidden_size=8 * tp,
        intermediate_size=draw(st.integers(1, 20)) * tp,
        num_layers=layers,
        num_heads=2 * tp,
        num_kv_heads=tp,
    )
    with torch.device("meta"):
        model = Llama(config)
    rest = (
        draw(data_policies("dp")) if tp == 1 else draw(st.sampled_from([fs.replicate("dp"), fs.fsdp("dp")]))
    )
    if tp > 1:
        rest = rest + fs.tp(fs.rules.llama, "tp")
    mesh = fs.Mesh(pp=pp, dp=dp, **({"tp": tp} if tp > 1 else {}))
    piped = fs.pipeline(
        # a count every schedule runs: torch refuses some others (tests/unit/test_schedules.py)
        "pp",
        microbatches=pp * per_rank * draw(st.integers(1, 2)),
        schedule=schedule,
        stages_per_rank=per_rank,
    )
    return model, mesh, piped + rest, rest


@st.composite
def documents(
    draw: st.DrawFn, max_documents: int = 8, max_length: int = 20, vocab: int = 256
) -> list[list[int]]:
    """Token-id documents of drawn lengths (at least one token each), as `fs.pack` takes them."""
    lengths = draw(st.lists(st.integers(1, max_length), min_size=1, max_size=max_documents))
    return [draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)) for n in lengths]


@st.composite
def skewed_rows(draw: st.DrawFn, cp: int) -> tuple[int, ...]:
    """A packed row's segments: one long document among many short ones, padded to a multiple of ``2·cp``.

    The long one holds most of the row's tokens (twice the short ones', and 32 a rank) and nearly all
    its attention work, anywhere in the row: the case where cutting by tokens is far off.
    """
    shorts = draw(st.lists(st.integers(1, 32), min_size=4 * cp, max_size=60))
    least = max(2 * sum(shorts), 32 * cp)
    long = draw(st.integers(least, 4 * least))
    at = draw(st.integers(0, len(shorts)))
    lengths = [*shorts[:at], long, *shorts[at:]]
    padding = -sum(lengths) % (2 * cp)
    return tuple(lengths + ([padding] if padding else []))
