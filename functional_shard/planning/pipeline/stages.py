"""Pipeline stages as data: which modules each stage runs, which pp rank holds it. Pure.

Cut as torchtitan cuts them: the repeated blocks are the units of work, the modules before them one
more with the first stage, those after one more with the last, split evenly (the remainder early).
Looped schedules put stage ``s`` on rank ``s % pp``; V-shaped ones stages ``s`` and ``2·pp − 1 − s``
on rank ``s``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence

from functional_shard.core.errors import PolicyError, counted
from functional_shard.core.tree import ModelTree, owner_paths
from functional_shard.core.validate import one_of, positive_int
from functional_shard.planning.tp.rules import layout_of

__all__ = ["SCHEDULES", "boundary_features", "rank_stages", "split_stages", "stage_finder", "stage_rank"]

SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""Our schedule names → the class in ``torch.distributed.pipelining.schedules``."""

SINGLE_STAGE = frozenset({"gpipe", "1f1b"})
"""Schedules that run exactly one stage per rank."""
V_SHAPED = frozenset({"zbv", "dualpipev"})
"""Schedules that run two stages per rank in a V (first and last stage on rank 0)."""


def check_schedule(schedule: str, stages_per_rank: int) -> None:
    """Refuse an unknown schedule, or a stage count per rank the schedule cannot run.

    Raises:
        PolicyError: naming the schedule, the count and what would work.
    """
    one_of(schedule, SCHEDULES, "schedule", error=PolicyError)
    positive_int(stages_per_rank, "stages_per_rank", meaning="model chunks each rank runs", error=PolicyError)
    if schedule in SINGLE_STAGE and stages_per_rank != 1:
        raise PolicyError(
            f"pipeline(schedule={schedule!r}, stages_per_rank={stages_per_rank}): {schedule!r} runs one "
            "stage per rank; use 'interleaved1f1b', 'looped_bfs' or 'interleaved_zb' for more"
        )
    if schedule in V_SHAPED and stages_per_rank != 2:
        raise PolicyError(
            f"pipeline(schedule={schedule!r}, stages_per_rank={stages_per_rank}): the V-shaped "
            f"schedule {schedule!r} runs exactly two stages per rank; set stages_per_rank=2"
        )


def stage_rank(stage: int, pp: int, stages_per_rank: int, schedule: str) -> int:
    """The pp coordinate of the rank that runs ``stage``.

    Examples:
        >>> stage_rank(5, 4, 2, "interleaved1f1b"), stage_rank(5, 4, 2, "zbv")
        (1, 2)
    """
    stages = pp * stages_per_rank
    if not 0 <= stage < stages:
        raise PolicyError(f"stage {stage} does not exist: {pp} ranks × {stages_per_rank} stages each")
    if schedule in V_SHAPED:
        return stage if stage < pp else stages - 1 - stage
    return stage % pp


def rank_stages(rank: int, pp: int, stages_per_rank: int, schedule: str) -> tuple[int, ...]:
    """The stages pp coordinate ``rank`` runs, in increasing order.

    Examples:
        >>> rank_stages(0, 4, 2, "interleaved1f1b"), rank_stages(0, 4, 2, "zbv")
        ((0, 4), (0, 7))
    """
    return tuple(
        s for s in range(pp * stages_per_rank) if stage_rank(s, pp, stages_per_rank, schedule) == rank
    )


def _owner_module(path: str) -> str:
    return path.rpartition(".")[0]


def _param_names(tree: ModelTree) -> list[str]:
    """Every name of every parameter: a tied head's ``lm_head.weight`` as well as its embedding's."""
    names = dict.fromkeys(tree.params)
    for canonical in tree.params:
        names.update(dict.fromkeys(tree.aliases.get(canonical, ())))
    return list(names)


def _outer(tree: ModelTree) -> tuple[list[str], list[str], list[str]]:
    """(modules before the blocks, the blocks, modules after), each a param-owning module path."""
    blocks = [block.path for block in tree.blocks]
    in_block = {path for block in tree.blocks for path in block.params}
    order = {path: index for index, path in enumerate(tree.modules)}
    first = order[blocks[0]] if blocks else len(order)
    before: list[str] = []
    after: list[str] = []
    for path in _param_names(tree):
        if path in in_block:
            continue
        owner = _owner_module(path)
        side = before if order.get(owner, 0) < first else after
        if owner not in side:
            side.append(owner)
    before.sort(key=lambda m: order.get(m, 0))
    after.sort(key=lambda m: order.get(m, 0))
    return before, blocks, after


