"""`fs.checkpoint.load_hf` in one process: folders it refuses leave the module untouched, and name maps.

A refusal is a `ShardingError` naming the file and the first keys, raised before any
parameter changes: a hypothesis test damages folders in drawn ways and compares the module
bit for bit.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import einops
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.runtime.checkpoint.hf.names import Piece, name_map, pattern_map, rotary_rows

from .. import load_hf_cases as cases

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cases.write_folder(tmp_path_factory.mktemp("hf") / "llama", "llama")


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def untouched(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_one_process_reads_what_from_pretrained_reads(folder):
    import transformers

    model = cases.build("llama", seed=5)
    fs.checkpoint.load_hf(folder, model)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def damaged(folder: Path, target: Path, kind: str, key_index: int, cut: int) -> str:
    """A copy of ``folder`` damaged as ``kind`` says; returns what the refusal must name."""
    shutil.copytree(folder, target)
    weights = target / "model.safetensors"
    tensors = load_file(weights)
    key = sorted(tensors)[key_index % len(tensors)]
    if kind == "missing":
        del tensors[key]
        save_file(tensors, weights)
        return f"{key.removeprefix('model.')}: missing"
    if kind == "unexpected":
        save_file({**tensors, "model.extra.weight": torch.ones(2)}, weights)
        return "model.extra.weight (model.safetensors): unexpected"
    if kind == "shape":
        tensors[key] = torch.ones(*tensors[key].shape[:-1], tensors[key].shape[-1] + 1)
        save_file(tensors, weights)
        return "in the folder"
    if kind == "quantized":
        tensors[key] = tensors[key].to(torch.int8)
        save_file(tensors, weights)
        return f"{key} (model.safetensors): stored as I8, quantized"
    if kind == "quantization_config":
        config = json.loads((target / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "bitsandbytes"}
        (target / "config.json").write_text(json.dumps(config))
        return "quantization_config (bitsandbytes)"
    if kind == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: max(8, len(data) - 1 - cut)])
        return "damaged file model.safetensors"
    if kind == "header":
        data = bytearray(weights.read_bytes())
        data[8 + cut % 16] = ord("!")
        weights.write_bytes(bytes(data))
        return "damaged file model.safetensors"
    if kind == "pickle":
        weights.unlink()
        torch.save(tensors, target / "pytorch_model.bin")
        return "trust=True"
    assert kind == "index"
    index = {"weight_map": {k: "model-00002-of-00002.safetensors" for k in tensors}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return "lacks model-00002-of-00002.safetensors"


KINDS = (
    "missing",
    "unexpected",
    "shape",
    "quantized",
    "quantization_config",
    "truncated",
    "header",
    "pickle",
    "index",
)


@settings(max_examples=10)
@given(kind=st.sampled_from(KINDS), key_index=st.integers(0, 100), cut=st.integers(0, 64), meta=st.booleans())
def test_a_damaged_folder_is_refused_by_name_and_changes_nothing(
    folder, tmp_path_factory, kind, key_index, cut, meta
):
    target = tmp_path_factory.mktemp("damaged") / "copy"
    named = damaged(folder, target, kind, key_index, cut)
    model = cases.build("llama", meta=meta, seed=5)
    before = None if meta else snapshot(model)
    with pytest.raises(fs.ShardingError, match=re.escape(named)) as refused:
        fs.checkpoint.load_hf(target, model)
    assert str(refused.value).startswith("fs.checkpoint.load_hf changed nothing")
    if meta:
        assert all(p.is_meta for p in model.parameters())
    else:
        assert untouched(model, before)


def test_float_weights_whose_header_says_whole_numbers_are_refused_by_file_and_tensor(folder, tmp_path):
    # I32 for F32 keeps every length and offset consistent, so safetensors opens the file; before,
    # load_hf read the bytes as integers and filled the weight with them
    target = tmp_path / "retyped"
    shutil.copytree(folder, target)
    tensors = load_file(target / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight"
    save_file({**tensors, key: tensors[key].view(torch.int32)}, target / "model.safetensors")
    model = cases.build("llama", meta=True)
    named = f"{key} (model.safetensors): stored as I32, whole numbers, for the model's torch.float32"
    with pytest.raises(fs.ShardingError, match=re.escape(named)):
        fs.checkpoint.load_hf(target, model)
    assert all(p.is_meta for p in model.parameters())


def test_a_file_cut_short_after_its_header_was_read_is_refused_by_file_and_tensor(folder, tmp_path):
    # safetensors checks the header against the file's length when load_hf opens it: a copy still
    # being written may be cut after that; a window read from the mapped file raised torch's
    # "offset ... must be ... no greater than buffer length" (a read in one stretch already said this)
    from functional_shard.runtime.checkpoint.hf.slices import open_folder

    target = tmp_path / "cut"
    shutil.copytree(folder, target)
    opened = open_folder(target, trust=False)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    last = max(opened.sources.values(), key=lambda source: source.start)
    window = [slice(0, 1)] * len(last.shape)
    with pytest.raises(
        fs.ShardingError, match=re.escape(f"{last.key} (model.safetensors): the file ends inside")
    ):
        opened.read(last.key, window)
    opened.release()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # before: "no" was truthy, so pickles (which can run code) were trusted
        ({"trust": "no"}, "load_hf(trust=str): a bool (True reads pickled"),
        ({"root": None}, "load_hf(root=NoneType): a str (the name of the submodule"),
        # before: "mapping: a int" under "does not fit the model", as if the folder were wrong
        (
            {"mapping": 5},
            "load_hf(mapping=int): a dict of folder patterns to model names, a function of a folder key, "
            "or None (None reads the folder's own names)",
        ),
    ],
)
def test_trust_and_root_of_another_type_are_refused_by_name(folder, options, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.checkpoint.load_hf(folder, cases.build("llama", meta=True), **options)


def test_convert_to_hf_refuses_a_trust_that_is_no_bool(tmp_path):
    # before: a truthy "no" trusted the checkpoint's pickled objects
    with pytest.raises(fs.ShardingError, match=re.escape("convert_to_hf(trust=str): a bool (True rebuilds")):
        fs.checkpoint.convert_to_hf(tmp_path / "ckpt", tmp_path / "out", {}, trust="no")


def test_a_path_that_is_no_folder_is_refused_with_its_own_fix(tmp_path):
    # not "does not fit the model ... or mapping=": there is no folder to fit
    nowhere = tmp_path / "nowhere"
    with pytest.raises(fs.ShardingError) as refused:
        fs.checkpoint.load_hf(nowhere, cases.build("llama", meta=True, seed=5))
    assert str(refused.value) == (
        f"fs.checkpoint.load_hf changed nothing: {nowhere} is not a folder; pass the folder "
        "save_pretrained wrote (config.json and weights)"
    )


@pytest.mark.parametrize(
    ("device", "what"), [("nonsense", "a torch device"), ("meta", "a device this machine has")]
)
def test_a_device_that_cannot_hold_the_shards_is_refused_before_anything_is_read(folder, device, what):
    # torch's own RuntimeError came from deep inside; meta would have left the model unfilled
    model = cases.build("llama", meta=True, seed=5)
    with pytest.raises(fs.ShardingError, match=re.escape(f"load_hf(device={device!r}): {what}")):
        fs.checkpoint.load_hf(folder, model, device=device)
    assert all(p.is_meta for p in model.parameters())


def test_an_untied_folder_into_a_model_that_ties_its_head_is_refused_not_half_read(folder):
    # the folder's lm_head.weight holds its own values: filling the tied pair with the embedding's
    # alone dropped them, where from_pretrained unties the pair and keeps both
    import transformers

    kind, options = cases.FAMILIES["llama"]
    config = getattr(transformers, kind)(**{**options, "tie_word_embeddings": True})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        fs.ShardingError, match=re.escape("holds model.embed_tokens.weight and lm_head.weight apart")
    ):
        fs.checkpoint.load_hf(folder, model)
    assert all(p.is_meta for p in model.parameters())
    # two keys mapped to one weight the model does not tie: no tie to speak of
    norm = "model.layers.0.input_layernorm.weight"
    with pytest.raises(fs.ShardingError, match=re.escape(f"{norm}: missing")) as refused:
        fs.checkpoint.load_hf(
            folder,
            cases.build("llama", meta=True),
            mapping=lambda key: {norm: "model.norm.weight"}.get(key, key),
        )
    assert "ties" not in str(refused.value)


def test_a_config_that_is_no_json_object_is_refused_not_read_as_none(folder, tmp_path):
    target = tmp_path / "listed"
    shutil.copytree(folder, target)
    (target / "config.json").write_text("[1, 2]")
    with pytest.raises(
        fs.ShardingError, match=re.escape("has a config.json holding a JSON list, not an object")
    ):
        fs.checkpoint.load_hf(target, cases.build("llama", meta=True))


def test_pickled_weights_load_with_trust_as_safetensors_do(folder, tmp_path):
    target = tmp_path / "pickled"
    damaged(folder, target, "pickle", 0, 0)
    model = cases.build("llama", seed=5)
    fs.checkpoint.load_hf(target, model, trust=True)
    reference = cases.build("llama", seed=6)
    fs.checkpoint.load_hf(folder, reference)
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.state_dict().items())


def test_a_meta_model_is_filled_straight_from_the_files(folder):
    model = cases.build("llama", meta=True)
    fs.checkpoint.load_hf(folder, model)
    reference = cases.build("llama", seed=9)
    fs.checkpoint.load_hf(folder, reference)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    torch.testing.assert_close(cases.logits_of(model), cases.logits_of(reference), atol=0, rtol=0)


class Wrapped(torch.nn.Module):
    """The model as a child, as a LightningModule holds it (``self.model``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = cases.build("llama", meta=True)


def test_a_model_under_a_root_reads_the_folder_under_its_own_names(folder):
    # the plan is applied to the wrapper with root="model"; names, ignored keys and computed
    # buffers are the model's own
    wrapped = Wrapped()
    fs.checkpoint.load_hf(folder, wrapped, root="model")
    reference = cases.build("llama", seed=9)
    fs.checkpoint.load_hf(folder, reference)
    for name, value in reference.state_dict().items():
        assert torch.equal(wrapped.model.state_dict()[name], value), name
    torch.testing.assert_close(cases.logits_of(wrapped.model), cases.logits_of(reference), atol=0, rtol=0)
    with pytest.raises(fs.ShardingError, match=re.escape("load_hf(root='nowhere'): the module has no such")):
        fs.checkpoint.load_hf(folder, Wrapped(), root="nowhere")


def test_name_maps_take_patterns_candidates_and_pieces():
    mapping = pattern_map({"a.*.q": [Piece("b.*.qkv", 0), "b.*.wq"], "a.*.k": Piece("b.*.qkv", 1)})
    assert mapping("a.3.q") == [Piece("b.3.qkv", 0), "b.3.wq"]
    resolve = name_map({"a.*.q": [Piece("b.*.qkv", 0), "b.*.wq"]}, torch.nn.Linear(1, 1), {"b.3.wq"})
    assert resolve("a.3.q") == "b.3.wq"  # the candidate the model holds
    with pytest.raises(fs.ShardingError, match="mapping: 'x': 3"):
        pattern_map({"x": 3})  # type: ignore[dict-item]
    with pytest.raises(fs.ShardingError, match=r"mapping\('x'\) returned 3"):
        name_map(lambda key: 3, torch.nn.Linear(1, 1), set())("x")  # type: ignore[arg-type,return-value]


@given(heads=st.integers(1, 4), half=st.integers(1, 8))
def test_rotary_rows_undo_torchtitans_permutation(heads, half):
    # torchtitan's converter writes its interleaved rows as Hugging Face's halves:
    # (heads, pairs, 2) -> (heads, 2, pairs); reading back must give the model's rows
    titan = torch.arange(heads * 2 * half)
    hf = einops.rearrange(titan, "(h d two) -> (h two d)", h=heads, two=2)
    assert torch.equal(hf[rotary_rows(torch.arange(titan.numel()), 2 * half)], titan)
