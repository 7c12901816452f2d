"""Fixtures: a shared demo-small fabric (router + 2 CPU workers) for the client tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fabric_util import SplitFabric  # noqa: E402


@pytest.fixture(scope="session")
def fabric(tmp_path_factory: pytest.TempPathFactory):
    """demo-small (hidden 1024, MoE layers 0-3, 32 experts) on two CPU workers, exact mode."""
    f = SplitFabric(tmp_path_factory.mktemp("fabric"))
    yield f
    f.close()


@pytest.fixture()
def client(fabric: SplitFabric):
    with fabric.client() as c:
        yield c
