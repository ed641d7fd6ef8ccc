"""Crashes lose nothing: a rank SIGKILLed under ``torchrun --max-restarts=1`` (in mid-step, or
in mid-save) and the job resumes from the last whole checkpoint to the weights of a run that
never crashed; a hung peer ends a torchrun job, a Lightning Trainer run and a local run
within the timeout, naming the collective and the rank.

The torchrun runs are examples/train_torchrun.py, through tests/crash_run.py (which arms the
kill or the hang, in the first attempt only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import functional_shard as fs

ROOT = pathlib.Path(__file__).parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
TP = ("--mesh", "dp=2,tp=2", "--policy", "fsdp(dp) + tp(llama, tp)")
# the default suite's kill: the same resume on 2 ranks, half the processes to start (4 ranks: slow)
TP_ON_TWO = ("--mesh", "tp=2", "--policy", "tp(llama, tp)")


def ranks_of(args: tuple[str, ...]) -> int:
    """The world size the plan's ``--mesh`` (``dp=2,tp=2``) asks torchrun for."""
    mesh = args[args.index("--mesh") + 1]
    return math.prod(int(axis.split("=")[1]) for axis in mesh.split(","))


@dataclasses.dataclass
class Launched:
    """A process in a session of its own (so that a hung rank it started goes with it), its
    output in files: a pipe would stay open as long as an orphaned hung rank holds it."""

    process: subprocess.Popen[bytes]
    out: pathlib.Path
    err: pathlib.Path


def launch(command: list[str], folder: pathlib.Path, env: dict[str, str] | None = None) -> Launched:
    folder.mkdir(parents=True, exist_ok=True)
    out, err = folder / "stdout", folder / "stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen(
            command, stdout=stdout, stderr=stderr, cwd=ROOT, env=env, start_new_session=True
        )
    return Launched(process, out, err)


def start(script: str, *args: str, folder: pathlib.Path, restarts: int = 0, crash: str = "") -> Launched:
    """torchrun on the mesh's gloo processes; ``crash`` arms tests/crash_run.py (first attempt only)."""
    env = {**os.environ, "CRASH_AT": crash, "CRASH_MARKER": str(folder / "struck")}
    ranks = ("--nproc-per-node", str(ranks_of(args)))
    return launch([*TORCHRUN, *ranks, f"--max-restarts={restarts}", str(ROOT / script), *args], folder, env)


def finish(launched: Launched, timeout: float = 280) -> tuple[int, str, str]:
    try:
        code = launched.process.wait(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):  # what is left of its session: a hung rank
            os.killpg(launched.process.pid, signal.SIGKILL)
        launched.process.wait()
    return code, launched.out.read_text(), launched.err.read_text()


def final_weights(folder: pathlib.Path, steps: int) -> dict[str, torch.Tensor]:
    full = fs.checkpoint.convert(folder / f"step-{steps:06d}", folder / "final.pt")
    return torch.load(full, weights_only=True)["model"]


def losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step +(\d+)  loss (\S+)$", stdout, re.M)}


def crash_and_compare(tmp_path: pathlib.Path, plan: tuple[str, ...], crash: str, steps: int, resumed_at: int):
    common = (*plan, "--steps", str(steps), "--save-every", "2")
    # the uninterrupted run and the crashing one side by side: the machine's cores are shared
    # between them rather than waited for twice
    straight = start(
        "examples/train_torchrun.py",
        *common,
        "--checkpoint-dir",
        str(tmp_path / "straight"),
        folder=tmp_path / "straight-run",
    )
    crashing = start(
        "tests/crash_run.py",
        *common,
        "--checkpoint-dir",
        str(tmp_path / "crashed"),
        folder=tmp_path / "crashed-run",
        # one restart brings the job back; a second is there for gloo's rare abort as a
        # process exits (it would resume from the final checkpoint and stop at once)
        restarts=2,
        crash=crash,
    )
    code, out, err = finish(straight)
    assert code == 0, out + err
    # the uninterrupted run is also the default suite's torchrun job (test_torchrun.py's own: slow):
    # the plan from the command line, printed, and the example's counting task learnt, quietly
    assert "Plan on Mesh(" in out, out
    learnt = losses(out)
    assert sorted(learnt) == list(range(1, steps + 1)), out
    assert learnt[steps] < learnt[1] - 0.3, learnt
    assert "Warning" not in err, err
    crashed_code, crashed_out, crashed_err = finish(crashing)
    assert crashed_code == 0, crashed_out + crashed_err
    assert (tmp_path / "crashed-run" / "struck").exists()  # the kill happened
    # torchrun saw a worker fail (rank 1's SIGKILL, or a peer's lost connection, whichever first)
    assert "failed (exitcode: " in crashed_err, crashed_err
    assert f"crashed/step-{resumed_at:06d} at step {resumed_at} (restart 1)" in crashed_out
    # the steps after the checkpoint ran again, and saw the same batches
    assert {s: v for s, v in losses(crashed_out).items() if s > resumed_at} == {
        s: v for s, v in losses(out).items() if s > resumed_at
    }
    expected = final_weights(tmp_path / "straight", steps)
    got = final_weights(tmp_path / "crashed", steps)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        # bit for bit: the same plan on the same ranks sums in the same order, the checkpoint
        # holds the weights and AdamW's state exactly, and each step's batch follows its number
        assert torch.equal(got[name], value), name


