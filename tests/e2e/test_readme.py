"""The README's example runs and says what the README says it prints."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[2]


def test_readme_example_runs():
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    plan = namespace["plan"]
    assert plan.local_shape("layers.0.mlp.up_proj.weight", rank=5) == (344, 4096)


def test_main_job_runs():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plan_llama.py"), "tiny", "2", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "Plan on Mesh(dp=2, tp=2)" in result.stdout
    assert "memory on rank 0" in result.stdout
