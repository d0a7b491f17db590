"""reasoning-gym's procedural tasks (PyPI `reasoning-gym`, about a hundred generators with their
own scorers): `--task reasoning_gym:NAME`, the generator's config keywords as `--task-config
KEY VALUE ...`.

Rows. Training rows are generated from the run's seed, one generator index per row (the
generator is procedural: row i is the same for the same seed and config), lazily, so there are
always fresh problems; held-out rows come from a seed of their own, fixed by the task's name and
config (every run of a comparison evaluates on the same problems), and a training row whose
question is a held-out one is replaced by another index's, so the two never share a problem.
Held-out problems are distinct: 500 of them, or from a small problem space (an easy config) a
fifth of the problems its draws found, so most remain for training.
Each row's prompt is a system message (`--system-prompt`, else reasoning-gym's default: think,
then the answer between <answer> tags) and the question as a user message, rendered by the
model's chat template.

Scoring. The reward `correct` is the generator's own `score_answer` on the text between the
completion's last <answer> tags (reasoning-gym's `extract_answer`), or, in a reply without
them, on the whole reply stripped (small models rarely write the tags; reasoning-gym's default
scorer then gives 1 for exactly the answer and len(answer)/len(reply) for a reply holding it):
a number in [0, 1], 1 meaning right. Many generators' scorers evaluate the answer
(sympy's parse_expr, eval), so the scorer runs in the sandbox where the model's programs run,
each answer in a worker of its own with reasoning-gym mounted read-only and preloaded (a fork
per answer: about 8 ms): model text never runs in the trainer. An answer whose scorer fails or
runs out of its limits scores 0. `answer_tag` (weight 0: logged) says whether the tags were
there. A scorer that evaluates an answer runs it in the scorer's own worker: the sandbox keeps it
from the machine, the trainer and every other answer's score, but an answer written to fool that
evaluation could set its own score, as it could in any trainer that runs these scorers.
"""

from __future__ import annotations

import difflib
import json
import zlib
from collections.abc import Sequence
from functools import cache
from typing import Any

import yaml

from grouprl.errors import UserError
from grouprl.tasks.base import Task
from grouprl.tasks.rewards.common import completion_text

PREFIX = "reasoning_gym:"
#: Training rows (generator indices) a run draws from: far more than a run uses.
TRAIN_ROWS = 100_000
#: Held-out rows; evaluation reads the first `--eval-size`.
HELDOUT_ROWS = 500
#: Replacement indices tried for a training row whose question is held out.
DISJOINT_TRIES = 64
#: What the scorer's worker may use: reasoning-gym's imports are already in its address space.
SCORER_MEMORY_MB, SCORER_CPU_SECONDS = 4096, 5.0
#: The scorer, run in the sandbox once per answer: the request on stdin, the score on stdout.
SCORER = """
import json, sys
import reasoning_gym
request = json.loads(sys.stdin.read())
dataset = reasoning_gym.create_dataset(request["name"], **request["config"])
score = float(dataset.score_answer(request["answer"], request["entry"]))
print(json.dumps(score if 0.0 <= score <= 1.0 else 0.0))
"""
#: The extra that installs it (pyproject's optional dependency)
EXTRA = "pip install 'grouprl[reasoning-gym]'"


def _rg():
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(f"--task reasoning_gym:NAME needs reasoning-gym: {EXTRA}") from None
    return reasoning_gym


def config_values(config: dict[str, Any] | None) -> dict[str, Any]:
    """`--task-config`'s values as YAML reads them ("3" -> 3, "[1, 2]" -> [1, 2], "true" ->
    True), as a YAML config file would give them; seed and size are the run's."""
    out = {}
    for key, value in (config or {}).items():
        if key in ("seed", "size"):
            raise UserError(f"--task-config {key}: the run sets it (--seed; the rows are "
                            "generated as needed)")  # fmt: skip
        out[key] = yaml.safe_load(value) if isinstance(value, str) else value
    return out


@cache
def _generator(name: str, config_json: str, seed: int, size: int):
    """reasoning-gym's generator `name` with `config` (JSON), `seed` and `size`: UserError on
    an unknown name or a config it refuses."""
    rg = _rg()
    names = sorted(rg.factory.DATASETS)
    if name not in names:
        near = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else f" (there are {len(names)})"
        raise UserError(f"reasoning-gym has no task {name!r}{hint}")
    config = json.loads(config_json)
    try:
        return rg.create_dataset(name, seed=seed, size=size, **config)
    except (TypeError, ValueError, AssertionError) as err:
        _, config_cls = rg.factory.DATASETS[name]
        fields = ", ".join(f for f in config_cls.__dataclass_fields__ if f not in ("seed", "size"))
        raise UserError(f"reasoning_gym:{name} refused --task-config {config}: {err} "
                        f"(its keywords: {fields})") from None  # fmt: skip


def _row(entry: dict[str, Any], system: str) -> dict[str, Any]:
    """A task row of a generated entry (its metadata kept as JSON reads it back: the scorer
    sees exactly that)."""
    plain = json.loads(json.dumps({k: entry[k] for k in ("question", "answer", "metadata")},
                                  default=str))  # fmt: skip
    prompt = [{"role": "system", "content": system}, {"role": "user", "content": entry["question"]}]
    return {"prompt": prompt, "answer": plain["answer"], "entry": plain}


