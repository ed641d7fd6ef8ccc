"""Every test in this folder is marked `unit` (`-m unit`): pure and fast, no process but
this one and no process group beyond it."""

import dataclasses
from pathlib import Path

import pytest

import functional_shard as fs

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # a conftest's hook sees every folder's items
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.unit)


@pytest.fixture
def local_measured_on(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The process counts ``fs.hardware("local")`` was measured with, each answered by h100's numbers
    (no gloo processes started)."""
    from functional_shard.costing.time import hardware as profiles

    counts: list[int] = []

    def measure(processes: int) -> fs.Hardware:
        counts.append(processes)
        return dataclasses.replace(fs.hardware("h100"), name="local", devices_per_node=processes)

    monkeypatch.setattr(profiles, "_local", measure)
    return counts
