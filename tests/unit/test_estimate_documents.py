"""`fs.estimate(documents=...)`: attention over packed rows counted per document.

A row holding documents ``d₁ … d_k`` does the attention of each document alone: the model flops of
``Σ dᵢ²`` query-key pairs where the whole row has ``seq²``, and a causal kernel running the documents
apart ``Σ dᵢ(dᵢ + 1) / 2`` of them. Held three ways: one document of ``seq`` tokens changes nothing;
``k`` equal documents cost ``1/k`` of the row; and a packed row's attention equals that of tracing its
documents one by one, and the kernel's that of the pairs the zoo's real document mask keeps.

Under context parallel each row is cut as the runtime cuts it (`document_ranges`): a cp rank's model
flops are its queries' pairs in their documents (the ranks' add up to the unsplit rows'), its kernel
flops every pair of its queries and the rows' keys, as the all-gather engine's mask-reading SDPA runs them.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.core.document_masks import document_mask
from functional_shard.costing.time.documents import RowDocuments, row_documents
from functional_shard.runtime.engines.context.parallel import packed_positions
from functional_shard.zoo import llama

MODEL = llama("tiny")
PLAN = fs.shard(MODEL, fs.Mesh(dp=2), fs.fsdp("dp") + fs.mixed_precision())
SEQ = 32


def _trace(seq: int, batch: int = 1, **options):
    return fs.trace_activations(MODEL, PLAN, batch=batch, seq=seq, **options)


def _attention(trace) -> tuple[int, float]:
    """Attention's model flops and kernel flops over the step (forward, backward, recompute)."""
    model = trace.attention_flops + trace.attention_backward_flops + trace.attention_recompute_flops
    kernel = (
        trace.attention_kernel_flops
        + trace.attention_kernel_backward_flops
        + trace.attention_kernel_recompute_flops
    )
    return model, kernel


@pytest.fixture(scope="module")
def whole():
    return fs.estimate(MODEL, PLAN, batch=2, seq=SEQ, hardware="h100")


