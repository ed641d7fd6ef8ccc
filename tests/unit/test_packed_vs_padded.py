"""bench/packed_vs_padded.py compares like with like: padded and packed rows compute the same.

The same drawn documents, padded (each alone in a row, padding after it, causal over the row) and
packed by `fs.pack` (end to end, each attending only to itself), give the zoo Llama the same summed
token loss over the documents' targets (-100 elsewhere ignored) and the same gradients, with the
rotary embedding at each document's positions on both paths.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.zoo import CONFIGS, Llama

from ..strategies import documents

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))

import packed_vs_padded as bench

CONFIG = CONFIGS["tiny"]


def _loss_and_grads(model: torch.nn.Module, steps: list[bench.Step]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = sum(bench.summed_loss(model, step) for step in steps)
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}


@settings(max_examples=10, deadline=None)
@given(docs=documents(max_documents=8), seq_len=st.integers(12, 24), to_longest=st.booleans())
def test_padded_and_packed_rows_give_the_same_loss_and_gradients(docs, seq_len, to_longest):
    docs = [doc for doc in docs if len(doc) <= seq_len] or [[1, 2]]
    torch.manual_seed(0)
    model = Llama(CONFIG).double()
    length = max(map(len, docs)) if to_longest else seq_len
    padded = [bench.padded_rows(docs, length)]
    packed = [bench.packed_rows(fs.pack(docs, seq_len=seq_len))]
    assert padded[0].useful == packed[0].useful == sum(map(len, docs))
    padded_loss, padded_grads = _loss_and_grads(model, padded)
    packed_loss, packed_grads = _loss_and_grads(model, packed)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-10)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-9, atol=1e-11, msg=name)


def test_the_bench_lays_every_document_out_on_each_path():
    docs = bench.skewed_documents()
    for name, steps in bench.steps_of(docs).items():
        assert sum(step.useful for step in steps) == sum(map(len, docs)), name
        assert all(step.shape[0] <= bench.ROWS for step in steps), name
