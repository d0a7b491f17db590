"""Environments (`--environment path/env.py:Class`, TRL's environment_factory shape): one
instance per rollout, reset from its row with the group's seed; step-style games on a scripted
model with exact ids and masks; groups share their initial state (asserted); get_reward is a
reward, and reward functions receive `environments=`; a run with an environment trains,
resumes bit for bit and evaluates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grouprl.cli import main
from grouprl.config import TrainConfig
from grouprl.errors import UserError
from grouprl.models import load_tokenizer
from grouprl.rollout import sample_groups
from grouprl.tasks import get_task
from grouprl.tasks.tools.calls import PlainTurns
from grouprl.tasks.tools.environments import group_seed, load_environment
from grouprl.tasks.tools.use import ToolUse
from grouprl.train.build import build_rewards, build_tools
from grouprl.train.prompts import prompt_ids
from scripted import Scripted

ROOT = Path(__file__).resolve().parents[2]
VAULT = f"{ROOT / 'examples' / 'vault' / 'env.py'}:Vault"

GAME = '''
import random

class Guess:
    """Guess a secret digit; each wrong guess is answered < or >."""

    def reset(self, prompt, seed, **row):
        self.secret = random.Random(seed).randint(1, 9) if row.get("secret") is None \\
            else row["secret"]
        self.guesses = []
        return " go:"

    def step(self, text):
        guess = int(text[-1]) if text and text[-1].isdigit() else -1
        self.guesses.append(guess)
        if guess == self.secret:
            return None
        return "<" if guess < self.secret else ">"

    def get_reward(self):
        return 1.0 / len(self.guesses) if self.guesses[-1] == self.secret else 0.0


class Unseeded(Guess):
    """As TRL's examples write them: the global random."""

    def reset(self, prompt, **row):
        self.secret, self.guesses = random.randint(1, 10**9), []
        return f" {self.secret}"


class OwnGenerator(Guess):
    """Randomness grouprl cannot reach: a generator of its own, seeded from the OS."""

    def reset(self, prompt, **row):
        self.secret, self.guesses = random.Random().randint(1, 10**9), []
        return f" {self.secret}"


def saw_environments(completions, environments, **kwargs):
    return [float(len(env.guesses)) for env in environments]
