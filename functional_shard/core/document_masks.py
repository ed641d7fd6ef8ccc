"""Where packed documents begin, as models read it: positions, masks, and the check of both.

`document_mask` keeps attention inside each document; `check_packed_inputs` refuses ids or positions
that do not describe documents laid end to end (`functional_shard.core.packing.pack` lays them out).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from .errors import ShardingError, bullets

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "attend_within_documents",
    "check_microbatch_documents",
    "check_packed_inputs",
    "check_pipelined_documents",
    "document_attention_mask",
    "document_block_mask",
    "document_mask",
    "document_positions",
    "rank_share",
    "values_checked",
]


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document: 0 where its id first appears in the row, then 1, 2, ...

    Tensor operations only: it runs on fake and meta tensors too.

    Examples:
        >>> document_positions(torch.tensor([[0, 0, 0, 1, 1, 2]])).tolist()
        [[0, 1, 2, 0, 1, 0]]
    """
    index = torch.arange(document_ids.shape[-1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The ``(rows, 1, seq, seq)`` boolean attention mask that keeps causal attention inside documents.

    True where the key is at or before the query in the same document, for SDPA's ``attn_mask``.
    Tensor operations only: it runs on fake and meta tensors too.

    Examples:
        >>> document_mask(torch.tensor([[0, 0, 1]])).int().tolist()
        [[[[1, 0, 0], [1, 1, 0], [0, 0, 1]]]]
    """
    seq = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal)[:, None]


def document_block_mask(document_ids: torch.Tensor) -> BlockMask:
    """Flex attention's block mask keeping causal attention inside documents.

    Its kernel skips every block of query-key pairs the mask holds wholly out, so a row of short
    documents costs their causal triangles, not the row's. Flex attention imports here, lazily.

    Examples:
        >>> document_block_mask(torch.tensor([[0] * 100 + [1] * 156])).shape
        (1, 1, 256, 256)
    """
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(row: Any, head: Any, query: Any, key: Any) -> Any:
        return (document_ids[row, query] == document_ids[row, key]) & (query >= key)

    rows, seq = document_ids.shape
    # compiled on CUDA so the mask is made block by block, never as a whole seq x seq tensor
    make: Callable[..., BlockMask] = (
        _compiled(create_block_mask) if document_ids.is_cuda else create_block_mask
    )
    return make(same_document_causal, rows, None, seq, seq, device=document_ids.device)


def document_attention_mask(document_ids: torch.Tensor) -> torch.Tensor | BlockMask:
    """The mask a model's attention takes for ``document_ids``, as `attend_within_documents` runs it.

    On CUDA, flex attention's block mask (`document_block_mask`); elsewhere, and for a cp rank's
    share (`rank_share`: the context-parallel engine routes SDPA calls, reading their masks), SDPA's
    boolean mask (`document_mask`): flex attention has no backward on the CPU.

    Examples:
        >>> document_attention_mask(torch.tensor([[0, 0, 1]])).dtype
        torch.bool
    """
    if document_ids.is_cuda and not _share.get():
        return document_block_mask(document_ids)
    return document_mask(document_ids)


def attend_within_documents(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | BlockMask
) -> torch.Tensor:
    """Attention of ``(rows, heads, seq, head_dim)`` tensors under `document_attention_mask`'s ``mask``.

    A boolean mask goes to SDPA; a block mask to flex attention, compiled on CUDA (eager flex
    attention, forward only, elsewhere: it scores every pair).

    Examples:
        >>> q = torch.randn(1, 2, 3, 4)
        >>> ids = torch.tensor([[0, 0, 1]])
        >>> out = attend_within_documents(q, q, q, document_attention_mask(ids))
        >>> torch.allclose(out[:, :, 2], q[:, :, 2])  # the last token's document is itself alone
        True
    """
    if isinstance(mask, torch.Tensor):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    from torch.nn.attention.flex_attention import flex_attention

    run = _compiled(flex_attention) if query.is_cuda else cast("Callable[..., Any]", flex_attention)
    return cast(torch.Tensor, run(query, key, value, block_mask=mask))


@functools.cache
def _compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    # flex attention runs its fused kernel only compiled; one compiled function serves every call
    return torch.compile(function)


# set while a context-parallel step runs a model on its rank's share of rows it checked whole
_share: contextvars.ContextVar[bool] = contextvars.ContextVar("_share", default=False)


# set while a model runs on some of the rows whose values its step checked whole, up front
_checked: contextvars.ContextVar[bool] = contextvars.ContextVar("_checked", default=False)


@contextlib.contextmanager
def values_checked() -> Iterator[None]:
    """Within it, `check_packed_inputs` checks shapes and dtypes only: the caller checked the values.

    A pipeline's step checks its rows whole before the schedule runs, on every rank alike
    (`check_pipelined_documents`); each stage's forward then runs on a micro-batch of those rows,
    where a check of their values again would read the device once a micro-batch and a stage. Unlike
    `rank_share`, the rows are whole rows, and the model's attention mask its usual one.

    Examples:
        >>> ids = torch.tensor([[0, 2, 2]])  # no document 1: refused outside
        >>> with values_checked():
        ...     check_packed_inputs(ids, positions=None, document_ids=ids)
    """
    token = _checked.set(True)
    try:
        yield
    finally:
        _checked.reset(token)


@contextlib.contextmanager
def rank_share() -> Iterator[None]:
    """Within it, `check_packed_inputs` checks shapes and dtypes only: the rows are a cp rank's share.

    A share holds pieces of documents, not documents laid end to end, so its values cannot pass
    the check; the step that cut it checked the whole rows first.

    Examples:
        >>> ids = torch.tensor([[0, 0, 2, 2]])  # documents 0 and 2 of a row, without 1
        >>> with rank_share():
        ...     check_packed_inputs(ids, positions=torch.tensor([[0, 3, 4, 5]]), document_ids=ids)
    """
    token = _share.set(True)
    try:
        yield
    finally:
        _share.reset(token)


def check_packed_inputs(
    tokens: torch.Tensor,
    *,
    positions: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    who: str = "forward",
) -> None:
    """Refuse positions and document ids that do not describe documents laid end to end.

    As `functional_shard.core.packing.pack` makes them. ``tokens`` may be the ``(rows, seq, features)``
    hidden states a later pipeline stage runs the model on. Positions without document ids may not restart
    inside a row (attention would cross documents). Values are checked on real tensors only, and not
    within `rank_share` or `values_checked`.

    Raises:
        ShardingError: a shape or dtype other than the tokens', or values as above, one bullet a row.

    Examples:
        >>> batch = fs.pack([[1, 2], [3, 4, 5]], seq_len=6)
        >>> ids = batch.document_ids
        >>> check_packed_inputs(batch.tokens, positions=batch.positions, document_ids=ids)
        >>> check_packed_inputs(batch.tokens, positions=torch.arange(6)[None], document_ids=ids)
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: forward: positions disagree with document_ids in 1 row:
        * row 0: token 2 is at position 2, but it is token 0 of its document (which starts at token 2)
        Pass positions that count 0, 1, 2, ... from each document's first token ...
    """
    if positions is None and document_ids is None:
        return
    for name, value in (("positions", positions), ("document_ids", document_ids)):
        _check_shape(tokens, name, value, who)
    if not _values_to_check(tokens, positions, document_ids):
        return
    if bool(torch.stack(_well_formed(positions, document_ids)).all()):
        return  # one look at the device's answer; the rows are read only to say what is wrong
    if document_ids is not None:
        _raise_for_rows(
            who,
            "document_ids do not count up by one from 0",
            _id_problems(document_ids),
            "Pass ids that are 0 for each row's first document and one more at each next one "
            "(pack() makes them: PackedBatch.document_ids).",
        )
    if positions is not None and document_ids is not None:
        _raise_for_rows(
            who,
            "positions disagree with document_ids",
            _position_problems(positions, document_positions(document_ids)),
            "Pass positions that count 0, 1, 2, ... from each document's first token "
            "(PackedBatch.positions).",
        )
    elif positions is not None:
        _raise_for_rows(
            who,
            "positions restart inside a row, as packed documents' do, without document_ids",
            _restart_problems(positions),
            "Pass document_ids too (PackedBatch.document_ids) so that attention stays inside each "
            "document; positions alone only turn the rotary embedding.",
        )


def check_microbatch_documents(
    positions: torch.Tensor | None, document_ids: torch.Tensor | None, microbatches: int, who: str
) -> None:
    """Refuse a document that goes on from one pipeline micro-batch into the next.

    A pipeline cuts its batch into micro-batches between rows, and runs each apart. A row whose
    first token is not at position 0 while ``document_ids`` say a document starts there holds the
    rest of a document begun in the row before: at the first row of a micro-batch, it straddles two.
    Positions alone say nothing of where documents start: a row of them is one document, whatever
    its first position, and no row attends to another in one process either. Values are checked on
    real tensors only.

    Raises:
        ShardingError: one bullet a straddling row, with the fix.

    Examples:
        >>> ids = torch.zeros(4, 3, dtype=torch.long)
        >>> positions = torch.tensor([[0, 1, 2], [3, 4, 5], [0, 1, 2], [0, 1, 2]])
        >>> check_microbatch_documents(positions, ids, 4, who="step")
        Traceback (most recent call last):
        ...
        functional_shard.ShardingError: step: a document straddles two pipeline micro-batches in 1 row:
        * row 1, micro-batch 1's first, starts at position 3: its document goes on from row 0, ...
        >>> check_microbatch_documents(positions, ids, 2, who="step")  # rows 0 and 1 run together
    """
    firsts = _microbatch_firsts(positions, document_ids, microbatches)
    if positions is None or firsts is None:
        return
    going_on = (positions[firsts, 0] != 0).nonzero().flatten().tolist()
    per = positions.shape[0] // microbatches
    problems = [
        f"row {int(firsts[i])}, micro-batch {int(firsts[i]) // per}'s first, starts at position "
        f"{int(positions[firsts[i], 0])}: its document goes on from row {int(firsts[i]) - 1}, in "
        f"micro-batch {int(firsts[i]) // per - 1}"
        for i in going_on
    ]
    _raise_for_rows(
        who,
        "a document straddles two pipeline micro-batches",
        problems,
        "Each micro-batch's rows run apart, and no row attends to another: pack every document into "
        "one row (fs.pack does; long='split' makes each piece a document of its own, from position 0).",
    )


def check_pipelined_documents(
    tokens: torch.Tensor,
    *,
    positions: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    microbatches: int,
    who: str,
) -> None:
    """`check_microbatch_documents`, then `check_packed_inputs`, with one look at the device for both.

    A pipeline's step checks its rows so before its schedule runs; its stages then check their
    micro-batches' shapes alone (`values_checked`). The rows are read, to say what is wrong, only
    where that one look finds something.

    Raises:
        ShardingError: as `check_microbatch_documents`, then as `check_packed_inputs`.

    Examples:
        >>> batch = fs.pack([[1, 2], [3, 4, 5], [6, 7]], seq_len=3)
        >>> check_pipelined_documents(
        ...     batch.tokens, positions=batch.positions, document_ids=batch.document_ids,
        ...     microbatches=3, who="step")
    """
    if _pass_both(tokens, positions, document_ids, microbatches):
        return
    check_microbatch_documents(positions, document_ids, microbatches, who)
    check_packed_inputs(tokens, positions=positions, document_ids=document_ids, who=who)


def _pass_both(
    tokens: torch.Tensor, positions: torch.Tensor | None, document_ids: torch.Tensor | None, microbatches: int
) -> bool:
    """Whether both checks of `check_pipelined_documents` pass, read from the device once.

    False wherever the checks answer without that read (no values to check, a refused shape), so
    that they run as they are.
    """
    if positions is None and document_ids is None:
        return True
    shaped = all(
        _shape_problem(tokens, name, value, "") is None
        for name, value in (("positions", positions), ("document_ids", document_ids))
    )
    if not shaped or not _values_to_check(tokens, positions, document_ids):
        return False
    checks = _well_formed(positions, document_ids)
    firsts = _microbatch_firsts(positions, document_ids, microbatches)
    if positions is not None and firsts is not None:
        checks.append((positions[firsts, 0] == 0).all())
    return bool(torch.stack(checks).all())


def _microbatch_firsts(
    positions: torch.Tensor | None, document_ids: torch.Tensor | None, microbatches: int
) -> torch.Tensor | None:
    """The rows that begin each micro-batch but the first, where a document could straddle two; or None."""
    if positions is None or document_ids is None or not _has_values(positions, document_ids):
        return None
    rows = positions.shape[0]
    if microbatches < 2 or rows % microbatches:
        return None
    return torch.arange(rows // microbatches, rows, rows // microbatches, device=positions.device)


def _check_shape(tokens: torch.Tensor, name: str, value: Any, who: str) -> None:
    problem = _shape_problem(tokens, name, value, who)
    if problem is not None:
        raise ShardingError(problem)


def _shape_problem(tokens: torch.Tensor, name: str, value: Any, who: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return f"{who}({name}={type(value).__name__}): pass a tensor shaped like the tokens"
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        return f"{who}: {name} holds {value.dtype} values; pass integers (torch.long)"
    # a later pipeline stage's model is given the hidden states, (rows, seq, features)
    rows_by_seq = tuple(tokens.shape[:2])
    if tuple(value.shape) != rows_by_seq:
        return (
            f"{who}: {name} has shape {tuple(value.shape)}, but the tokens have {rows_by_seq}; "
            f"pass one {name[:-1].replace('_id', ' id')} a token (rows x seq_len, as PackedBatch.{name})"
        )
    return None


def _values_to_check(
    tokens: torch.Tensor, positions: torch.Tensor | None, document_ids: torch.Tensor | None
) -> bool:
    """Whether `check_packed_inputs` looks at the values: real, non-empty, not a share, not checked."""
    if tokens.numel() == 0 or _share.get() or _checked.get():
        return False
    return _has_values(tokens, positions, document_ids)


def _well_formed(positions: torch.Tensor | None, document_ids: torch.Tensor | None) -> list[torch.Tensor]:
    """`check_packed_inputs`' conditions on the values, each a boolean tensor on their device, unread."""
    checks = []
    if document_ids is not None:
        # in int64: in the ids' own narrow dtype, uint8's 255 -> 0 (a row's 257th document) steps by one
        steps = document_ids.long().diff(dim=-1)
        checks += [(document_ids[:, :1] == 0).all(), ((steps == 0) | (steps == 1)).all()]
        if positions is not None:
            checks.append((positions == document_positions(document_ids)).all())
    elif positions is not None:
        checks.append((positions[:, 1:] != 0).all())
    return checks


def _has_values(*tensors: torch.Tensor | None) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return not any(
        isinstance(tensor, FakeTensor) or tensor.device.type == "meta"
        for tensor in tensors
        if tensor is not None
    )


def _id_problems(document_ids: torch.Tensor) -> list[str]:
    problems = []
    for row, ids in enumerate(document_ids.tolist()):
        if ids and ids[0] != 0:
            problems.append(f"row {row}: its first document has id {ids[0]}, not 0")
            continue
        for token in range(1, len(ids)):
            if ids[token] - ids[token - 1] not in (0, 1):
                problems.append(
                    f"row {row}: the id goes from {ids[token - 1]} to {ids[token]} at token {token}"
                )
                break
    return problems


def _position_problems(positions: torch.Tensor, expected: torch.Tensor) -> list[str]:
    problems = []
    for row in range(positions.shape[0]):
        wrong = (positions[row] != expected[row]).nonzero()
        if wrong.numel():
            token = int(wrong[0, 0])
            place = int(expected[row, token])
            problems.append(
                f"row {row}: token {token} is at position {int(positions[row, token])}, but it is "
                f"token {place} of its document (which starts at token {token - place})"
            )
    return problems


def _restart_problems(positions: torch.Tensor) -> list[str]:
    problems = []
    for row in range(positions.shape[0]):
        restarts = (positions[row, 1:] == 0).nonzero()
        if restarts.numel():
            problems.append(f"row {row}: position 0 again at token {int(restarts[0, 0]) + 1}")
    return problems


def _raise_for_rows(who: str, what: str, problems: list[str], fix: str) -> None:
    if not problems:
        return
    shown = problems[:5] + ([f"... and {len(problems) - 5} rows more"] if len(problems) > 5 else [])
    noun = "row" if len(problems) == 1 else "rows"
    raise ShardingError(bullets(f"{who}: {what} in {len(problems)} {noun}:", shown, fix))