def _from_pieces(tree: ModelTree, pieces: Sequence[str]) -> tuple[list[str], list[str], list[str]] | None:
    """`_outer` read from a model's own list of pipeline pieces (an HF ``_pp_plan``), in order.

    None when the pieces do not name the blocks' parent or leave a parameter out.
    """
    blocks = [block.path for block in tree.blocks]
    parents = {path.rpartition(".")[0] for path in blocks}
    if len(parents) != 1 or (parent := parents.pop()) not in pieces:
        return None
    cut = list(pieces).index(parent)
    before = [p for p in pieces[:cut] if p in tree.modules]
    after = [p for p in pieces[cut + 1 :] if p in tree.modules]
    covered = [*before, parent, *after]
    if not all(any(m == "" or path.startswith(m + ".") for m in covered) for path in _param_names(tree)):
        return None
    return before, blocks, after


def split_stages(
    tree: ModelTree,
    stages: int,
    split: Sequence[Iterable[str]] | None = None,
    pieces: Sequence[str] | None = None,
) -> tuple[tuple[str, ...], ...]:
    """The module paths of each stage, torchtitan's way or as ``split`` says.

    ``pieces``: a model's own ordered pipeline pieces (Hugging Face's ``base_model_pp_plan``), used
    where they name the block list and miss no parameter.

    Raises:
        PolicyError: no repeated blocks, fewer units than stages, or a bad ``split``.

    Examples:
        >>> from functional_shard import zoo
        >>> from functional_shard.core.tree import read_model
        >>> stages = split_stages(read_model(zoo.llama("tiny")), 2)
        >>> stages[0][:2], stages[1][-2:]
        (('embed_tokens', 'layers.0'), ('norm', 'lm_head'))
    """
    if split is not None:
        return _checked_split(tree, stages, split)
    before, blocks, after = (pieces and _from_pieces(tree, pieces)) or _outer(tree)
    if not blocks:
        raise PolicyError(
            "pipeline(): the model has no repeated blocks (an nn.ModuleList of layers) to cut "
            "into stages; pass split=[[module paths of stage 0], [of stage 1], ...]"
        )
    units: list[list[str]] = ([before] if before else []) + [[b] for b in blocks] + ([after] if after else [])
    if len(units) < stages:
        sides = " and ".join(side for side, held in (("before", before), ("after", after)) if held)
        raise PolicyError(
            f"pipeline(): {stages} stages but only {counted(len(blocks), 'block')}"
            + (f" plus the modules {sides} them" if sides else "")
            + f" to share; use at most {counted(len(units), 'stage')}"
        )
    size, extra = divmod(len(units), stages)
    out: list[tuple[str, ...]] = []
    start = 0
    for stage in range(stages):
        take = size + (1 if stage < extra else 0)
        out.append(tuple(path for unit in units[start : start + take] for path in unit))
        start += take
    return tuple(out)


def _checked_split(
    tree: ModelTree, stages: int, split: Sequence[Iterable[str]]
) -> tuple[tuple[str, ...], ...]:
    given = tuple(tuple(stage) for stage in split)
    if len(given) != stages:
        raise PolicyError(
            f"pipeline(split=...): {counted(len(given), 'stage')} listed, but the plan has "
            f"{counted(stages, 'stage')}; list the modules of each stage"
        )
    seen: dict[str, int] = {}
    problems = []
    for index, stage in enumerate(given):
        if not stage:
            problems.append(f"stage {index} lists no module")
        for path in stage:
            if path not in tree.modules:
                problems.append(f"stage {index}: {path!r} is not a module of the model")
            elif path in seen:
                problems.append(f"{path!r} is in stages {seen[path]} and {index}")
            seen[path] = index
    problems += _nested_across_stages(seen)
    for path in _param_names(tree):
        owners = [m for m in seen if m == "" or path.startswith(m + ".")]
        if not owners:
            problems.append(f"parameter {path!r} is in no stage")
    if not problems:
        problems = _blocks_out_of_order(tree, given)
    if problems:
        raise PolicyError("pipeline(split=...):\n" + "\n".join(f"* {p}" for p in problems))
    return given


def _nested_across_stages(seen: dict[str, int]) -> list[str]:
    """A listed module inside one another stage lists: the other's ranks would drop it with its parent."""
    return [
        f"{path!r} (stage {stage}) is inside {outer!r} (stage {seen[outer]}); list the parts of "
        f"{repr(outer) if outer else 'the model'} each stage runs instead"
        for path, stage in seen.items()
        for outer in list(owner_paths(path))[1:]
        if outer in seen and seen[outer] != stage
    ]


