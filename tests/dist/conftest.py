"""Every test in this folder is marked `dist` (`-m dist`): process worlds (LocalWorld ranks,
gloo groups, the fake process group)."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # a conftest's hook sees every folder's items
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.dist)
