"""OpenEnv servers through `--environment`, the way TRL's OpenEnv examples train them: the test's
own OpenEnv environment (a guessing game) served by openenv's `create_app` under uvicorn on
127.0.0.1, and an `environment_factory`-style class whose instances each hold one client
session. Every group's sessions are reset with one seed; the sessions are kept and reused
across steps (one per rollout running at once, never one per rollout ever run) and closed at
the end; a server that refuses a session is one line naming its settings, before training."""

from __future__ import annotations

import json
import random
import socket
import threading
from typing import ClassVar

import pytest

pytest.importorskip("openenv", reason="pip install -e '.[openenv]' (make test does)")
uvicorn = pytest.importorskip("uvicorn")

from openenv.core.env_server.http_server import create_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

import grouprl  # noqa: E402
from grouprl.cli import main  # noqa: E402

#: the client side, as a user writes it for TRL's environment_factory (the URL from the
#: environment, as TRL's examples take it from a flag)
CLIENT = '''
import os

from openenv.core.generic_client import GenericEnvClient


class Guess:
    """A digit from 1 to 9 to guess in three tries; the server says higher or lower."""

    def __init__(self):
        self.client = GenericEnvClient(base_url=os.environ["GUESS_URL"]).sync()

    def reset(self, seed, **row):
        self.reward = 0.0
        return self.client.reset(seed=seed).observation["feedback"] + " Guess:"

    def step(self, text):
        result = self.client.step({"guess": text.strip()[-1:] or "0"})
        self.reward = result.reward or 0.0
        return None if result.done else result.observation["feedback"] + " Guess:"

    def get_reward(self):
        return self.reward

    def close(self):
        self.client.close()
'''


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str = ""


class GuessGame(Environment):
    """The server's game; the class tallies its sessions (every reset's seed, and how many are
    open at once)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    seeds: ClassVar[list[int]] = []
    open: ClassVar[set[int]] = set()
    peak: ClassVar[int] = 0
    #: guards the tally; notified when a session closes
    lock: ClassVar[threading.Condition] = threading.Condition()

    def __init__(self):
        super().__init__()
        self._state, self.secret = State(episode_id="", step_count=0), 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        with GuessGame.lock:
            GuessGame.seeds.append(seed)
            GuessGame.open.add(id(self))
            GuessGame.peak = max(GuessGame.peak, len(GuessGame.open))
        self.secret = random.Random(seed).randint(1, 9)
        self._state = State(episode_id=episode_id or "", step_count=0)
        return GuessObservation(done=False, reward=0.0, feedback="A digit from 1 to 9.")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        guess = int(action.guess) if action.guess.isdigit() else 0
        if guess == self.secret:
            return GuessObservation(done=True, reward=1.0, feedback="Right.")
        return GuessObservation(done=self._state.step_count >= 3, reward=0.0,
                                feedback="Higher." if guess < self.secret else "Lower.")  # fmt: skip

    @property
    def state(self):
        return self._state

    def close(self):
        with GuessGame.lock:
            GuessGame.open.discard(id(self))
            GuessGame.lock.notify_all()


def serve(capacity: int):
    """The game on a free port of 127.0.0.1 (a uvicorn thread, on a socket bound here and
    handed over: no other process can take the port in between); (server, url). Clients may
    connect at once: the listening socket queues them until uvicorn accepts."""
    app = create_app(GuessGame, GuessAction, GuessObservation, max_concurrent_envs=capacity)
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(128)
    port = listening.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True).start()
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture
def game(tmp_path, monkeypatch):
    """A server with room for 64 sessions, the client file, and a fresh tally."""
    GuessGame.seeds, GuessGame.open, GuessGame.peak = [], set(), 0
    server, url = serve(64)
    monkeypatch.setenv("GUESS_URL", url)
    path = tmp_path / "guess.py"
    path.write_text(CLIENT)
    yield path
    server.should_exit = True


G, PROMPTS = 4, 4
FLAGS = ["--steps", "3", "--prompts-per-step", str(PROMPTS), "--group-size", str(G), "--algo",
         "grpo", "--max-new-tokens", "24", "--max-turns", "3", "--eval-size", "4",
         "--eval-samples", "2", "--eval-every", "0", "--no-progress", "--threads", "1"]  # fmt: skip


def check_sessions(at_once: int) -> None:
    """Every group's sessions were reset with one seed (a training group's G; an evaluated
    problem's 2 samples and its greedy one, 3); no more sessions than a step or an evaluation
    batch holds at once were ever open; none is left open."""
    counts: dict[int, int] = {}
    for seed in GuessGame.seeds:
        counts[seed] = counts.get(seed, 0) + 1
    episodes = {s: c for s, c in counts.items() if s != 0}  # 0: the pre-flight's
    assert episodes and all(c % G == 0 or c % 3 == 0 for c in episodes.values()), counts
    assert sum(c % G == 0 for c in episodes.values()) >= PROMPTS  # the training groups
    assert GuessGame.peak <= at_once
    # the server closes a session in its own thread, after the client's close went out: wait
    # for the closes themselves (a session never closed fails here, after the backstop)
    with GuessGame.lock:
        assert GuessGame.lock.wait_for(lambda: not GuessGame.open, timeout=60), GuessGame.open


def test_an_openenv_server_trains_through_the_command_line(game, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--environment", f"{game}:Guess", *FLAGS, "--output-dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert len(rows) == 3 and "reward_Guess" in rows[0] and rows[0]["turns_mean"] > 1
    # the pre-flight opened a step's 16 sessions (the evaluation's 4 x 3 are fewer): reused
    check_sessions(PROMPTS * G)
    assert GuessGame.peak == PROMPTS * G


def test_an_openenv_server_trains_through_the_python_api(game, tmp_path):
    from grouprl.tasks.loading import import_file

    cls = import_file(game, "environment").Guess
    result = grouprl.Trainer(environment=cls, steps=2, prompts_per_step=PROMPTS, group_size=G,
                             algo="grpo", max_new_tokens=24, max_turns=3, eval_size=4,
                             eval_samples=2, eval_every=0, progress=False, threads=1,
                             output_dir=tmp_path / "api").train()  # fmt: skip
    assert result.steps_done == 2
    check_sessions(PROMPTS * G)


def test_a_server_without_room_is_one_line_before_training(tmp_path, monkeypatch, capsys):
    GuessGame.seeds, GuessGame.open, GuessGame.peak = [], set(), 0
    server, url = serve(2)
    monkeypatch.setenv("GUESS_URL", url)
    (tmp_path / "guess.py").write_text(CLIENT)
    out = tmp_path / "run"
    try:
        code = main(["train", "--environment", f"{tmp_path / 'guess.py'}:Guess", *FLAGS,
                     "--output-dir", str(out)])  # fmt: skip
    finally:
        server.should_exit = True
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "refused a session" in err[0] and "CAPACITY_REACHED" in err[0]
    assert "SUPPORTS_CONCURRENT_SESSIONS = True" in err[0] and "max_concurrent_envs=16" in err[0]
    assert not (out / "metrics.jsonl").exists()  # before training
