"""`fs.checkpoint.load_hf`: a Hugging Face folder into a model under every plan, each rank its slices.

Each plan's loaded weights, gathered whole, equal bit for bit what one process gets
(transformers' ``from_pretrained``; for a model of other names, `load_hf` into a plain module),
and its logits those of ``from_pretrained`` within 1e-6 (fp32). The whole family matrix runs
under ``-m slow``; the default suite keeps one case per kind of layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import functional_shard as fs

from .. import load_hf_cases as cases
from ..worlds import RestartingWorld

pytest.importorskip("transformers")

DEFAULT = [
    ("llama", "fsdp_tp_meta", "float32"),  # 2-D, straight from the meta device
    ("mixtral", "ep", "float32"),  # experts stacked from one file tensor each, split by rank
    ("llama", "pp", "bfloat16"),  # a stage reads its own layers; bf16 params
    ("titan", "fsdp_tp_meta", "float32"),  # torchtitan 0.3.0's Llama 3 through the ready map
]
EVERY = [(family, plan, "float32") for family in cases.FAMILIES for plan in cases.plans(family)] + [
    ("llama", "fsdp", "bfloat16"),
    ("qwen2_tied", "fsdp_tp", "bfloat16"),
]


@pytest.fixture(scope="module")
def world(world4):
    return world4


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    # bf16 on disk for the fused family: cast into fp32 master weights as it is read
    root = tmp_path_factory.mktemp("hf")
    dtypes = {"fused": torch.bfloat16}
    return {
        family: str(cases.write_folder(root / family, family, dtypes.get(family, torch.float32)))
        for family in cases.FAMILIES
    }


def check(world: RestartingWorld, folders: dict[str, str], chosen: list[tuple[str, str, str]]) -> None:
    results = world.run(cases.load_all, folders, chosen)[0]
    references: dict[
        tuple[str, str], tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]
    ] = {}
    for (family, plan, dtype), result in zip(chosen, results, strict=True):
        if (family, dtype) not in references:
            references[(family, dtype)] = cases.reference(
                Path(folders[family]), family, getattr(torch, dtype)
            )
        state, logits, buffers = references[(family, dtype)]
        label = f"{family} under {plan} ({dtype})"
        # each rank reads the elements its shards hold, no more (a tied weight once)
        for rank, (read, held) in enumerate(result["reads"]):
            assert read == held, f"{label}: rank {rank} read {read} elements for {held} held"
        assert set(result["state"]) <= set(state), label
        for name, value in result["state"].items():
            assert value.dtype == state[name].dtype, f"{label}: {name}"
            assert torch.equal(value, state[name]), (
                f"{label}: {name} differs by {(value - state[name]).abs().max()}"
            )
        for name, value in result["buffers"].items():
            assert torch.equal(value, buffers[name]), f"{label}: buffer {name}"
        if result["logits"] is not None:
            tolerance = 1e-6 if dtype == "float32" else 2e-2
            torch.testing.assert_close(result["logits"], logits, atol=tolerance, rtol=tolerance, msg=label)
            loss = cases.loss_of(result["logits"])
            torch.testing.assert_close(loss, cases.loss_of(logits), atol=tolerance, rtol=tolerance, msg=label)


def test_a_folder_loads_under_each_kind_of_layout_as_one_process_reads_it(world, folders):
    check(world, folders, DEFAULT)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(cases.FAMILIES))
def test_every_family_loads_under_every_plan(world, folders, family):
    check(world, folders, [case for case in EVERY if case[0] == family])


def test_export_under_one_plan_then_load_under_another_is_bit_identical(world, folders, tmp_path):
    # the fused family: torchtitan's names, the map run both ways (pieces, rotary rows)
    from safetensors.torch import load_file

    exported = tmp_path / "exported"
    config = str(Path(folders["fused"]) / "config.json")
    world.run(cases.load_then_export, folders["fused"], "fused", "tp", str(exported), config)
    original = load_file(Path(folders["fused"]) / "model.safetensors")
    written = {k: v for file in sorted(exported.glob("*.safetensors")) for k, v in load_file(file).items()}
    assert written.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(written[key], value.float()), key  # bf16 on disk, fp32 parameters
    result = world.run(cases.load_all, {"fused": str(exported)}, [("fused", "pp", "float32")])[0][0]
    state, _, _ = cases.reference(Path(folders["fused"]), "fused")
    for name, value in result["state"].items():
        assert torch.equal(value, state[name]), name


def test_torchtitans_llama_reads_hugging_faces_weights_to_the_same_logits(folders):
    # one process: the grouped wqkv and the interleaved rotary give Hugging Face's logits
    import transformers

    model = cases.build("titan")
    fs.checkpoint.load_hf(folders["titan"], model, mapping=fs.checkpoint.torchtitan_llama)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["titan"], attn_implementation="sdpa")
    torch.testing.assert_close(cases.logits_of(model), cases.logits_of(hf), atol=1e-6, rtol=1e-5)
