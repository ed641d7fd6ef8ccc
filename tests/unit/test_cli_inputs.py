"""Command-line values that were once replaced or let through in silence are refused in one line."""

import os
import re
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard.cli import main
from functional_shard.frontends import live_demo as demo
from functional_shard.frontends.cli import parse_mesh
from functional_shard.frontends.cli.inputs import InputError
from functional_shard.zoo import llama

TINY = ["plan", "--model", "tiny"]
MODEL = llama("tiny")


def refused(capsys, *argv: str) -> str:
    """The one line of stderr a bad command line gives (exit code 2, no traceback)."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("functional-shard: "), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("mesh", "says"),
    [
        ("dp=2,dp=4", "--mesh 'dp=2,dp=4': axis 'dp' given twice"),
        ("dp=2,tp=2,dp=2", "--mesh 'dp=2,tp=2,dp=2': axis 'dp' given twice"),
        ("dp=2, dp =4", "axis 'dp' given twice"),
        ("", "--mesh '': empty; write AXIS=SIZE pairs"),
        (" ", "--mesh ' ': empty; write AXIS=SIZE pairs"),
    ],
)
def test_a_mesh_given_twice_or_empty_is_refused_not_replaced(capsys, mesh, says):
    """An empty --mesh once became the default dp=8,tp=4, and a repeated axis kept its last size."""
    assert says in refused(capsys, *TINY, "--mesh", mesh, "--policy", "fsdp(dp)")


@given(
    names=st.lists(st.sampled_from(["dp", "tp", "cp", "pp", "ep"]), min_size=1, max_size=4, unique=True),
    sizes=st.lists(st.integers(1, 4), min_size=5, max_size=5),
    repeat=st.integers(0, 3),
)
def test_any_axis_written_twice_is_named(names, sizes, repeat):
    twice = names[repeat % len(names)]
    text = ",".join(f"{n}={s}" for n, s in zip([*names, twice], sizes, strict=False))
    with pytest.raises(InputError, match=re.escape(f"axis {twice!r} given twice")):
        parse_mesh(text)
    once = ",".join(f"{n}={s}" for n, s in zip(names, sizes, strict=False))
    assert parse_mesh(once) == fs.Mesh(dict(zip(names, sizes, strict=False)))


@pytest.mark.parametrize("policy", ["", " "])
def test_an_empty_policy_is_refused_and_points_to_none(capsys, policy):
    """An empty --policy once became the default fsdp(dp) + tp(auto, tp) + bf16."""
    err = refused(capsys, *TINY, "--mesh", "dp=2", "--policy", policy)
    assert f"--policy {policy!r}: empty; write a policy" in err
    assert "or none for no policy" in err


def test_auto_refuses_an_empty_mesh_or_policy_too(capsys):
    err = refused(capsys, *TINY, "--auto", "--mesh", "", "--devices", "4", "--budget", "1GiB", "--seq", "8")
    assert "--auto searches meshes and policies itself" in err


def test_parse_policy_names_none_for_an_empty_text():
    with pytest.raises(fs.PolicyError, match=re.escape("policy '': empty; write one, e.g. ")):
        fs.parse_policy("")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "tp(llama, tp, loss_parallel=true, loss_parallel=false)",
            "tp() is given the keyword 'loss_parallel' twice",
        ),
        ("fsdp(dp, min_params=1, min_params=2)", "fsdp() is given the keyword 'min_params' twice"),
        (
            "pipeline(pp, microbatches=4, microbatches=8)",
            "pipeline() is given the keyword 'microbatches' twice",
        ),
        ("cp(cp, engine=ring, load_balance=false, engine=auto)", "cp() is given the keyword 'engine' twice"),
    ],
)
def test_a_keyword_given_twice_is_refused_by_name(text, says):
    """ast parses f(a=1, a=2) (only Python's compiler refuses it): the last value once won."""
    with pytest.raises(fs.PolicyError, match=re.escape(says)):
        fs.parse_policy(f"fsdp(dp) + {text}" if not text.startswith("fsdp") else text, MODEL)


@pytest.mark.parametrize("model", [MODEL, None])
@pytest.mark.parametrize("written", ["partial", "selectve", "fulll"])
def test_a_mistyped_checkpointing_policy_is_called_a_policy(model, written):
    """It was once reported as a module class the model lacks."""
    for text in (f"checkpointing(Block, {written})", f"checkpointing('layers.*', Block, {written})"):
        says = f"checkpointing policy {written!r}: full, selective or torchtitan"
        with pytest.raises(fs.PolicyError, match=re.escape(says)):
            fs.parse_policy(text, model)


def test_checkpointing_still_takes_several_classes_and_names_an_unknown_one():
    assert fs.parse_policy("checkpointing(Block, Attention, selective)", MODEL) == fs.checkpointing(
        *(type(m) for m in (MODEL.layers[0], MODEL.layers[0].self_attn)), policy="selective"
    )
    with pytest.raises(fs.PolicyError, match=re.escape("checkpointing 'Blok' is not a module class")):
        fs.parse_policy("checkpointing(Block, Blok)", MODEL)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("x.jpgg", "the extension .jpgg is not a picture format"),
        ("x.png.bak", "the extension .bak is not a picture format"),
        ("x", "the name has no extension"),
    ],
)
def test_a_picture_name_matplotlib_cannot_write_is_refused_before_anything_is_built(
    capsys, tmp_path, name, says
):
    """It was once a matplotlib ValueError traceback, after the plan was made and drawn."""
    pytest.importorskip("matplotlib")
    target = tmp_path / name
    # the model does not exist: the --png check comes before it is looked for
    err = refused(capsys, "plan", "--model", "no-such-model", "--mesh", "dp=2", "--png", str(target))
    assert f"--png {str(target)!r}: {says}; end it with one of " in err
    assert all(f".{kind}," in err for kind in ("pdf", "png", "svg"))
    assert not list(tmp_path.iterdir())


