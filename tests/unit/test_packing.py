"""`fs.pack` and the zoo Llama on packed documents.

`pack` keeps every token in order, restarts positions at each document, fills rows next fit
and pads only after a row's last document; the zoo's tiny Llama gives a packed batch the
loss and the gradients of its documents run one by one.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import flex_attention

import functional_shard as fs
from functional_shard.core.document_masks import (
    check_microbatch_documents,
    check_packed_inputs,
    check_pipelined_documents,
    document_block_mask,
    document_mask,
    document_positions,
)
from functional_shard.core.packing import IGNORE_INDEX, DocumentTooLongError, counted_share, share_weighted
from functional_shard.frontends import model_zoo
from functional_shard.zoo import CONFIGS, Llama, llama

from .. import cp_cases
from ..strategies import documents


def _pieces(docs: list[list[int]], seq_len: int) -> list[list[int]]:
    """Each document cut into pieces of at most ``seq_len`` tokens, in order."""
    return [doc[start : start + seq_len] for doc in docs for start in range(0, len(doc), seq_len)]


# ---- pack: its invariants, drawn, and a table of hand-checked rows ------------------------


@given(docs=documents(), seq_len=st.integers(1, 24), pad_id=st.integers(0, 3))
def test_pack_keeps_every_token_in_order_and_restarts_positions(docs, seq_len, pad_id):
    batch = fs.pack(docs, seq_len, long="split", pad_id=pad_id)
    rows = batch.tokens.tolist()
    assert batch.tokens.shape == batch.positions.shape == batch.labels.shape == (len(rows), seq_len)
    segments = []
    for row, offsets in enumerate(batch.offsets):
        assert offsets[0] == 0
        assert all(a < b for a, b in itertools.pairwise(offsets))
        assert offsets[-1] <= seq_len
        assert len(batch.sources[row]) == len(offsets) - 1
        bounds = [*offsets, seq_len] if offsets[-1] < seq_len else list(offsets)
        for number, (start, stop) in enumerate(itertools.pairwise(bounds)):
            assert batch.positions[row, start:stop].tolist() == list(range(stop - start))
            assert batch.document_ids[row, start:stop].tolist() == [number] * (stop - start)
        for start, stop in itertools.pairwise(offsets):
            segments.append(rows[row][start:stop])
            assert batch.labels[row, start : stop - 1].tolist() == rows[row][start + 1 : stop]
            assert batch.labels[row, stop - 1] == IGNORE_INDEX
        # padding only after the row's last document, and it predicts nothing
        assert rows[row][offsets[-1] :] == [pad_id] * (seq_len - offsets[-1])
        assert set(batch.labels[row, offsets[-1] :].tolist()) <= {IGNORE_INDEX}
    assert segments == _pieces(docs, seq_len)
    assert [s for row in batch.sources for s in row] == [
        index for index, doc in enumerate(docs) for _ in range(0, len(doc), seq_len)
    ]
    assert batch.padding == len(rows) * seq_len - sum(len(doc) for doc in docs)
    assert torch.equal(document_positions(batch.document_ids), batch.positions)
    check_packed_inputs(batch.tokens, positions=batch.positions, document_ids=batch.document_ids)


@given(docs=documents(), seq_len=st.integers(1, 24))
def test_pack_fills_rows_next_fit(docs, seq_len):
    # a row ends only where the next piece would not fit in what is left of it
    batch = fs.pack(docs, seq_len, long="split")
    for offsets, following in zip(batch.offsets, batch.offsets[1:], strict=False):
        assert offsets[-1] + following[1] > seq_len


@given(docs=documents(), seq_len=st.integers(1, 24))
def test_cu_seqlens_bound_every_document_and_padding_over_the_flattened_rows(docs, seq_len):
    batch = fs.pack(docs, seq_len, long="split")
    bounds = batch.cu_seqlens.tolist()
    assert batch.cu_seqlens.dtype == torch.int32
    assert bounds[0] == 0
    assert bounds[-1] == batch.tokens.numel()
    assert all(a < b for a, b in itertools.pairwise(bounds))
    assert set(range(0, batch.tokens.numel(), seq_len)) <= set(bounds)  # no segment crosses rows
    flat = batch.positions.view(-1).tolist()
    assert [i for i, p in enumerate(flat) if p == 0] == bounds[:-1]


@given(docs=documents(), seq_len=st.integers(1, 24))
def test_pack_refuses_each_long_document_by_index_unless_split(docs, seq_len):
    long = [(index, len(doc)) for index, doc in enumerate(docs) if len(doc) > seq_len]
    if not long:
        assert fs.pack(docs, seq_len).offsets == fs.pack(docs, seq_len, long="split").offsets
        return
    with pytest.raises(DocumentTooLongError) as raised:
        fs.pack(docs, seq_len)
    message = str(raised.value)
    for index, length in long:
        assert f"* document {index} has {length} tokens" in message
    assert 'Pass long="split"' in message
    assert f"raise seq_len to {max(n for _, n in long)}" in message


@pytest.mark.parametrize(
    ("docs", "seq_len", "tokens", "offsets"),
    [
        ([[1, 2], [3, 4]], 4, [[1, 2, 3, 4]], ((0, 2, 4),)),
        ([[1, 2, 3], [4, 5]], 4, [[1, 2, 3, 0], [4, 5, 0, 0]], ((0, 3), (0, 2))),
        ([[1], [2, 3, 4, 5, 6]], 2, [[1, 0], [2, 3], [4, 5], [6, 0]], ((0, 1), (0, 2), (0, 2), (0, 1))),
        ([torch.tensor([7, 8]), (9,)], 3, [[7, 8, 9]], ((0, 2, 3),)),
    ],
)
def test_pack_by_hand(docs, seq_len, tokens, offsets):
    batch = fs.pack(docs, seq_len, long="split")
    assert batch.tokens.tolist() == tokens
    assert batch.offsets == offsets


def test_pack_by_hand_labels_and_ids():
    batch = fs.pack([[1, 2, 3], [4, 5]], 6, pad_id=9)
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 5, 9]]
    assert batch.labels.tolist() == [[2, 3, -100, 5, -100, -100]]
    assert batch.document_ids.tolist() == [[0, 0, 0, 1, 1, 2]]
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 6]
    assert (batch.seq_len, batch.padding, batch.pad_id) == (6, 1, 9)


@pytest.mark.parametrize(
    ("docs", "kwargs", "message"),
    [
        ([[1, 2, 3]], {"seq_len": 0}, "pack(seq_len=0): a positive int (the tokens in each row)"),
        (
            [[1]],
            {"seq_len": 4, "long": "truncate"},
            "pack(long='truncate'): one of 'refuse', 'split' (what to do",
        ),
        ([[1]], {"seq_len": 4, "pad_id": 0.5}, "pack(pad_id=0.5): an int of at least 0 (the token id"),
        # before: accepted, and the embedding read row -1 (or raised deep inside the model)
        (
            [[1]],
            {"seq_len": 4, "pad_id": -100},
            "pack(pad_id=-100): an int of at least 0 (the token id of the padding; token ids count from 0)",
        ),
        # before: a raw OverflowError from torch.full
        (
            [[1]],
            {"seq_len": 4, "pad_id": 2**63},
            "pack(pad_id=9223372036854775808): an int of at most 9223372036854775807, the largest int64 "
            "(the token id of the padding",
        ),
        ([], {"seq_len": 4}, "pack(seq_len=4): no documents to pack"),
        ("abc", {"seq_len": 4}, "pack(documents=str): pass a sequence of documents"),
        (
            [[1], [], [0.5, 1.5], [[1, 2]], "hi"],
            {"seq_len": 4},
            "pack(seq_len=4): 4 of 5 documents cannot be packed:\n* document 1 is empty\n"
            "* document 2 holds torch.float32 values, not integer token ids\n"
            "* document 3 has shape (1, 2), not one dim of token ids\n* document 4 is a str, not token ids",
        ),
        (
            [[1, 2], [3, -1, -7]],
            {"seq_len": 4},
            "* document 1 holds a negative token id (-7); token ids count from 0",
        ),
        # before: "document 1 (list) is not a sequence of token ids"
        (
            [[1], [3, 2**70]],
            {"seq_len": 4},
            "* document 1 holds token id 1180591620717411303424 at position 1, outside int64 "
            "(token ids: 0 to 9223372036854775807)",
        ),
        # before: packed, as the negative id -9223372036854775803
        (
            [torch.tensor([3, 2**63 + 5], dtype=torch.uint64)],
            {"seq_len": 4},
            "* document 0 holds token id 9223372036854775813 at position 1, outside int64",
        ),
        # before: packed, True as token id 1
        (
            [[1, 2], [1, True]],
            {"seq_len": 4},
            "* document 1 holds a bool at position 1, not an integer token id",
        ),
    ],
)
def test_pack_refuses_what_it_cannot_pack(docs, kwargs, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.pack(docs, **kwargs)


def test_a_long_document_is_a_sharding_error_naming_the_fix():
    with pytest.raises(
        fs.ShardingError,
        match=re.escape(
            "pack(seq_len=3): 2 documents are longer than a row:\n* document 0 has 4 tokens\n"
            '* document 2 has 5 tokens\nPass long="split" to cut each into pieces of at most 3 tokens, '
            "or raise seq_len to 5."
        ),
    ):
        fs.pack([[1, 2, 3, 4], [5], [1, 2, 3, 4, 5]], 3)


# ---- the zoo Llama on packed documents ---------------------------------------------------

MODEL = Llama(CONFIGS["tiny"])
torch.manual_seed(0)
for _parameter in MODEL.parameters():
    torch.nn.init.normal_(_parameter, std=0.1)


def _loss_and_grads(loss: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    grads = torch.autograd.grad(loss, list(MODEL.parameters()))
    return loss.detach(), list(grads)


@settings(max_examples=20)
@given(docs=documents(max_documents=5, max_length=12), seq_len=st.integers(4, 16), rotary=st.booleans())
def test_a_packed_batch_has_the_loss_and_gradients_of_its_documents_alone(docs, seq_len, rotary):
    batch = fs.pack(docs, seq_len, long="split")
    positions = batch.positions if rotary else None
    logits = MODEL(batch.tokens, positions=positions, document_ids=batch.document_ids)
    packed = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")
    alone = torch.zeros(())
    for piece in _pieces(docs, seq_len):
        tokens = torch.tensor([piece])
        at = torch.arange(len(piece))[None] if rotary else None
        out = MODEL(tokens, positions=at)
        alone = alone + F.cross_entropy(out[0, :-1], tokens[0, 1:], reduction="sum")
    packed_loss, packed_grads = _loss_and_grads(packed)
    alone_loss, alone_grads = _loss_and_grads(alone)
    torch.testing.assert_close(packed_loss, alone_loss)
    torch.testing.assert_close(packed_grads, alone_grads)


@settings(max_examples=5, deadline=None)
@given(docs=documents(max_documents=5, max_length=40), seq_len=st.integers(8, 48))
def test_flex_attentions_block_mask_gives_the_logits_of_sdpas_boolean_mask(docs, seq_len):
    # the path CUDA takes (flex attention skipping masked blocks), run eagerly, forward only:
    # flex attention has no backward on the CPU
    batch = fs.pack(docs, seq_len, long="split")
    inputs = {"positions": batch.positions, "document_ids": batch.document_ids}
    with torch.no_grad():
        on_sdpa = MODEL(batch.tokens, **inputs)
        with _flex_on_the_cpu():
            on_flex = MODEL(batch.tokens, **inputs)
    torch.testing.assert_close(on_flex, on_sdpa, atol=1e-5, rtol=1e-4)


@contextlib.contextmanager
def _flex_on_the_cpu() -> Iterator[None]:
    """Within it, the zoo Llama takes flex attention's block mask on the CPU, as on CUDA."""
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        # eager flex attention, the CPU's stand-in for the fused kernel, warns that it is not one,
        # and dynamo (which it runs under its eager backend) warns of ops it passes through
        warnings.simplefilter("ignore", UserWarning)
        patch.setattr(model_zoo, "document_attention_mask", document_block_mask)
        # the flex kernel's math in Python, without dynamo (whose state earlier tests in the run
        # change): forward only, as flex attention on the CPU is anyway
        patch.setattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
        yield


