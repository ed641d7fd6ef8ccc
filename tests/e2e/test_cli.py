"""`functional-shard`: plan any model from the shell, diff plans, pictures; every bad input one line."""

import io
import json
import re
import subprocess
import sys

import pytest

import functional_shard as fs
from functional_shard import zoo
from functional_shard.cli import main
from functional_shard.core.units import format_bytes
from functional_shard.frontends import cli
from functional_shard.frontends.cli.output import Out

TINY = ["plan", "--model", "tiny"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_prints_the_plan_and_its_cost(capsys):
    code, out, _ = run(capsys, *TINY, "--mesh", "dp=2,tp=2", "--policy", "fsdp(dp) + tp(llama, tp) + bf16")
    assert code == 0
    assert "Plan on Mesh(dp=2, tp=2): data parallel fsdp over ('dp',); tensor parallel over ('tp',)" in out
    assert "mixed precision: bfloat16 (reduce float32)" in out
    assert "layers.*.mlp.down_proj.weight ×2" in out  # repeated layers folded
    assert "sent per step" in out


def test_json_writes_the_plan_and_dash_prints_only_json(capsys, tmp_path):
    target = tmp_path / "plan.json"
    code, out, _ = run(capsys, *TINY, "--mesh", "dp=4", "--policy", "zero(2, dp)", "--json", str(target))
    assert code == 0
    assert f"wrote the plan to {target}" in out
    plan = fs.Plan.from_json(target.read_text())
    assert plan.config.data_parallel == "zero2"
    code, out, _ = run(capsys, *TINY, "--mesh", "dp=4", "--policy", "zero(2, dp)", "--json", "-")
    assert fs.Plan.from_json(out) == plan


def test_diff_shows_each_tensors_change_and_the_memory_and_traffic_delta(capsys, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main([*TINY, "--mesh", "dp=4", "--policy", "ddp(dp)", "--json", str(a)]) == 0
    assert main([*TINY, "--mesh", "dp=4", "--policy", "fsdp(dp)", "--json", str(b)]) == 0
    capsys.readouterr()
    code, out, _ = run(capsys, "diff", str(a), str(b))
    assert code == 0
    plan_a, plan_b = (fs.Plan.from_json(p.read_text()) for p in (a, b))
    cost_a, cost_b = plan_a.cost(), plan_b.cost()
    lines = out.splitlines()
    assert any(line.split() == ["<plan>", "data_parallel", "ddp", "fsdp"] for line in lines)
    # the four specs of a tensor that change alike share one row; repeated layers fold
    row = next(line for line in lines if line.startswith("layers.*.mlp.up_proj.weight ×2"))
    assert "storage, grad, optim" in row
    assert "P(None, None)" in row
    assert "P('dp', None)" in row
    params = next(line for line in lines if line.startswith("params "))
    assert params.split()[-2:] == format_bytes(cost_b.params_bytes - cost_a.params_bytes).split()
    sent = next(line for line in lines if line.startswith("sent per step"))
    assert sent.split()[-2:] == format_bytes(cost_b.comm_total_bytes - cost_a.comm_total_bytes).split()


def test_png_writes_the_pictures(capsys, tmp_path):
    target = tmp_path / "plan.png"
    code, out, _ = run(
        capsys, *TINY, "--mesh", "dp=2,tp=2", "--policy", "fsdp(dp) + tp(llama, tp)", "--png", str(target)
    )
    assert code == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote the pictures to {target}" in out


@pytest.fixture(scope="module")
def hf_config_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("which", ["folder", "file"])
def test_a_hugging_face_config_is_planned_on_the_meta_device(capsys, hf_config_folder, which):
    model = hf_config_folder if which == "folder" else hf_config_folder / "config.json"
    assert cli.load_model(str(model)).model.embed_tokens.weight.device.type == "meta"
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        str(model),
        "--mesh",
        "dp=2,tp=2",
        "--policy",
        "fsdp(dp) + tp(llama, tp) + checkpointing(LlamaDecoderLayer)",
    )
    assert code == 0
    assert "2 checkpointed modules" in out
    assert "model.layers.*.self_attn.q_proj.weight ×2" in out


def test_a_factory_builds_the_model_on_the_meta_device(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def big():\n"
        "    layer = torch.nn.Linear(100_000, 100_000)  # 40 GB if it were real\n"
        "    assert layer.weight.device.type == 'meta'\n"
        "    return torch.nn.Sequential(layer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = run(capsys, "plan", "--model", "my_models:big", "--mesh", "dp=8", "--policy", "fsdp(dp)")
    assert code == 0
    assert "0.weight  100000×100000" in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            [*TINY[:2], "llama-3"],
            "--model 'llama-3': not a zoo model "
            "(llama-1b, llama-3-405b, llama-3-8b, llama-70b, llama-7b, tiny, tiny-tied)",
        ),
        ([*TINY[:2], "missing/config.json"], "--model 'missing/config.json': no such file or folder"),
        (
            [*TINY[:2], "no_such_package.models:build"],
            "--model 'no_such_package.models:build': cannot import",
        ),
        ([*TINY[:2], "torch.nn:Linear"], "--model 'torch.nn:Linear': Linear() raised TypeError"),
        ([*TINY, "--policy", "fsdp:dp+tp:tp"], "the old name:axis form is gone"),
        ([*TINY, "--policy", "fsdp(dp) + tp(lama, tp)"], "in 'tp(lama, tp)': unknown rule set 'lama'"),
        (
            [*TINY, "--mesh", "dp=eight"],
            "--mesh 'dp=eight': write axis=size pairs joined by commas, e.g. dp=8,tp=4",
        ),
        ([*TINY, "--mesh", "dp=0"], "--mesh 'dp=0': "),
        (
            [*TINY, "--mesh", "dp=2,tp=2", "--policy", "fsdp(dp)"],
            "plan does not fit the model on Mesh(dp=2, tp=2): axis 'tp' (size 2) is used by no policy",
        ),
        ([*TINY, "--batch", "4"], "--batch needs --seq"),
        ([*TINY, "--seq", "0"], "--seq 0: a positive number"),
        ([*TINY, "--auto", "--devices", "4", "--budget", "1GiB"], "--auto needs --devices, --budget and"),
        ([*TINY, "--batch", "0", "--seq", "16"], "--batch 0: a positive number"),
        ([*TINY, "--batch", "1", "--seq", "16", "--hardware", "abacus"], "--hardware 'abacus'"),
        ([*TINY, "--kernels", "compile"], "--kernels needs --seq"),
        ([*TINY, "--documents", "8,8"], "--documents needs --seq"),
        ([*TINY, "--batch", "1", "--seq", "16", "--documents", "8,eight"], "--documents '8,eight': write"),
        (
            [*TINY, "--batch", "1", "--seq", "16", "--documents", "8,16"],
            "--documents '8,16': estimate(documents=...): 1 row holds more than seq=16 tokens",
        ),
        ([*TINY, "--batch", "1", "--seq", "16", "--kernels", "fused"], "--kernels 'fused': name some of"),
        (
            [*TINY, "--batch", "1", "--seq", "16", "--kernels", "float8"],
            "--kernels 'float8': fs.Kernels(float8=True)",
        ),
        (
            [*TINY, "--auto", "--devices", "8", "--budget", "80 parsecs", "--batch", "8", "--seq", "64"],
            "--budget '80 parsecs'",
        ),
        ([*TINY, "--auto", "--mesh", "dp=8"], "--auto searches meshes and policies itself"),
        ([*TINY, "--budget", "80GiB"], "--devices and --budget go with --auto"),
        (
            [*TINY, "--mesh", "dp=4", "--policy", "fsdp(dp)", "--png", "/no/such/folder/p.png"],
            "--png '/no/such/folder/p.png': there is no folder '/no/such/folder' to write it in",
        ),
        (["diff", "/no/such/a.json", "/no/such/b.json"], "'/no/such/a.json': cannot read"),
        (
            [*TINY, "--mesh", "dp=4", "--policy", "fsdp(dp)", "--png", "p.png", "--param", "wieght"],
            "--param 'wieght': the plan has no tensor 'wieght'",
        ),
        ([*TINY, "--param", "lm_head.weight"], "--param goes with --png"),
        ([*TINY, "--polcy", "fsdp(dp)"], "unrecognized arguments: --polcy"),
    ],
)
def test_every_bad_input_is_one_line_and_exit_code_2(capsys, argv, says):
    with_exit = pytest.raises(SystemExit) if "--polcy" in argv else None
    if with_exit:
        with with_exit as stopped:
            main(argv)
        code = stopped.value.code
        err = capsys.readouterr().err
    else:
        code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("functional-shard")
    assert says in err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err


