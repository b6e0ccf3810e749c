"""Test-wide settings: offline, deterministic, and hypothesis profiles."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from hypothesis import HealthCheck, settings  # noqa: E402

# CI runs the same examples every time (a red CI must be reproducible); locally each run explores anew.
settings.register_profile("ci", derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

_FILE_SECONDS = Path(__file__).with_name("file_seconds.txt")


def pytest_configure(config):
    """``-n 2 --dist loadfile`` hands whole files to the workers in the collection's order; xdist would first re-sort
    them by test count, which sends the slow files with few tests (a MiniLM fixture, red-team ascents) last and leaves
    one worker alone with them.  The collection below is ordered longest first instead (LPT)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """On a pytest-xdist worker (whose collection's order the controller deals out): the files ``file_seconds.txt``
    lists first, longest first, then the others in collection order; the tests of a file in their own order (a stable
    sort).  A serial run keeps the plain order."""
    if not hasattr(config, "workerinput"):
        return
    seconds = {}
    for line in _FILE_SECONDS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            t, path = line.split(maxsplit=1)
            seconds[path] = float(t)
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test model is tiny: one intra-op thread avoids OpenMP oversubscription on the 2-core CI
    machine (measured 10-70x slower with two threads when the other core is busy).  Restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory):
    """A folder of this test run that every pytest-xdist worker shares (their basetemps' parent; the basetemp itself
    in a serial run), for results several test files compute alike (``lipschitz_testkit.cached_layer_rows``)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture
def without_reach_drift():
    """F70c's post-pass off (``REACH_DRIFT_TOKENS = 0``, F72's tier too): for the tests of F37a/F45b/F61b's rule, whose maxima must be
    the floats of the full refinement -- F70 lowers the rows of the tokens it evaluates, which tokens depends on the
    refinement, so with it on the maxima are certified but not those floats.  Its own patch: a test's
    ``monkeypatch.undo()`` leaves it in place."""
    from transcover.lipschitz import _local_stages

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_local_stages, "REACH_DRIFT_TOKENS", 0)
        yield


@pytest.fixture(autouse=True)
def _mpmath_precision():
    """Every test starts from 320-bit mpmath (the exact references' arithmetic) and leaves the precision as it found
    it.  mpmath's precision is one global: a module's import-time ``mp.dps = 80`` was overridden by whichever module
    xdist imported later, and a test's own ``mp.dps = 30`` leaked into the next file on the same worker, where an
    80-digit reference then failed at 1e-6 (``test_local_weights``, CI of stop 37).  A test that sets its own
    precision still does so, for itself."""
    import mpmath

    old = mpmath.mp.prec
    mpmath.mp.prec = 320
    yield
    mpmath.mp.prec = old
