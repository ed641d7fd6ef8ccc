"""docs/cli.md shows real output: every ```console block is run and compared.

To refresh the page after the output changed on purpose: ``python3 -m tests.unit.test_docs_cli``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import shlex
import sys
import tempfile

import pytest

from functional_shard.cli import main

ROOT = pathlib.Path(__file__).parents[2]
PAGE = ROOT / "docs" / "cli.md"
BLOCK = re.compile(r"```console\n\$ (functional-shard [^\n]*)\n(.*?)```", re.S)


def run(command: str, workdir: pathlib.Path) -> str:
    """What ``command`` prints (stdout and stderr, in order), run in ``workdir``."""
    argv = shlex.split(command)[1:]
    output = io.StringIO()
    old_cwd, old_columns = os.getcwd(), os.environ.get("COLUMNS")
    os.chdir(workdir)
    os.environ["COLUMNS"] = "100"  # argparse wraps --help to the terminal
    try:
        with (
            contextlib.redirect_stdout(output),
            contextlib.redirect_stderr(output),
            contextlib.suppress(SystemExit),  # --help exits
        ):
            main(argv)
    finally:
        os.chdir(old_cwd)
        if old_columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old_columns
    return output.getvalue()


def workdir(base: pathlib.Path) -> pathlib.Path:
    """A scratch folder that sees the repository's examples/ as the docs' commands do."""
    (base / "examples").symlink_to(ROOT / "examples")
    return base


def refreshed(text: str, base: pathlib.Path) -> str:
    folder = workdir(base)
    return BLOCK.sub(lambda m: f"```console\n$ {m.group(1)}\n{run(m.group(1), folder)}```", text)


def test_the_cli_page_shows_what_the_commands_print(tmp_path):
    text = PAGE.read_text()
    assert len(BLOCK.findall(text)) >= 8
    if refreshed(text, tmp_path) != text:
        (tmp_path / "again").mkdir()
        stale = [
            command
            for (command, shown), (_, now) in zip(
                BLOCK.findall(text), BLOCK.findall(refreshed(text, tmp_path / "again")), strict=True
            )
            if shown != now
        ]
        pytest.fail(
            f"docs/cli.md shows stale output for {stale}; refresh it: python3 -m tests.unit.test_docs_cli"
        )


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as scratch:
        PAGE.write_text(refreshed(PAGE.read_text(), pathlib.Path(scratch)))
    print(f"refreshed {PAGE}", file=sys.stderr)
