import subprocess
import sys

import functional_shard as fs
from functional_shard.cli import main


def test_plan_prints_explain_and_cost(capsys):
    assert (
        main(
            ["plan", "--model", "tiny", "--mesh", "dp=2,tp=2", "--policy", "fsdp:dp+tp:tp", "--tokens", "64"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Plan on Mesh(dp=2, tp=2)" in out
    assert "sent per step" in out


def test_plan_json_round_trips(capsys):
    assert main(["plan", "--model", "tiny", "--mesh", "dp=4", "--policy", "zero2:dp", "--json"]) == 0
    assert fs.Plan.from_json(capsys.readouterr().out).config.data_parallel == "zero2"


def test_bad_input_is_a_message_not_a_traceback(capsys):
    assert main(["plan", "--model", "tiny", "--mesh", "dp=2,tp=2", "--policy", "fsdp:dp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("functional-shard: plan does not fit the model")
    assert "axis 'tp' (size 2) is used by no policy" in err


def test_the_console_script_is_installed():
    result = subprocess.run(
        [sys.executable, "-m", "functional_shard.cli", "plan", "--model", "tiny", "--mesh", "dp=2"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2  # the default policy names a 'tp' axis this mesh lacks
    assert "tp(llama, 'tp') names axis 'tp'" in result.stderr
