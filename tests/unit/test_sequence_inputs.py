"""Context-parallel inputs a caller gets wrong are refused with a fix, not a torch traceback.

`fs.context_chunks` and `fs.forward_backward`'s step take whole (batch, seq) sequences;
`fs.sequence_context` a positive token count; ``loss_fn`` a scalar. Under cp and sequence
parallel, the length a caller gave is named, not a rank's share of it. Most checks fail
before any process group is needed; the rest run in a gloo world of one, or torch's fake
group where a mesh of several ranks is needed.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard.core.document_masks import document_mask
from functional_shard.core.sequence import check_sequence_length, check_split_share, chunk_count
from functional_shard.costing.trace import activations
from functional_shard.zoo import Llama, LlamaConfig, llama

from ..strategies import documents

CP2 = fs.shard(nn.Linear(2, 2), fs.Mesh(cp=2), fs.replicate() + fs.cp("cp"))
TOKENS = torch.arange(8)[None]


def _llama() -> nn.Module:
    return Llama(LlamaConfig(128, 32, 64, num_layers=2, num_heads=4, num_kv_heads=2))


def _cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())


# ---- fs.context_chunks: no process group needed --------------------------------------


@pytest.mark.parametrize(
    ("tensors", "kwargs", "message"),
    [
        (
            (torch.arange(8),),
            {"rank": 1},
            "fs.context_chunks: tensor 0 has shape (8,), no dim 1: pass (batch, seq) tensors "
            "(x[None] for one sequence), or dim=0",
        ),
        ((TOKENS,), {"rank": 1, "dim": 2}, "tensor 0 has shape (1, 8), no dim 2"),
        ((TOKENS,), {"rank": 1, "dim": -3}, "tensor 0 has shape (1, 8), no dim -3"),
        ((torch.tensor(3),), {"rank": 0}, "tensor 0 has shape (), no dim 1"),
        # a mask of another rank: no other dim is offered, it would not suit tensor 0
        (
            (TOKENS, torch.arange(8)),
            {"rank": 0},
            "tensor 1 has shape (8,), no dim 1: pass (batch, seq) tensors",
        ),
        (
            (TOKENS,),
            {"rank": 0, "dim": 1.0},
            "context_chunks(dim=1.0): an int (the sequence dim)",
        ),
        (([[0, 1, 2, 3, 4, 5, 6, 7]],), {"rank": 1}, "expected a torch.Tensor for tensor 0, got list"),
        ((np.arange(8)[None],), {"rank": 1}, "expected a torch.Tensor for tensor 0, got ndarray"),
        ((TOKENS, None), {"rank": 1}, "expected a torch.Tensor for tensor 1, got NoneType"),
        ((TOKENS,), {"rank": 1.0}, "context_chunks(rank=1.0): an int in [0, 2)"),
        (
            (TOKENS,),
            {"rank": "1"},
            "context_chunks(rank='1'): an int in [0, 2) (a global rank of the plan's Mesh(cp=2))",
        ),
        ((TOKENS,), {"rank": True}, "(rank=True): an int in [0, 2)"),
        ((TOKENS,), {"rank": 2}, "(rank=2): an int in [0, 2)"),
        ((TOKENS,), {"rank": -1}, "(rank=-1): an int in [0, 2)"),
    ],
)
def test_context_chunks_refuses_what_is_no_batch_of_sequences(tensors, kwargs, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.context_chunks(CP2, *tensors, **kwargs)


def test_context_chunks_outside_a_process_group_asks_for_a_rank():
    assert not torch.distributed.is_initialized()
    with pytest.raises(
        fs.ShardingError, match=re.escape("pass rank=, or call dist.init_process_group(...) first")
    ):
        fs.context_chunks(CP2, TOKENS)


@pytest.mark.parametrize(
    "plan", [fs.cp("cp"), fs.Mesh(cp=2), nn.Linear(2, 2)], ids=["policy", "mesh", "model"]
)
def test_context_chunks_refuses_what_is_not_a_plan(plan):
    with pytest.raises(
        fs.ShardingError,
        match=re.escape(f"context_chunks(plan={type(plan).__name__}): a Plan (fs.shard(model, mesh, policy)"),
    ):
        fs.context_chunks(plan, TOKENS, rank=0)


@given(seq=st.integers(1, 64), rank=st.integers(0, 1), dim=st.sampled_from([1, -1]))
def test_context_chunks_cuts_any_divisible_length_along_a_negative_dim_too(seq, rank, dim):
    tokens = torch.arange(seq)[None]
    if seq % 4:
        # named by the argument that gave it (the refusal once named a seq= it does not take)
        said = (
            re.escape(f"tensors[0].shape[{dim}]={seq}: ") + f".* does not divide the sequence length {seq};"
        )
        with pytest.raises(fs.ShardingError, match=said):
            fs.context_chunks(CP2, tokens, rank=rank, dim=dim)
        return
    mine, positions = fs.context_chunks(CP2, tokens, rank=rank, dim=dim)
    assert mine.tolist() == [positions.tolist()]


def test_context_chunks_names_an_empty_sequence_by_its_tensor():
    with pytest.raises(fs.ShardingError, match=re.escape("tensors[0].shape[1]=0: a positive int")):
        fs.context_chunks(CP2, torch.zeros(2, 0), rank=0)


@given(seq=st.one_of(st.integers(-100, 0), st.floats(allow_nan=False), st.none(), st.booleans()))
def test_a_length_that_is_no_count_of_tokens_is_named_not_rounded(seq):
    with pytest.raises(
        fs.ShardingError,
        match=re.escape(f"seq_len={seq!r}: a positive int (a count of tokens)"),
    ):
        check_sequence_length(seq, 2, load_balance=True, name="seq_len")


# ---- cp and sequence parallel: the whole length is named ------------------------------


@given(
    cp=st.integers(2, 4),
    tp=st.integers(2, 4),
    balance=st.booleans(),
    per_chunk=st.integers(1, 12),
)
def test_a_share_tp_cannot_split_is_refused_naming_the_whole_length_and_the_lengths_that_work(
    cp, tp, balance, per_chunk
):
    seq = per_chunk * chunk_count(cp, load_balance=balance)  # the chunks divide it
    multiple = math.lcm(chunk_count(cp, load_balance=balance), cp * tp)
    if seq % multiple == 0:
        check_split_share(seq, cp, tp, load_balance=balance, axis="tp", who="x")
        return
    with pytest.raises(fs.ShardingError) as error:
        check_split_share(seq, cp, tp, load_balance=balance, axis="tp", who="x")
    text = str(error.value)
    assert f"the {seq}-token sequence leaves {seq // cp} tokens on each of the cp={cp} ranks" in text
    assert f"a multiple of {multiple} (" in text
    above = (seq // multiple + 1) * multiple
    assert f"{above}" in text
    assert above % (cp * tp) == 0
    assert above % chunk_count(cp, load_balance=balance) == 0


def test_the_plan_under_cp_and_sequence_parallel_names_the_length_given(monkeypatch):
    def no_trace(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced before refusing")

    monkeypatch.setattr(activations._Run, "trace", no_trace)
    model = llama("tiny")
    policy = (
        fs.fsdp("cp") + fs.cp("cp", load_balance=False) + fs.tp(fs.rules.llama, "tp", sequence_parallel=True)
    )
    plan = fs.shard(model, fs.Mesh(cp=2, tp=2), policy)
    message = (
        "trace_activations(seq=6): the 6-token sequence leaves 3 tokens on each of the cp=2 ranks, which "
        "sequence parallel over 'tp' splits evenly over its 2 ranks, and 2 does not divide 3; use a sequence "
        "length that is a multiple of 4 (4 or 8: cp=2 ranks x tp=2)"
    )
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        activations.trace_activations(model, plan, batch=1, seq=6)


@pytest.mark.parametrize(
    ("mesh", "policy", "seq", "says"),
    [
        (
            fs.Mesh(tp=2),
            fs.tp(fs.rules.llama, "tp", sequence_parallel=True),
            3,
            "sequence parallel over 'tp'",
        ),
        (
            fs.Mesh(cp=2, tp=2),
            fs.fsdp("cp")
            + fs.cp("cp", load_balance=False)
            + fs.tp(fs.rules.llama, "tp", sequence_parallel=True),
            6,
            "the 6-token sequence leaves 3 tokens",
        ),
    ],
    ids=["tp", "cp and tp"],
)
def test_an_estimate_of_a_length_sequence_parallel_cannot_split_names_estimate(mesh, policy, seq, says):
    model = llama("tiny")
    with pytest.raises(fs.ShardingError, match=re.escape(f"estimate(seq={seq}): {says}")):
        fs.estimate(model, fs.shard(model, mesh, policy), batch=1, seq=seq)


def test_a_step_under_cp_and_sequence_parallel_names_the_length_given(fake_world):
    fake_world(4)
    policy = (
        fs.fsdp("cp") + fs.cp("cp", load_balance=False) + fs.tp(fs.rules.llama, "tp", sequence_parallel=True)
    )
    model = _llama()
    plan = fs.shard(model, fs.Mesh(cp=2, tp=2), policy)
    model = fs.apply(plan, model)
    step = fs.forward_backward(plan, model, _cross_entropy)
    tokens = torch.randint(0, 128, (1, 6))
    with pytest.raises(
        fs.ShardingError, match=re.escape("fs.forward_backward: the 6-token sequence leaves 3 tokens")
    ):
        step(tokens, tokens)


# ---- the step and sequence_context, in a gloo world of one --------------------------


@pytest.fixture
def cp1(one_rank):
    model = _llama()
    plan = fs.shard(model, fs.Mesh(cp=1), fs.replicate("cp") + fs.cp("cp"))
    return plan, fs.apply(plan, model)


@pytest.mark.parametrize(
    ("inputs", "targets", "message"),
    [
        (
            torch.arange(8),
            torch.arange(8),
            "fs.forward_backward under context parallel: inputs has shape (8,), no dim 1: pass (batch, seq) "
            "tensors (x[None] for one sequence)",
        ),
        (TOKENS, torch.arange(8), "targets has shape (8,), no dim 1"),
        ([[0, 1, 2, 3]], TOKENS, "expected a torch.Tensor for inputs, got list"),
        (TOKENS, None, "expected a torch.Tensor for targets, got NoneType"),
    ],
)
def test_the_cp_step_refuses_what_is_no_batch_of_sequences(cp1, inputs, targets, message):
    plan, model = cp1
    step = fs.forward_backward(plan, model, _cross_entropy)
    with pytest.raises(fs.ShardingError, match=re.escape(message)) as error:
        step(inputs, targets)
    assert "dim=" not in str(error.value)  # the step has no dim to pass


@pytest.mark.parametrize("seq_len", [-2, 0, 8.0, None, True, "8"])
def test_sequence_context_refuses_a_length_that_is_no_count_of_tokens(cp1, seq_len):
    plan, model = cp1
    message = "a positive int (the whole sequences' length in tokens)"
    with (
        pytest.raises(fs.ShardingError, match=re.escape(f"sequence_context(seq_len={seq_len!r}): {message}")),
        fs.sequence_context(plan, model, seq_len),
    ):
        pass


def _per_token(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), reduction="none")


@pytest.mark.parametrize(
    ("loss_fn", "message"),
    [
        (_per_token, "fs.forward_backward: loss_fn returned a tensor of shape (16,), but the step runs"),
        (lambda o, t: (_cross_entropy(o, t), 0), "loss_fn returned tuple"),
    ],
    ids=["per-token", "tuple"],
)
@pytest.mark.parametrize("context", [True, False], ids=["cp", "plain"])
def test_a_loss_fn_returning_no_scalar_is_refused_naming_the_fix(one_rank, loss_fn, message, context):
    model = _llama()
    policy = fs.replicate("cp") + fs.cp("cp") if context else fs.replicate("cp")
    plan = fs.shard(model, fs.Mesh(cp=1), policy)
    model = fs.apply(plan, model)
    step = fs.forward_backward(plan, model, loss_fn)
    tokens = torch.randint(0, 128, (2, 8))
    with pytest.raises(fs.ShardingError, match=re.escape(message)) as error:
        step(tokens, tokens)
    assert "return a scalar loss: a mean over the batch (reduction='mean', or loss.mean()) or a sum" in str(
        error.value
    )


def test_a_scalar_loss_of_one_element_still_steps(one_rank):
    model = _llama()
    plan = fs.shard(model, fs.Mesh(cp=1), fs.replicate("cp") + fs.cp("cp"))
    model = fs.apply(plan, model)
    step = fs.forward_backward(plan, model, lambda o, t: _cross_entropy(o, t)[None])
    tokens = torch.randint(0, 128, (2, 8))
    assert step(tokens, tokens).numel() == 1


# ---- packed rows: the engine's mask, and the step's keywords --------------------------


@given(docs=documents(max_documents=10, max_length=24), seq_len=st.sampled_from([24, 32, 48]))
def test_the_packed_mask_is_the_rows_document_mask_at_each_ranks_queries(docs, seq_len):
    from functional_shard.runtime.engines.context.parallel import SequenceShard, packed_positions

    batch = fs.pack(docs, seq_len, long="split")
    ids = batch.document_ids
    whole = document_mask(ids)[:, 0]  # [rows, seq, seq]
    rows = torch.arange(ids.shape[0])[:, None, None]
    for cp in (2, 4):
        held = []
        for rank in range(cp):
            positions, keys = packed_positions(ids, cp, rank)
            held.append(positions)
            shard = SequenceShard(
                group=None,
                size=cp,
                seq_len=seq_len,
                positions=positions,
                key_positions=keys,
                query_documents=ids.gather(1, positions),
                key_documents=ids.gather(1, keys),
            )
            expected = whole[rows, positions[:, :, None], keys[:, None, :]]
            assert torch.equal(shard.causal_mask[:, 0], expected)
            # what the model makes from its share of the ids: the same mask on its own keys
            mine = shard.causal_mask[:, 0][
                rows,
                torch.arange(positions.shape[1])[:, None],
                rank * positions.shape[1] + torch.arange(positions.shape[1]),
            ]
            assert torch.equal(shard.local_document_mask[:, 0], mine)
        every = torch.cat(held, dim=1).sort(dim=1).values
        assert torch.equal(every, torch.arange(seq_len).expand_as(every))


def _packed() -> fs.PackedBatch:
    return fs.pack([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 4], [7, 8, 9]], seq_len=16)


@pytest.mark.parametrize("context", [True, False], ids=["cp", "plain"])
def test_packed_rows_step_as_the_model_run_on_them(one_rank, context):
    model = _llama()
    policy = fs.replicate("cp") + fs.cp("cp") if context else fs.replicate("cp")
    plan = fs.shard(model, fs.Mesh(cp=1), policy)
    model = fs.apply(plan, model)
    batch = _packed()
    step = fs.forward_backward(plan, model, _cross_entropy)
    loss = step(batch.tokens, batch.labels, positions=batch.positions, document_ids=batch.document_ids)
    outputs = model(batch.tokens, positions=batch.positions, document_ids=batch.document_ids)
    assert loss.item() == pytest.approx(_cross_entropy(outputs, batch.labels).item(), abs=1e-6)


def test_packed_rows_the_cp_step_checks_whole(cp1):
    plan, model = cp1
    batch = _packed()
    step = fs.forward_backward(plan, model, _cross_entropy)
    with pytest.raises(fs.ShardingError, match=re.escape("under context parallel: positions disagree")):
        step(batch.tokens, batch.labels, positions=torch.arange(16)[None], document_ids=batch.document_ids)


@pytest.mark.parametrize("context", [True, False], ids=["cp", "plain"])
def test_packed_rows_to_a_forward_without_them_are_refused(one_rank, context):
    model = nn.Sequential(nn.Embedding(128, 8), nn.Linear(8, 128))
    policy = fs.replicate("cp") + fs.cp("cp") if context else fs.replicate("cp")
    plan = fs.shard(model, fs.Mesh(cp=1), policy)
    model = fs.apply(plan, model)
    batch = _packed()
    step = fs.forward_backward(plan, model, _cross_entropy)
    message = "fs.forward_backward(Sequential): its forward takes no document boundaries (no document_ids="
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        step(batch.tokens, batch.labels, document_ids=batch.document_ids)


def test_explain_says_packed_rows_are_cut_by_work_and_which_engine_runs_them():
    model = _llama()
    for engine, says in (
        ("auto", "by the all-gather engine (the ring has no document mask)"),
        ("all_gather", ""),
    ):
        text = fs.shard(model, fs.Mesh(cp=2), fs.replicate() + fs.cp("cp", engine=engine)).explain()
        assert "packed rows (document_ids=) are cut by attention work instead, each row its own way" in text
        assert (says in text) if says else ("the ring has no document mask" not in text)
    policy = fs.pipeline("pp", microbatches=2) + fs.fsdp("cp") + fs.cp("cp")
    text = fs.shard(model, fs.Mesh(pp=2, cp=2), policy).explain()
    assert "packed rows (document_ids=) are refused: under a pipeline the engine's document masks" in text