'''


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "game.py"
    path.write_text(GAME)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:arith")


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_step_game_is_the_models_turns_and_the_environments_answers(
    tokenizer, game, scripted_cache
):
    """Guess 3 (answered '<'), then 7 (answered '>'), then 5 (right: the episode ends at that
    EOS): exact ids; the answers are fed and not trained; get_reward sees three guesses."""
    uses = ToolUse(PlainTurns(tokenizer, max_calls=4), load_environment(f"{game}:Guess"))
    rows = [{"prompt": "#1=", "secret": 5}]
    start = uses.rollout(rows, 1, 0)
    assert start.prompts == ["#1= go:"]  # reset's text, appended to a string prompt
    eos = tokenizer.eos_token_id
    pieces = [([*_ids(tokenizer, "3"), eos], True), (_ids(tokenizer, "<"), False),
              ([*_ids(tokenizer, "7"), eos], True), (_ids(tokenizer, ">"), False),
              ([*_ids(tokenizer, "5"), eos], True)]  # fmt: skip
    script = [i for ids, _ in pieces for i in ids]
    prompt = prompt_ids(tokenizer, start.prompts[0])
    model = Scripted(tokenizer, ids={tuple(prompt): script + _ids(tokenizer, "9")})
    r = sample_groups(model, tokenizer, [prompt], group_size=1, max_new_tokens=20,
                      temperature=0.0, tools=start.handler)  # fmt: skip
    n = len(script)
    assert r.completion_ids[0, :n].tolist() == script and int(r.lengths[0]) == n
    assert r.loss_mask[0, :n].tolist() == [own for ids, own in pieces for _ in ids]
    assert not bool(r.truncated[0])
    (env,) = r.turns.environments
    assert env.guesses == [3, 7, 5] and env.get_reward() == 1 / 3
    assert [m["role"] for m in r.turns.transcripts[0]] == ["assistant", "user", "assistant",
                                                           "user", "assistant"]  # fmt: skip


def test_steps_count_against_max_turns(tokenizer, game, scripted_cache):
    uses = ToolUse(PlainTurns(tokenizer, max_calls=1), load_environment(f"{game}:Guess"))
    start = uses.rollout([{"prompt": "#1=", "secret": 5}], 1, 0)
    eos = tokenizer.eos_token_id
    script = [*_ids(tokenizer, "3"), eos, *_ids(tokenizer, "<"), *_ids(tokenizer, "4"), eos]
    prompt = prompt_ids(tokenizer, start.prompts[0])
    model = Scripted(tokenizer, ids={tuple(prompt): script})
    r = sample_groups(model, tokenizer, [prompt], group_size=1, max_new_tokens=20,
                      temperature=0.0, tools=start.handler)  # fmt: skip
    assert int(r.lengths[0]) == len(script)  # the second turn's end: past the one step allowed
    assert bool(r.turns.ended_by_turns[0]) and r.turns.environments[0].guesses == [3]


def test_a_group_shares_its_initial_state_and_a_reset_it_cannot_seed_is_refused(game):
    env = load_environment(f"{game}:Guess")
    assert env.takes_seed and env.has_step and env.has_reward and env.methods == ()
    rows = [{"prompt": "#1=", "secret": None}, {"prompt": "#2=", "secret": None}]
    seeds = [group_seed(0, 3, 0, row) for row in rows]
    episodes = env.start(rows, 4, seeds)
    secrets = [e.secret for e in episodes.instances]
    assert secrets[:4] == [secrets[0]] * 4 and secrets[4:] == [secrets[4]] * 4
    assert seeds == [group_seed(0, 3, 0, row) for row in rows]  # the same on any rank, resume
    assert seeds[0] != group_seed(0, 4, 0, rows[0])  # another step, another episode
    # the global random: seeded from the group's seed around each reset, so a group agrees
    unseeded = load_environment(f"{game}:Unseeded").start(rows, 3, seeds).instances
    assert [e.secret for e in unseeded[:3]] == [unseeded[0].secret] * 3
    assert unseeded[0].secret != unseeded[3].secret
    with pytest.raises(UserError, match="reset to different states") as err:
        load_environment(f"{game}:OwnGenerator").start(rows, 2, seeds)
    message = str(err.value)
    assert "take a seed keyword" in message and "\n" not in message
    assert "seeds Python's global random" in message  # says what grouprl did already


def test_get_reward_is_a_reward_and_rewards_receive_the_environments(game, tokenizer):
    """Without --rewards the environment's reward is the only one; with --rewards it is added
    at weight 1 unless weighted there; every reward function gets environments=."""
    task = get_task("arithmetic")
    spec = f"{game}:Guess"
    only = TrainConfig(environment=spec)
    tools = build_tools(only, task, tokenizer)
    rewards = build_rewards(only, task, torch.device("cpu"), tools)
    assert rewards.weights == {"Guess": 1.0} and rewards.pass_reward == "Guess"
    both = TrainConfig(environment=spec, rewards={f"{game}:saw_environments": 0.5})
    rewards = build_rewards(both, task, torch.device("cpu"), build_tools(both, task, tokenizer))
    assert rewards.weights == {"saw_environments": 0.5, "Guess": 1.0}
    envs = tools.environment.start([{"prompt": "#1=", "secret": 4}], 2, [0]).instances
    envs[0].guesses, envs[1].guesses = [4], [1, 2]
    from grouprl.tasks.base import TrainerState

    scores = rewards.score(["4", "12"], [{"prompt": "#1="}], 2, completion_ids=[[1], [1]],
                           state=TrainerState(), environments=envs)  # fmt: skip
    assert scores.by_function["Guess"].tolist() == [1.0, 0.0]
    assert scores.by_function["saw_environments"].tolist() == [1.0, 2.0]
    assert scores.total.tolist() == [1.5, 1.0]


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("class E:\n    def play(self):\n        '''x'''\n", "has no reset method"),
        ("class E:\n    def reset(self, **row):\n        pass\n", "neither public methods"),
        ("E = 3\n", "a int, not a class"),
    ],
)
def test_an_environment_that_cannot_be_used_is_one_line(tmp_path, source, match):
    (tmp_path / "env.py").write_text(source)
    with pytest.raises(UserError, match=match):
        load_environment(f"{tmp_path / 'env.py'}:E")


def test_a_reset_that_ignores_the_row_is_one_line(tmp_path):
    (tmp_path / "env.py").write_text(
        "class E:\n    def reset(self):\n        pass\n    def step(self, text):\n        pass\n"
    )
    env = load_environment(f"{tmp_path / 'env.py'}:E")
    with pytest.raises(UserError, match=r"E\.reset raised TypeError.*every column") as err:
        env.start([{"prompt": "x", "answer": "1"}], 2, [0])
    assert "prompt, answer" in str(err.value)


TINY = ["--config", "examples/vault/config.yaml", "--prompts-per-step", "8", "--group-size",
        "4", "--eval-size", "8", "--eval-samples", "2", "--threads", "1", "--no-progress",
        "--log-ratios", "0"]  # fmt: skip


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_vault_run_trains_resumes_bit_for_bit_and_evaluates(
    tmp_path, stop_at, capsys, monkeypatch
):
    """The shipped example (its config from the project root, shortened): the reward is
    Vault's, tools are its methods; a run stopped after step 2 and resumed ends with the same
    weights and logs as one that was not."""
    monkeypatch.chdir(ROOT)
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    assert main(["train", "--steps", "3", "--output-dir", str(whole), *TINY]) == 0
    stop_at(2)  # Ctrl-C as step 3 starts: saves after step 2
    assert main(["train", "--steps", "3", "--output-dir", str(parted), *TINY]) == 130
    stop_at(None)
    assert main(["train", "--resume", str(parted)]) == 0
    a, b = _jsonl(whole / "metrics.jsonl"), _jsonl(parted / "metrics.jsonl")
    assert [m["step"] for m in a] == [1, 2, 3]
    # get_reward is the reward the advantages come from: the total is Vault's alone
    assert all(m["reward_mean"] == m["reward_Vault"] for m in a)  # the same values, averaged
    assert any(m["reward_Vault"] > 0 for m in a) and any(m["loss"] != 0 for m in a)
    keys = ("loss", "reward_Vault", "tool_calls", "grad_norm")
    assert [[m.get(k) for k in keys] for m in a] == [[m.get(k) for k in keys] for m in b]
    from safetensors.torch import load_file

    wa = load_file(whole / "final" / "model.safetensors")
    wb = load_file(parted / "final" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    capsys.readouterr()
    args = ["eval", "--task", "lookup", "--environment", VAULT, "--model", str(whole / "final"),
            "--limit", "8", "--samples", "2", "--json", "--threads", "1"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["pass_reward"] == "Vault" and 0.0 <= out["pass_at_1"] <= 1.0
    assert out["tool_call_rate"] is not None and not math.isnan(out["tool_call_rate"])
