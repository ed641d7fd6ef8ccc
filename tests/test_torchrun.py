"""examples/train_torchrun.py under torchrun for real: 4 gloo processes, a plan from the command line."""

import math
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    return subprocess.run(
        [*command, str(ROOT / "examples" / "train_torchrun.py"), *args],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )


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
