"""A trace for CUDA keeps what CUDA's kernels keep: nn.RMSNorm as one fused kernel.

Measured on an H200 (torch 2.11, docs/will-it-fit.md "What CUDA keeps"): ``nn.RMSNorm``
dispatches to ``aten._fused_rms_norm``, which keeps its input and a float32 inverse RMS a
row; the CPU's composite keeps two float32 copies of a bf16 input. Here: the stand-in
computes what the composite computes, gradients included, and keeps what the fused
kernel keeps, and a whole model's trace differs by exactly that.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard.costing.trace.activations import trace_activations
from functional_shard.costing.trace.cuda_kernels import cuda_kernels, fused_rms_norm
from functional_shard.zoo import Llama, LlamaConfig


@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 24),
    weighted=st.booleans(),
    eps=st.one_of(st.none(), st.floats(1e-8, 1e-2)),
)
def test_the_stand_in_computes_what_the_composite_computes(rows, width, weighted, eps):
    generator = torch.Generator().manual_seed(rows * 100 + width)
    x = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    weight = torch.randn(width, generator=generator, dtype=torch.float64) if weighted else None
    grad = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    results = []
    for norm in (torch.nn.functional.rms_norm, fused_rms_norm):
        leaves = [x.clone().requires_grad_()] + ([weight.clone().requires_grad_()] if weighted else [])
        out = norm(leaves[0], (width,), leaves[1] if weighted else None, eps)
        out.backward(grad)
        results.append([out.detach()] + [leaf.grad for leaf in leaves])
    for ours, torchs in zip(*results, strict=True):
        torch.testing.assert_close(ours, torchs)


@given(rows=st.integers(1, 8), width=st.integers(2, 32))
def test_it_keeps_the_input_and_a_float32_inverse_rms_a_row(rows, width):
    norm = nn.RMSNorm(width).to(torch.bfloat16)
    x = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    kept = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor
        return tensor

    with cuda_kernels(True), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    parameters = {p.untyped_storage().data_ptr() for p in norm.parameters()}
    inputs = {x.untyped_storage().data_ptr()}
    own = [t for key, t in kept.items() if key not in parameters | inputs]
    assert inputs <= set(kept)
    assert [(t.dtype, t.numel()) for t in own] == [(torch.float32, rows)]
    assert torch.nn.functional.rms_norm is not fused_rms_norm  # swapped back


@settings(max_examples=20)  # two whole-model traces an example; the drawn space is 54 cases
@given(
    hidden=st.sampled_from([16, 32, 64]),
    layers=st.integers(1, 3),
    batch=st.integers(1, 2),
    seq=st.sampled_from([4, 8, 16]),
)
def test_a_cuda_trace_keeps_six_bytes_a_feature_less_per_bf16_norm(hidden, layers, batch, seq):
    # the composite keeps the input's float32 copy and the normalised float32 product
    # (8 bytes a feature) where the fused kernel keeps the bf16 input (2): per norm of
    # every block, and the final one
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers)
    model = Llama(config).to("meta")
    plan = fs.shard(model, fs.Mesh(dp=1), fs.replicate() + fs.mixed_precision())
    cpu, cuda = (
        trace_activations(model, plan, batch=batch, seq=seq, cuda=on_cuda).activation_bytes
        for on_cuda in (False, True)
    )
    assert cpu - cuda == (2 * layers + 1) * 6 * hidden * batch * seq
