"""`functional-shard demo`, the README's main job: a real run beside its prediction."""

import pathlib
import re
import subprocess
import sys

import pytest

from functional_shard.cli import main

ROOT = pathlib.Path(__file__).parents[2]


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "functional_shard", "demo", *args], capture_output=True, text=True, timeout=300
    )


def test_the_readme_main_job_is_the_demo():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"```bash\n.*&& functional-shard demo\n```", readme)


def test_the_default_demo_holds_every_prediction_and_matches_one_process():
    """FSDP x TP on 4 processes: each rank's bytes and each collective's bytes as
    predicted, the losses of one process; every row says so, and the exit code too."""
    result = demo()
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Plan on Mesh(dp=2, tp=2)" in out
    assert len(re.findall(r"^  rank \d: .* ok$", out, re.M)) == 4
    assert re.search(r"^  reduce_scatter  over dp .* ok$", out, re.M)
    assert re.search(r"^  all_reduce      over tp .* ok$", out, re.M)
    assert "DIFFERS" not in out
    assert out.rstrip().endswith("All predictions held and the run matched one process.")


def test_a_mesh_the_model_cannot_split_is_refused_before_anything_starts(capsys):
    # in this process: the refusal comes before any rank starts (the run above is the whole job)
    assert main(["demo", "--mesh", "tp=4", "--policy", "tp(llama, tp)"]) == 2
    err = capsys.readouterr().err
    assert "its 2 attention heads (32 features, head_dim 16) do not split over 4" in err
    assert "Traceback" not in err


@pytest.mark.slow  # a whole job keeps one smoke case by default: the plain demo above
def test_the_packed_demo_trains_packed_rows_as_one_process():
    """--packed: rows of documents of mixed lengths, each attending only to itself; the same
    predictions hold (packing moves no bytes of its own) and the losses are one process's on
    the same rows."""
    result = demo("--packed")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "packed rows of 16 tokens: one long document among short ones in each" in out
    assert "Training, global batch 4 x 16 packed rows: loss per step" in out
    assert len(re.findall(r"^  rank \d: .* ok$", out, re.M)) == 4
    assert "DIFFERS" not in out
    assert out.rstrip().endswith("All predictions held and the run matched one process.")