def _blocks_out_of_order(tree: ModelTree, stages: tuple[tuple[str, ...], ...]) -> list[str]:
    """Blocks of one list that a later stage runs before an earlier one: the forward runs them in order."""
    stage_of = stage_finder(stages)
    lists: dict[str, list[str]] = {}
    for block in tree.blocks:
        lists.setdefault(block.path.rpartition(".")[0], []).append(block.path)
    problems = []
    for blocks in lists.values():
        for earlier, later in itertools.pairwise(blocks):
            first, then = stage_of(earlier, module=True), stage_of(later, module=True)
            if first is not None and then is not None and then < first:
                problems.append(
                    f"{later!r} is in stage {then}, before {earlier!r} in stage {first}, but the forward "
                    "runs it after; give each stage the blocks after the previous stage's"
                )
                break
    return problems


# a search asks of a few cuts of one model again and again: each cut's finder (and what it
# found) is kept
@functools.lru_cache(maxsize=64)
def stage_finder(stages: tuple[tuple[str, ...], ...]) -> Callable[..., int | None]:
    """A function from a path to its stage (None when no stage holds it), memoized per module.

    A tensor belongs to the stage of its innermost listed enclosing module; a module (``module=True``)
    to its own or its innermost listed enclosing module's.

    Examples:
        >>> find = stage_finder((("embed", "layers.0"), ("layers.1", "head")))
        >>> find("layers.1.mlp.weight"), find("head.weight"), find("rope.freqs")
        (1, 1, None)
        >>> find("layers.0", module=True), find("layers.1.mlp", module=True), find("", module=True)
        (0, 1, None)
    """
    by_module = {module: stage for stage, modules in enumerate(stages) for module in modules}
    found: dict[str, int | None] = {}

    def stage_of(path: str, *, module: bool = False) -> int | None:
        owner = path if module else path.rpartition(".")[0]
        if owner not in found:
            found[owner] = next((by_module[m] for m in owner_paths(owner) if m in by_module), None)
        return found[owner]

    return stage_of


def tied_across_stages_fix(stages: Iterable[int | None], n_stages: int) -> str:
    """The fix for a tied parameter whose modules fall in ``stages`` of ``n_stages``.

    A split keeps the model's order, so a weight the first stage and the last both use (a causal
    LM's input embedding tied to its head) stays split across stages whatever the split.

    Examples:
        >>> tied_across_stages_fix([0, 3], 4).endswith("or plan it without pipeline()")
        True
        >>> "pipeline(split=...)" in tied_across_stages_fix([1, 2], 4)
        True
    """
    untie = (
        "untie it, each module with its own copy of the weight, as torchtitan requires under a pipeline "
        "(Hugging Face: tie_word_embeddings=False, then copy the loaded embedding into the head)"
    )
    if {0, n_stages - 1} <= set(stages):
        return f"{untie}, or plan it without pipeline()"
    return f"{untie}, or put every module that uses it in one stage with pipeline(split=...)"


def _output_features(tree: ModelTree, path: str) -> int | None:
    """Features of what the module owning the weight at ``path`` outputs.

    A Linear's weight is (out, in), a Conv1D's (in, out), an Embedding's (num, dim), a norm's its width.
    """
    tensor = tree.params[path]
    if tensor.ndim == 1:
        return tensor.shape[0]
    if tensor.ndim == 2:
        return tensor.shape[1] if layout_of(tensor) in ("embedding", "conv1d") else tensor.shape[0]
    return None


def boundary_features(
    tree: ModelTree, stages: tuple[tuple[str, ...], ...], hidden_size: int | None = None
) -> tuple[int, ...]:
    """Features per token of the activation stage ``s`` sends to stage ``s + 1``, per boundary.

    ``hidden_size`` where the model's config names it, else the last weighted module's output features
    in the sending stage; 0 where neither says.

    Examples:
        >>> from functional_shard import zoo
        >>> from functional_shard.core.tree import read_model
        >>> tree = read_model(zoo.llama("tiny"))
        >>> boundary_features(tree, split_stages(tree, 2)), tree.params["norm.weight"].shape
        ((64,), (64,))
    """
    if hidden_size is not None:
        return tuple(hidden_size for _ in stages[1:])
    stage_of = stage_finder(stages)
    last: dict[int, str] = {}  # each stage's last weight with 1 or 2 dims, in model order
    for path, tensor in tree.params.items():
        if path.endswith(".weight") and tensor.ndim in (1, 2) and (stage := stage_of(path)) is not None:
            last[stage] = path
    return tuple(_output_features(tree, last[s]) or 0 if s in last else 0 for s in range(len(stages) - 1))
