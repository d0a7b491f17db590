"""Environments on TRL's terms: written the way TRL's examples write them (Python's global
`random` in `reset` and in a tool), with a dataset of one repeated prompt or no dataset at all.
A group starts from one state, its rollouts then draw apart, a run is a function of its seed,
resumes bit for bit, and leaves the caller's global random state as it found it."""

from __future__ import annotations

import asyncio
import json
import random
import signal

import numpy as np
import pytest
from safetensors.torch import load_file

from grouprl.cli import main
from grouprl.tasks.randomness import RandomStream, seeded
from grouprl.tasks.tools.calls import Call, Tool, run_calls
from grouprl.tasks.tools.environments import group_seed
from grouprl.tasks.tools.use import Episode
from grouprl.train import loop

ENV = '''
import random


class Safe:
    """TRL's way: reset draws the episode from the global random, and so does the tool."""

    def reset(self, **kwargs):
        self.key = random.randint(100, 999)
        self.addend = random.randint(10, 99)
        self.value = random.randint(10, 99)
        self.draws, self.answer = [], None
        return f"{self.key}+{self.addend}="

    def lookup(self, key: int) -> int:
        """The value stored under a key.

        Args:
            key: the key to look up.

        Returns:
            The value under the key.
        """
        self.draws.append(random.random())
        if key != self.key:
            raise KeyError(f"no key {key}")
        return self.value

    def step(self, text):
        tail = text.rpartition("|")[2].strip()
        self.answer = int(tail) if tail.isdigit() else None
        return None

    def get_reward(self):
        return 1.0 if self.answer == self.value + self.addend else 0.0


class OwnsTheData(Safe):
    """No dataset: reset writes the whole prompt, as TRL's IncrementEnv does."""

    def reset(self, **kwargs):
        return "#" + super().reset(**kwargs)


class NeedsARow(Safe):
    def reset(self, key, **kwargs):
        return super().reset()


class WritesNothing(Safe):
    def reset(self, **kwargs):
        super().reset()
        return None
'''
#: builtin:lookup calls `<lookup>KEY</lookup>` about 30% of the time: a model that really calls.
FLAGS = ["--model", "builtin:lookup", "--max-new-tokens", "48", "--steps", "3",
         "--prompts-per-step", "8", "--group-size", "4", "--eval-size", "4", "--eval-samples",
         "2", "--eval-every", "2", "--save-every", "1", "--no-progress", "--threads", "1",
         "--log-ratios", "0", "--seed", "5"]  # fmt: skip
