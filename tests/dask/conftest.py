"""A real distributed cluster for tests/dask: two worker processes of two
task threads each (distributed.LocalCluster, processes=True), started once
per session.  The workers import the fastattn under test (the directory that
holds it goes on their PYTHONPATH)."""
from __future__ import annotations

import os

import pytest

from support import FASTATTN_PARENT


@pytest.fixture(scope="session")
def client():
    distributed = pytest.importorskip(
        "distributed", reason="the 'dask' extra is not installed (pip install '.[dask]')")
    env = {"PYTHONPATH": FASTATTN_PARENT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=True,
                                       dashboard_address=None, env=env)
    c = distributed.Client(cluster)
    try:
        yield c
    finally:
        c.close()
        cluster.close()
