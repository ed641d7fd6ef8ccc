"""The docs' pictures stay the pages' own: every picture a page embeds is drawn at build time
by a hook (docs/_hooks/), the home page and each parallelism's page embed the picture of
their example and still say what it draws, and the home page links every page of the nav.

Nothing is drawn here (the docs build draws every picture); the hook's check runs on the
pages as they are and on made-up ones.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys
from types import SimpleNamespace

import pytest

ROOT = pathlib.Path(__file__).parents[2]
DOCS = ROOT / "docs"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_hook", DOCS / "_hooks" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hooks():
    pictures, architecture = load("pictures"), load("architecture")
    yield pictures, architecture
    del sys.modules["pictures_hook"], sys.modules["architecture_hook"]


def drawn(hooks) -> set[str]:
    pictures, architecture = hooks
    return set(pictures.PICTURES) | {architecture.PICTURE.removesuffix(".png")}


def test_every_picture_is_embedded_and_every_embedded_one_drawn(hooks):
    pictures, _ = hooks
    assert pictures.problems(DOCS, drawn(hooks)) == []
    embedded = {name for page in DOCS.glob("*.md") for name in pictures.EMBEDDED.findall(page.read_text())}
    assert embedded == drawn(hooks)  # no picture drawn for nothing


def test_the_home_page_and_each_parallelism_page_show_their_example(hooks):
    pictures, _ = hooks
    pages = {"index.md", "policies.md", "will-it-fit.md", "pipelines.md", "moe.md", "long-context.md"}
    assert set(pictures.EXAMPLES) == pages
    for picture, quotes in pictures.EXAMPLES.values():
        assert picture in pictures.PICTURES
        assert quotes


def test_a_missing_picture_or_a_changed_example_is_found(hooks, tmp_path):
    pictures, _ = hooks
    (tmp_path / "other.md").write_text("# Other\n\n![gone](generated/gone.png)\n")
    index = (DOCS / "index.md").read_text()
    (tmp_path / "index.md").write_text(index.replace("fs.Mesh(dp=8, tp=4)", "fs.Mesh(dp=16, tp=2)"))
    (tmp_path / "policies.md").write_text("# Policies\n\n```python\npolicy = fs.fsdp('dp')\n```\n")
    found = pictures.problems(tmp_path, drawn(hooks))
    assert found[0].startswith("index.md's example no longer says 'fs.Mesh(dp=8, tp=4)'")
    assert "other.md embeds generated/gone.png, which no hook in docs/_hooks draws" in found
    assert "policies.md does not embed its example's picture, generated/policies-llama-7b.png" in found
    assert len(found) == 2 + 1 + len(pictures.EXAMPLES["policies.md"][1])


def test_the_build_stops_on_a_picture_no_hook_drew(hooks, tmp_path):
    pytest.importorskip("mkdocs")
    from mkdocs.exceptions import PluginError

    pictures, architecture = hooks
    (tmp_path / "generated").mkdir()
    # a file on disk from an older build counts only if a hook still draws it
    (tmp_path / "generated" / "stale.png").write_bytes(b"\x89PNG")
    (tmp_path / "page.md").write_text("![old](generated/stale.png)\n")
    config = {"docs_dir": str(tmp_path), "hooks": {"pictures": pictures, "architecture": architecture}}
    with pytest.raises(PluginError, match=r"page\.md embeds generated/stale\.png"):
        pictures.on_files(SimpleNamespace(), config)
    (tmp_path / "page.md").write_text("![map](generated/architecture.png)\n")
    (tmp_path / "generated" / "architecture.png").write_bytes(b"\x89PNG")
    files = SimpleNamespace()
    assert pictures.on_files(files, config) is files


def nav_pages() -> list[str]:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def walk(items):
        for item in items:
            for value in item.values() if isinstance(item, dict) else [item]:
                yield from walk(value) if isinstance(value, list) else [value]

    return list(walk(config["nav"]))


def test_the_home_page_links_every_page_of_the_nav():
    pages = nav_pages()
    assert len(pages) > 15
    linked = re.findall(r"^- \[[^]]+\]\(([\w-]+\.md)\)", (DOCS / "index.md").read_text(), re.M)
    assert linked == [page for page in pages if page != "index.md"]  # all of them, in the nav's order
