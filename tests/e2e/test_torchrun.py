"""examples/train_torchrun.py under torchrun for real: 4 gloo processes, a plan from the command line."""

import importlib.util
import itertools
import math
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from .. import load_hf_cases

ROOT = pathlib.Path(__file__).parents[2]


def torchrun(*args: str, processes: int = 4) -> subprocess.CompletedProcess[str]:
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *("--nproc-per-node", str(processes)),
    ]
    return subprocess.run(
        [*command, str(ROOT / "examples" / "train_torchrun.py"), *args],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )


@pytest.mark.slow  # by default, test_crash.py's uninterrupted run is this job on 2 ranks
def test_a_plan_from_the_command_line_trains_under_torchrun():
    result = torchrun("--mesh", "dp=2,tp=2", "--policy", "fsdp(dp) + tp(llama, tp)", "--steps", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\S+)$", result.stdout, re.M)]
    assert len(losses) == 4
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 0.3  # the counting task is learnt
    assert "Plan on Mesh(dp=2, tp=2): data parallel fsdp over ('dp',)" in result.stdout
    assert "Warning" not in result.stderr


def test_the_docs_show_the_launches_this_example_makes():
    launching = (ROOT / "docs" / "launching.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for text in (launching, readme):
        assert "torchrun --standalone --nproc-per-node 4 examples/train_torchrun.py" in text
        assert re.search(
            r"torchrun --nnodes \d+ --nproc-per-node \d+ --rdzv-backend c10d --rdzv-endpoint", text
        )
        assert re.search(r"Trainer\([^)]*num_nodes=\d+[^)]*strategy=ShardStrategy\(plan\)", text)


@pytest.mark.slow
def test_a_pipeline_plan_trains_under_torchrun():
    """pp=2 stages, each FSDP-sharded over dp=2: fs.forward_backward runs the 1F1B schedule."""
    policy = "pipeline(pp, microbatches=4) + fsdp(dp)"
    result = torchrun("--mesh", "pp=2,dp=2", "--policy", policy, "--steps", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\S+)$", result.stdout, re.M)]
    assert len(losses) == 4
    assert losses[-1] < losses[0] - 0.3  # the counting task is learnt through the schedule
    assert "pipeline over 'pp': 2 stages, 1 per rank, schedule 1f1b, 4 micro-batches" in result.stdout
    assert "Warning" not in result.stderr


@pytest.mark.slow
def test_a_batch_the_micro_batches_do_not_divide_is_refused_under_torchrun():
    policy = "pipeline(pp, microbatches=4) + fsdp(dp)"
    result = torchrun("--mesh", "pp=2,dp=2", "--policy", policy, "--steps", "1", "--batch", "3")
    # the script exits 2 with the reason; torchrun reports a failed child as 1
    assert result.returncode != 0, result.stdout + result.stderr
    assert "train_torchrun: fs.forward_backward: the inputs' batch of 3 does not split" in result.stderr
    assert "step    1" not in result.stdout


@pytest.mark.slow
def test_a_context_parallel_plan_trains_under_torchrun():
    """dp=2 x cp=2: each rank runs its chunks of the sequences, attention gathers the rest."""
    policy = "fsdp(dp, cp) + cp(cp)"
    result = torchrun("--mesh", "dp=2,cp=2", "--policy", policy, "--seq", "64", "--steps", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\S+)$", result.stdout, re.M)]
    assert len(losses) == 4
    assert losses[-1] < losses[0] - 0.3  # the counting task is learnt from chunks of it
    assert "context parallel over 'cp': activations split on the sequence dim into 4 chunks" in result.stdout
    assert "Warning" not in result.stderr


def example_module():
    """The script as a module, for its batches (its main runs only as a script)."""
    spec = importlib.util.spec_from_file_location("train_torchrun", ROOT / "examples" / "train_torchrun.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_run_starts_from_a_hugging_face_folder_under_torchrun(tmp_path):
    """--model FOLDER --init-from FOLDER on 2 processes: each rank reads its FSDP shards from
    the folder, so the first step's loss is from_pretrained's on the same batch."""
    transformers = pytest.importorskip("transformers")
    folder = load_hf_cases.write_folder(tmp_path / "llama", "llama")
    model = ("--model", str(folder), "--init-from", str(folder))
    plan = ("--mesh", "dp=2", "--policy", "fsdp(dp)")
    result = torchrun(*model, *plan, "--steps", "2", "--batch", "2", "--seq", "8", processes=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"weights from {folder}" in result.stdout
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\S+)$", result.stdout, re.M)]
    assert len(losses) == 2
    # step 0's batch over both data-parallel ranks, drawn as the script draws it
    tokens = example_module().counting_batch(0, 2 * 2, 8, load_hf_cases.VOCAB, 0)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    with torch.no_grad():
        logits = pretrained(tokens[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert losses[0] == pytest.approx(expected.item(), abs=2e-4)  # printed to 4 decimals
    assert "Warning" not in result.stderr


@pytest.mark.slow
def test_init_from_a_missing_folder_is_refused_before_the_run_starts(tmp_path):
    missing = str(tmp_path / "nowhere")
    result = torchrun("--mesh", "dp=2", "--policy", "fsdp(dp)", "--init-from", missing, processes=2)
    assert result.returncode != 0
    refusals = [line for line in result.stderr.splitlines() if line.startswith("train_torchrun:")]
    assert len(refusals) == 1, result.stderr
    assert refusals[0].startswith(
        f"train_torchrun: --init-from {missing!r}: not a folder; pass a Hugging Face"
    )
    assert "step" not in result.stdout


@pytest.mark.slow
def test_packed_rows_train_under_torchrun_as_one_process():
    """--packed under dp=2 x cp=2: rows of one long counting document among short ones, cut over
    the cp ranks by attention work; rank 0 trains the same rows in one process from the same
    first weights, and the losses agree."""
    policy = "fsdp(dp, cp) + cp(cp)"
    result = torchrun("--mesh", "dp=2,cp=2", "--policy", policy, "--seq", "64", "--steps", "4", "--packed")
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\S+)$", result.stdout, re.M)]
    assert len(losses) == 4
    assert losses[-1] < losses[0] - 0.3  # counting is learnt within each document
    parity = re.search(
        r"^one process on the same packed rows: largest loss difference (\S+) .*  ok$", result.stdout, re.M
    )
    assert parity, result.stdout
    assert float(parity.group(1)) < 1e-4
    assert "Warning" not in result.stderr


def test_packed_rows_hold_mixed_documents_and_fill_their_rows():
    """The example's packed rows: one long document (1/2 to 3/4 of a row) among short ones,
    the same rows for the same step."""
    module = example_module()
    batch = module.packed_batch(3, rows=6, seq=32, vocab=256, seed=0)
    assert batch.tokens.shape == (6, 32)
    for offsets in batch.offsets:
        lengths = [b - a for a, b in itertools.pairwise(offsets)]
        assert max(lengths) >= 16
        assert len(lengths) >= 3
        assert sum(1 for n in lengths if n >= 16) == 1
    again = module.packed_batch(3, rows=6, seq=32, vocab=256, seed=0)
    assert torch.equal(batch.tokens, again.tokens)
