"""The vLLM engine's tests. They run in the environment `make test-vllm` builds (vLLM pins a
transformers older than the main environment's); where vLLM is not installed they are not
collected. Their models are tiny Qwen2s with heads of 64, which vLLM's CPU attention runs."""

import importlib.util
import json

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]

REWARDS = '''
def length(completions, **kwargs):
    """A score that differs within every group: the completion's length in characters."""
    return [min(len(c), 40) / 40 for c in completions]
'''


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """A random chat model (Qwen2, BPE, ChatML, two EOS ids) with hidden 128 and 2 heads of 64."""
    from grouprl.models.tiny import save_tiny_chat_model

    directory = tmp_path_factory.mktemp("vllm_model")
    save_tiny_chat_model(directory, hidden_size=128, intermediate_size=256)
    return directory


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """Prompts (a JSONL of sums) and a reward file whose scores spread within every group."""
    root = tmp_path_factory.mktemp("vllm_files")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 60) for b in range(3)]
    (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARDS)
    return root


@pytest.fixture(scope="session")
def servers(vllm_model_dir):
    """Two vLLM servers on 127.0.0.1, started together from the model's directory by the
    command the docs give (`grouprl.rollout.vllm_server.server_command`, as `--vllm-server local`
    starts one), shared by every server test; both are stopped at the end."""
    import time

    from grouprl.rollout.vllm_server import LocalServer

    start = time.monotonic()
    options = dict(dtype="float32", max_model_len=512, kv_cache_bytes=64 << 20)
    # one thread each: two servers and the trainer share this machine's 2 cores, and vLLM's
    # CPU threads spin while they wait (with 2 threads each, a step took 10 times as long)
    started = [LocalServer(vllm_model_dir, wait=False, env={"OMP_NUM_THREADS": "1"}, **options)
               for _ in range(2)]  # fmt: skip
    try:
        for server in started:
            server.wait()
        print(f"\ntwo vLLM servers answered after {time.monotonic() - start:.1f} s")
        yield [server.url for server in started]
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="session")
def model(vllm_model_dir):
    """The random chat model, float32, in eval mode (tests that change weights copy it)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(vllm_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_model_dir)
