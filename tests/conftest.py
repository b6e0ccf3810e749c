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


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test model is tiny: one intra-op thread avoids OpenMP oversubscription on the 2-core CI
    machine (measured 10-70x slower with two threads when the other core is busy).  Restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
