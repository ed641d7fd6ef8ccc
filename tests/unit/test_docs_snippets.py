"""The pages' interactive examples (```pycon blocks) print what they show, run as doctests."""

from __future__ import annotations

import doctest
import pathlib
import re

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
