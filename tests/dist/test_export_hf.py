"""Hugging Face export: from a run under any plan (real gloo ranks) and offline from a checkpoint."""

from __future__ import annotations

import json
import re

import pytest
import torch

import functional_shard as fs
from functional_shard.frontends.cli import main
from functional_shard.runtime.checkpoint.hf.folder import shard_files
from functional_shard.zoo import Llama

from .. import dist_cases, export_hf_cases, hf_cases

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face export needs transformers (the hf extra)."
)
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors comes with transformers.")


def weights(folder) -> dict[str, torch.Tensor]:
    """Every tensor of an exported folder, by key (one file, or the index's shards)."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    found: dict[str, torch.Tensor] = {}
    for name in files or ["model.safetensors"]:
        found.update(safetensors_torch.load_file(folder / name))
    return found


def loaded(folder) -> torch.nn.Module:
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(folder)
    finally:
        transformers.logging.set_verbosity(verbosity)


def assert_same_logits(folder, model_name: str, state: dict[str, torch.Tensor]) -> None:
    """The exported folder, loaded by transformers, computes what the trained state does."""
    expected = hf_cases.build(model_name, seed=5)
    expected.load_state_dict(state)
    tokens = hf_cases.batches(1)[0][:, :-1]
    with torch.no_grad():
        got, want = loaded(folder)(input_ids=tokens).logits, expected(input_ids=tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_an_fsdp_tp_run_exports_a_folder_transformers_loads(world4, tmp_path):
    cases = [
        ("llama_tied", "fsdp_tp", str(tmp_path / "tied"), str(tmp_path / "ckpt")),
        ("llama", "fsdp_tp", str(tmp_path / "untied"), None),
    ]
    results = world4.run(export_hf_cases.train_and_export_all, cases)
    for (model_name, _, folder, _), ranks in zip(cases, zip(*results, strict=True), strict=True):
        folder = tmp_path / folder.rsplit("/", 1)[-1]
        state = ranks[0]["state"]
        assert_same_logits(folder, model_name, state)
        exported = weights(folder)
        tied = model_name == "llama_tied"
        assert ("lm_head.weight" in exported) is not tied  # written once, as save_pretrained does
        assert exported.keys() == {k for k in state if not (tied and k == "lm_head.weight")}
        # every rank wrote a share of the files, none of them the whole model
        keys_by_rank = [{key for file in rank["written"] for key in file["keys"]} for rank in ranks]
        assert all(keys and keys < exported.keys() for keys in keys_by_rank)
        assert set().union(*keys_by_rank) == exported.keys()
        total = sum(t.numel() * t.element_size() for t in exported.values())
        assert max(sum(file["bytes"] for file in rank["written"]) for rank in ranks) < total / 2
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == total
        assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # offline, from the run's sharded checkpoint: the same weights
    tied_folder, checkpoint = tmp_path / "tied", tmp_path / "ckpt"
    config = tied_folder / "config.json"
    converted = fs.checkpoint.convert_to_hf(checkpoint, tmp_path / "offline", config)
    assert converted.prefix == ""
    offline, online = weights(converted.path), weights(tied_folder)
    assert offline.keys() == online.keys()
    for key, value in online.items():
        torch.testing.assert_close(offline[key], value, atol=0, rtol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero1", "ddp", "tp"])
def test_every_data_parallel_plan_exports_the_trained_model(world4, tmp_path, strategy):
    folder = tmp_path / "out"
    ranks = world4.run(export_hf_cases.train_and_export, "llama_tied", strategy, str(folder), None)
    assert_same_logits(folder, "llama_tied", ranks[0]["state"])
    assert all(rank["written"] for rank in ranks)


@pytest.mark.slow
def test_a_pipeline_run_exports_each_stage_from_its_own_ranks(world4, tmp_path):
    folder = tmp_path / "out"
    ranks = world4.run(export_hf_cases.pipeline_export, str(folder))
    assert_same_logits(folder, "llama", ranks[0]["state"])
    first_stage = {key for rank in ranks[:2] for file in rank["written"] for key in file["keys"]}
    last_stage = {key for rank in ranks[2:] for file in rank["written"] for key in file["keys"]}
    assert "model.embed_tokens.weight" in first_stage
    assert "lm_head.weight" in last_stage
    assert not first_stage & last_stage


# ---- how the files are cut and spread (pure) ------------------------------------------------

ALONE, EVERY = frozenset({0}), frozenset({0, 1, 2, 3})
FIRST_STAGE, LAST_STAGE = frozenset({0, 1}), frozenset({2, 3})


@pytest.mark.parametrize(
    ("sizes", "shard_bytes", "writers", "files"),
    [
        # one file holds everything: save_pretrained's single model.safetensors
        ([("a", 4, ALONE), ("b", 4, ALONE)], 100, 1, [("model.safetensors", ("a", "b"), 0)]),
        # four ranks: files of about total / 4, each written by the rank with the fewest bytes
        (
            [("a", 4, EVERY), ("b", 4, EVERY), ("c", 4, EVERY), ("d", 4, EVERY)],
            100,
            4,
            [(f"model-0000{n}-of-00004.safetensors", (key,), n - 1) for n, key in enumerate("abcd", 1)],
        ),
        # one process (offline): a tensor larger than a file gets its own
        (
            [("a", 2, ALONE), ("big", 50, ALONE), ("c", 2, ALONE), ("d", 2, ALONE)],
            10,
            1,
            [
                ("model-00001-of-00003.safetensors", ("a",), 0),
                ("model-00002-of-00003.safetensors", ("big",), 0),
                ("model-00003-of-00003.safetensors", ("c", "d"), 0),
            ],
        ),
        # pipeline stages: a file holds one stage's tensors, written by one of its ranks
        (
            [("a", 4, FIRST_STAGE), ("b", 4, FIRST_STAGE), ("c", 4, LAST_STAGE), ("d", 4, LAST_STAGE)],
            100,
            2,
            [
                ("model-00001-of-00002.safetensors", ("a", "b"), 0),
                ("model-00002-of-00002.safetensors", ("c", "d"), 2),
            ],
        ),
    ],
    ids=["one_file", "spread", "big_tensor", "stages"],
)
def test_files_are_cut_by_size_and_stage_and_spread_over_the_ranks(sizes, shard_bytes, writers, files):
    cut = shard_files(sizes, shard_bytes=shard_bytes, writers=writers)
    assert [(file.name, file.keys, file.writer) for file in cut] == files


# ---- refused before anything is written (one process, no process group) ----------------


def test_a_model_without_a_config_needs_one(tmp_path):
    model = Llama(dist_cases.EVEN)
    with pytest.raises(
        fs.ShardingError, match=re.escape("config: the model (Llama) carries no Hugging Face")
    ):
        fs.checkpoint.export_hf(tmp_path / "out", model)
    assert not (tmp_path / "out").exists()


def test_a_plain_module_exports_with_a_config_dict(tmp_path):
    model = hf_cases.build("llama")
    config = {**hf_cases.config("llama").to_dict(), "architectures": ["LlamaForCausalLM"]}
    plain = torch.nn.Module()  # the same tensors under the same names, no Hugging Face class
    for name, child in model.named_children():
        plain.add_module(name, child)
    fs.checkpoint.export_hf(tmp_path / "out", plain, config)
    assert weights(tmp_path / "out").keys() == model.state_dict().keys()


def test_a_model_still_on_the_meta_device_is_refused_before_anything_is_written(tmp_path):
    with torch.device("meta"):
        model = hf_cases.build("llama")
    with pytest.raises(
        fs.ShardingError, match=re.escape("more are on the meta device (built there and never")
    ):
        fs.checkpoint.export_hf(tmp_path / "out", model)
    assert list(tmp_path.iterdir()) == []


def test_an_export_under_a_file_or_of_no_module_is_refused(tmp_path):
    model = hf_cases.build("llama")
    (tmp_path / "notes").write_text("important")
    under = f"path: {tmp_path / 'notes'} is a file, not a folder, so nothing can be written inside it"
    with pytest.raises(fs.ShardingError, match=re.escape(under)):
        fs.checkpoint.export_hf(tmp_path / "notes" / "out", model)
    with pytest.raises(fs.ShardingError, match=re.escape("export_hf(model=str): a Module")):
        fs.checkpoint.export_hf(tmp_path / "out", "model")
    with pytest.raises(
        fs.ShardingError,
        match=re.escape("load_hf(module=str): a Module (the model fs.apply parallelized, or will)"),
    ):
        fs.checkpoint.load_hf(tmp_path / "out", "model")
    assert [p.name for p in tmp_path.iterdir()] == ["notes"]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            {"hidden_size": 64},
            "model.embed_tokens.weight: shape [128, 32] in the model, [128, 64] for the config",
        ),
        (
            {"num_hidden_layers": 1},
            "model.layers.1.self_attn.q_proj.weight: in the model, not in LlamaForCausalLM",
        ),
        ({"num_hidden_layers": 3}, "model.layers.2.self_attn.q_proj.weight: missing from the model"),
        ({"tie_word_embeddings": True}, "lm_head.weight: the config ties it to model.embed_tokens.weight"),
    ],
    ids=["hidden_size", "fewer_layers", "more_layers", "tied"],
)
def test_a_config_that_does_not_match_the_model_is_refused(tmp_path, change, problem):
    model = hf_cases.build("llama")
    config = hf_cases.config("llama")
    for field, value in change.items():
        setattr(config, field, value)
    with pytest.raises(fs.ShardingError, match=re.escape(problem)):
        fs.checkpoint.export_hf(tmp_path / "out", model, config)
    assert list(tmp_path.iterdir()) == []


def test_a_target_that_is_not_an_earlier_export_is_refused(tmp_path):
    model = hf_cases.build("llama_tied")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(fs.ShardingError, match=re.escape("is a folder that is not a Hugging Face export")):
        fs.checkpoint.export_hf(tmp_path / "notes", model)
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["todo.txt"]
    # an earlier export is replaced
    fs.checkpoint.export_hf(tmp_path / "out", model, max_shard_bytes=10_000)
    fs.checkpoint.export_hf(tmp_path / "out", model)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


# ---- offline, from a checkpoint file --------------------------------------------------------


def lightning_file(tmp_path, model: torch.nn.Module):
    """A Trainer's full checkpoint file: the LightningModule's state (its model under ``model.``)."""
    path = tmp_path / "last.ckpt"
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": {**state, "loss_scale": torch.ones(())}, "epoch": 3}, path)
    return path


def test_the_cli_exports_a_lightning_checkpoint_finding_its_prefix(tmp_path, capsys):
    model = hf_cases.build("llama")
    source = lightning_file(tmp_path, model)
    config = tmp_path / "config.json"
    config.write_text(hf_cases.config("llama").to_json_string())
    code = main(
        ["checkpoint", "convert", str(source), str(tmp_path / "hf"), "--to", "hf", "--config", str(config)]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "stripped the prefix 'model.'" in out
    assert "left out 1 key outside it (loss_scale)" in out
    exported = weights(tmp_path / "hf")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(exported[key], value, atol=0, rtol=0)


def test_the_cli_refuses_an_offline_export_in_one_line(tmp_path, capsys):
    source = lightning_file(tmp_path, hf_cases.build("llama"))
    config = tmp_path / "config.json"
    config.write_text(hf_cases.config("llama").to_json_string())
    target = ["checkpoint", "convert", str(source), str(tmp_path / "hf"), "--to", "hf"]
    assert main(target) == 2
    assert "--config" in capsys.readouterr().err
    assert main([*target, "--config", str(config), "--prefix", "other."]) == 2
    err = capsys.readouterr().err
    assert "model.embed_tokens.weight: missing from the checkpoint" in err
    assert "--prefix" in err
    assert not (tmp_path / "hf").exists()