def test_a_picture_without_matplotlib_is_refused_before_anything_is_built(capsys, tmp_path, monkeypatch):
    """It was refused only once the plan was made (or searched for) and printed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as though it were not installed
    target = tmp_path / "plan.png"
    # the model does not exist: the --png check comes before it is looked for
    err = refused(capsys, "plan", "--model", "no-such-model", "--mesh", "dp=2", "--png", str(target))
    assert f"--png {str(target)!r}: plan.visualize() draws with matplotlib, which is not installed" in err
    assert "pip install 'functional-shard[plot]'" in err


def test_a_picture_suffix_in_capitals_is_accepted(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "plan.SVG"
    assert main([*TINY, "--mesh", "dp=2", "--policy", "fsdp(dp)", "--png", str(target)]) == 0
    assert target.read_bytes().lstrip().startswith(b"<?xml")


class _StartedError(Exception):
    """Raised in place of starting the demo's processes."""


def _no_processes(*_args, **_kwargs):
    raise _StartedError


@pytest.mark.parametrize("over", [1, 56])
def test_the_demo_refuses_more_processes_than_the_machine_runs_before_starting_any(capsys, monkeypatch, over):
    """A dp=64 demo on two cores once started 64 gloo processes and crawled for minutes."""
    monkeypatch.setattr(demo, "LocalWorld", _no_processes)
    limit = demo.process_limit()
    size = limit + over
    err = refused(capsys, "demo", "--mesh", f"dp={size}", "--policy", "fsdp(dp)")
    assert f"Mesh(dp={size}) needs {size} local processes (one per device), more than the {limit}" in err
    assert "pass --force" in err
    with pytest.raises(fs.ShardingError, match=re.escape(f"more than the {limit} the demo starts")):
        demo.run(fs.Mesh(dp=size), "fsdp(dp)")


