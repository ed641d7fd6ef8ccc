"""docs/architecture.md stays true: its picture is drawn from every module there is, and the
files and names it points to exist.

The picture's reader (docs/_hooks/architecture.py) is checked on a small made-up package
too: an import up a layer, inside a function, is seen; an import under TYPE_CHECKING counts;
``fs.name`` is the module the façade loads for it, and a climb when it points up a layer; a
subpackage that is no known layer still gets a band, above the others.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = "functional_shard"


@pytest.fixture(scope="module")
def hook():
    spec = importlib.util.spec_from_file_location(
        "architecture_hook", ROOT / "docs" / "_hooks" / "architecture.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_reader_sees_every_kind_of_import_and_every_layer(hook, tmp_path):
    write(
        tmp_path,
        {
            "functional_shard/__init__.py": (
                '"""The façade."""\n'
                "_DEFINITIONS: dict = {'planning.thing': ('thing', 'work as _work')}\n"
            ),
            "functional_shard/core/__init__.py": '"""The vocabulary: a note, not a box."""\n',
            "functional_shard/core/words.py": "",
            "functional_shard/core/low.py": "def f():\n    from functional_shard.planning import thing\n",
            "functional_shard/core/data.py": "import functional_shard as fs\ndef m():\n    return fs._work\n",
            "functional_shard/planning/__init__.py": '"""Plans."""\n',
            "functional_shard/planning/thing.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..core import words\n"
            ),
            "functional_shard/extra/__init__.py": '"""No known layer."""\n',
            "functional_shard/extra/new.py": "import functional_shard as fs\ndef g():\n    return fs.thing\n",
            "adapters/__init__.py": '"""Adapters."""\n',
            "adapters/tool.py": "from functional_shard.core.low import f\n",
        },
    )
    modules = hook.read_modules(tmp_path)
    boxes, graph = hook.drawn_graph(modules)
    low, data = "functional_shard.core.low", "functional_shard.core.data"
    thing = "functional_shard.planning.thing"
    assert graph[low] == {thing}  # inside a function, through the package
    assert graph[thing] == {"functional_shard.core.words"}  # under TYPE_CHECKING
    assert graph["functional_shard.extra.new"] == {thing}  # fs.thing, as the façade loads it
    assert graph["functional_shard.adapters.tool"] == {low}
    assert hook.upward(boxes, graph) == [(data, thing), (low, thing)]
    # a climb through the façade is told apart from an import up a layer; one down is no climb
    assert hook.climbs(modules) == {(data, thing): "fs._work"}
    bands = hook.layout(boxes, graph).bands
    assert [band.layer for band in bands] == ["core", "planning", "adapters", "extra"]
    assert "functional_shard.core" not in boxes  # a folder's note
    assert modules["functional_shard.core"].summary == "The vocabulary: a note, not a box."


# the methods of a lower layer's data whose work lives above, each reaching it through the
# façade (docs/architecture.md); a new one is a design decision: add it here and on the page
CLIMBS = {
    (f"{PACKAGE}.core.mesh", f"{PACKAGE}.runtime.device_mesh"): "fs._build_device_mesh",
    (f"{PACKAGE}.costing.time.hardware", f"{PACKAGE}.runtime.measure"): "fs.measure",
    (f"{PACKAGE}.planning.plan.plan", f"{PACKAGE}.costing.cost.cost_model"): "fs._unit_gathered, fs.cost",
    (f"{PACKAGE}.planning.plan.plan", f"{PACKAGE}.frontends.pictures.visualize"): "fs._visualize",
}


def test_the_picture_holds_every_module_and_no_import_points_up(hook):
    modules = hook.read_modules()
    boxes, graph = hook.drawn_graph(modules)
    placed = {name for band in hook.layout(boxes, graph).bands for name in band.names}
    assert placed == set(boxes)
    assert {module.layer for module in boxes.values()} == set(hook.LAYERS)
    assert "functional_shard.runtime.engines.data_parallel" in placed
    assert "functional_shard.adapters.lightning.trainer" in placed
    assert hook.climbs(modules) == CLIMBS
    # the page says no import points up: the climbs above, through the façade, are all there is
    assert hook.upward(boxes, graph) == sorted(CLIMBS)


def test_the_picture_is_drawn_the_same_twice(hook, tmp_path):
    assert hook.draw(tmp_path) is True
    assert (tmp_path / hook.PICTURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert hook.draw(tmp_path) is False  # same code, same bytes: mkdocs serve does not loop


def located(name: str) -> pathlib.Path | None:
    """A path the page names: from the repository's root, or short, inside the package."""
    for path in (ROOT / name, ROOT / "functional_shard" / name):
        if path.exists():
            return path
    return None


def test_the_page_names_files_and_names_that_exist():
    page = PAGE.read_text()
    files = set(re.findall(r"`((?:[\w.]+/)+[\w.]*\.py)`", page))
    assert len(files) > 10
    assert [name for name in files if located(name) is None] == []
    for name, file in re.findall(r"`(\w+)` in `((?:[\w.]+/)+[\w.]*\.py)`", page):
        text = located(file).read_text()
        assert re.search(rf"^(def|class) {name}\b|^{name} = |^    \"{name}\": ", text, re.M), (name, file)
