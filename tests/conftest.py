"""Suite-wide settings: one torch thread per test.

The models in the tests are tiny, so a second thread buys little, and two threads on a 2-core
machine that is also running something else can slow a test down by orders of magnitude (OpenMP
workers spin-waiting for a core). One thread also makes timings and results repeatable.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