@pytest.mark.parametrize(
    ("documents", "rows"),
    [([SEQ], 1), ([[SEQ], [SEQ]], 2), (fs.pack([[1] * SEQ], seq_len=SEQ), 1)],
)
def test_one_document_of_seq_tokens_changes_nothing(whole, documents, rows):
    found = fs.estimate(MODEL, PLAN, batch=2, seq=SEQ, hardware="h100", documents=documents)
    assert found.documents == RowDocuments(SEQ, ((SEQ,),) * rows)
    assert (found.flops, found.model_flops, found.peak_bytes) == (
        whole.flops,
        whole.model_flops,
        whole.peak_bytes,
    )
    assert found.compute_seconds == pytest.approx(whole.compute_seconds, rel=1e-12)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_k_equal_documents_cost_a_kth_of_the_rows_attention(k):
    alone = _trace(SEQ)
    packed = _trace(SEQ, documents=[SEQ // k] * k)
    (model, kernel), (model_k, kernel_k) = _attention(alone), _attention(packed)
    assert model_k == pytest.approx(model / k, abs=64)  # each op's count is rounded to a flop
    # a causal kernel's diagonal: (S/k + 1) / (S + 1) of the row's causal kernel, about 1/k
    assert kernel_k == pytest.approx(kernel * (SEQ // k + 1) / (SEQ + 1), rel=1e-12)
    # the rest of the step is that of the tokens, whatever the documents
    assert packed.forward_flops - packed.attention_flops == alone.forward_flops - alone.attention_flops
    assert packed.activation_bytes == alone.activation_bytes


@settings(max_examples=6)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4).filter(lambda ls: sum(ls) <= SEQ))
def test_a_packed_row_attends_as_its_documents_traced_one_by_one(lengths):
    padding = SEQ - sum(lengths)
    segments = [*lengths, padding] if padding else lengths  # the padding: one segment more
    packed = _attention(_trace(SEQ, documents=lengths))
    one_by_one = [_attention(_trace(n)) for n in segments]
    assert packed[0] == pytest.approx(sum(model for model, _ in one_by_one), abs=64)
    assert packed[1] == pytest.approx(sum(kernel for _, kernel in one_by_one), rel=1e-9)


def test_the_kernel_runs_the_pairs_the_real_document_mask_keeps():
    batch = fs.pack([[1] * n for n in (5, 9, 3, 20, 7, 11, 2)], seq_len=SEQ)
    rows = batch.tokens.shape[0]
    alone = _trace(SEQ, batch=rows, backward=False)
    packed = _trace(SEQ, batch=rows, backward=False, documents=batch)
    per_pair = alone.attention_flops / (rows * SEQ * SEQ)  # the full score matrix's, per query-key pair
    kept = int(document_mask(batch.document_ids).sum())  # causal pairs inside documents, padding its own
    assert packed.attention_kernel_flops == pytest.approx(per_pair * kept, rel=1e-12)


def test_a_traced_mask_is_read_over_the_whole_row_and_kept():
    batch = fs.pack([[1] * n for n in (10, 12, 6, 30)], seq_len=SEQ)
    rows = batch.tokens.shape[0]
    inputs = {"tokens": batch.tokens, "document_ids": batch.document_ids}
    masked = _trace(SEQ, batch=rows, inputs=inputs, documents=batch)
    apart = _trace(SEQ, batch=rows, documents=batch)
    # the same model flops; a kernel that reads a mask runs every pair of the row
    assert _attention(masked)[0] == _attention(apart)[0]
    unpacked_kernel = _attention(_trace(SEQ, batch=rows, inputs=inputs))[1]
    assert _attention(masked)[1] == unpacked_kernel > _attention(apart)[1]
    # and keeps the mask, a byte a pair, which a kernel given the documents apart does not
    assert masked.activation_bytes - apart.activation_bytes >= rows * SEQ * SEQ


def test_the_estimate_counts_and_says_the_documents(whole):
    found = fs.estimate(MODEL, PLAN, batch=2, seq=SEQ, hardware="h100", documents=[8, 8, 8, 8])
    assert found.model_flops < whole.model_flops
    assert found.compute_parts["attention"] < whole.compute_parts["attention"]
    assert found.compute_parts["matmul"] == pytest.approx(whole.compute_parts["matmul"], rel=1e-12)
    assert found.peak_bytes == whole.peak_bytes  # no mask: a kernel given the documents apart keeps none
    lines = [line for line in found.explain().splitlines() if "packed documents" in line]
    assert lines == [
        "packed documents: 4.0 a row of 32 tokens (1 row given), padding 0.0%; attention counted per "
        "document, 25.0% of the whole row's model flops"
    ]
    assert found.to_dict()["documents"] == [[8, 8, 8, 8]]
    assert "documents" not in whole.to_dict()


def test_useful_tokens_leave_the_padding_out(whole):
    found = fs.estimate(MODEL, PLAN, batch=2, seq=SEQ, hardware="h100", documents=[[8, 8], [24]])
    assert found.useful_tokens_per_second == pytest.approx(found.tokens_per_second * 40 / 64, rel=1e-12)
    assert found.to_dict()["useful_tokens_per_second"] == found.useful_tokens_per_second
    assert f"({found.useful_tokens_per_second:,.0f} of documents, padding left out)" in found.explain()
    assert whole.useful_tokens_per_second == whole.tokens_per_second
    assert "useful_tokens_per_second" not in whole.to_dict()
    assert "padding left out" not in whole.explain()


def test_a_pipeline_counts_each_micro_batch_per_document():
    plan = fs.shard(MODEL, fs.Mesh(pp=2), fs.pipeline("pp", microbatches=2))
    whole = fs.estimate(MODEL, plan, batch=4, seq=SEQ, hardware="h100")
    found = fs.estimate(MODEL, plan, batch=4, seq=SEQ, hardware="h100", documents=[16, 16])
    assert found.model_flops < whole.model_flops
    assert found.peak_bytes == whole.peak_bytes


# ---- what is refused, each named -------------------------------------------------------


@pytest.mark.parametrize(
    ("documents", "message"),
    [
        (
            [[16, 16], [30, 4], [33]],
            "estimate(documents=...): 2 rows hold more than seq=32 tokens:\n"
            "* row 1: documents [30, 4] hold 34 tokens\n* row 2: documents [33] hold 33 tokens\n",
        ),
        ([40], "estimate(documents=...): 1 row holds more than seq=32 tokens:\n* row 0: documents [40]"),
        (
            fs.pack([[1, 2]], seq_len=16),
            "estimate(documents=PackedBatch): its rows hold 16 tokens, but seq=32",
        ),
        ([[4], [0, 3]], "row 1 holds [0, 3]: each length must be a positive int"),
        ([[4], []], "row 1 is [], not a non-empty sequence of document lengths"),
        ([], "estimate(documents=[]): pass a PackedBatch, a sequence of rows"),
        (8, "estimate(documents=int): pass a PackedBatch"),
        ([2.5], "one row's lengths [2.5], not all positive ints:\n* length 0 is 2.5"),
        # one row's lengths, one of them not a length: not read as rows (row 1 is 16, ...)
        (
            [0, 16],
            "estimate(documents=...): one row's lengths [0, 16], not all positive ints:\n* length 0 is 0\n",
        ),
    ],
)
def test_documents_that_do_not_fit_are_refused_by_row(documents, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.estimate(MODEL, PLAN, batch=2, seq=SEQ, documents=documents)


# ---- under context parallel: each cp rank's share, as the runtime cuts the rows -------------


def _cp_plan(cp: int, **options):
    return fs.shard(
        MODEL, fs.Mesh(dp=2, cp=cp), fs.fsdp(("dp", "cp")) + fs.cp("cp", **options) + fs.mixed_precision()
    )


def _packed_rows(draw_lengths: list[list[int]]) -> fs.PackedBatch:
    return fs.pack([[1] * n for row in draw_lengths for n in row], seq_len=SEQ)


drawn_documents = st.lists(st.integers(1, SEQ), min_size=1, max_size=8)


@settings(max_examples=5, deadline=None)
@given(lengths=drawn_documents)
def test_cp_1_counts_as_no_cp(lengths):
    batch = _packed_rows([lengths])
    rows = len(batch)
    no_cp = fs.shard(MODEL, fs.Mesh(dp=2, cp=1), fs.fsdp(("dp", "cp")) + fs.mixed_precision())
    plain = fs.estimate(MODEL, no_cp, batch=rows, seq=SEQ, hardware="h100", documents=batch)
    one = fs.estimate(MODEL, _cp_plan(1), batch=rows, seq=SEQ, hardware="h100", documents=batch)
    assert (one.flops, one.model_flops, one.peak_bytes) == (plain.flops, plain.model_flops, plain.peak_bytes)
    assert one.compute_seconds == pytest.approx(plain.compute_seconds, rel=1e-12)


@settings(max_examples=5, deadline=None)
@given(lengths=drawn_documents, cp=st.sampled_from([2, 4]))
def test_the_ranks_model_flops_add_up_to_the_unsplit_rows(lengths, cp):
    batch = _packed_rows([lengths])
    rows = len(batch)
    unsplit = _attention(_trace(SEQ, batch=rows, documents=batch))[0]
    plan = _cp_plan(cp)
    # the ranks 0 .. cp-1 are the cp coordinates 0 .. cp-1 of dp rank 0
    shares = [
        _attention(fs.trace_activations(MODEL, plan, batch=rows, seq=SEQ, rank=rank, documents=batch))[0]
        for rank in range(cp)
    ]
    assert sum(shares) == pytest.approx(unsplit, abs=64 * cp)


@settings(max_examples=5, deadline=None)
@given(lengths=drawn_documents, cp=st.sampled_from([2, 4]), rank=st.integers(0, 3))
def test_a_cp_rank_counts_what_the_engine_runs_on_its_share(lengths, cp, rank):
    rank %= cp
    batch = _packed_rows([lengths])
    rows, local = len(batch), SEQ // cp
    plan = _cp_plan(cp)
    traced = fs.trace_activations(
        MODEL, plan, batch=rows, seq=SEQ, rank=rank, backward=False, documents=batch
    )
    plain = fs.trace_activations(MODEL, plan, batch=rows, seq=SEQ, rank=rank, backward=False)
    per_pair = plain.attention_flops / (rows * local * SEQ)  # the full score matrix's, per query-key pair
    # the tokens the runtime hands this rank, and their documents, from the rows' real document ids
    positions, _ = packed_positions(batch.document_ids, cp, rank)
    ids = batch.document_ids
    pairs = sum(
        int((ids[row] == ids[row, position]).sum())
        for row in range(rows)
        for position in positions[row].tolist()
    )
    assert traced.attention_flops == pytest.approx(per_pair * pairs, abs=64)
    # the all-gather engine's SDPA reads a boolean mask of its queries and the whole rows' keys:
    # it runs every pair of them, those of other documents and later keys too
    assert traced.attention_kernel_flops == pytest.approx(per_pair * rows * local * SEQ, rel=1e-12)
    # and keeps the mask, a byte a pair a row, where the unpacked rows share one causal mask
    assert traced.activation_bytes - plain.activation_bytes >= (rows - 1) * local * SEQ


def test_the_estimate_counts_the_busiest_cp_rank_and_says_so():
    documents = [[30, 2], [4] * 8]
    plan = _cp_plan(2)
    found = fs.estimate(MODEL, plan, batch=2, seq=SEQ, hardware="h100", documents=documents)
    ranks = [
        fs.estimate(MODEL, plan, batch=2, seq=SEQ, hardware="h100", documents=documents, rank=rank)
        for rank in range(2)
    ]
    assert [each.documents.cp_rank for each in ranks] == [0, 1]
    assert found.documents.cp_rank == 1
    assert (
        found.model_flops == max(each.model_flops for each in ranks) > min(each.model_flops for each in ranks)
    )
    # the engine's mask kernel runs the same pairs on every rank, and keeps the same mask
    assert ranks[0].peak_bytes == ranks[1].peak_bytes
    assert found.compute_parts["attention"] == pytest.approx(ranks[0].compute_parts["attention"], rel=1e-12)
    assert found.compute_seconds == pytest.approx(ranks[0].compute_seconds, rel=1e-12)
    line = next(line for line in found.explain().splitlines() if "packed documents" in line)
    assert (
        "cut over cp=2 ranks by attention work, cp rank 1's share counted (52.7% of the model flops" in line
    )
    assert "skipping no pair" in line


def test_packed_rows_under_cp_are_counted_on_the_all_gather_engine():
    plan = _cp_plan(2, engine="ring")
    found = fs.estimate(MODEL, plan, batch=2, seq=SEQ, hardware="h100", documents=[16, 16])
    assert found.context_engine == "all_gather"
    assert "ring_workspace" not in found.memory
    assert fs.estimate(MODEL, plan, batch=2, seq=SEQ, hardware="h100").context_engine == "ring"


def test_packed_rows_need_cp_to_divide_them_not_2_cp():
    plan = _cp_plan(2)  # load balancing: unpacked rows are cut in 4 chunks
    with pytest.raises(fs.ShardingError, match="cuts each sequence into 4 equal chunks"):
        fs.estimate(MODEL, plan, batch=1, seq=30, hardware="h100")
    found = fs.estimate(MODEL, plan, batch=1, seq=30, hardware="h100", documents=[20, 10])
    assert found.documents.rank_pairs(0) + found.documents.rank_pairs(1) == 20 * 20 + 10 * 10


def test_a_cp_size_that_does_not_divide_the_rows_is_refused():
    plan = fs.shard(MODEL, fs.Mesh(cp=3), fs.fsdp("cp") + fs.cp("cp", load_balance=False))
    with pytest.raises(fs.ShardingError, match=re.escape("does not divide the packed rows' length 32")):
        fs.estimate(MODEL, plan, batch=1, seq=SEQ, documents=[16, 16])


@pytest.mark.parametrize(
    ("rows", "model", "causal"),
    [
        (((8,),), 1.0, 36 / 64),
        (((4, 4),), 0.5, 20 / 64),
        (((4,),), 0.5, 20 / 64),  # the padding attends to itself, as a segment of its own
        (((2, 2, 2, 2), (8,)), 0.625, (4 * 3 + 36) / 2 / 64),
    ],
)
def test_shares_of_hand_checked_rows(rows, model, causal):
    found = row_documents([list(row) for row in rows], seq=8)
    assert (found.model_share, found.causal_share) == pytest.approx((model, causal))
