"""Suite-wide settings: offline Hugging Face libraries, a private datasets cache, one torch
thread per test (GROUPRL_TEST_THREADS=2 for two: `make test-numerics` runs both).

Nothing may be downloaded: `HF_HUB_OFFLINE` and `HF_DATASETS_OFFLINE` make a hub id that is not
cached fail at once instead of retrying the network (set before any HF library is imported).

The models in the tests are tiny, so a second thread buys little, and two threads on a 2-core
machine that is also running something else can slow a test down by orders of magnitude (OpenMP
workers spin-waiting for a core). One thread also makes timings and results repeatable.
"""

import os
import signal

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _private_datasets_cache(tmp_path_factory):
    """`datasets` writes Arrow caches of loaded files: keep them out of the home directory
    (read when `datasets` is first imported, which grouprl does lazily, inside a test)."""
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf_datasets_cache"))


#: torch threads per test: rounding differs with the thread count (reductions split differently),
#: so the tolerance-bearing tests run under both 1 and 2 (`make test-numerics`).
THREADS = int(os.environ.get("GROUPRL_TEST_THREADS", "1"))


@pytest.fixture(autouse=True)
def _torch_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """A tiny random chat model of the kind users bring (Qwen2, BPE, ChatML, two EOS ids)."""
    from grouprl.models.tiny import save_tiny_chat_model

    directory = tmp_path_factory.mktemp("chat_model")
    save_tiny_chat_model(directory)
    return directory


@pytest.fixture
def scripted_cache(monkeypatch):
    """Sampling with `scripted.Scripted` models: their cache is a `scripted.ScriptCache`."""
    from grouprl.rollout import _hf
    from scripted import ScriptCache

    monkeypatch.setattr(_hf, "new_cache", lambda model: ScriptCache())


@pytest.fixture
def stop_at(monkeypatch):
    """`stop_at(step, signum=SIGINT, error=None)`: as the training loop starts step `step`
    (0-based), send this process `signum`, or raise `error`; `stop_at(None)` undoes it."""
    import os

    from grouprl.train import loop

    original = loop.collect_batch

    def arm(step, signum=signal.SIGINT, error=None):
        if step is None:
            monkeypatch.setattr(loop, "collect_batch", original)
            return

        def collect(cfg, sampler, at, position):
            if at == step:
                if error is not None:
                    raise error
                os.kill(os.getpid(), signum)
            return original(cfg, sampler, at, position)

        monkeypatch.setattr(loop, "collect_batch", collect)

    return arm
