"""One parameter's sharding: the layers' answers merged, and what is wrong with a placement.

The merge follows `functional_shard.planning.policy.types`'s rules; the checks say, per tensor, what
torch's engines would refuse. Both are memoised: a model's blocks repeat a few (shape, sharding) pairs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from functional_shard.core.mesh import Mesh
from functional_shard.core.spec import Owned, P, ParamSharding, spec_problems
from functional_shard.core.tree import ModelTree, TensorSpec

from .plan.config import PlanConfig
from .policy.types import DataParallel, Layer, ParamProblemError, Policy, TensorParallel
from .tp.styles import layout_of

__all__ = [
    "axis_problems",
    "compute_free_axes",
    "merge",
    "place",
    "sharding_problems",
    "tensor_problems",
    "unused_axes",
]


def _merge_spec(a: P, b: P, model: tuple[tuple[str, ...], ...], ndim: int) -> P:
    dims = []
    for d, (mine, theirs) in enumerate(zip(a.dim_axes(ndim), b.dim_axes(ndim), strict=True)):
        axes = list(dict.fromkeys(mine + theirs))
        # compute splits are major; splits that exist only at rest nest inside them
        dims.append(tuple(x for x in model[d] if x in axes) + tuple(x for x in axes if x not in model[d]))
    return P(*dims)


@functools.lru_cache(maxsize=4096)
def merge(a: ParamSharding, b: ParamSharding, ndim: int) -> ParamSharding | str:
    """``a`` (from the layers before) merged with ``b`` (one more layer's answer), or why not.

    Why not: a message with ``{0}`` and ``{1}`` for the two layers' names.

    Examples:
        >>> fsdp = ParamSharding(storage=P("dp"), grad=P("dp"), optim=P("dp"))
        >>> merge(fsdp, ParamSharding.uniform(P("tp", None)), 2).storage
        P(('tp', 'dp'), None)
        >>> merge(ParamSharding.uniform(P("tp")), ParamSharding.uniform(P("ep")), 1)[:40]
        '{0} and {1} both split dim 0 for compute'
    """
    model = []
    for d, (mine, theirs) in enumerate(zip(a.compute.dim_axes(ndim), b.compute.dim_axes(ndim), strict=True)):
        if mine and theirs and mine != theirs:
            return (
                f"{{0}} and {{1}} both split dim {d} for compute ({mine} vs {theirs}); let one rule claim it"
            )
        model.append(mine or theirs)
    model_axes = tuple(model)
    if isinstance(a.optim, Owned) or isinstance(b.optim, Owned):
        owned, other = (a.optim, b.optim) if isinstance(a.optim, Owned) else (b.optim, a.optim)
        if isinstance(other, Owned) or not other.is_replicated:
            return (
                "{0} and {1}: ZeRO-1 keeps optimizer state whole per rank and "
                "cannot also split it; use fsdp() (ZeRO-3) or zero(2) with tensor parallel"
            )
        optim: P | Owned = owned
    else:
        optim = _merge_spec(a.optim, b.optim, model_axes, ndim)
    return ParamSharding(
        _merge_spec(a.storage, b.storage, model_axes, ndim),
        P(*model_axes),
        _merge_spec(a.grad, b.grad, model_axes, ndim),
        optim,
    )


@functools.lru_cache(maxsize=4096)
def _answer_problems(answer: ParamSharding, shape: tuple[int, ...], mesh: Mesh) -> tuple[str, ...]:
    # checked before merging: merging aligns specs to the tensor's rank and would hide
    # an extra entry or an axis named twice in one dim
    return tuple(
        f"{field} {problem}"
        for field, spec in answer.specs().items()
        if isinstance(spec, P)
        for problem in spec_problems(spec, shape, mesh)
    )


def place(
    layers: tuple[Layer, ...], names: tuple[str, ...], tree: ModelTree, tensor: TensorSpec, mesh: Mesh
) -> ParamSharding:
    """The sharding ``layers`` give one tensor, known by ``names`` (tied names: several).

    Raises:
        ParamProblemError: a layer's answer does not fit, tied names disagree, or answers do not merge.

    Examples:
        >>> from functional_shard.core.tree import read_model
        >>> tree = read_model(nn.Linear(4, 2))
        >>> layers = (fs.fsdp("dp") + fs.tp([("*", "colwise")], "tp")).layers
        >>> place(layers, ("weight",), tree, tree.params["weight"], fs.Mesh(dp=2, tp=2)).storage
        P(('tp', 'dp'), None)
    """
    result: ParamSharding | None = None
    owner: Layer | None = None  # the last layer that answered
    ndim = tensor.ndim
    # each name is seen as its own module owns it (a tied lm_head is a Linear)
    seen = [(name, tree.spec_as(name, names[0])) for name in names]
    for layer in layers:
        given = [(n, a) for n, spec in seen if (a := layer(n, spec, mesh)) is not None]
        if not given:
            continue
        for _, answer in given:
            if found := _answer_problems(answer, tensor.shape, mesh):
                raise ParamProblemError(f"{layer.name} gives " + "; ".join(found))
        if len(given) > 1 and len({answer.normalized(ndim) for _, answer in given}) > 1:
            detail = "; ".join(f"{name} gets {answer}" for name, answer in given)
            raise ParamProblemError(f"tied names disagree under {layer.name}: {detail}. Give them one rule")
        answer = given[0][1]
        if isinstance(layer, TensorParallel) and len(given) < len(seen):
            _refuse_unsplit_alias(layer, given, seen, answer, ndim)
        if result is None or owner is None:
            result = answer.normalized(ndim)
        else:
            merged = merge(result, answer, ndim)
            if isinstance(merged, str):
                raise ParamProblemError(merged.format(owner.name, layer.name))
            result = merged
        owner = layer
    return result if result is not None else ParamSharding.replicated().normalized(ndim)


def _refuse_unsplit_alias(
    layer: TensorParallel,
    given: list[tuple[str, ParamSharding]],
    seen: list[tuple[str, TensorSpec]],
    answer: ParamSharding,
    ndim: int,
) -> None:
    # a tied name no rule covers takes the split its twin's rule gives; a Linear or Embedding
    # holding it, left without a style, would run the split weight on whole activations
    if answer.normalized(ndim).compute.is_replicated:
        return
    ruled = {name for name, _ in given}
    layers = ("linear", "embedding", "conv1d")
    for name, spec in seen:
        if name not in ruled and layout_of(spec) in layers:
            split = "; ".join(f"{n} gets {a.compute!r}" for n, a in given)
            module = name.rpartition(".")[0]
            raise ParamProblemError(
                f"tied names disagree under {layer.name}: {split}, but no rule covers {name}, so its "
                f"{layout_of(spec)} layer would run the split weight unsplit. Give {module!r} a rule that "
                "splits it alike (a head tied to a rowwise embedding: 'colwise_gather')"
            )


def tensor_problems(
    path: str, tensor: TensorSpec, sharding: ParamSharding, mesh: Mesh, data_axes: frozenset[str]
) -> list[str]:
    """`sharding_problems` of one tensor, each line naming its path and shape.

    Examples:
        >>> tensor = fs.TensorSpec((6, 4), torch.float32)
        >>> tensor_problems("w", tensor, ParamSharding.uniform(P(None, "tp")), fs.Mesh(tp=4), frozenset())
        []
    """
    return [
        f"{path}, shape {tensor.shape}: {problem}"
        for problem in sharding_problems(tensor.shape, sharding, mesh, data_axes)
    ]


@functools.lru_cache(maxsize=4096)
def sharding_problems(
    shape: tuple[int, ...], sharding: ParamSharding, mesh: Mesh, data_axes: frozenset[str]
) -> tuple[str, ...]:
    """What is wrong with ``sharding`` for any tensor of ``shape`` (cached: blocks repeat).

    Examples:
        >>> split = ParamSharding(storage=P(None, "dp"), grad=P(None, "dp"), optim=P(None, "dp"))
        >>> sharding_problems((4, 6), split, fs.Mesh(dp=4), frozenset({"dp"}))[0][:48]
        "storage P(None, 'dp') shards dim 1 (size 6) at r"
    """
    found = []
    for name, spec in sharding.specs().items():
        if isinstance(spec, Owned):
            if spec.axis not in mesh:
                found.append(f"optim {spec!r} names axis {spec.axis!r}, which is not in {mesh!r}")
            continue
        found.extend(f"{name} {problem}" for problem in spec.problems(shape, mesh))
    if found:
        return tuple(found)
    ndim = len(shape)
    compute = sharding.compute.dim_axes(ndim)
    for name in ("storage", "grad", "optim"):
        spec = sharding.specs()[name]
        if not isinstance(spec, P):
            continue
        for d, axes in enumerate(spec.dim_axes(ndim)):
            if axes[: len(compute[d])] != compute[d]:
                found.append(
                    f"{name} {spec!r} does not contain compute {sharding.compute!r} on dim {d}; "
                    "state at rest must be split at least as the computation sees it"
                )
    for axis in sharding.compute.axes:
        if axis in data_axes:
            found.append(
                f"compute {sharding.compute!r} splits over {axis!r}, a data-parallel axis "
                "(the batch is split over it); use a separate mesh axis for tensor parallel"
            )
    at_rest_only = [
        (d, axes[len(compute[d]) :])
        for d, axes in enumerate(sharding.storage.dim_axes(ndim))
        if axes[len(compute[d]) :]
    ]
    if len(at_rest_only) > 1:
        found.append(
            f"storage {sharding.storage!r} splits {len(at_rest_only)} dims at rest; FSDP2 shards one"
        )
    for d, axes in at_rest_only:
        if d == 0:
            continue
        size = shape[d]
        for axis in compute[d]:
            size = -(-size // mesh[axis])
        if size % mesh.axes_size(axes):
            found.append(
                f"storage {sharding.storage!r} shards dim {d} (size {size}) at rest over "
                f"{axes} (size {mesh.axes_size(axes)}); FSDP2 shards a dim other than 0 only when it "
                "divides evenly. Shard dim 0, or pad the parameter"
            )
    return tuple(found)


def axis_problems(policy: Policy, mesh: Mesh) -> list[str]:
    """The axes the policy's layers claim that ``mesh`` lacks, and a misplaced cp axis, one line each.

    Examples:
        >>> axis_problems(fs.fsdp("dp"), fs.Mesh(tp=2))
        ["fsdp('dp') names axis 'dp', which is not in Mesh(tp=2)"]
    """
    return [
        f"{layer.name} names axis {a!r}, which is not in {mesh!r}"
        for layer in policy.layers
        for a in layer.claimed_axes
        if a not in mesh
    ] + _context_axis_problems(policy, mesh)


def _context_axis_problems(policy: Policy, mesh: Mesh) -> list[str]:
    context = policy.context_parallel
    if context is None:
        return []
    axis, name = context.axis, context.name
    if axis not in mesh:
        return [f"{name} names axis {axis!r}, which is not in {mesh!r}; add it to the mesh"]
    others = [
        layer.name
        for layer in policy.layers
        if axis in layer.claimed_axes and not isinstance(layer, DataParallel)
    ]
    if others:
        return [f"{name}: axis {axis!r} is {others[0]}'s; cut sequences over an axis of their own"]
    experts = policy.expert_parallel
    if experts is not None and experts.axis == axis:
        return [f"{name} and {experts.name} on one axis: each needs its own axis"]
    data = policy.data_parallel
    if not any(layer.replicate_axes is None or axis in layer.claimed_axes for layer in data):
        return [
            f"{name}: the ranks of {axis!r} see different tokens of the same sequences, so their "
            f"gradients are averaged over it: name it in the data-parallel layer too, fs.fsdp(('dp', "
            f"{axis!r})) to shard the parameters over it as well (as torchtitan does), or "
            f"fs.replicate({axis!r}) to keep them whole there"
        ]
    return []


def unused_axes(policy: Policy, mesh: Mesh, shardings: Iterable[ParamSharding]) -> list[str]:
    """The mesh axes of size > 1 that neither a layer nor a spec uses, one line each.

    Examples:
        >>> unused_axes(fs.fsdp("dp"), fs.Mesh(dp=2, tp=2), [])[0][:30]
        "axis 'tp' (size 2) is used by "
    """
    layers = policy.layers
    claimed = {axis for layer in layers for axis in layer.claimed_axes}
    takes_rest = any(isinstance(layer, DataParallel) and layer.replicate_axes is None for layer in layers)
    used = claimed | {a for s in shardings for spec in s.specs().values() for a in spec.axes}
    return [
        f"axis {axis!r} (size {size}) is used by no policy: add fs.replicate({axis!r}) "
        f"to split the batch over it, or fs.fsdp({axis!r}) to shard over it"
        for axis, size in mesh.axes
        if axis not in used and size > 1 and not takes_rest
    ]


def compute_free_axes(config: PlanConfig) -> frozenset[str]:
    """The data-parallel axes no computation may split.

    Expert parallelism's axis is one of them: expert tensors are split over it, tokens travel to them.

    Examples:
        >>> from functional_shard.planning.plan.config import FsdpConfig
        >>> hsdp = FsdpConfig("hsdp", replicate_axes=("rep",), shard_axes=("dp",))
        >>> sorted(compute_free_axes(fs.PlanConfig(hsdp)))
        ['dp', 'rep']
    """
    return frozenset(config.data_axes) - {config.experts.axis if config.experts else None}