def test_a_fault_of_the_plan_is_not_blamed_on_documents(capsys):
    # the default mesh's tp=4 cannot split the tiny Llama's 2 key/value heads, --documents or not
    code, _, err = run(capsys, *TINY, "--batch", "1", "--seq", "16", "--documents", "8,8")
    assert code == 2
    assert err.startswith("functional-shard: estimate: Llama cannot run the tensor-parallel split"), err
    assert "--documents" not in err


def test_a_diff_of_something_that_is_not_a_plan_is_one_line(capsys, tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"a": 1}))
    code, _, err = run(capsys, "diff", str(tmp_path / "x.json"), str(tmp_path / "x.json"))
    assert code == 2
    assert err.count("\n") == 1
    assert "not a plan written by --json" in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tables_use_rich_on_a_terminal_and_plain_text_otherwise():
    pytest.importorskip("rich")
    terminal, pipe = Out(_Terminal()), Out(io.StringIO())
    for out in (terminal, pipe):
        out.table("memory", ("part", "bytes"), [("params", "1.00 KiB")], right=1)
    assert "─" in terminal.stream.getvalue()
    assert pipe.stream.getvalue() == "memory\npart       bytes\nparams  1.00 KiB\n"


def test_the_plan_table_is_drawn_by_rich_on_a_wide_terminal(monkeypatch):
    pytest.importorskip("rich")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setenv("COLUMNS", "250")
    assert main([*TINY, "--mesh", "dp=2,tp=2", "--policy", "fsdp(dp) + tp(llama, tp)"]) == 0
    out = re.sub(r"\x1b\[[0-9;]*m", "", terminal.getvalue())  # rich's bold header
    header = next(line for line in out.splitlines() if line.startswith("path "))
    assert header.split() == [
        "path",
        "shape",
        "dtype",
        "storage",
        "compute",
        "grad",
        "optim",
        "local",
        "(rank",
        "0)",
        "bytes/device",
    ]
    assert "─" * 20 in out
    assert re.search(
        r"^lm_head\.weight +256×64 +float32 +P\(\('tp', 'dp'\), None\) .* 16\.00 KiB$", out, re.M
    )