def test_an_unpacked_call_is_causal_over_the_row_without_rotary():
    tokens = torch.randint(0, 256, (2, 8))
    one_document = torch.zeros_like(tokens)
    with torch.no_grad():
        torch.testing.assert_close(MODEL(tokens), MODEL(tokens, document_ids=one_document))
        turned = MODEL(tokens, positions=torch.arange(8).expand(2, 8))
    assert not torch.allclose(MODEL(tokens).detach(), turned)


def test_document_mask_is_block_diagonal_and_causal():
    mask = document_mask(torch.tensor([[0, 0, 1, 1, 1, 2]]))[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


@pytest.mark.parametrize(
    ("positions", "document_ids", "message"),
    [
        (
            [[0, 1, 2, 3, 4, 5]],
            [[0, 0, 0, 1, 1, 1]],
            "Llama.forward: positions disagree with document_ids in 1 row:\n* row 0: token 3 is at "
            "position 3, but it is token 0 of its document (which starts at token 3)",
        ),
        (
            None,
            [[0, 0, 2, 2, 2, 2]],
            "Llama.forward: document_ids do not count up by one from 0 in 1 row:\n* row 0: the id goes "
            "from 0 to 2 at token 2",
        ),
        (None, [[1, 1, 1, 1, 2, 2]], "* row 0: its first document has id 1, not 0"),
        (None, [[0, 0, 1, 1, 0, 0]], "* row 0: the id goes from 1 to 0 at token 4"),
        (
            [[0, 1, 2, 0, 1, 2]],
            None,
            "Llama.forward: positions restart inside a row, as packed documents' do, without "
            "document_ids in 1 row:\n* row 0: position 0 again at token 3\nPass document_ids too",
        ),
        ([[0, 1, 2]], None, "Llama.forward: positions has shape (1, 3), but the tokens have (1, 6)"),
        ([[0.0] * 6], None, "Llama.forward: positions holds torch.float32 values; pass integers"),
    ],
)
def test_packed_inputs_that_describe_no_documents_are_refused_before_anything_runs(
    positions, document_ids, message
):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        MODEL(
            torch.zeros(1, 6, dtype=torch.long),
            positions=None if positions is None else torch.tensor(positions),
            document_ids=None if document_ids is None else torch.tensor(document_ids),
        )


@pytest.mark.parametrize(
    ("dtype", "wrap"), [(torch.uint8, "from 255 to 0"), (torch.int8, "from 127 to -128")]
)
def test_ids_of_a_narrow_dtype_that_wrap_around_are_refused(dtype, wrap):
    # a row's document past the dtype's largest id is read as id 0 (or the lowest) again: its
    # tokens would attend to the row's first document; counted in the ids' dtype, the step is one
    ids = torch.arange(torch.iinfo(dtype).max + 2).to(dtype)[None]
    tokens = torch.zeros(ids.shape, dtype=torch.long)
    message = f"step: document_ids do not count up by one from 0 in 1 row:\n* row 0: the id goes {wrap}"
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        check_packed_inputs(tokens, positions=None, document_ids=ids, who="step")
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        check_packed_inputs(tokens, positions=document_positions(ids), document_ids=ids, who="step")


# ---- the estimate traces the zoo model on fake tensors, packed or not ---------------------


def test_estimate_traces_the_zoo_model_with_and_without_packing():
    model = llama("tiny")
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp"))
    batch = fs.pack([[1] * 5, [2] * 9, [3] * 2], 8, long="split")
    inputs = {"tokens": batch.tokens, "positions": batch.positions, "document_ids": batch.document_ids}
    plain = fs.estimate(model, plan, batch=3, seq=8)
    packed = fs.estimate(model, plan, batch=3, seq=8, inputs=inputs)
    # the same weights; the packed step also holds the rotary angles and each row's mask
    assert packed.peak_bytes > plain.peak_bytes > 0


def test_a_straddle_is_seen_at_micro_batch_boundaries_only():
    ids = torch.zeros(4, 3, dtype=torch.long)
    going_on = torch.tensor([[0, 1, 2], [0, 1, 2], [3, 4, 5], [0, 1, 2]])
    with pytest.raises(
        fs.ShardingError, match=re.escape("row 2, micro-batch 1's first, starts at position 3")
    ):
        check_microbatch_documents(going_on, ids, 2, who="step")
    check_microbatch_documents(going_on, ids, 1, who="step")  # one micro-batch: nothing to straddle
    check_microbatch_documents(going_on, None, 2, who="step")  # positions alone: a row is one document


def test_a_later_pipeline_stage_checks_the_ids_against_its_hidden_states():
    batch = fs.pack([[1, 2], [3, 4, 5]], seq_len=6)
    hidden = torch.zeros(*batch.tokens.shape, 8)
    check_packed_inputs(hidden, positions=batch.positions, document_ids=batch.document_ids)
    with pytest.raises(fs.ShardingError, match=re.escape("has shape (1, 5), but the tokens have (1, 6)")):
        check_packed_inputs(hidden, positions=None, document_ids=batch.document_ids[:, :5])


def _refusal(check: Callable[[], object]) -> str | None:
    try:
        check()
    except fs.ShardingError as error:
        return str(error)
    return None


@given(docs=documents(max_length=12), seq_len=st.integers(2, 12), data=st.data())
def test_a_pipelines_check_refuses_as_its_two_checks_after_one_read(docs, seq_len, data):
    batch = fs.pack(docs, seq_len, long="split")
    positions, ids = batch.positions.clone(), batch.document_ids.clone()
    if data.draw(st.booleans(), label="corrupted"):
        wrong = data.draw(st.sampled_from([positions, ids]))
        wrong[data.draw(st.integers(0, len(batch) - 1)), data.draw(st.integers(0, seq_len - 1))] += 1
    given = data.draw(st.sampled_from([(positions, ids), (positions, None), (None, ids)]))
    rows = len(batch)
    microbatches = data.draw(st.sampled_from([m for m in range(1, rows + 1) if rows % m == 0]))

    def apart() -> None:
        check_microbatch_documents(*given, microbatches, who="step")
        check_packed_inputs(batch.tokens, positions=given[0], document_ids=given[1], who="step")

    expected = _refusal(apart)
    with cp_cases.counting_host_reads() as reads:
        got = _refusal(
            lambda: check_pipelined_documents(
                batch.tokens, positions=given[0], document_ids=given[1], microbatches=microbatches, who="step"
            )
        )
    assert got == expected
    if expected is None:  # the rows are read only to say what is wrong
        assert reads == {"aten._local_scalar_dense": 1}


@given(parts=st.sampled_from([1, 2, 4]), data=st.data())
def test_share_weighted_is_the_loss_weighted_by_its_counted_share(parts, data):
    rows = parts * data.draw(st.integers(1, 2))
    counts = data.draw(st.lists(st.booleans(), min_size=rows * 3, max_size=rows * 3))
    whole = torch.where(torch.tensor(counts).view(rows, 3), 7, IGNORE_INDEX)
    counted = (whole != IGNORE_INDEX).sum()
    for part in whole.chunk(parts):
        # a mean over no counted target is nan, as F.cross_entropy's
        empty = bool((part == IGNORE_INDEX).all())
        loss = torch.tensor(float("nan") if empty else data.draw(st.floats(0.125, 10.0, width=32)))
        weight = counted_share(part, whole, parts)
        expected = torch.tensor(0.0) if weight == 0.0 else loss * weight
        got = share_weighted(loss, part, counted, parts)
        torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True)


def test_a_part_of_padding_alone_adds_nothing_to_the_loss_nor_its_gradient():
    logits = torch.randn(3, 5, requires_grad=True)
    padding = torch.full((3,), IGNORE_INDEX)
    loss = F.cross_entropy(logits, padding)
    assert loss.isnan()
    weighted = share_weighted(loss, padding, torch.tensor(4), 2)
    weighted.backward()
    assert weighted.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))
