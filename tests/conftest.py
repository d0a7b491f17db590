"""Suite-wide settings: offline Hugging Face libraries, a private datasets cache, one torch
thread per test.

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


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
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

        def collect(cfg, at, *args):
            if at == step:
                if error is not None:
                    raise error
                os.kill(os.getpid(), signum)
            return original(cfg, at, *args)

        monkeypatch.setattr(loop, "collect_batch", collect)

    return arm
