"""An LLM judge as a reward: an OpenAI-compatible chat endpoint asked to score each completion.

A judge is a YAML file, named as a reward (`--rewards judge.yaml 1.0`; its metric is the file's
stem):

    judge:
      url: http://127.0.0.1:8000/v1   # any OpenAI-compatible server: vLLM, `grouprl serve`, ...
      model: my-judge
      template: |                     # {prompt}, {completion} and the row's columns
        Question: {prompt}
        Answer: {completion}
        Reference: {answer}
        Score the answer from 0 to 10. Reply "Score: N".
      parse: number                   # number: the answer's last number, mapped from `scale`
      scale: [0, 10]                  #   onto [0, 1]; choice: the first of `choices` it names;
                                      #   rubric: a "criterion: N" line for each of `rubric`
                                      #   (criterion -> weight), their weighted mean
      concurrency: 8                  # calls at once
      retries: 2                      # after the first try, on no answer, a timeout, 429, 5xx
      backoff: 0.5                    # seconds before the first retry, doubled after each
      timeout: 30                     # seconds a call may take
      temperature: 0.0
      max_tokens: 64
      api_key_env: null               # an environment variable holding the key, if it needs one

Every completion's score is first looked up in a cache keyed by the judge (its model, template,
parser and sampling: not its url, concurrency, retries or timeout), the prompt and the
completion; in a run the cache is written through to `judge-NAME.jsonl` in the run directory, so
a completion scored again, or a resumed run, asks nothing. A judge that does not answer (after its retries) or answers what the parser cannot read
scores None for that completion (TRL's "does not apply": the other rewards score it), counted in
`NAME_unscored` and never turned into 0. Answers the parser could not read are cached (asking
again at temperature 0 gives the same); calls that got no answer are not. The judge's answers go
to samples.jsonl (`NAME_answer`).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from string import Formatter
from typing import Any

from grouprl.errors import UserError, one_line

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
#: Seconds the set-up check waits for the judge's GET /models.
SETUP_TIMEOUT = 10.0


@dataclass(frozen=True)
class JudgeConfig:
    url: str
    model: str
    template: str
    parse: str = "number"
    scale: tuple[float, float] = (0.0, 10.0)
    choices: dict[str, float] = field(default_factory=dict)
    rubric: dict[str, float] = field(default_factory=dict)
    concurrency: int = 8
    retries: int = 2
    backoff: float = 0.5
    timeout: float = 30.0
    temperature: float = 0.0
    max_tokens: int = 64
    api_key_env: str | None = None
    group: bool = False

    def key(self, prompt: str, completion: str) -> str:
        """The cache key of one judgement: what decides the judge's answer and its score (not
        where or how patiently it is asked)."""
        judge = {k: v for k, v in asdict(self).items() if k in JUDGING}
        text = json.dumps([judge, prompt, completion], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


#: The settings a cached judgement depends on.
JUDGING = ("model", "template", "parse", "scale", "choices", "rubric", "temperature",
           "max_tokens", "group")  # fmt: skip


def is_judge_spec(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) and Path(spec).expanduser().is_file()


def reward_model_settings(spec: str) -> dict[str, Any] | None:
    """A reward YAML's `reward_model:` settings (a sequence-classification model on a device
    of its own: `model`, a directory or hub id; `device`; `batch_size`), or None (a judge's)."""
    import yaml

    try:
        values = yaml.safe_load(Path(spec).expanduser().read_text()) or {}
    except yaml.YAMLError:
        return None
    settings = values.get("reward_model") if isinstance(values, dict) else None
    if settings is None:
        return None
    known = {"model", "device", "batch_size"}
    if not isinstance(settings, dict) or not settings.get("model") or set(settings) - known:
        raise UserError(f"reward model {spec}: give `reward_model:` with model (a directory or "
                        "hub id), and optionally device and batch_size")  # fmt: skip
    return settings


def load_judge(spec: str) -> Judge:
    """The judge a YAML file describes (see the module docstring); UserError naming the file."""
    import yaml

    path = Path(spec).expanduser()
    try:
        values = (yaml.safe_load(path.read_text()) or {}).get("judge")
    except (yaml.YAMLError, AttributeError) as err:
        raise UserError(f"judge {path}: not a YAML mapping with a `judge:` key "
                        f"({one_line(err)})") from None  # fmt: skip
    if not isinstance(values, dict):
        raise UserError(f"judge {path}: give its settings under a `judge:` key")
    fields = set(JudgeConfig.__dataclass_fields__)
    unknown = sorted(set(values) - fields)
    if unknown:
        raise UserError(f"judge {path}: unknown setting {unknown[0]!r}; known: "
                        f"{', '.join(sorted(fields))}")  # fmt: skip
    missing = [k for k in ("url", "model", "template") if not values.get(k)]
    if missing:
        raise UserError(f"judge {path}: give its {missing[0]}")
    if "scale" in values:
        values["scale"] = tuple(float(v) for v in values["scale"])
    config = JudgeConfig(**values)
    if config.parse not in ("number", "choice", "rubric"):
        raise UserError(f"judge {path}: parse {config.parse!r}; use number, choice or rubric")
    if config.parse == "rubric" and not (
        config.rubric and all(w > 0 for w in config.rubric.values())
    ):
        raise UserError(f"judge {path}: parse rubric needs rubric (a criterion -> its weight > 0)")
    if config.group and config.parse != "number":
        raise UserError(f"judge {path}: a group judge scores with numbers (parse: number)")
    fields = {f for _, f, _, _ in Formatter().parse(config.template) if f}
    if config.group and "completions" not in fields:
        raise UserError(f"judge {path}: a group judge's template shows the group's answers: "
                        "put {completions} in it")  # fmt: skip
    if config.parse == "choice" and not config.choices:
        raise UserError(f"judge {path}: parse choice needs choices (a word -> its score)")
    if config.parse == "number" and not config.scale[0] < config.scale[1]:
        raise UserError(f"judge {path}: scale {list(config.scale)} must rise")
    return Judge(path.stem, config)


class Judge:
    """Callable with TRL's reward signature (see the module docstring)."""

    def __init__(self, name: str, config: JudgeConfig) -> None:
        self.__name__, self.config = name, config
        self.cache: dict[str, dict] = {}
        self.cache_file: Path | None = None
        self.calls = 0  # requests sent, retries included
        fields = [f for _, f, _, _ in Formatter().parse(config.template) if f]
        self.columns = sorted({f.split(".")[0].split("[")[0] for f in fields}
                              - {"prompt", "completion", "completions"})  # fmt: skip
        # the template's columns are required: a dataset without one is one line at set-up
        params = [inspect.Parameter("completions", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                  *(inspect.Parameter(c, inspect.Parameter.KEYWORD_ONLY) for c in self.columns),
                  inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]  # fmt: skip
        self.__signature__ = inspect.Signature(params)

    def check(self) -> None:
        """The judge answers its models route (one line where it does not)."""
        import httpx

        try:
            httpx.get(f"{self.config.url.rstrip('/')}/models", timeout=SETUP_TIMEOUT,
                      headers=self._headers()).raise_for_status()  # fmt: skip
        except Exception as err:
            raise UserError(f"judge {self.__name__}: {self.config.url} does not answer "
                            f"({one_line(err)}); start the judge's server or fix its url") from None  # fmt: skip

    def bind(self, directory: Path) -> None:
        """Write the cache through to `directory` (a run's), reading what it holds."""
        rank = os.environ.get("RANK", "0")
        self.cache_file = (
            directory / f"judge-{self.__name__}{'' if rank == '0' else '.' + rank}.jsonl"
        )
        for path in sorted(directory.glob(f"judge-{self.__name__}*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a crash
                    continue
                self.cache[entry["key"]] = entry

    def __call__(self, completions: Sequence[Any], prompts: Sequence[Any] | None = None,
                 log_extra: Any = None, log_metric: Any = None, group_size: int = 1,
                 **columns: Any) -> list[float | None]:  # fmt: skip
        n = len(completions)
        prompts = list(prompts) if prompts is not None else [""] * n
        texts = [_text(c) for c in completions]
        size = group_size if self.config.group else 1  # completions judged together
        units = []  # (cache key, the judge's message, the completions it scores)
        for first in range(0, n, size):
            rows = list(range(first, min(first + size, n)))
            values = {c: columns[c][first] for c in self.columns}
            prompt = _text(prompts[first])
            shown = [texts[i] for i in rows]
            listed = "\n".join(f"{k + 1}. {t}" for k, t in enumerate(shown))
            message = self.config.template.format(prompt=prompt, completion=shown[0],
                                                  completions=listed, **values)  # fmt: skip
            units.append((self.config.key(prompt, json.dumps(shown)), message, rows))
        missing = {key: (message, len(rows)) for key, message, rows in units
                   if key not in self.cache}  # fmt: skip
        if missing:
            self._store(_run(self._ask_all(missing)))
        scores: list[float | None] = [None] * n
        answers: list[str | None] = [None] * n
        for key, _, rows in units:
            entry = self.cache.get(key) or {"scores": None, "answer": None}
            for k, i in enumerate(rows):
                answers[i] = entry["answer"]
                scores[i] = None if entry["scores"] is None else entry["scores"][k]
        if log_extra is not None:
            log_extra(f"{self.__name__}_answer", answers)
        if log_metric is not None:
            log_metric(f"{self.__name__}_unscored", sum(s is None for s in scores) / max(n, 1))
        return scores

    # --- the calls
    def _headers(self) -> dict[str, str]:
        env = self.config.api_key_env
        key = os.environ.get(env) if env else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _ask_all(self, asks: dict[str, tuple[str, int]]) -> dict[str, dict]:
        import httpx

        gate = asyncio.Semaphore(self.config.concurrency)
        async with httpx.AsyncClient(timeout=self.config.timeout, trust_env=False,
                                     headers=self._headers()) as client:  # fmt: skip

            async def one(key: str, message: str, count: int) -> tuple[str, dict | None]:
                async with gate:
                    answer = await self._ask(client, message)
                if answer is None:
                    return key, None  # no answer: not cached, asked again next time
                return key, {"key": key, "scores": self._parse(answer, count), "answer": answer}

            done = await asyncio.gather(*(one(k, m, c) for k, (m, c) in asks.items()))
        return {k: v for k, v in done if v is not None}

    async def _ask(self, client: Any, message: str) -> str | None:
        c = self.config
        body = {"model": c.model, "messages": [{"role": "user", "content": message}],
                "temperature": c.temperature, "max_tokens": c.max_tokens}  # fmt: skip
        wait = c.backoff
        for attempt in range(c.retries + 1):
            if attempt:
                await asyncio.sleep(wait)
                wait *= 2
            self.calls += 1
            try:
                response = await client.post(f"{c.url.rstrip('/')}/chat/completions", json=body)
            except Exception:
                continue
            if response.status_code == 429 or response.status_code >= 500:
                continue
            if response.status_code != 200:
                return None  # the judge refuses this request: asking again changes nothing
            try:
                return response.json()["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError):
                return None
        return None

    def _parse(self, answer: str, count: int) -> list[float | None] | None:
        """The scores of `count` completions the answer gives, or None (it gives none)."""
        c = self.config
        if c.group:  # one "k: score" line per completion, k = 1 ... count
            lines = re.findall(r"^\s*(\d+)\s*[:.)]\s*(-?\d+(?:\.\d+)?)", answer, re.M)
            given = {int(k): self._number(v) for k, v in lines}
            if sorted(given) != list(range(1, count + 1)):
                return None
            return [given[k] for k in range(1, count + 1)]
        if c.parse == "rubric":  # "criterion: N" for each, their weighted mean
            given = {}
            for name in c.rubric:
                m = re.search(rf"^\W*{re.escape(name)}\W*[:=]\s*(-?\d+(?:\.\d+)?)", answer,
                              re.M | re.I)  # fmt: skip
                given[name] = None if m is None else self._number(m.group(1))
            if any(v is None for v in given.values()):
                return [None]
            total = sum(c.rubric.values())
            return [sum(w * given[k] for k, w in c.rubric.items()) / total]
        if c.parse == "choice":
            found = [(m.start(), word) for word in c.choices
                     for m in [re.search(rf"\b{re.escape(word)}\b", answer)] if m]  # fmt: skip
            return [float(c.choices[min(found)[1]]) if found else None]
        numbers = NUMBER.findall(answer)
        return [self._number(numbers[-1]) if numbers else None]

    def _number(self, text: str) -> float | None:
        """A number from the judge's scale onto [0, 1]; None outside it."""
        low, high = self.config.scale
        value = float(text)
        return (value - low) / (high - low) if low <= value <= high else None

    def _store(self, found: dict[str, dict]) -> None:
        self.cache.update(found)
        if self.cache_file is not None and found:
            with self.cache_file.open("a") as f:
                for entry in found.values():
                    f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())


def _text(value: Any) -> str:
    """A prompt or completion as text: a conversation's messages' contents, joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m)
                         for m in value)  # fmt: skip
    return str(value)


def _run(awaitable: Any) -> Any:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(awaitable)
    finally:
        loop.close()