SOURCES = {
    "no-dataset": ["--environment", "ENV:OwnsTheData"],
    "one-prompt": ["--environment", "ENV:Safe", "--dataset", "DATA"],
}
DROP = {"step_seconds", "rollout_seconds", "tokens_per_s"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("episodes")
    (root / "env.py").write_text(ENV)
    (root / "data.jsonl").write_text("".join(json.dumps({"prompt": "#"}) + "\n" for _ in range(64)))
    return root


def _args(files, source: str) -> list[str]:
    return [a.replace("ENV", str(files / "env.py")).replace("DATA", str(files / "data.jsonl"))
            for a in SOURCES[source]]  # fmt: skip


def _record(monkeypatch) -> list[dict]:
    """Each step's sampled batch, and whether the caller's global random states survived it."""
    seen, original = [], loop.collect_batch

    def collect(cfg, sampler, step, position):
        before = random.getstate(), np.random.get_state()[1].copy()
        collected = original(cfg, sampler, step, position)
        kept = random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
        # the environments' states now: once scored, their instances serve the next rollouts
        states = [(e.key, e.addend, e.value, list(e.draws))
                  for e in collected.sampled.rollout.turns.environments]  # fmt: skip
        seen.append({"step": step, "batch": collected.sampled, "caller_state_kept": kept,
                     "states": states})  # fmt: skip
        return collected

    monkeypatch.setattr(loop, "collect_batch", collect)
    return seen


def _logs(run) -> tuple[list[dict], list[str], list[str]]:
    metrics = [{k: v for k, v in json.loads(line).items() if k not in DROP}
               for line in (run / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    return metrics, (run / "samples.jsonl").read_text(), (run / "eval.jsonl").read_text()


@pytest.mark.parametrize("source", list(SOURCES))
def test_episodes_start_together_draw_apart_and_repeat_from_the_seed(
    files, tmp_path, monkeypatch, source
):
    seen = _record(monkeypatch)
    random.seed(1234)
    assert main(["train", *_args(files, source), *FLAGS, "--output-dir", str(tmp_path / "a")]) == 0
    assert len(seen) == 3 and all(s["caller_state_kept"] for s in seen)
    keys, called_apart = set(), 0
    for record in seen:
        batch = record["batch"]
        envs = record["states"]
        for g in range(len(batch.rows)):
            group = envs[g * 4 : (g + 1) * 4]
            start = {(key, addend, value) for key, addend, value, _ in group}
            assert len(start) == 1, start  # one initial state per group
            keys |= start
            callers = [draws for *_, draws in group if draws]
            called_apart += len(callers) >= 2 and len({c[0] for c in callers}) == len(callers)
        assert int(batch.rollout.turns.calls.sum()) > 0  # the model called the tool
    assert len(keys) == 24  # every group of every step a fresh episode
    assert called_apart > 0  # after the reset, a group's rollouts drew apart
    seen.clear()
    assert main(["train", *_args(files, source), *FLAGS, "--output-dir", str(tmp_path / "b")]) == 0
    assert _logs(tmp_path / "a") == _logs(tmp_path / "b")  # the seed decides the run


def test_an_episode_run_stopped_and_resumed_ends_bit_for_bit(files, tmp_path, stop_at):
    args = [*_args(files, "no-dataset"), *FLAGS]
    assert main(["train", *args, "--output-dir", str(tmp_path / "whole")]) == 0
    stop_at(2, signal.SIGINT)
    assert main(["train", *args, "--output-dir", str(tmp_path / "cut")]) == 130
    stop_at(None)
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    assert _logs(tmp_path / "cut") == _logs(tmp_path / "whole")
    got, want = (
        load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("cut", "whole")
    )
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in got)


def test_eval_and_check_run_on_episodes(files, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = [*_args(files, "no-dataset"), "--model", "builtin:lookup", "--max-new-tokens", "48",
            "--threads", "1"]  # fmt: skip
    assert main(["eval", *args, "--limit", "4", "--samples", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 4 and out["tool_call_rate"] is not None
    assert main(["eval", *args, "--split", "train"]) == 2
    assert "no train split" in capsys.readouterr().err
    assert main(["check", *args, "--prompts-per-step", "4", "--group-size", "4", "--json",
                 "--check-steps", "1"]) in (0, 1)  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"][0]["rendered"].startswith("<bos>#")  # reset wrote the prompt
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        ("NeedsARow", "reset gets no row (the environment owns the data)"),
        ("WritesNothing", "returned None with no dataset"),
    ],
)
def test_an_environment_that_cannot_own_the_data_is_one_line(files, tmp_path, capsys, cls, message):
    run = tmp_path / "run"
    args = ["--environment", f"{files / 'env.py'}:{cls}", *FLAGS, "--output-dir", str(run)]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not run.exists()


def test_global_randomness_is_seeded_per_reset_and_streamed_per_rollout():
    random.seed(7)
    np.random.seed(7)
    caller = random.getstate(), np.random.get_state()[1].copy()
    with seeded(42):
        first = random.random(), np.random.random()
    with seeded(42):
        assert (random.random(), np.random.random()) == first  # the same start for a group
    streams = [RandomStream(group_seed(42, k)) for k in range(2)]
    draws = []
    for stream in streams:
        with stream.swapped():
            draws.append(random.random())
    with streams[0].swapped():
        later = random.random()  # a stream goes on where its last call left it
    again = RandomStream(group_seed(42, 0))
    with again.swapped():
        replay = random.random(), random.random()
    assert replay == (draws[0], later) and draws[0] != draws[1]
    assert random.getstate() == caller[0] and (np.random.get_state()[1] == caller[1]).all()


def test_training_and_held_out_episodes_never_share_a_seed():
    train = {Episode(i).seed(0, s, 0) for i in range(200) for s in range(5)}
    held = {Episode(k, held_out=True).seed(0, "eval") for k in range(200)}
    assert all(s % 2 == 0 for s in train) and all(s % 2 == 1 for s in held)
    assert len(held) == 200 and not train & held


def test_async_environment_methods_run_one_at_a_time_with_their_own_streams():
    """Interleaved coroutines would draw from each other's streams (the streams are
    process-wide state): an environment's async tools run one at a time, each in its stream."""

    class Env:
        async def draw(self) -> str:
            first = random.random()
            await asyncio.sleep(0)  # where a concurrent loop would switch to the other call
            return f"{first},{random.random()}"

    env = Env()
    tools = [Tool("draw", env.draw, stream=RandomStream(seed)) for seed in (11, 12)]
    results = run_calls([(tool, Call("draw", "")) for tool in tools], timeout=5.0)
    expected = []
    for seed in (11, 12):
        with RandomStream(seed).swapped():
            expected.append((f"{random.random()},{random.random()}", False))
    assert results == expected