def test_force_starts_them_anyway(monkeypatch):
    monkeypatch.setattr(demo, "LocalWorld", _no_processes)
    monkeypatch.setattr(demo, "process_limit", lambda: 2)
    with pytest.raises(fs.ShardingError, match="needs 4 local processes"):
        demo.run(fs.Mesh(dp=4), "fsdp(dp)")
    with pytest.raises(_StartedError):
        demo.run(fs.Mesh(dp=4), "fsdp(dp)", force=True)
    with pytest.raises(_StartedError):
        main(["demo", "--mesh", "dp=4", "--policy", "fsdp(dp)", "--force"])


@pytest.mark.parametrize(("cores", "limit"), [(1, 8), (2, 8), (3, 12), (16, 64)])
def test_the_process_limit_is_four_per_core_and_at_least_eight(monkeypatch, cores, limit):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)), raising=False)
    assert demo.process_limit() == limit


def test_the_demo_refuses_an_unsized_axis_before_starting(monkeypatch):
    monkeypatch.setattr(demo, "LocalWorld", _no_processes)
    says = "Mesh(dp=-1): the demo starts one process per device"
    with pytest.raises(fs.ShardingError, match=re.escape(says)):
        demo.run(fs.Mesh(dp=-1), "fsdp(dp)")


def _write(path, model, mesh=None):
    path.write_text(fs.shard(model, mesh or fs.Mesh(dp=2), fs.fsdp("dp")).to_json())
    return str(path)


@pytest.mark.parametrize(
    ("before", "after", "says"),
    [
        (nn.Linear(8, 8), nn.Linear(8, 16), "weight (8×8 -> 16×8), bias (8 -> 16);"),
        (nn.Linear(8, 8), nn.Linear(8, 8, bias=False), "bias (8 -> absent);"),
        (
            MODEL,
            llama("tiny-tied"),
            "lm_head.weight (",
        ),
        (
            MODEL,
            llama("llama-1b"),
            "embed_tokens.weight (256×64 -> 128256×2048), layers.0.input_layernorm.weight (64 -> 2048), "
            "layers.0.self_attn.q_proj.weight (64×64 -> 2048×2048) and ",
        ),
    ],
)
def test_a_diff_of_plans_of_two_models_is_refused_naming_the_tensors(capsys, tmp_path, before, after, says):
    """It once listed every tensor's change as though one model's plan had changed."""
    a, b = _write(tmp_path / "a.json", before), _write(tmp_path / "b.json", after)
    err = refused(capsys, "diff", a, b)
    assert f"{a!r} and {b!r} plan different models: their tensors differ, " in err
    assert says in err
    assert err.rstrip().endswith("diff compares two plans of the same model")


def test_a_diff_of_two_plans_of_one_model_still_runs(capsys, tmp_path):
    a = _write(tmp_path / "a.json", MODEL)
    b = tmp_path / "b.json"
    b.write_text(fs.shard(MODEL, fs.Mesh(dp=2), fs.zero(2, "dp")).to_json())
    assert main(["diff", a, str(b)]) == 0
    assert "data_parallel" in capsys.readouterr().out


