"""The chat-format tool example (examples/chat_tools): its model is fitted on exactly the ids the
trainer feeds and samples at run time, and its shipped config trains it.

make_model.py cuts each fitted conversation where the trainer cuts it (the prompt through the
template, each reply up to its `<|im_end|>`, each tool result as the template renders it up to
the next assistant header) and encodes the pieces one by one. If that drifted from the sampler
(a boundary token more or less, a number split differently), the fitted model would see other
ids at RL time than it was fitted on. Here a scripted model writes the fitted replies and the
sampler runs the real tool in between: prompt, completion ids and loss mask must equal the
fitted example's, id for id.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from grouprl import cli
from grouprl.rollout import sample_groups
from grouprl.rollout.sampling import encode_prompts
from grouprl.tasks.tools.calls import Tool
from grouprl.tasks.tools.chat import ChatTools
from scripted import Scripted

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "chat_tools"
sys.path.insert(0, str(EXAMPLE))
import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("scripted_cache")


@pytest.fixture(scope="module")
def tokenizer():
    render = make_model.build_tokenizer(["x"], 300)
    rng = random.Random(0)
    texts = []
    for _ in range(20):
        numbers = make_model.problem(rng, (2, 3, 4))
        turns = make_model.conversation(numbers, rng, guess=0.3, slip=0.0)
        texts.append(
            "".join(
                t for t, _ in make_model.segments(render, make_model.row(numbers)["prompt"], turns)
            )
        )
    return make_model.build_tokenizer(texts, vocab_size=400)


def test_the_fitted_ids_are_the_ids_the_trainer_feeds_and_samples(tokenizer):
    numbers = [17, 4, 20]
    row = make_model.row(numbers)
    turns = make_model.conversation(numbers, random.Random(0), guess=0.0, slip=0.0)
    assert [t["role"] for t in turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    ids, trained = make_model.encode(
        tokenizer, make_model.segments(tokenizer, row["prompt"], turns)
    )

    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    handler = ChatTools([Tool("add", make_model.add)], tokenizer, end_ids=end, max_calls=4)
    (prompt,), _ = encode_prompts(tokenizer, [row["prompt"]], tools=handler.schemas)
    assert prompt == ids[: len(prompt)] and not any(trained[: len(prompt)])
    script = ids[len(prompt) :]
    model = Scripted(tokenizer, ids={tuple(prompt): [*script, tokenizer.eos_token_id]})
    r = sample_groups(model, tokenizer, [prompt], group_size=1, max_new_tokens=len(script) + 4,
                      temperature=0.0, tools=handler)  # fmt: skip

    n = len(script)
    assert r.completion_ids[0, :n].tolist() == script and int(r.lengths[0]) == n
    assert r.loss_mask[0, :n].tolist() == [bool(t) for t in trained[len(prompt) :]]
    assert (int(r.turns.calls[0]), int(r.turns.failures[0])) == (2, 0)
    assert r.turns.transcripts[0][-1]["content"] == "41"
    # every number is one token, wherever it stands (the question, a call, a result, the reply)
    for number in ("17", "21", "41"):
        assert [number] == tokenizer.tokenize(number)
        assert script.count(tokenizer.convert_tokens_to_ids(number)) >= 1


def test_the_shipped_config_trains_a_model_make_model_wrote(tmp_path, monkeypatch):
    """make_model.py's output (a few fitting steps of a very small model) in its default place
    under the working directory, then the shipped config.yaml for one step: the run calls the
    example's tool and scores with its reward."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(EXAMPLE.parent)
    argv = [
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--hidden-size",
        "16",
        "--layers",
        "1",
        "--threads",
        "1",
    ]
    assert make_model.main(argv) == 0
    assert (tmp_path / "runs/chat_tools/model/config.json").exists()
    code = cli.main(["train", "--config", "examples/chat_tools/config.yaml", "--steps", "1",
                     "--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "24",
                     "--eval-size", "2", "--eval-samples", "1", "--threads", "1",
                     "--output-dir", str(tmp_path / "run"), "--report-to", "none"])  # fmt: skip
    assert code == 0
    import json

    (metrics,) = [
        json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    ]
    assert "reward_right_sum" in metrics and "tool_calls_mean" in metrics
