"""docs/pipelines.md's table of bubbles and micro-batches in flight is what torch's schedule lists give.

The table is bench/pipeline_schedules.py's output (equal stages: forward 1, backward 2); this
test reads each row back and runs the same simulation.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from functional_shard.planning.pipeline.schedules import in_flight, simulate
from functional_shard.planning.pipeline.stages import SINGLE_STAGE

PAGE = pathlib.Path(__file__).parents[2] / "docs" / "pipelines.md"
ROW = re.compile(r"^\| (\w+) \| (\d+) \| (\d+) \| ([\d.]+)% \| ([\d.]+)% \| ([^|]+) \|$", re.M)


def _rows() -> list[tuple[str, int, int, float, float, str]]:
    return [
        (name, int(pp), int(m), float(bubble), float(book), flight.strip())
        for name, pp, m, bubble, book, flight in ROW.findall(PAGE.read_text())
    ]


def test_the_table_is_found():
    assert len(_rows()) >= 10


@pytest.mark.parametrize(("name", "pp", "m", "bubble", "book", "flight"), _rows())
def test_each_row_is_what_the_schedule_gives(name, pp, m, bubble, book, flight):
    v = 1 if name in SINGLE_STAGE else 2
    line = simulate(name, pp, m, v, forward=1.0 / v, backward=2.0 / v)
    assert f"{line.bubble:.2%}" == f"{bubble:.2f}%"
    assert f"{(pp - 1) / (v * m + pp - 1):.2%}" == f"{book:.2f}%"
    counts = in_flight(name, pp, m, v)
    if re.fullmatch(r"\d+(, \d+)*", flight):  # rows written out in full (others abbreviate)
        assert ", ".join(map(str, counts)) == flight
