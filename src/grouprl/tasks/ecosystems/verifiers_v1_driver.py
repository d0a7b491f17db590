"""The verifiers 0.4 driver: a program run by a Python that has verifiers 0.4 (its own
environment: 0.4 pins `openai<3`), talking to grouprl over its stdin and stdout, one JSON object a
line. It imports nothing of grouprl (grouprl is not installed where it runs).

It loads one environment (`SingleAgentEnv` of a taskset: an installed module or a file that
exports one `Taskset`), with the null harness run as a local subprocess (never Prime's hosted
sandboxes), and runs one episode (a `run_slot`) per `run` command, its model the episode's URL
on grouprl's endpoint (`TrainClientConfig`: verifiers renders with `renderers` and asks the
token route). What it writes:

- after `load`: {"tasks": [{"prompt": text}, ...]} or {"error": why};
- when an episode ends: {"done": key, "ok": bool, "reward": float|null, "rewards": {name:
  value}, "error": text|null, "branches": [{"token_ids": [...], "sampled_mask": [...]}, ...]}.

Commands: {"cmd": "load", "env": SPEC, "args": {...}, "tokenizer": DIR_OR_ID, "renderer":
config|null, "harness": name|null, "max_turns": n}; {"cmd": "run", "key": K, "task": i, "base":
URL, "model": NAME, "sampling": {...}}; {"cmd": "close"}.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any


def _taskset_id(spec: str) -> str:
    """The taskset id verifiers imports: an installed module's name, or a file's, registered
    (its directory put on the path of the tool servers it starts too)."""
    if not spec.endswith(".py"):
        return spec
    path = Path(spec).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"verifiers taskset file {path} does not exist")
    name = path.stem
    sys.path.insert(0, str(path.parent))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(path.parent), os.environ.get("PYTHONPATH")) if p
    )
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    if not getattr(module, "__all__", None):
        import verifiers.v1 as vf

        found = [v for v in vars(module).values()
                 if isinstance(v, type) and issubclass(v, vf.Taskset) and v is not vf.Taskset
                 and v.__module__ == name]  # fmt: skip
        if len(found) != 1:
            raise ValueError(f"{path} defines {len(found)} Taskset classes; export one in "
                             "__all__")  # fmt: skip
        module.__all__ = [found[0].__name__]
    return name


def _prompt_text(task: Any) -> str:
    prompt = getattr(task.data, "prompt", None)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        parts = []
        for m in prompt:
            content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
            parts.append(content if isinstance(content, str) else json.dumps(content))
        return "\n".join(parts)
    return str(prompt)


class Driver:
    def __init__(self, out: Any) -> None:
        self.out, self.lock = out, threading.Lock()
        self.env: Any = None
        self.tasks: list[Any] = []
        self.settings: dict[str, Any] = {}

    def say(self, obj: dict) -> None:
        with self.lock:
            self.out.write(json.dumps(obj) + "\n")
            self.out.flush()

    def load(self, cmd: dict) -> None:
        try:
            import verifiers.v1 as vf
            from verifiers.v1.harnesses.null import NullHarnessConfig
        except ImportError as err:
            raise ValueError(f"{sys.executable} has no verifiers 0.4 ({err}): pip install "
                             "verifiers==0.4.0 renderers==0.1.12 uv into its environment") from None  # fmt: skip

        harness = cmd.get("harness") or "null"
        if harness != "null":
            raise ValueError(
                f"harness {harness!r}: verifiers' harnesses other than the null one run the "
                "model's commands as host processes; grouprl runs the null harness only"
            )
        config = vf.SingleAgentEnvConfig(
            taskset=vf.TasksetConfig(id=_taskset_id(cmd["env"]), **(cmd.get("args") or {})),
            agent=vf.AgentConfig(
                harness=NullHarnessConfig(id="null"),
                runtime=vf.SubprocessConfig(),
                max_turns=int(cmd.get("max_turns") or 10),
            ),
        )
        self.env = vf.load_environment(config)
        self.tasks = list(self.env.taskset)
        self.settings = cmd

    async def run(self, cmd: dict) -> dict:
        import verifiers.v1 as vf

        key = cmd["key"]
        try:
            client = vf.TrainClientConfig(
                base_url=cmd["base"], api_key_var="GROUPRL_ENDPOINT_KEY",
                renderer=self.settings.get("renderer"),
                renderer_model_name=cmd["tokenizer"],
            )  # fmt: skip
            ctx = vf.ModelContext(model=cmd["model"], client=client,
                                  sampling=vf.SamplingConfig(**cmd["sampling"]))  # fmt: skip
            task = self.tasks[int(cmd["task"])]
            (slot,) = self.env.slots(task, 1)
            episode = await self.env.run_slot(slot, ctx)
        except Exception as err:
            return {"done": key, "ok": False, "reward": None, "rewards": {},
                    "error": f"{type(err).__name__}: {err}", "branches": []}  # fmt: skip
        errors = [f"{e.type}: {e.message}" for e in episode.errors]
        traces = list(episode.traces)
        trace = traces[0] if traces else None
        if trace is not None:
            errors += [f"{e.type}: {e.message}" for e in trace.errors]
        ok = bool(episode.ok) and trace is not None and bool(trace.ok)
        rewards = {} if trace is None else {
            name: (None if r is None else float(r.value)) for name, r in trace.rewards.items()}  # fmt: skip
        branches = [] if trace is None else [
            {"token_ids": list(b.token_ids), "sampled_mask": [bool(m) for m in b.sampled_mask]}
            for b in trace.branches]  # fmt: skip
        turns = None if trace is None else trace.info.get("turn_rewards")
        if not (isinstance(turns, list) and all(t is None or isinstance(t, (int, float))
                                                for t in turns)):  # fmt: skip
            turns = None
        return {"done": key, "ok": ok, "reward": None if trace is None else trace.reward,
                "rewards": rewards, "error": "; ".join(errors)[-2000:] or None,
                "branches": branches, "turn_rewards": turns}  # fmt: skip


async def serve(driver: Driver, lines: asyncio.Queue) -> None:
    running: set[asyncio.Task] = set()
    serving = None
    try:
        while True:
            cmd = await lines.get()
            if cmd is None or cmd.get("cmd") == "close":
                break
            if cmd["cmd"] == "load":
                try:
                    driver.load(cmd)
                    serving = driver.env.serving()
                    await serving.__aenter__()
                except Exception as err:
                    driver.say({"error": f"{type(err).__name__}: {err}"})
                    continue
                driver.say({"tasks": [{"prompt": _prompt_text(t)} for t in driver.tasks]})
            elif cmd["cmd"] == "run":

                async def one(cmd: dict = cmd) -> None:
                    driver.say(await driver.run(cmd))

                task = asyncio.ensure_future(one())
                running.add(task)
                task.add_done_callback(running.discard)
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if serving is not None:
            await serving.__aexit__(None, None, None)


def _main() -> None:
    # this file's directory is grouprl's (its verifiers.py would shadow verifiers itself)
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    # the protocol owns stdout; anything else printed goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # the subprocess runtime runs `uv` from PATH: this environment's own
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]
    driver = Driver(out)
    loop = asyncio.new_event_loop()
    lines: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(lines.put_nowait, json.loads(line))
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read, daemon=True).start()
    try:
        loop.run_until_complete(serve(driver, lines))
    except Exception:
        traceback.print_exc()
        driver.say({"error": traceback.format_exc(limit=3)})
    finally:
        loop.close()


if __name__ == "__main__":
    _main()