def test_a_rank_killed_in_mid_step_resumes_to_the_weights_of_a_run_that_never_crashed(tmp_path):
    """Rank 1 is killed after step 3's backward; torchrun restarts every worker; they resume at 2."""
    crash_and_compare(tmp_path, TP_ON_TWO, "step:3:1", steps=4, resumed_at=2)


@pytest.mark.slow
def test_a_rank_killed_while_a_checkpoint_is_written_resumes_from_the_one_before(tmp_path):
    """Rank 1 is killed in the second save (step 4), its shards written, nothing renamed: the
    cut save is passed over and the run resumes from step 2."""
    crash_and_compare(tmp_path, TP, "save:2:1", steps=6, resumed_at=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan",
    [
        TP,
        ("--mesh", "dp=4", "--policy", "fsdp(dp)"),
        ("--mesh", "pp=2,dp=2", "--policy", "pipeline(pp, microbatches=4) + fsdp(dp)"),
    ],
    ids=["fsdp_tp", "fsdp", "pipeline"],
)
def test_other_plans_resume_after_a_kill_in_mid_step(tmp_path, plan):
    crash_and_compare(tmp_path, plan, "step:3:1", steps=4, resumed_at=2)


@pytest.mark.slow
def test_a_hung_rank_ends_a_torchrun_job_within_its_timeout_naming_the_collective_and_rank(tmp_path):
    began = time.monotonic()
    hung = start(
        "tests/crash_run.py", *TP, "--steps", "4", "--timeout", "3", folder=tmp_path, crash="hang:2:1"
    )
    code, out, err = finish(hung, timeout=120)
    assert code != 0
    named = r"CollectiveTimeoutError: rank [023] waited 3s in \S.*; ranks \[1\] never joined it: hung or dead"
    assert re.search(named, err), err
    assert "step    2" not in out
    assert time.monotonic() - began < 100  # start-up, the 3 s wait and the grace; not the hour


@pytest.mark.slow
def test_a_hung_rank_ends_a_lightning_trainer_run_within_its_timeout(tmp_path):
    """4 CPU processes that Lightning launches; ShardStrategy(timeout=timedelta(seconds=3))."""
    began = time.monotonic()
    process = launch([sys.executable, "-m", "tests.lightning_hang", "3"], tmp_path)
    code, _, err = finish(process, timeout=150)
    assert code != 0
    assert re.search(
        r"functional_shard\.CollectiveTimeoutError: rank [023] waited 3s in torch\.distributed\.\w+; "
        r"ranks \[1\] never joined it: hung or dead",
        err,
    ), err
    assert time.monotonic() - began < 140


@pytest.mark.slow
def test_a_hung_rank_ends_a_fabric_collective_within_the_timeout():
    # here and below, worlds of their own (not the run's shared ones): a short timeout, and a
    # rank that hangs or dies
    from .. import lightning_hang

    with pytest.raises(
        fs.CollectiveTimeoutError,
        match=r"^rank [02] waited 3s in torch\.distributed\.barrier; ranks \[1\] never joined it: "
        r"hung or dead",
    ):
        fs.run_local(lightning_hang.fabric_barrier_while_rank_1_sleeps, 3, timeout=60)


def all_reduce_while_rank_1_sleeps() -> None:
    """Ranks 0 and 2 wait in an all-reduce that rank 1 never reaches."""
    if dist.get_rank() == 1:
        time.sleep(30)
        return
    with fs.watch_collectives():
        dist.all_reduce(torch.ones(1))


def test_watch_collectives_names_the_collective_and_the_ranks_that_never_came():
    began = time.monotonic()
    with pytest.raises(
        fs.CollectiveTimeoutError,
        match=r"^rank [02] waited 2s in torch\.distributed\.all_reduce; ranks \[1\] never joined it: "
        r"hung or dead",
    ):
        fs.run_local(all_reduce_while_rank_1_sleeps, 3, timeout=2)
    assert time.monotonic() - began < 25  # the wait and the grace, not the sleeping rank's 30 s


def all_reduce_while_rank_1_dies() -> None:
    """Ranks 0 and 2 wait in an all-reduce; rank 1's process ends before it gets there."""
    if dist.get_rank() == 1:
        time.sleep(0.5)
        os._exit(1)
    with fs.watch_collectives():
        dist.all_reduce(torch.ones(1))


def test_a_dead_peer_ends_the_run_at_once_naming_the_collective_and_the_rank():
    # gloo tells the others at once that the connection closed: no waiting out the timeout
    began = time.monotonic()
    with pytest.raises(
        fs.CollectiveTimeoutError,
        match=r"^rank [02] lost a peer's connection in torch\.distributed\.all_reduce.*ranks \[1\]",
    ):
        fs.run_local(all_reduce_while_rank_1_dies, 3, timeout=60)
    assert time.monotonic() - began < 45


def test_a_timeout_must_be_positive():
    with pytest.raises(fs.ShardingError, match=re.escape("init_distributed(timeout=0): a positive number")):
        fs.init_distributed(timeout=0)


@pytest.mark.slow  # a script's whole start, twice over (its ranks import it again)
def test_ranks_started_from_a_script_without_a_main_guard_are_said_to_need_one(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import torch.distributed as dist\nimport functional_shard as fs\n\n"
        "print(fs.run_local(dist.get_rank, 2, timeout=20))\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "RankFailedError: ranks [0, 1] died in get_rank, ranks [0, 1] as they started" in last
    assert 'under `if __name__ == "__main__":`' in last
