"""Tensor-parallel rules from a model's structure: `tp("auto")` when no named rule set fits.

Each kind of repeated block runs once on meta tensors with the inputs the model passes it, and the
data flow decides, not the names: a projection reading the block's input is **colwise**, one reading
only colwise outputs and writing the block's output **rowwise**, a colwise one whose output is cut by
``split`` or ``chunk`` a `functional_shard.planning.tp.styles.Packed`. Whatever cannot be classified is
refused, naming the modules. docs/your-model.md ("`tp("auto")` from the model's structure") has the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from functional_shard.core.errors import PolicyError
from functional_shard.core.tree import read_model
from functional_shard.planning.fsdp.repeated_blocks import repeated_blocks

from .styles import Packed, Style

__all__ = ["BlockFlow", "block_calls", "structural_rules", "trace_block"]

_INPUT = "<input>"
_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)

# ops that act on each feature (or each head) on its own: a split output may pass through them
_LOCAL_OPS = frozenset(
    {
        "add", "sub", "mul", "div", "neg", "pow", "exp", "sqrt", "rsqrt", "tanh", "sigmoid", "relu",
        "silu", "gelu", "mish", "softplus", "dropout", "where", "clamp", "abs", "sin", "cos", "float",
        "to", "type_as", "half", "bfloat16", "view", "reshape", "transpose", "permute", "contiguous",
        "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "repeat_interleave", "clone",
        "scaled_dot_product_attention", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__",
        "__mul__", "__rmul__", "__imul__", "__truediv__", "__neg__", "__getitem__", "dim", "size",
        "__get__", "split", "chunk", "view_as_complex", "view_as_real",
    }
)  # fmt: skip
# of those, the ops that may cut a split output by position along its features: a
# projection's whole output cut by split or chunk is a fused one (its pieces packed), any
# other cut is refused
_SPLITTING = frozenset({"split", "chunk", "__getitem__"})
_PACKING = frozenset({"split", "chunk"})


@dataclass(frozen=True, slots=True)
class BlockFlow:
    """What one block's trace found: each projection's style, and what could not be classified.

    ``styles``: relative projection path → ``colwise``, ``rowwise`` or `Packed`; ``problems``: one line each.
    """

    styles: tuple[tuple[str, Style | Packed], ...]
    problems: tuple[tuple[str, str], ...]
    """(module path relative to the block, "" for the block itself; why), one each."""


class _Recorder(TorchFunctionMode):
    """Tags each tensor with the projections (or the block input) its values come from."""

    def __init__(self, origin: dict[int, frozenset[str]], keep: list[torch.Tensor], depth: list[int]) -> None:
        super().__init__()
        # depth[0] > 0 inside a projection's own forward, whose ops its hooks account for
        self.origin, self.keep, self.depth = origin, keep, depth
        self.misuse: dict[str, set[str]] = {}
        # projection -> {(width of the cut tensor, sizes of the pieces)} for each split/chunk
        # of its output along the features
        self.cuts: dict[str, set[tuple[int, tuple[int, ...]]]] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        sources: frozenset[str] = frozenset()
        for tensor in _tensors((args, kwargs)):
            sources |= self.origin.get(id(tensor), frozenset())
        projections = sources - {_INPUT}
        cuts = name in _SPLITTING and _cuts_features(name, args, kwargs)
        pieces = tuple(int(t.shape[-1]) for t in _tensors(out)) if cuts and name in _PACKING else ()
        if len(pieces) > 1 and len(sources) == 1 and projections and not self.depth[0]:
            # one projection's output (and nothing else) cut into pieces: packed if the cut
            # takes its whole output (_classify knows the projection's width)
            (path,) = projections
            self.cuts.setdefault(path, set()).add((int(args[0].shape[-1]), pieces))
        elif projections and not self.depth[0] and (name not in _LOCAL_OPS or cuts):
            for path in projections:
                self.misuse.setdefault(path, set()).add(name)
        for tensor in _tensors(out):
            self.origin[id(tensor)] = self.origin.get(id(tensor), frozenset()) | sources
            self.keep.append(tensor)  # alive, so that no other tensor takes its id
        return out


def _cuts_features(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    # split/chunk/indexing along the last dim of a projection's output takes some of its
    # features by position: under a colwise split each rank holds other features
    if not args or not isinstance(args[0], torch.Tensor) or args[0].ndim == 0:
        return False
    tensor = args[0]
    if name == "__getitem__":
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(item is Ellipsis for item in index):
            return not (isinstance(index[-1], slice) and index[-1] == slice(None))
        return len(index) == tensor.ndim and index[-1] != slice(None)
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    return isinstance(dim, int) and dim % tensor.ndim == tensor.ndim - 1


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _hidden_size(block: nn.Module) -> int | None:
    # the block's input width: its first norm's, else its first projection's input
    for module in block.modules():
        if isinstance(module, nn.LayerNorm | nn.RMSNorm) and module.normalized_shape:
            return int(module.normalized_shape[-1])
        if isinstance(module, nn.Linear):
            return module.in_features
    return None


def trace_block(block: nn.Module, seq: int = 4, call: Call | None = None) -> BlockFlow:
    """Classify ``block``'s projections by tracing one forward on meta tensors.

    Args:
        block: a repeated block.
        seq: the traced sequence length, when ``call`` is not given.
        call: the ``(args, kwargs)`` the model calls it with (`block_calls`); ``None``: hidden states only.

    Returns:
        The block's `BlockFlow` (projection paths relative to the block).

    Examples:
        >>> mlp = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        >>> trace_block(mlp).styles
        (('1', 'colwise'), ('3', 'rowwise'))
    """
    width = _hidden_size(block)
    if width is None:
        return BlockFlow((), (("", "holds no nn.Linear or norm to tell its input width from"),))
    origin: dict[int, frozenset[str]] = {}
    keep: list[torch.Tensor] = []
    reads: dict[str, frozenset[str]] = {}
    linears: dict[str, nn.Module] = {path: m for path, m in block.named_modules() if isinstance(m, nn.Linear)}
    handles = []
    depth = [0]
    for path, module in linears.items():
        handles.append(module.register_forward_pre_hook(_reader(path, reads, origin, depth)))
        handles.append(module.register_forward_hook(_writer(path, origin, keep, depth)))
    state = {name: torch.empty_like(t, device="meta") for name, t in _state(block)}
    args, kwargs = call or ((torch.zeros(2, seq, width, device="meta"),), {})
    hidden = next((t for t in _tensors((args, kwargs)) if t.ndim and t.shape[-1] == width), None)
    if hidden is None:
        return BlockFlow((), (("", f"is called with no tensor of its width {width} (its hidden states)"),))
    origin[id(hidden)] = frozenset({_INPUT})
    recorder = _Recorder(origin, keep, depth)
    try:
        with recorder:
            out = torch.func.functional_call(block, state, args, kwargs)
    except Exception as error:  # the block's own code: any failure is reported, not raised
        given = (
            "the inputs the model passes it"
            if call
            else f"one hidden-states input of shape (2, {seq}, {width})"
        )
        failure = f"{type(error).__name__}: {str(error)[:200]}"
        why = f"could not be traced with {given} on the meta device ({failure})"
        return BlockFlow((), (("", why),))
    finally:
        for handle in handles:
            handle.remove()
    result = next(_tensors(out), None)
    written = origin.get(id(result), frozenset()) if result is not None else frozenset()
    return _classify(linears, reads, written, recorder.misuse, recorder.cuts)


Call = tuple[tuple[Any, ...], dict[str, Any]]


def block_calls(model: nn.Module, blocks: list[str], seq: int = 4) -> dict[str, Call]:
    """Each block's first call, as one forward of ``model`` on meta token ids ``(2, seq)`` makes it.

    A model that stops early (not runnable on token ids or meta) gives the calls made until then.

    Examples:
        >>> model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
        >>> args, kwargs = block_calls(model, ["1"])["1"]
        >>> tuple(args[0].shape), kwargs
        ((2, 4, 8), {})
    """
    calls: dict[str, Call] = {}

    def recorder(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls.setdefault(path, (args, kwargs))

        return hook

    handles = [
        model.get_submodule(path).register_forward_pre_hook(recorder(path), with_kwargs=True)
        for path in blocks
    ]
    state = {name: torch.empty_like(t, device="meta") for name, t in _state(model)}
    try:
        torch.func.functional_call(model, state, (torch.zeros(2, seq, dtype=torch.long, device="meta"),))
    except Exception:  # the model's own code: what ran before it stopped is kept
        pass
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _join(block_path: str, relative: str) -> str:
    return f"{block_path}.{relative}" if relative else block_path


def _state(block: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from block.named_parameters(remove_duplicate=False)
    yield from block.named_buffers(remove_duplicate=False)


def _reader(
    path: str, reads: dict[str, frozenset[str]], origin: dict[int, frozenset[str]], depth: list[int]
) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        depth[0] += 1
        sources: frozenset[str] = frozenset()
        for tensor in _tensors(args):
            sources |= origin.get(id(tensor), frozenset())
        reads[path] = reads.get(path, frozenset()) | sources

    return hook


def _writer(
    path: str, origin: dict[int, frozenset[str]], keep: list[torch.Tensor], depth: list[int]
) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        depth[0] -= 1
        for tensor in _tensors(out):  # a projection's output comes from it alone
            origin[id(tensor)] = frozenset({path})
            keep.append(tensor)

    return hook


def _classify(
    linears: dict[str, nn.Module],
    reads: dict[str, frozenset[str]],
    written: frozenset[str],
    misuse: dict[str, set[str]],
    cuts: dict[str, set[tuple[int, tuple[int, ...]]]],
) -> BlockFlow:
    # in call order: the residual stream is the block's input plus what rowwise projections
    # wrote into it; a projection reading only the stream is colwise, one reading only
    # colwise outputs and writing the block's output rowwise (joining the stream)
    stream = {_INPUT}
    styles: dict[str, Style | Packed] = {}
    problems: list[tuple[str, str]] = []
    for path, read in reads.items():
        sources = sorted(read - stream)
        split = {p for p, style in styles.items() if style == "colwise"}
        if read <= stream:
            styles[path] = "colwise"
            continue
        if read & stream:
            why = (
                f"reads both the residual stream and the output of {sources}; a projection is split colwise "
                "when it reads the stream, rowwise when it reads split outputs only"
            )
        elif not read <= split:
            others = sorted(read - split)
            why = (
                f"reads the output of {others}, which do not read the residual stream: a chain of "
                "projections has no colwise/rowwise split"
            )
        elif path not in written:
            why = (
                f"reads split outputs ({sources}) but does not write the block's output (the residual "
                "stream), so no all-reduce makes its output whole"
            )
        else:
            styles[path] = "rowwise"
            stream.add(path)
            continue
        problems.append((path, why))
    problems += [(path, "never called in the traced forward") for path in linears if path not in reads]
    read_back = {source for path, style in styles.items() if style == "rowwise" for source in reads[path]}
    for path, style in list(styles.items()):
        if style != "colwise":
            continue
        if path not in read_back:
            problems.append((path, "reads the residual stream, but no rowwise projection reads its output"))
        if misuse.get(path):
            problems.append(
                (
                    path,
                    f"its output passes through {sorted(misuse[path])}, which mix or cut its features (a "
                    "reduction or norm over the split width, a slice of its features); only elementwise ops, "
                    "views to heads, attention and a split of its whole output into pieces may run between "
                    "colwise and rowwise",
                )
            )
        elif path in cuts:
            packed, why = _packed(linears[path], cuts[path])
            if packed is not None:
                styles[path] = packed
            else:
                problems.append((path, why))
    return BlockFlow(tuple(styles.items()), tuple(problems))


def _packed(linear: nn.Module, cuts: set[tuple[int, tuple[int, ...]]]) -> tuple[Packed | None, str]:
    # a fused projection: its whole output cut into the same pieces wherever it is cut (each
    # rank then holds its share of each piece, and its own output cuts alike at 1/tp the sizes)
    width = int(getattr(linear, "out_features", 0))
    ways = sorted(cuts)
    if len(ways) == 1 and ways[0][0] == width:
        return Packed(ways[0][1]), ""
    found = ", ".join(f"{pieces} of {cut} features" for cut, pieces in ways)
    return None, (
        f"its output ({width} features) is cut into {found}; a fused projection's whole output must be cut "
        "into the same pieces wherever it is cut (split or chunk along its features) to split each piece "
        "on its own"
    )


def structural_rules(model: nn.Module) -> list[tuple[str, Style | Packed]]:
    """Tensor-parallel rules for ``model`` from its structure (see the module docstring).

    Args:
        model: the module to split (called on token ids to see what its blocks are passed).

    Returns:
        ``(module path, style)`` pairs in model order: projections, norms, embedding and head.

    Raises:
        PolicyError: no repeated blocks, or projections the trace cannot classify (each named, with why).

    Examples:
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
        ...     def forward(self, x):
        ...         return x + self.down(torch.relu(self.up(self.norm(x))))
        >>> model = nn.Sequential(nn.Embedding(10, 8), Block(), Block(), nn.Linear(8, 10))
        >>> structural_rules(model)[:3]
        [('0', 'rowwise'), ('1.norm', 'sequence'), ('1.up', 'colwise')]
    """
    tree = read_model(model)
    blocks = [path for path, _ in repeated_blocks(tree)]
    if not blocks:
        raise PolicyError(
            "tp('auto'): the model has no repeated blocks (elements of a ModuleList, ModuleDict or "
            "Sequential) to derive rules from; pass rules: fs.tp([(pattern, 'colwise'), ...], axis)"
        )
    found: dict[str, Style | Packed] = {}
    problems: list[str] = []
    flows: dict[tuple[Any, ...], BlockFlow] = {}
    calls = block_calls(model, blocks)
    for block_path in blocks:
        block = model.get_submodule(block_path)
        # alike blocks are traced once: one class, same submodules and shapes
        kind = (type(block), *((path, type(m)) for path, m in block.named_modules()))
        kind += tuple((name, tuple(t.shape)) for name, t in _state(block))
        flow = flows.get(kind)
        if flow is None:
            flow = flows[kind] = trace_block(block, call=calls.get(block_path))
            problems += [f"{_join(block_path, relative)}: {why}" for relative, why in flow.problems]
        for relative, style in flow.styles:
            found[f"{block_path}.{relative}"] = style
        for relative, module in block.named_modules():
            if isinstance(module, _NORMS) and relative:
                found[f"{block_path}.{relative}"] = "sequence"
    if problems:
        raise PolicyError(
            "tp('auto'): cannot classify these modules from the model's data flow:\n"
            + "\n".join(f"  - {line}" for line in problems)
            + "\nPass rules of your own for them: fs.tp([(pattern, 'colwise'), ...], axis)"
        )
    inside = tuple(f"{path}." for path in blocks)
    outside = [(path, m) for path, m in model.named_modules() if path and not path.startswith(inside)]
    outside = [(path, m) for path, m in outside if path not in blocks]
    edge: dict[str, Style | Packed] = {}
    # the token embedding: the largest table (a learned position table is smaller, left whole)
    tables = {path: m.num_embeddings for path, m in outside if isinstance(m, nn.Embedding)}
    heads = [path for path, m in outside if isinstance(m, nn.Linear)]
    token = max(tables, key=lambda path: tables[path]) if tables else None
    if token is not None:
        edge[token] = "rowwise"

    # a head tied to the token embedding splits the shared (vocabulary, dim) weight as the
    # embedding does, on the vocabulary, wherever it is (BERT's pre-training decoder comes before
    # its next-sentence head); one tied to a table left whole stays whole too
    def shares(path: str, tensors: set[int]) -> bool:
        return any(id(p) in tensors for p in model.get_submodule(path).parameters())

    split = {id(p) for p in model.get_submodule(token).parameters()} if token is not None else set()
    whole = {id(p) for path in tables if path != token for p in model.get_submodule(path).parameters()}
    for path in heads:
        if shares(path, split):
            edge[path] = "colwise_gather"
    if heads and not shares(heads[-1], whole):
        edge[heads[-1]] = "colwise_gather"
    for path, module in outside:
        if isinstance(module, _NORMS):
            edge[path] = "sequence"
    order = {path: index for index, path in enumerate(dict(model.named_modules()))}
    return sorted({**found, **edge}.items(), key=lambda item: order[item[0]])
