"""Hypothesis profiles, the fake process group, a gloo world of one, and LocalWorlds shared by
the whole run (one per size, set back after each test that used one).

The tests sit in folders by kind, each folder's conftest marking its tests: unit/ (pure and
fast), dist/ (process worlds), e2e/ (whole jobs: torchrun, the demo, Lightning, the wheel).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, settings

# explain phase left out: it needs libcst, which nothing else here uses
PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)
settings.register_profile(
    "ci",
    phases=PHASES,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", phases=PHASES, deadline=None, max_examples=100, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture
def fake_world() -> Iterator[Callable[..., None]]:
    """Join torch's fake process group as ``rank`` of ``world_size`` (collectives do nothing).

    One process stands in for any rank of a big mesh: torch builds the real DTensors and
    FSDP2/TP layouts on meta tensors, so local shapes can be checked at scale.
    """
    # private, hence kept in this one fixture
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def join(world_size: int, rank: int = 0) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_rank() -> Iterator[None]:
    """This process as a gloo world of one (`worlds.alone`)."""
    from .worlds import alone

    with alone():
        yield


@pytest.fixture(scope="session")
def worlds() -> Iterator[Callable[[int], object]]:
    """``worlds(size)``: the run's `RestartingWorld` of ``size`` gloo ranks, started when first
    asked for, restarted only after an intended failure closed it."""
    from .worlds import Worlds

    started = Worlds()
    yield started
    started.close()


# the last test of the run that asks for the shared worlds (set once collection is done)
_LAST_WORLD_TEST = pytest.StashKey[str]()


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [item.nodeid for item in session.items if "worlds" in getattr(item, "fixturenames", ())]
    session.config.stash[_LAST_WORLD_TEST] = users[-1] if users else ""


@pytest.fixture(autouse=True)
def _reset_worlds(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that ran on a shared world: its ranks set back for the next test; after the
    last such test of the run, the worlds closed. Idle ranks are not free: each gloo group the
    tests left keeps a thread waking on every rank (40 groups on 4 ranks: a fifth of a core,
    measured), and the worlds idled so through every later test, the whole unit suite (1,400
    tests) included. A test asking for a world after that would start it again."""
    yield
    if "worlds" in request.fixturenames:
        worlds = request.getfixturevalue("worlds")
        if request.node.nodeid == request.config.stash.get(_LAST_WORLD_TEST, ""):
            worlds.close()
        else:
            worlds.reset()


@pytest.fixture(scope="session")
def world4(worlds: Callable[[int], object]) -> object:
    """Four gloo ranks shared by the whole run."""
    return worlds(4)