def test_the_demo_reads_the_new_policy_syntax_before_starting_processes():
    with pytest.raises(fs.PolicyError, match="unknown rule set 'lama'"):
        fs.demo.run(fs.Mesh(dp=2, tp=2), "fsdp(dp) + tp(lama, tp)")


def test_the_console_script_reports_in_one_line_from_a_real_process():
    result = subprocess.run(
        [sys.executable, "-m", "functional_shard", "plan", "--model", "tiny", "--mesh", "dp=2"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2  # the default policy names a 'tp' axis this mesh lacks
    assert result.stderr == (
        "functional-shard: plan does not fit the model on Mesh(dp=2): tp(llama, 'tp') names axis 'tp', "
        "which is not in Mesh(dp=2) (and 16 more problems). Fix the rule, change the mesh, or pad the "
        "parameter.\n"
    )
    assert "Traceback" not in result.stderr


def test_help_starts_without_torch_transformers_matplotlib_or_the_tracer():
    # `functional-shard --help` answers at once: each command loads what it needs when it runs
    code = (
        "import json, sys\n"
        "from functional_shard.cli import main\n"
        "for argv in (['--help'], ['plan', '--help'], ['diff', '--help'], ['checkpoint', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    heavy = ("torch", "transformers", "matplotlib", "rich", "functional_shard.costing")
    loaded = [m for m in json.loads(result.stderr) if any(m == h or m.startswith(h + ".") for h in heavy)]
    assert loaded == []
    assert result.stdout.startswith("usage: functional-shard [-h] {plan,diff,demo,checkpoint} ...")


def test_mesh_text():
    assert cli.parse_mesh("dp=8, tp=4") == fs.Mesh(dp=8, tp=4)


# ---- the estimate and the search (fs.estimate, fs.search_plans) ----
def test_batch_and_seq_add_the_estimate_on_the_named_hardware(capsys, tmp_path):
    argv = [*TINY, "--mesh", "dp=4", "--policy", "fsdp(dp) + bf16", "--batch", "2", "--seq", "16"]
    code, out, _ = run(capsys, *argv, "--hardware", "a100", "--png", str(tmp_path / "p.png"))
    assert code == 0
    model = zoo.llama("tiny")
    plan = fs.shard(model, fs.Mesh(dp=4), fs.parse_policy("fsdp(dp) + bf16"))
    estimate = fs.estimate(model, plan, batch=2, seq=16, hardware="a100")
    assert str(estimate) in out  # --batch is per data-parallel rank, as fs.estimate takes it
    assert "estimate on rank 0, a100, micro-batch 2 x 16 tokens" in out
    assert out.rstrip().endswith("wrote the pictures to " + str(tmp_path / "p.png"))
    code, _, err = run(capsys, *argv, "--hardware", "abacus")
    assert code == 2
    assert err.startswith("functional-shard: --hardware 'abacus': unknown hardware 'abacus'; choose one of")


@pytest.mark.parametrize(
    ("flag", "value", "options", "says"),
    [
        ("--kernels", "compile", {"kernels": fs.Kernels(compile=True)}, "with torch.compile"),
        ("--documents", "4,4,8", {"documents": [4, 4, 8]}, "packed documents: 3.0 a row of 16 tokens"),
    ],
)
def test_estimate_flags_reach_the_estimate(capsys, flag, value, options, says):
    argv = [*TINY, "--mesh", "dp=4", "--policy", "fsdp(dp) + bf16", "--batch", "2", "--seq", "16"]
    code, out, _ = run(capsys, *argv, flag, value)
    assert code == 0
    model = zoo.llama("tiny")
    plan = fs.shard(model, fs.Mesh(dp=4), fs.parse_policy("fsdp(dp) + bf16"))
    estimate = fs.estimate(model, plan, batch=2, seq=16, **options)
    assert str(estimate) in out
    assert says in out


def test_auto_prints_the_candidates_then_the_chosen_plan(capsys, tmp_path):
    argv = [*TINY, "--auto", "--devices", "4", "--batch", "8", "--seq", "64", "--top", "4"]
    code, out, _ = run(capsys, *argv, "--budget", "1500KiB", "--json", str(tmp_path / "best.json"))
    assert code == 0
    report = fs.search_plans(
        zoo.llama("tiny"), devices=4, memory_budget="1500KiB", batch=8, seq=64, hardware="h100"
    )
    lines = out.splitlines()
    assert lines[0] == (
        f"{len(report.candidates)} candidates on h100, budget 1.46 MiB: "
        f"{sum(c.fits for c in report.candidates)} fit; the first 4, those that fit first, fastest first:"
    )
    assert lines[1].split() == ["mesh", "policy", "peak", "step", "verdict"]
    chosen = report.best_candidate
    assert lines[2].startswith(f"{chosen.mesh!r}  ")
    assert lines[2].endswith("  chosen")
    assert chosen.policy_text in lines[2]
    assert lines[7] == f"chosen: {chosen.mesh!r} {chosen.policy_text}; its plan and estimate:"
    assert lines[9].startswith(f"Plan on {chosen.mesh!r}")
    assert fs.Plan.from_json((tmp_path / "best.json").read_text()) == report.best
    # the chosen candidate's own estimate is shown whole: the micro-batch is the global 8 over
    # dp, memory by part, the step and its parts, tokens/s
    assert str(chosen.estimate) in out
    for part in ("params", "activations", "loss_workspace"):
        assert re.search(rf"^  {part} +[\d.]+ [KMG]?i?B$", out, re.M), part
    assert re.search(r"^step [\d.]+ (us|ms): compute", out, re.M)
    assert re.search(r"^tokens/s per device [\d,]+, MFU", out, re.M)
    code, out, err = run(capsys, *argv, "--budget", "100KiB")
    assert code == 2
    assert "0 fit" in out.splitlines()[0]
    assert re.fullmatch(
        r"functional-shard: --budget: no plan fits 100\.00 KiB per device on 4 devices; the closest, "
        r"Mesh\(.*\) .*, peaks at [\d.]+ KiB \([\d.]+ KiB over\): use more devices, a smaller --batch "
        r"or --seq, or a larger --budget\n",
        err,
    )


def test_seq_alone_means_one_sequence_per_data_parallel_rank(capsys):
    code, out, _ = run(capsys, *TINY, "--mesh", "dp=4", "--policy", "fsdp(dp) + bf16", "--seq", "16")
    assert code == 0
    assert "estimate on rank 0, h100, micro-batch 1 x 16 tokens" in out
    # with --auto, a global batch of one sequence per device: every candidate's micro-batch is
    # the devices over its data-parallel size
    code, out, _ = run(capsys, *TINY, "--auto", "--devices", "2", "--budget", "1GiB", "--seq", "16")
    assert code == 0
    report = fs.search_plans(zoo.llama("tiny"), devices=2, memory_budget="1GiB", batch=2, seq=16)
    chosen = report.best_candidate
    assert f"chosen: {chosen.mesh!r} {chosen.policy_text};" in out
    assert str(chosen.estimate) in out


def test_a_model_folder_with_its_weights_is_planned_from_config_json_alone(capsys, tmp_path):
    """What save_pretrained writes (config.json and model.safetensors), as --init-from takes it:
    planned on the meta device, no weights read."""
    pytest.importorskip("transformers")
    from .. import load_hf_cases

    folder = load_hf_cases.write_folder(tmp_path / "llama", "llama")
    assert (folder / "model.safetensors").is_file()
    assert cli.load_model(str(folder)).model.embed_tokens.weight.device.type == "meta"
    code, out, err = run(
        capsys, "plan", "--model", str(folder), "--mesh", "dp=2,tp=2", "--policy", "fsdp(dp) + tp(llama, tp)"
    )
    assert code == 0, err
    assert "Plan on Mesh(dp=2, tp=2): data parallel fsdp over ('dp',); tensor parallel over ('tp',)" in out


def test_auto_gives_a_mixture_of_experts_model_tensor_and_expert_parallel_candidates(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ).save_pretrained(tmp_path)
    argv = ["plan", "--model", str(tmp_path), "--auto", "--devices", "2", "--budget", "1GiB", "--seq", "16"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "no tensor parallelism" not in out
    assert "expert parallel (experts split by index over ep), the best of each ep size:" in out
    assert "Mesh(dp=1, ep=2)" in out
    assert "fsdp(dp, ep) + ep(ep)" in out
    assert "chosen: " in out


def test_auto_counts_the_kernels_in_every_candidate(capsys):
    argv = [*TINY, "--auto", "--devices", "2", "--budget", "1GiB", "--batch", "2", "--seq", "16"]
    code, out, _ = run(capsys, *argv, "--top", "1", "--kernels", "compile")
    assert code == 0
    report = fs.search_plans(
        zoo.llama("tiny"), devices=2, memory_budget="1GiB", batch=2, seq=16, kernels=fs.Kernels(compile=True)
    )
    fits = sum(c.fits for c in report.candidates)
    assert f"candidates on h100 with torch.compile, budget 1.00 GiB: {fits} fit" in out
    assert report.best_candidate is not None
    assert str(report.best_candidate.estimate) in out
