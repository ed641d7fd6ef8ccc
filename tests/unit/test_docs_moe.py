"""docs/moe.md shows what bench/moe_table.py prints for the Mixtral-8x7B shape.

The page's generated blocks (the fsdp-vs-ep arithmetic, the explain()/cost() excerpts and
the estimate table) are refreshed by ``python bench/moe_table.py --write-page docs/moe.md``;
this test rewrites a copy of the page the same way and fails when the copy differs.
"""

from __future__ import annotations

import pathlib
import runpy
import shutil

import pytest

ROOT = pathlib.Path(__file__).parents[2]
PAGE = ROOT / "docs" / "moe.md"

pytest.importorskip("transformers")


@pytest.mark.slow
def test_the_moe_page_shows_what_the_table_script_prints(tmp_path):
    script = runpy.run_path(str(ROOT / "bench" / "moe_table.py"))
    copy = tmp_path / "moe.md"
    shutil.copy(PAGE, copy)
    script["main"](["--write-page", str(copy)])
    if copy.read_text() != PAGE.read_text():
        refresh = "python bench/moe_table.py --write-page docs/moe.md"
        pytest.fail(f"docs/moe.md shows stale output; refresh it: {refresh}")