def held_out_entries(name: str, config_json: str, seed: int) -> list[dict]:
    """HELDOUT_ROWS distinct problems of the held-out generator; from a small problem space
    (fewer than 2 x HELDOUT_ROWS distinct among 4 x HELDOUT_ROWS draws) a fifth of the distinct
    problems drawn, so most stay for training."""
    generator = _generator(name, config_json, seed, 4 * HELDOUT_ROWS)
    distinct: dict[str, dict] = {}
    for i in range(4 * HELDOUT_ROWS):
        entry = generator[i]
        distinct.setdefault(entry["question"], entry)
    entries = list(distinct.values())
    keep = HELDOUT_ROWS if len(entries) >= 2 * HELDOUT_ROWS else max(1, len(entries) // 5)
    return entries[:keep]


class GeneratedRows(Sequence):
    """Training rows generated on demand from a seed (row i: generator index i, or a
    replacement index when index i's question is a held-out one)."""

    def __init__(self, make, held_out: set[str], system: str, name: str) -> None:
        self.make, self.held_out, self.system, self.name = make, held_out, system, name
        self._rows: dict[int, dict] = {}

    def __len__(self) -> int:
        return TRAIN_ROWS

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index not in self._rows:
            self._rows[index] = self._generate(index)
        return self._rows[index]

    def _generate(self, index: int) -> dict:
        generator = self.make()
        for k in range(DISJOINT_TRIES):
            entry = generator[index + k * TRAIN_ROWS]
            if entry["question"] not in self.held_out:
                return _row(entry, self.system)
        raise UserError(
            f"reasoning_gym:{self.name}: {DISJOINT_TRIES} problems in a row were held-out ones: "
            "the config leaves too few distinct problems to hold some out; widen it"
        )


def reasoning_gym_task(
    name: str, config: dict[str, Any] | None = None, seed: int = 0, system_prompt: str | None = None
) -> Task:
    """The task `reasoning_gym:NAME` (see the module docstring); `system_prompt`: the system
    message (None: reasoning-gym's default)."""
    rg = _rg()
    values = config_values(config)
    text = json.dumps(values, sort_keys=True)
    system = system_prompt or rg.utils.SYSTEM_PROMPTS["default"]
    heldout_seed = zlib.crc32(f"grouprl held-out {name} {text}".encode())
    heldout = [_row(entry, system) for entry in held_out_entries(name, text, heldout_seed)]
    questions = {row["entry"]["question"] for row in heldout}
    train = GeneratedRows(lambda: _generator(name, text, seed, TRAIN_ROWS * DISJOINT_TRIES),
                          questions, system, name)  # fmt: skip
    rewards = {"correct": scorer(name, values), "answer_tag": answer_tag}
    return Task(name=f"{PREFIX}{name}", train=train, heldout=heldout, reward_funcs=rewards,
                reward_weights={"correct": 1.0, "answer_tag": 0.0}, stop=None,
                max_new_tokens=512, default_steps=200)  # fmt: skip


def tagged(completion: Any) -> str | None:
    """The text between the completion's last <answer> tags (reasoning-gym's rule), or None."""
    text = completion_text(completion)
    return None if text is None else _rg().utils.extract_answer(text)


def extracted(completion: Any) -> str | None:
    """The answer to score: `tagged`'s, else the whole reply stripped (None: no text)."""
    found = tagged(completion)
    if found is not None:
        return found
    text = completion_text(completion)
    return None if text is None or not text.strip() else text.strip()


def answer_tag(completions, **_) -> list[float]:
    """1 where the completion gave an answer between <answer> tags."""
    return [float(tagged(c) is not None) for c in completions]


def scorer(name: str, config: dict[str, Any]):
    """The reward `correct`: the generator's score_answer in the sandbox (module docstring)."""
    from grouprl.sandbox.run import Limits, Packages, run_each

    packages = Packages(("reasoning-gym",), ("reasoning_gym",))
    limits = Limits(cpu_seconds=SCORER_CPU_SECONDS, memory_mb=SCORER_MEMORY_MB)

    def correct(completions, entry, **_) -> list[float]:
        answers = [extracted(c) for c in completions]
        todo = [i for i, a in enumerate(answers) if a is not None]
        requests = [json.dumps({"name": name, "config": config, "answer": answers[i],
                                "entry": entry[i]}) for i in todo]  # fmt: skip
        scores = [0.0] * len(completions)
        for i, ran in zip(todo, run_each(SCORER, requests, limits, packages), strict=True):
            if ran.stdout is not None:
                scores[i] = float(json.loads(ran.stdout))
        return scores

    def check_rows(rows, where) -> None:  # before a run: can the sandbox score here?
        from grouprl.sandbox import available

        reason = available()
        if reason is not None:
            raise UserError(f"reasoning_gym:{name} scores answers in the code sandbox, which "
                            f"cannot run here: {reason}")  # fmt: skip

    correct.check_rows = check_rows
    return correct
