"""Layouts crossed with precision and checkpointing: each combination trains as one process.

Every layout the engines run (DDP, ZeRO-1/2, FSDP, HSDP, FSDP×TP, FSDP×SP, cp with FSDP,
cp × SP, pp × FSDP, pp × SP) under each option that changes how a step runs: bf16 compute,
selective and full checkpointing (under bf16 too) and CPU offload, for the zoo Llama and a
Hugging Face Llama, on 4 gloo ranks through `fs.forward_backward`. The combinations the
engines refuse before anything runs (mixed precision or offload with DDP, ZeRO-1 or no data
parallel layer; DDP over tensor parallel) are tested in tests/dist/test_apply_errors.py.

fp32 runs give one process's losses and first gradients; bf16 runs give the losses of one
process that makes the same casts by hand (`cp_cases.reference_bf16`) within bf16's
rounding of the loss (a relative 1e-2), and its gradients within 5e-2 of their norm.
The bf16 × selective checkpointing column is the one a GPU run found broken (FSDP2's input
cast re-ran inside the recompute); tests/dist/test_checkpointing.py keeps its default case.
"""

from __future__ import annotations

import itertools

import pytest

from .. import cp_cases

LAYOUTS = [
    ({"dp": 4}, "ddp(dp)"),
    ({"dp": 4}, "zero(1, dp)"),
    ({"dp": 4}, "zero(2, dp)"),
    ({"dp": 4}, "fsdp(dp)"),
    ({"node": 2, "gpu": 2}, "hsdp(node, gpu)"),
    ({"dp": 2, "tp": 2}, "fsdp(dp) + tp(RULES, tp)"),
    ({"dp": 2, "tp": 2}, "fsdp(dp) + sp(RULES, tp)"),
    ({"dp": 2, "cp": 2}, "fsdp(dp, cp) + cp(cp)"),
    ({"cp": 2, "tp": 2}, "fsdp(cp) + sp(RULES, tp) + cp(cp)"),
    ({"pp": 2, "dp": 2}, "pipeline(pp, microbatches=2) + fsdp(dp)"),
    ({"pp": 2, "tp": 2}, "pipeline(pp, microbatches=2) + sp(RULES, tp)"),
]
OPTIONS = [
    "bf16",
    "checkpointing(BLOCK, selective)",
    "bf16 + checkpointing(BLOCK, selective)",
    "bf16 + checkpointing(BLOCK, full)",
    "offload",
]
# rule set and checkpointed block of each model kind
KINDS = {"zoo": ("llama", "Block"), "hf_llama": ("hf", "LlamaDecoderLayer")}
_FSDP = ("fsdp(", "hsdp(", "zero(2")


def _runs(base: str, option: str) -> bool:
    # FSDP2 carries the casts and the offload: without it the engines refuse them up front
    return any(layer in base for layer in _FSDP) or ("bf16" not in option and "offload" not in option)


CASES = [
    (kind, mesh, f"{base} + {option}".replace("RULES", rules).replace("BLOCK", block))
    for kind, (rules, block) in KINDS.items()
    for (mesh, base), option in itertools.product(LAYOUTS, OPTIONS)
    if _runs(base, option)
]


def _case_id(case: tuple[str, dict[str, int], str]) -> str:
    kind, mesh, policy = case
    return f"{kind}-{'x'.join(f'{a}{n}' for a, n in mesh.items())}-{policy}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_layout_under_each_option_trains_as_one_process(world4, case):
    kind, mesh, policy = case
    pipelined = "pipeline" in policy
    # a pipeline does not keep a tie between stages in step: the zoo's untied variant
    kind = "zoo_untied" if pipelined and kind == "zoo" else kind
    train = cp_cases.train_pipelined if pipelined else cp_cases.train
    first = world4.run(train, kind, mesh, policy)[0]
    bf16 = "bf16" in policy
    expected = (cp_cases.reference_bf16 if bf16 else cp_cases.reference)(kind, first["data_parallel"])
    if bf16:
        assert first["losses"] == pytest.approx(expected["losses"], rel=1e-2)
    else:
        assert first["losses"] == pytest.approx(expected["losses"], abs=1e-4)
    for name, grad in first.get("grads", {}).items():
        reference = expected["grads"][name]
        error = ((grad - reference).norm() / reference.norm()).item()
        assert error < (5e-2 if bf16 else 1e-4), f"{name}: relative error {error:.2e}"


def test_the_matrix_leaves_out_only_what_the_engines_refuse():
    # ddp, zero(1) and pp × sp (no FSDP) refuse bf16's three options and offload; the rest run
    assert len(CASES) == len(KINDS) * (len(LAYOUTS) * len(OPTIONS) - 3 * 4)
    assert not any("ddp(dp) + bf16" in policy or "zero(1, dp) + offload" in policy for _, _, policy in CASES)
    assert any("pipeline" in policy and "bf16 + checkpointing" in policy for _, _, policy in CASES)
