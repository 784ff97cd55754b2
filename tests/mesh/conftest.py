from __future__ import annotations

import pytest

from pdmesh.localmesh import start_mesh


@pytest.fixture(scope="session")
def tiny_mesh(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("tiny"), model="tiny")
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")  # one module uses it; the real model idles no longer than that
def smol_mesh(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("smol"), model="smollm2")
    yield mesh
    mesh.stop()
