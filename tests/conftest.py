"""Fixtures, the global-state guard and the hypothesis profiles of the fastattn
tests.  The shared helpers (tolerances, oracle, array builders, child
processes, property checks) are in support.py: ``from support import ...``.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import fastattn
from fastattn import _kernels

from support import SIMD_CAPABLE, TESTS_DIR, TEST_FOLDERS, _restore_simd


# --------------------------------------------------------------------------
# Hypothesis profiles (see docs/testing.md).  Chosen by HYPOTHESIS_PROFILE:
#
# ci    (the default) derandomized -- every run draws the same examples, so a
#       red CI run is red again locally -- no example database, no deadline
#       (the machine is shared; timing is not a property), and the failing
#       example's reproduction blob printed.  Budgeted so that every property
#       file together stays within ~30 s of the default pytest run.
# long  25x the examples, random (a fresh search each run), failures kept in
#       the local .hypothesis/ database and replayed first on the next run.
#
# Property tests take their example count from ``prop_settings(weight)``:
# weight x the profile's base count, so one profile scales every test.

PROFILE_BASE_EXAMPLES = {"ci": 20, "long": 500}

settings.register_profile(
    "ci", max_examples=PROFILE_BASE_EXAMPLES["ci"], deadline=None, derandomize=True,
    database=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "long", max_examples=PROFILE_BASE_EXAMPLES["long"], deadline=None, derandomize=False,
    print_blob=True, suppress_health_check=[HealthCheck.too_slow])
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)


# --------------------------------------------------------------------------
# Imports between test folders.

def pytest_configure(config):
    """Every folder of test files on sys.path before anything is collected.

    Some test modules import helpers from test modules in other folders
    (reliability/test_concurrency.py: similarity/test_similarity.py's plugin;
    the property files: layers/test_multihead.py's and
    layers/test_layers_attention.py's builders).  pytest's default (prepend)
    import mode puts a folder on sys.path only when it imports a test file
    from it, so those imports would depend on the collection order, and
    fail when the importing file runs alone.  Basenames are unique across the
    folders, so no module shadows another."""
    for folder in TEST_FOLDERS:
        if folder not in sys.path:
            sys.path.append(folder)


# --------------------------------------------------------------------------
# Fixtures: SIMD dispatch and thread count, the random generator.


@pytest.fixture(params=["simd", "scalar"])
def simd_mode(request):
    """Run the test once with the AVX2 kernels and once with the scalar ones."""
    if request.param == "simd":
        if not SIMD_CAPABLE:
            pytest.skip("this CPU/build has no AVX2+FMA kernels")
        _kernels.set_simd_disabled(False)
        assert fastattn.simd_active()
    else:
        _kernels.set_simd_disabled(True)
        assert not fastattn.simd_active()
    try:
        yield request.param
    finally:
        _restore_simd()


@pytest.fixture(autouse=True)
def _global_state_guard():
    """Every test leaves SIMD dispatch and the thread default as it found them."""
    simd_before = _kernels.simd_active()
    threads_before = fastattn._threads._global_threads
    yield
    _restore_simd()
    fastattn.set_num_threads(threads_before)
    assert _kernels.simd_active() == simd_before
    assert fastattn._threads._context_threads.get() is None


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


def pytest_collection_modifyitems(session, config, items):
    """tests/dask last: its session-wide Dask client (tests/dask/conftest.py)
    keeps an event loop thread that allocates and frees on its own schedule,
    which the whole-process tracemalloc checks of other folders would count."""
    dask_dir = os.path.join(TESTS_DIR, "dask") + os.sep
    items.sort(key=lambda item: str(item.path).startswith(dask_dir))