def test_a_diff_counts_on_each_row_the_layers_that_change_that_way(capsys, tmp_path):
    # layer 0 and layers 1-2 change to two different specs: a row of one layer and a row of
    # two, not two rows that each claim all three layers
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(3))

    def split(path, tensor, mesh):
        return fs.ParamSharding.uniform(fs.P("dp", None) if path == "layers.0.weight" else fs.P(None, "dp"))

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(fs.shard(model, fs.Mesh(dp=2), fs.replicate()).to_json())
    b.write_text(fs.shard(model, fs.Mesh(dp=2), fs.replicate() + split).to_json())
    assert main(["diff", str(a), str(b)]) == 0
    rows = [
        line.split("  ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("layers.*")
    ]
    # the spec rows of layer 0 and of layers 1-2, and all three halving their bytes
    assert rows == ["layers.*.weight", "layers.*.weight ×3", "layers.*.weight ×2"]


@pytest.mark.parametrize(
    ("flag", "needs"),
    [
        ("--model", []),
        ("--hardware", ["--seq", "16"]),
        ("--kernels", ["--seq", "16"]),
        ("--documents", ["--seq", "16"]),
        ("--json", []),
        ("--png", []),
        ("--param", ["--png", "plan.png"]),
    ],
)
@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_value_is_refused_not_taken_for_the_flag_left_out(
    capsys, monkeypatch, tmp_path, flag, needs, value
):
    """An empty --json once wrote no file (a blank one wrote a file named ' '), --hardware became h100,
    --kernels and --documents were dropped, all with exit code 0; an empty --model was the folder '.'."""
    monkeypatch.chdir(tmp_path)  # where a file named ' ' would once have been written
    argv = ["plan", "--mesh", "dp=2", "--policy", "fsdp(dp)", *needs, flag, value]
    err = refused(capsys, *argv)
    assert f"{flag} {value!r}: empty; give a value, or leave the flag out" in err
    assert not list(tmp_path.iterdir())


def test_plan_refuses_an_unsized_axis_by_naming_the_mesh_flag(capsys):
    """It was once shard()'s advice to call mesh.resolve(world_size), which no flag of plan can do."""
    err = refused(capsys, *TINY, "--mesh", "dp=-1,tp=2", "--policy", "fsdp(dp)")
    assert "--mesh 'dp=-1,tp=2': size -1 takes the devices left over" in err
    assert err.rstrip().endswith("give every axis its size")


@pytest.mark.parametrize(
    ("module", "source", "says"),
    [
        ("raising_models", "raise ValueError('no GPU here')", "(ValueError: no GPU here)"),
        ("broken_models", "def build(:\n", "(SyntaxError: "),
        (".relative_models", "", "(TypeError: the 'package' argument is required"),
    ],
)
def test_a_factory_module_that_fails_to_import_is_one_line(
    capsys, tmp_path, monkeypatch, module, source, says
):
    """Only an ImportError was reported; the module's own error, or a relative name, was a traceback."""
    (tmp_path / f"{module.lstrip('.')}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    err = refused(capsys, "plan", "--model", f"{module}:build", "--mesh", "dp=2", "--policy", "fsdp(dp)")
    assert f"--model '{module}:build': cannot import '{module}' {says}" in err


def test_a_config_json_whose_values_transformers_refuses_is_one_line(capsys, tmp_path):
    """transformers checks a config's values with huggingface_hub, whose error was a traceback."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": -5}')
    err = refused(capsys, "plan", "--model", str(tmp_path), "--mesh", "dp=2", "--policy", "fsdp(dp)")
    assert (
        f"--model {str(tmp_path / 'config.json')!r}: transformers cannot build a causal LM from it (" in err
    )


def test_a_diff_of_a_file_that_is_not_text_is_one_line(capsys, tmp_path):
    """A file that is not UTF-8 (a .pt checkpoint given for its plan) was a UnicodeDecodeError traceback."""
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"\x80\x02\xff\xfe")
    plan = _write(tmp_path / "plan.json", MODEL)
    err = refused(capsys, "diff", str(binary), plan)
    assert f"{str(binary)!r}: cannot read ('utf-8' codec can't decode byte 0x80" in err


@pytest.mark.parametrize("budget", ["0", "0GiB", "-1", "0.4"])
def test_a_budget_of_no_bytes_is_asked_to_be_positive(capsys, budget):
    """The refusal once asked for 'a number of bytes', which 0 is; 0.4 was read as 0 bytes, which
    the search then refused without naming --budget."""
    argv = ["--auto", "--devices", "2", "--budget", budget, "--seq", "16"]
    err = refused(capsys, *TINY, *argv)
    assert f"--budget {budget!r}: memory size {budget!r}: a positive number of bytes or text like" in err


def test_an_unknown_param_is_refused_by_name_before_the_tables_with_the_tensors_it_may_mean(capsys, tmp_path):
    """It was blamed on --png, after the plan's tables were printed, with no tensor to suggest."""
    target = tmp_path / "plan.png"
    argv = ["--mesh", "dp=2", "--policy", "fsdp(dp)", "--png", str(target), "--param", "lm_head"]
    code = main([*TINY, *argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err == (
        "functional-shard: --param 'lm_head': the plan has no tensor 'lm_head'; "
        "did you mean ['lm_head.weight']?\n"
    )
    assert not target.exists()


def test_top_without_auto_is_refused_like_devices_and_budget(capsys):
    """--top, which only the search's candidates table reads, was ignored without --auto."""
    err = refused(capsys, *TINY, "--mesh", "dp=2", "--policy", "fsdp(dp)", "--top", "3")
    assert "--top goes with --auto" in err


def test_a_diff_of_an_empty_file_name_says_so(capsys, tmp_path):
    """An unset shell variable ("$BEFORE") was reported as the folder '.' that cannot be read."""
    err = refused(capsys, "diff", "", _write(tmp_path / "plan.json", MODEL))
    assert "'': an empty file name; give the file plan --json wrote" in err


def test_an_empty_config_for_a_hugging_face_export_is_refused_not_read_from_here(
    capsys, tmp_path, monkeypatch
):
    """An empty --config (an unset "$CONFIG") once read the config.json of the folder it ran in."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (tmp_path / "ckpt").mkdir()
    err = refused(capsys, "checkpoint", "convert", "ckpt", "hf", "--to", "hf", "--config", "")
    assert "convert_to_hf(config=''): a path (a str or os.PathLike)" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("name", "says"), [("out/plan.json", "there is no folder "), (".", "a folder; ")])
def test_a_json_file_that_cannot_be_written_is_refused_before_the_plan_is_made(capsys, tmp_path, name, says):
    """It was refused only after the plan was made (after a search, perhaps minutes long) and printed."""
    target = str(tmp_path / name)
    # the model does not exist: the --json check comes before it is looked for
    err = refused(capsys, "plan", "--model", "no-such-model", "--mesh", "dp=2", "--json", target)
    assert f"--json {target!r}: {says}" in err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--mesh", "dp=1,cp=2", "--policy", "fsdp((dp, cp)) + cp(cp)", "--seq", "6"], "--seq 6: cp=2 with"),
        (["--mesh", "dp=2", "--policy", "fsdp(dp)", "--seq", "8", "--kernels", "float8"], "--kernels"),
    ],
)
def test_a_value_the_library_refuses_is_named_by_the_flag_that_gave_it(capsys, flags, says):
    """The estimate's refusals named its own arguments: estimate(seq=6), for what --seq 6 gave."""
    assert refused(capsys, *TINY, *flags).startswith(f"functional-shard: {says}")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--policy", "fsdp("], "--policy: policy 'fsdp(' is not an expression"),
        (["--policy", "fsdp(dp) + checkpointing(Nope)"], "--policy: policy 'fsdp(dp) + checkpointing(Nope)'"),
        (["--steps", "2"], "--steps 2: an int of 3 or more (the demo measures step 3)"),
    ],
)
def test_the_demo_names_the_flag_it_refuses(capsys, monkeypatch, argv, says):
    monkeypatch.setattr(demo, "LocalWorld", _no_processes)
    assert says in refused(capsys, "demo", "--mesh", "dp=2", *argv)


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"model": "nope"}, "run(model='nope'): one of 'tiny', 'tiny-tied'"),
        ({"steps": 2}, "run(steps=2): an int of 3 or more"),
        ({"steps": 3.0}, "run(steps=3.0): an int of 3 or more"),
        ({"mesh": {"dp": 2}}, "run(mesh=dict): a Mesh"),
    ],
)
def test_the_demo_from_python_names_the_argument_it_refuses(monkeypatch, arguments, says):
    monkeypatch.setattr(demo, "LocalWorld", _no_processes)
    arguments = {"mesh": fs.Mesh(dp=2), "policy": "fsdp(dp)"} | arguments
    with pytest.raises(fs.ShardingError, match=re.escape(says)):
        demo.run(**arguments)
