"""One torch thread for the approximation tests: the models are tiny, and two threads on a shared
2-core CI machine are several times slower than one.  The setting is restored after each test."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
