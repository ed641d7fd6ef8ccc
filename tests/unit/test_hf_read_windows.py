"""A window of a safetensors file read straight into a tensor equals the same window sliced."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from functional_shard.runtime.checkpoint.hf.slices import open_folder

from ..sweeps import FEW

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@st.composite
def windows(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
    window = []
    for size in shape:
        start = draw(st.integers(0, size))
        window.append(slice(start, draw(st.integers(start, size))))
    return shape, tuple(window)


@settings(max_examples=FEW, deadline=None)  # a file written per example
@given(case=windows(), stored=st.sampled_from(DTYPES), wanted=st.sampled_from(DTYPES))
def test_a_window_read_into_a_tensor_equals_the_window_sliced(
    tmp_path_factory: pytest.TempPathFactory,
    case: tuple[tuple[int, ...], tuple[slice, ...]],
    stored: torch.dtype,
    wanted: torch.dtype,
) -> None:
    shape, window = case
    folder = tmp_path_factory.mktemp("folder")
    # another tensor first, so that this one's bytes begin inside the file, not at its data's start
    whole = torch.randn(shape).to(stored)
    save_file({"a.first": torch.randn(3), "b.tensor": whole}, str(folder / "model.safetensors"))
    expected = whole[window].to(wanted)
    into = torch.full(expected.shape, -7.0, dtype=wanted)
    read = open_folder(folder, trust=False).read("b.tensor", window, into=into)
    # one stretch of the file (a view of the whole that is contiguous) is read straight in;
    # any other window comes back as a view of the mapped file, which the caller copies
    if expected.numel():
        assert (read is into) == whole[window].is_contiguous()
    if read is not into:
        into.copy_(read)
    assert torch.equal(into, expected)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(case=windows(), stored=st.sampled_from(DTYPES), wanted=st.sampled_from(DTYPES))
def test_a_window_read_into_a_tensor_equals_the_window_sliced_full_sweep(
    tmp_path_factory: pytest.TempPathFactory,
    case: tuple[tuple[int, ...], tuple[slice, ...]],
    stored: torch.dtype,
    wanted: torch.dtype,
) -> None:
    test_a_window_read_into_a_tensor_equals_the_window_sliced.hypothesis.inner_test(
        tmp_path_factory, case, stored, wanted
    )
