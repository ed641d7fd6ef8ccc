"""The pages show what runs: their interactive examples (```pycon blocks) run as doctests, and
(slow) the tables a bench prints are the ones on the pages."""

from __future__ import annotations

import contextlib
import doctest
import io
import pathlib
import re
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```pycon\n(.*?)^```", re.M | re.S)


def _blocks() -> list[tuple[str, str]]:
    return [
        (f"{page.name}:{page.read_text()[: match.start()].count(chr(10)) + 1}", match.group(1))
        for page in PAGES
        for match in BLOCK.finditer(page.read_text())
    ]


def test_the_pages_have_interactive_examples():
    assert _blocks()


@pytest.mark.parametrize(("where", "block"), _blocks(), ids=[where for where, _ in _blocks()])
def test_an_interactive_example_prints_what_it_shows(where, block):
    test = doctest.DocTestParser().get_doctest(block, {}, where, where, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0, where


@pytest.mark.slow
def test_the_long_context_tables_are_what_the_bench_prints():
    # bench/long_context.py's rows (about a minute of estimates), on the two pages that show them
    script = runpy.run_path(str(ROOT / "bench" / "long_context.py"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        script["main"]()
    rows = [line for line in printed.getvalue().splitlines() if line.startswith("| ") and "GiB" in line]
    pages = (ROOT / "docs" / "long-context.md").read_text() + (ROOT / "docs" / "will-it-fit.md").read_text()
    assert len(rows) > 30
    assert [row for row in rows if row not in pages] == []


@pytest.mark.slow
def test_the_will_it_fit_example_prints_the_estimate_and_table_the_page_shows():
    # the page's first snippet (Llama-70B on 64 H100s, about 15 s), and the two outputs it quotes
    page = (ROOT / "docs" / "will-it-fit.md").read_text()
    code = re.search(r"^```python\n(.*?)^```", page, re.M | re.S).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "will-it-fit.md", "exec"), {})
    for start in ("estimate on rank 0, h100, micro-batch 1 x 8192", "mesh" + " " * 30 + "policy"):
        shown = page[page.index(start) : page.index("```", page.index(start))].strip()
        assert shown in printed.getvalue(), start
