"""The sdist and the wheel hold the whole package, and the wheel works on its own.

`pip install -e .` hides a package the wheel leaves out (the editable finder serves it from
the checkout): a wheel without ``functional_shard.engines`` once shipped that way. So the
distributions are built as a user's ``python3 -m build`` builds them (the sdist, then the
wheel from the sdist) and read file by file against the source tree. The `wheel`-marked
test, which CI runs (``.ci/run``), installs the wheel into a fresh virtual environment (no
system site packages, so no editable finder; no checkout on ``sys.path``) and runs it from
outside the checkout: every module imports, two ranks apply a plan and train a step, and
``functional-shard demo`` passes.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest
import torch

ROOT = pathlib.Path(__file__).parents[2]
PACKAGE = "functional_shard"
# where each source folder installs: adapters/ stays at the top of the repository
INSTALLS_AS = {PACKAGE: PACKAGE, "adapters": f"{PACKAGE}/adapters"}
# what a checkout holds that a build must not see: caches, earlier builds and, in development
# worktrees, the functional_shard/adapters symlink (setuptools would follow it)
OUTPUTS = shutil.ignore_patterns(
    ".git", "build", "dist", "site", ".venv", "*.egg-info", ".*cache*", ".hypothesis"
)
CACHES = shutil.ignore_patterns("__pycache__", "*.pyc")


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    if result.returncode != 0:
        pytest.fail(f"{command} exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def source_files() -> dict[str, str]:
    """Each file of the package's source folders (path in the repository) -> its installed path."""
    files = {}
    for folder, installed in INSTALLS_AS.items():
        for directory, subdirectories, names in os.walk(ROOT / folder):  # symlinks not followed
            subdirectories[:] = [name for name in subdirectories if name != "__pycache__"]
            for name in names:
                path = pathlib.Path(directory, name)
                if path.suffix != ".pyc" and not path.is_symlink():
                    relative = path.relative_to(ROOT / folder).as_posix()
                    files[f"{folder}/{relative}"] = f"{installed}/{relative}"
    return files


def _not_source(directory: str, names: list[str]) -> set[str]:
    ignored = set(CACHES(directory, names)) | {n for n in names if os.path.islink(os.path.join(directory, n))}
    return ignored | (set(OUTPUTS(directory, names)) if pathlib.Path(directory) == ROOT else set())


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """The sdist and the wheel, built from a copy of the checkout (which stays clean)."""
    base = tmp_path_factory.mktemp("dists")
    shutil.copytree(ROOT, base / "source", ignore=_not_source)
    run([sys.executable, "-m", "build", "--outdir", str(base / "dist"), str(base / "source")])
    return {
        "sdist": next((base / "dist").glob("*.tar.gz")),
        "wheel": next((base / "dist").glob("*.whl")),
    }


def test_the_wheel_holds_every_file_of_the_package_and_nothing_else(dists):
    expected = set(source_files().values())
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        held = {name for name in wheel.namelist() if ".dist-info/" not in name}
    assert sorted(expected - held) == [], "missing from the wheel"
    assert sorted(held - expected) == [], "in the wheel but not in the source tree"
    assert f"{PACKAGE}/py.typed" in held
    assert f"{PACKAGE}/runtime/engines/__init__.py" in held  # the package that once went missing


def test_the_sdist_holds_every_file_of_the_package(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        held = {name.removeprefix(f"{top}/") for name in sdist.getnames()}
    assert sorted(set(source_files()) - held) == [], "missing from the sdist"
    assert f"{PACKAGE}/py.typed" in held
    assert {"pyproject.toml", "setup.py", "README.md"} <= held


def test_the_source_walk_sees_both_folders():
    files = source_files()
    assert files["adapters/lightning/__init__.py"] == f"{PACKAGE}/adapters/lightning/__init__.py"
    assert files[f"{PACKAGE}/core/mesh.py"] == f"{PACKAGE}/core/mesh.py"
    # a worktree's functional_shard/adapters symlink is not a second copy of the adapters
    assert not [path for path in files if path.startswith(f"{PACKAGE}/adapters/")]


@pytest.mark.wheel
def test_the_installed_wheel_alone_imports_trains_and_runs_the_demo(dists, tmp_path):
    environment = tmp_path / "env"
    run([sys.executable, "-m", "venv", str(environment)])  # no system site packages
    python, command = environment / "bin" / "python", environment / "bin" / "functional-shard"
    install = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # torch first and pinned to this interpreter's version (CI's: the local CPU wheel), so
    # the wheel's unpinned torch requirement is already met and pulls no CUDA build
    run([*install, f"torch=={torch.__version__.split('+')[0]}"])
    run([*install, str(dists["wheel"])])  # the demo needs no extra
    outside = tmp_path / "work"
    outside.mkdir()
    shutil.copy(ROOT / "tests" / "wheel_smoke.py", outside)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}

    report = json.loads(run([str(python), "wheel_smoke.py"], cwd=outside, env=env).stdout.splitlines()[-1])
    assert pathlib.Path(report["package"]).resolve().is_relative_to(environment.resolve()), report["package"]
    assert [f for f in report["meta_path"] if "editable" in f.lower()] == []
    checkout = ROOT.resolve()
    inside = [entry for entry in report["sys_path"] if (outside / entry).resolve().is_relative_to(checkout)]
    assert inside == []
    # only the Lightning adapters need an extra this environment lacks
    assert report["needs_extra"]
    assert {module.split(".")[1] for module in report["needs_extra"]} == {"adapters"}, report["needs_extra"]
    assert report["moved"] == [True, True]
    assert report["losses"][0] == report["losses"][1] > 0

    demo = run([str(command), "demo"], cwd=outside, env=env)
    assert "All predictions held and the run matched one process." in demo.stdout
