"""A reward model behind a server: `grouprl serve` over a sequence-classification model answers
OpenRLHF's `POST /get_reward`, and `--rewards http://HOST:PORT/get_reward` scores with it what
the model scores in-process; a server that does not answer is one line at set-up, and scores None
(counted) later; a wrong number of rewards is one line."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp", reason="pip install -e '.[agents]' (make test does)")
pytest.importorskip("httpx", reason="pip install -e '.[agents]' (make test does)")

import torch

from grouprl.errors import UserError
from grouprl.tasks.rewards import remote
from grouprl.tasks.rewards.scoring import load_reward
from serving import served


@pytest.fixture(scope="module")
def reward_server(tmp_path_factory):
    """A tiny Llama reward model (one label) saved with a character tokenizer and a chat
    template, served by `grouprl serve` on a free port; its directory and URL."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grouprl.models import build_char_tokenizer

    path = tmp_path_factory.mktemp("rm") / "rm"
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    with served(path) as url:
        yield path, url


def test_the_server_scores_what_the_model_scores_in_process(reward_server):
    path, url = reward_server
    name, rm = load_reward(url)
    _, local = load_reward(str(path))
    assert name == "reward_model"
    prompts, completions = ["1+", "2+", "3+"], ["12", "345", "6"]
    logged = {}
    scores = rm(completions, prompts, log_metric=logged.__setitem__)
    # the same model, texts and batches of 16 on both sides: the same computation
    assert scores == local(completions, prompts) and logged["reward_model_unscored"] == 0.0
    chat = [[{"role": "user", "content": "1+"}]]
    reply = [[{"role": "assistant", "content": "12"}]]
    assert rm(reply, chat) == local(reply, chat)  # messages, rendered by its template


def test_a_server_that_does_not_answer(reward_server, monkeypatch):
    with pytest.raises(UserError, match="does not answer"):
        load_reward("http://127.0.0.1:9/get_reward")
    _, url = reward_server
    _, rm = load_reward(url)

    def down(body, retries):
        import httpx

        raise httpx.ConnectError("refused")

    monkeypatch.setattr(rm, "_post", down)
    logged = {}
    assert rm(["1", "2"], ["a", "b"], log_metric=logged.__setitem__) == [None, None]
    assert logged["reward_model_unscored"] == 1.0
    monkeypatch.setattr(rm, "_post", lambda body, retries: [0.5])
    with pytest.raises(UserError, match="answered 1 rewards for 2 queries"):
        rm(["1", "2"], ["a", "b"])
    assert remote.is_remote_spec(url) and not remote.is_remote_spec("rewards.py:fn")


def test_a_reward_model_yaml_names_its_device_and_batch_size(reward_server, tmp_path):
    import json

    path, _ = reward_server
    spec = tmp_path / "scorer.yaml"
    spec.write_text(json.dumps({"reward_model": {"model": str(path), "device": "cpu",
                                                 "batch_size": 1}}))  # fmt: skip
    name, rm = load_reward(str(spec), device="meta")  # its own device, not the run's
    _, default = load_reward(str(path))
    assert name == "scorer" and rm.batch_size == 1
    assert next(rm.model.parameters()).device.type == "cpu"
    # one text at a time on both sides (no padding): the same computation
    assert rm(["12", "345"], ["1+", "2+"]) == default(["12"], ["1+"]) + default(["345"], ["2+"])
    spec.write_text(json.dumps({"reward_model": {"device": "cpu"}}))
    with pytest.raises(UserError, match="give `reward_model:` with model"):
        load_reward(str(spec))
