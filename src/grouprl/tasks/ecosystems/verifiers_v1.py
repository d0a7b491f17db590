"""verifiers 0.4 environments (its v1 API: a `Taskset` of `Task`s with `@vf.reward`s, run by a
harness program that talks to a model over HTTP) through grouprl's endpoint: `--task
verifiers:ENV` where verifiers 0.4 is what runs it.

verifiers 0.4 pins `openai<3`, so it usually lives in an environment of its own (as vLLM's CPU
build does): `GROUPRL_VERIFIERS_PYTHON` names its Python (`make test` builds one,
`.venv-vf04`); without it, this Python runs it when its own verifiers is 0.4, and 0.3 runs
in-process (`grouprl.tasks.ecosystems.verifiers`) otherwise.

How a run goes. A driver program (`verifiers_v1_driver.py`, run by that Python) loads the
environment once and lists its tasks: they are the run's rows (a tenth, at least one, held
out). Each episode of a batch is a verifiers episode (`run_slot`) with the null harness run as
a local subprocess, its model the episode's URL on the run's endpoint: verifiers renders the
conversation with `renderers` and asks the token route, which the run's sampler answers exactly
as for an agent program (`grouprl.endpoint.agents`: batches formed when every live episode
waits, the group's first request its prompt, later turns fed into the row's cache when their
ids extend it, split into rows of their own when they do not). The episode's reward is the
trace's (Σ weight × score of the task's rewards), the `agent` reward.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import queue
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from grouprl.errors import UserError
from grouprl.tasks.base import Task, turns_summing_to

#: The environment variable naming the Python that runs verifiers 0.4.
PYTHON_VARIABLE = "GROUPRL_VERIFIERS_PYTHON"
DRIVER = Path(__file__).with_name("verifiers_v1_driver.py")
#: Seconds the driver may take to load the environment (it imports verifiers: ~4 s here).
LOAD_SECONDS = 300.0
#: Rows held out: a tenth, at least one, at most 500 (as for verifiers 0.3).
HELDOUT_SHARE, HELDOUT_MAX = 0.1, 500
#: Ended episodes whose results the driver keeps (a batch's, and more).
KEPT_RESULTS = 4096
#: Task-config keys that are grouprl's, not the taskset's.
OWN_KEYS = ("renderer", "harness", "max_turns")


def v1_python() -> str | None:
    """The Python that runs verifiers 0.4 (see the module docstring); None: 0.3 here."""
    named = os.environ.get(PYTHON_VARIABLE)
    if named:
        if not Path(named).exists():
            raise UserError(f"{PYTHON_VARIABLE}={named}: no such Python; name the python of "
                            "an environment with verifiers 0.4 (make test builds .venv-vf04)")  # fmt: skip
        return named
    try:
        from importlib.metadata import version

        mine = version("verifiers")
    except Exception:
        return None
    return sys.executable if mine.startswith("0.4.") else None


class V1Driver:
    """The driver process of one run: `start` an episode, `close` at the end. Its results
    arrive on a reader thread and resolve each episode's future in the loop that awaits it."""

    def __init__(self, python: str, spec: str, config: dict[str, Any]) -> None:
        self.spec = spec
        self.own = {k: config[k] for k in OWN_KEYS if k in config}
        if self.own.get("harness", "null") != "null":
            raise UserError(f"--task-config harness {self.own['harness']}: verifiers' harnesses "
                            "other than the null one run the model's commands as host "
                            "processes; grouprl runs the null harness only (drop harness)")  # fmt: skip
        self.args = {k: v for k, v in config.items() if k not in OWN_KEYS}
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "TRANSFORMERS_VERBOSITY": "error",
        }  # it has no torch, and needs none
        env.pop("PYTHONPATH", None)  # grouprl's path is not verifiers'
        try:
            self.proc = subprocess.Popen([python, str(DRIVER)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        except OSError as err:
            raise UserError(f"{python} did not start ({err}); {PYTHON_VARIABLE} must name a "
                            "Python with verifiers 0.4") from None  # fmt: skip
        self.replies: queue.Queue = queue.Queue()
        self.waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.lock = threading.Lock()
        # the latest ended episodes' results, by key (branches included): what verifiers
        # recorded, beside what grouprl trains on (bounded: a run ends many batches)
        self.results: OrderedDict[str, dict] = OrderedDict()
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)
        self.tasks = self._load()

    def _send(self, obj: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise UserError(f"the verifiers 0.4 driver of {self.spec} ended (exit code "
                            f"{self.proc.poll()}); its error is above") from None  # fmt: skip

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "done" not in obj:
                self.replies.put(obj)
                continue
            with self.lock:
                self.results[obj["done"]] = obj
                while len(self.results) > KEPT_RESULTS:
                    self.results.popitem(last=False)
                loop, future = self.waiting.pop(obj["done"], (None, None))
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, future, obj)
        self.replies.put({"error": f"the driver ended (exit code {self.proc.wait()})"})

    def _load(self) -> list[dict]:
        self._send({"cmd": "load", "env": self.spec, "args": self.args, **self.own})
        try:
            reply = self.replies.get(timeout=LOAD_SECONDS)
        except queue.Empty:
            self.close()
            raise UserError(f"verifiers environment {self.spec!r} did not load within "
                            f"{LOAD_SECONDS:g} s") from None  # fmt: skip
        if "error" in reply:
            self.close()
            raise UserError(f"verifiers environment {self.spec!r} did not load "
                            f"({reply['error'].strip()}); check its name and --task-config")  # fmt: skip
        return reply["tasks"]

    def start(self, key: str, task: int, base: str, model: str, tokenizer: str,
              sampling: dict[str, Any]) -> asyncio.Future:  # fmt: skip
        """Run task `task` as episode `key` against `base` (the episode's URL, …/v1); a future
        of its result in the running loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.lock:
            self.waiting[key] = (loop, future)
        self._send({"cmd": "run", "key": key, "task": task, "base": base, "model": model,
                    "tokenizer": tokenizer, "sampling": sampling})  # fmt: skip
        return future

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"cmd": "close"})
                self.proc.wait(timeout=30)
            except (UserError, subprocess.TimeoutExpired):
                self.proc.kill()


def _resolve(future: asyncio.Future, obj: dict) -> None:
    if not future.done():
        future.set_result(obj)


class V1Episodes:
    """The agent function of a verifiers 0.4 run: each episode is the driver's, against the
    episode's own URL (`client.base_url`)."""

    def __init__(self, driver: V1Driver, tokenizer: str, sampling: dict[str, Any]) -> None:
        self.driver, self.tokenizer, self.sampling = driver, tokenizer, sampling

    async def episode(self, client: Any, row: dict, model: str) -> float | None:
        base = str(client.base_url).rstrip("/")  # http://127.0.0.1:PORT/e/KEY/v1
        key = base.split("/e/")[1].split("/")[0]
        future = self.driver.start(key, int(row["vf_task"]), base, model, self.tokenizer,
                                   self.sampling)  # fmt: skip
        result = await future
        if not result["ok"]:
            raise RuntimeError(f"the verifiers episode failed: {result['error']}")
        # the task's `trace.info["turn_rewards"]` (prime-rl's convention): one per sampled turn,
        # in order over the trace's branches
        return turns_summing_to(result["reward"], result.get("turn_rewards"))


def verifiers_v1_task(spec: str, config: dict[str, Any], python: str) -> Task:
    """The task `verifiers:SPEC` on verifiers 0.4 (see the module docstring)."""
    driver = V1Driver(python, spec, config)
    rows = [{"prompt": t["prompt"], "vf_task": i} for i, t in enumerate(driver.tasks)]
    k = min(HELDOUT_MAX, max(1, int(len(rows) * HELDOUT_SHARE)))
    if len(rows) <= k:
        driver.close()
        raise UserError(f"verifiers:{spec}: {len(rows)} task(s), too few to hold some out")
    return Task(name=f"verifiers:{spec}", train=rows[:-k], heldout=rows[-k:], reward_funcs={},
                reward_weights={}, stop=None, max_new_tokens=256, driver=driver)  # fmt: skip
