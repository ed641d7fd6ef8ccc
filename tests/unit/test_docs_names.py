"""Every dotted name the README and the docs give in backticks (``functional_shard.x.y``,
``fs.x``) is one the package has: a module moved or a function renamed leaves no stale name."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# names the text uses that are not attributes: the log channel `quiet` makes, and a
# placeholder in the architecture page's pattern for a layer's modules
NOT_ATTRIBUTES = {"functional_shard.trace", "functional_shard.layer.module"}
NAME = re.compile(r"`[^`\n]*?\b((?:functional_shard|fs)(?:\.[A-Za-z_]\w*)+)")


def _names() -> list[tuple[str, str]]:
    found = {}
    for page in PAGES:
        for match in NAME.finditer(page.read_text()):
            dotted = match.group(1)
            full = "functional_shard" + dotted[2:] if dotted.startswith("fs.") else dotted
            found.setdefault(full, page.name)
    return sorted(found.items())


def _missing(dotted: str) -> str | None:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
            break
        except ModuleNotFoundError:
            continue
    for at, part in enumerate(parts[cut:], start=cut):
        if not hasattr(target, part):
            return f"{'.'.join(parts[:at])} has no {part!r}"
        target = getattr(target, part)
    return None


def test_the_pages_name_something():
    # the pattern finds the names the pages are known to give (a regex that matched nothing
    # would pass the test below on any page)
    names = dict(_names())
    assert "functional_shard.costing.cost.census.zero1_owners" in names
    assert "functional_shard.shard" in names


@pytest.mark.parametrize(("dotted", "page"), [n for n in _names() if n[0] not in NOT_ATTRIBUTES])
def test_a_name_the_docs_give_exists(dotted, page):
    missing = _missing(dotted)
    assert missing is None, f"{page} names `{dotted}`, but {missing}"


# a path into this repository, as the pages write it (a glob's `*` included)
PATH = re.compile(r"(?<![\w/.])((?:functional_shard|adapters|tests|bench|examples)/[\w./*-]*\w)")


def test_every_file_the_docs_give_exists():
    # a module moved into a layer's folder leaves no stale path on a page
    given = {(m.group(1), page.name) for page in PAGES for m in PATH.finditer(page.read_text())}
    assert len(given) > 20
    missing = sorted((path, page) for path, page in given if not any(ROOT.glob(path)))
    assert missing == []


def _calls() -> list[tuple[str, str, ast.Call]]:
    """Every call of a public name (``fs.x(...)``, ``fs.checkpoint.x(...)``) in the pages' Python blocks."""
    found = []
    for page in PAGES:
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.Call) and re.fullmatch(r"fs(\.\w+)+", ast.unparse(node.func)):
                    found.append((page.name, ast.unparse(node.func), node))
    return found


def test_the_pages_call_something():
    assert len(_calls()) > 50


def test_every_call_the_docs_show_fits_its_signature():
    # a renamed keyword or a positional argument that became keyword-only leaves no stale call
    wrong = []
    for page, name, node in _calls():
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue
        target = importlib.import_module("functional_shard")
        for part in name.split(".")[1:]:
            target = getattr(target, part)
        try:
            inspect.signature(target).bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as error:
            wrong.append(f"{page}: {ast.unparse(node)}: {error}")
    assert wrong == []
