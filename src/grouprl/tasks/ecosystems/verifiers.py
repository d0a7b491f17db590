"""verifiers environments (Prime Intellect's `verifiers` 0.3.x, the Environments Hub's format:
`Environment`, `SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv` with a `Rubric` and a `Parser`) on
grouprl's sampler: `--task verifiers:ENV` (an installed environment module, or a file
path/env.py, whose `load_environment(**args)` makes it; `--task-config` gives the args).

How a rollout runs. The environment keeps its own loop: each group is its `run_group` (G copies
of a dataset row), in an event loop of the batch's own, with an in-process client
(a `verifiers.Client` of grouprl's: `_client_class`) in place of an OpenAI endpoint. The client's requests are answered by
grouprl's sampler, exactly:

- The first request's messages (the environment's system prompt, few-shot examples, the row's
  prompt) and its tool definitions are rendered once by the model's chat template: these are
  the group's prompt ids, prefilled once for its G rollouts.
- A model turn ends at the model's end-of-turn token; its text (and the calls in it, parsed in
  the template's convention, as `--tool-format chat` reads them) is the client's response.
- The environment's reply (tool results, a user turn) arrives as the next request's new
  messages. They must extend the conversation as it was (the request's messages up to the last
  turn equal the last request's and the model's turn); only the new messages are rendered, from
  just after the model's end-of-turn token to the next assistant header (the template's own
  boundary tokens), and fed into the row's running KV cache. Nothing sampled is ever re-encoded:
  the ids trained on are the ids sampled and fed, turn by turn. A request that does not extend
  the conversation (an environment that rewrites its history) is one line.
- A turn cut by the budget (`--max-new-tokens` counts the whole trajectory) is the client's
  last response (finish_reason "length"); a request after it is refused as overlong, which ends
  the rollout as verifiers ends an overlong one.

Rewards. The rubric scores each group as `run_group` does; `rubric` (weight 1) is each
rollout's `reward`, and each of the rubric's functions is logged (weight 0) as
`vf_<name>`. The sampling arguments the environment asks for are grouprl's: its temperature,
top-p/k and budget rule.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from grouprl.errors import UserError
from grouprl.messages import Observation, ToolRequest
from grouprl.tasks.base import Task, turns_summing_to
from grouprl.tasks.tools.rendering import Renderer, conversation_key, extension
from grouprl.tasks.tools.rendering import message_dict as _message_dict
from grouprl.tasks.tools.use import RolloutStart, ToolUse

PREFIX = "verifiers:"
#: The state column a rollout's step rewards travel in (`VerifiersDriver`).
STEP_REWARDS = "grouprl_step_rewards"
EXTRA = "pip install 'grouprl[verifiers]'"
#: The model name the environment's requests carry.
MODEL = "grouprl"
#: Rows held out when the environment has no eval dataset: a tenth, at least one, at most 500.
HELDOUT_SHARE, HELDOUT_MAX = 0.1, 500
#: Seconds the environment's loops may run between two model turns without asking or finishing.
SETTLE_SECONDS = 120.0


def _vf():
    try:
        import verifiers
    except ImportError:
        raise UserError(f"--task verifiers:ENV needs verifiers 0.3: {EXTRA}") from None
    if not verifiers.__version__.startswith("0.3."):
        raise UserError(f"--task verifiers:ENV runs verifiers 0.3 environments; this is "
                        f"verifiers {verifiers.__version__}: {EXTRA}")  # fmt: skip
    return verifiers


def load_vf_environment(spec: str, args: dict[str, Any]) -> Any:
    """The environment `spec` names: a file path/env.py (its `load_environment(**args)`) or an
    installed environment module (`verifiers.load_environment(spec, **args)`)."""
    vf = _vf()
    quiet = logging.getLogger("verifiers")
    level, quiet.level = quiet.level, logging.CRITICAL  # its own error lines: ours says it
    try:
        if spec.endswith(".py"):
            from grouprl.tasks.loading import import_file

            path = Path(spec).expanduser()
            if not path.is_file():
                raise UserError(f"verifiers environment file {path} does not exist")
            module = import_file(path, "environment")
            make = getattr(module, "load_environment", None)
            if make is None and _defines_taskset(module):
                raise UserError(f"{path} is a verifiers 0.4 taskset, which this Python's "
                                f"verifiers {vf.__version__} cannot run: set "
                                "GROUPRL_VERIFIERS_PYTHON to the python of an environment with "
                                "verifiers 0.4 (make test builds .venv-vf04)")  # fmt: skip
            if make is None:
                raise UserError(f"{path} defines no load_environment(**args)")
            env = make(**args)
        else:
            env = vf.load_environment(spec, **args)
    except UserError:
        raise
    except Exception as err:
        raise UserError(f"verifiers environment {spec!r} did not load ({type(err).__name__}: "
                        f"{err}); check its name and --task-config") from None  # fmt: skip
    finally:
        quiet.setLevel(level)
    if not isinstance(env, vf.Environment):
        raise UserError(f"{spec}: load_environment returned a {type(env).__name__}, not a "
                        "verifiers Environment")  # fmt: skip
    return env


def _defines_taskset(module: Any) -> bool:
    """Whether `module` defines a verifiers 0.4 `Taskset` (a class with one among its bases)."""
    return any(isinstance(v, type) and any(b.__name__ == "Taskset" for b in v.__mro__[1:])
               for v in vars(module).values())  # fmt: skip


def verifiers_task(spec: str, config: dict[str, Any] | None = None, seed: int = 0) -> Task:
    """The task `verifiers:SPEC` (see the module docstring)."""
    from grouprl.tasks.ecosystems.reasoning_gym import config_values
    from grouprl.tasks.ecosystems.verifiers_v1 import v1_python, verifiers_v1_task

    python = v1_python()
    if python is not None:  # verifiers 0.4, in its own environment or this one
        return verifiers_v1_task(spec, config_values(config), python)
    env = load_vf_environment(spec, config_values(config))
    dataset = env.get_dataset()
    rows = [_row(dict(r), i) for i, r in enumerate(dataset)]
    if env.eval_dataset is not None or getattr(env, "eval_dataset_builder", None) is not None:
        heldout = [_row(dict(r), i) for i, r in enumerate(env.get_eval_dataset())]
    else:
        k = min(HELDOUT_MAX, max(1, int(len(rows) * HELDOUT_SHARE)))
        if len(rows) <= k:
            raise UserError(f"verifiers:{spec}: {len(rows)} row(s), too few to hold some out; "
                            "give the environment an eval dataset")  # fmt: skip
        rows, heldout = rows[:-k], rows[-k:]
    names = [f.__name__ for f in env.rubric._get_reward_funcs()]
    rewards = {"rubric": _rubric_reward, **{f"vf_{n}": _metric(n) for n in names}}
    weights = {"rubric": 1.0, **{f"vf_{n}": 0.0 for n in names}}
    return Task(name=f"{PREFIX}{spec}", train=rows, heldout=heldout, reward_funcs=rewards,
                reward_weights=weights, stop=None, max_new_tokens=256,
                driver=VerifiersDriver(env))  # fmt: skip


def _row(row: dict[str, Any], index: int) -> dict[str, Any]:
    """A task row: the dataset's row as verifiers gave it (`vf_input`), its prompt as the row's
    prompt (for budgets; the environment's first request is what the model sees)."""
    row.setdefault("example_id", index)
    return {"prompt": row.get("prompt"), "answer": row.get("answer"), "vf_input": row}


@dataclass
class Result:
    """A rollout's verifiers record, filled when its group is scored."""

    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    state: Any = None


def _per_turn(output: dict[str, Any]) -> float | list[float | None] | None:
    """A rollout's reward: the rubric's; or, where the environment rewarded its steps (a
    trajectory step's `reward`, as GymEnv and OpenEnvEnv set them), one per turn, the steps',
    with what the rubric gives beyond their sum on the last turn (so the turns sum to the
    rubric's reward)."""
    return turns_summing_to(output.get("reward"), output.get(STEP_REWARDS))


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _rubric_reward(completions, environments, **_) -> list[float | list[float | None] | None]:
    """The rubric's reward of each rollout (its group scored by `run_group`; a list where its
    steps were rewarded: `_per_turn`)."""
    return [r.reward for r in environments]


def _metric(name: str):
    def metric(completions, environments, **_) -> list[float | None]:
        return [r.metrics.get(name) for r in environments]

    metric.__name__ = f"vf_{name}"
    return metric


# ---------------------------------------------------------------------------------------------
# The client: requests answered by the sampler


@dataclass
class _Pending:
    """A request the sampler has not answered yet."""

    row: int
    messages: list[dict[str, Any]]
    future: asyncio.Future


def _client_class():
    vf = _vf()
    from verifiers.legacy.errors import OverlongPromptError

    class Client(vf.Client):
        def __init__(self, batch: VerifiersRollout) -> None:
            super().__init__(batch)

        def setup_client(self, config):  # configs are never given
            raise NotImplementedError

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kw):
            batch: VerifiersRollout = self.client
            state = kw.get("state")
            if batch.budget_spent(state):
                raise OverlongPromptError("grouprl's token budget for this rollout is spent")
            return await batch.ask(state, [_message_dict(m) for m in prompt], tools)

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            return response

        async def close(self):
            return None

    return Client


# ---------------------------------------------------------------------------------------------
# A batch of rollouts: the environment's loops, the sampler's turns


@dataclass(frozen=True)
class VerifiersDriver:
    """What a run keeps of a verifiers environment: the environment; `rollout` starts a batch."""

    env: Any

    def __post_init__(self) -> None:
        """Before the rubric scores a group (verifiers then gives every step the rollout's
        reward), the step rewards the environment set are copied into each state
        (`STEP_REWARDS`), which `run_group`'s outputs then carry (`_per_turn`)."""
        rubric = self.env.rubric
        score_group = rubric.score_group

        async def scored(states: list[Any], *args: Any, **kwargs: Any) -> Any:
            for state in states:
                state[STEP_REWARDS] = [_float_or_none(step.get("reward"))
                                       for step in state.get("trajectory") or []]  # fmt: skip
            return await score_group(states, *args, **kwargs)

        rubric.score_group = scored

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The environment's tools as the chat template renders them (OpenAI's schema)."""
        defs = getattr(self.env, "tool_defs", None) or []
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}}
                for t in defs]  # fmt: skip


class VerifiersRollout:
    """One batch of rollouts (rows, each repeated `group_size` times), their environment loops
    in an event loop of their own, as the sampler's `TurnHandler` (see the module docstring).
    `start` runs every loop to its first request; `respond` answers turns; `finish` (after
    sampling) ends what is left and scores the groups."""

    closers: ClassVar[list[str]] = []
    ends_turns = True
    keeps_content = True

    def __init__(self, driver: VerifiersDriver, rows: Sequence[dict], group_size: int,
                 renderer: Renderer, max_calls: int) -> None:  # fmt: skip
        self.driver, self.renderer, self.max_calls = driver, renderer, max_calls
        self.rows, self.G = list(rows), group_size
        self.loop = asyncio.new_event_loop()
        self.client = _client_class()(self)
        self.pending: dict[int, _Pending] = {}  # by row
        self.free = [list(range(g * group_size, (g + 1) * group_size)) for g in range(len(rows))]
        self.row_of: dict[int, int] = {}  # id(state) -> row
        self.states: dict[int, Any] = {}  # row -> its verifiers state
        self.last: dict[int, list[dict]] = {}  # the row's conversation so far (messages)
        self.spent: set[int] = set()  # rows whose budget ended a turn
        self.environments = [Result() for _ in range(len(rows) * group_size)]
        self.groups: list[asyncio.Task] = []
        self.tools: list[Any] | None = None  # the first request's tool definitions

    # --- the environment's side
    async def ask(self, state: Any, messages: list[dict], tools: Any) -> Any:
        row = self.row_of.get(id(state))
        if row is None:  # a rollout's first request: the next free row of its group
            group = int(state["input"]["example_id"])
            row = self.free[group].pop(0)
            self.row_of[id(state)] = row
            self.states[row] = state
            self.tools = tools
        future = self.loop.create_future()
        self.pending[row] = _Pending(row, messages, future)
        return await future

    def budget_spent(self, state: Any) -> bool:
        return self.row_of.get(id(state)) in self.spent

    def start(self) -> list[list[dict]]:
        """Every rollout to its first request; each row's prompt messages."""
        inputs = []
        for g, row in enumerate(self.rows):
            vf_input = dict(row["vf_input"], example_id=g)
            inputs.append([dict(vf_input) for _ in range(self.G)])

        async def launch():
            for group in inputs:
                self.groups.append(asyncio.ensure_future(
                    self.driver.env.run_group(group, self.client, MODEL, {},
                                              state_columns=[STEP_REWARDS])))  # fmt: skip

        self._run(launch())
        self._settle(range(len(self.environments)))
        missing = [r for r in range(len(self.environments)) if r not in self.pending]
        if missing:
            raise UserError(f"verifiers rollout {missing[0]} ended before asking the model "
                            "anything; the environment has nothing for the model to answer")  # fmt: skip
        prompts = [self.pending[r].messages for r in range(len(self.environments))]
        for r, messages in enumerate(prompts):
            self.last[r] = messages
            if conversation_key(messages) != conversation_key(prompts[r - r % self.G]):
                raise UserError(
                    "a verifiers environment asked the model differently in the rollouts of one "
                    f"group (rollout {r}); a group shares its prompt (prefilled once), so the "
                    "environment's setup must not draw it at random per rollout"
                )
        return prompts

    # --- the sampler's side
    def respond(self, requests: Sequence[ToolRequest]) -> list[Observation]:
        resumed = []
        for request in requests:
            pending = self.pending.pop(request.row, None)
            if pending is None:  # the environment is done with this row
                continue
            message = self.renderer.assistant(request.text)
            self.last[request.row] = [*pending.messages, message]
            pending.future.set_result(_response(message, "tool_calls" if message.get(
                "tool_calls") else "stop", self.driver))  # fmt: skip
            resumed.append(request.row)
        self._settle(resumed)
        out = []
        for request in requests:
            row = request.row
            if row not in self.pending or request.row not in resumed:
                out.append(Observation(end=True))
                continue
            if request.calls_made >= self.max_calls:  # refused: no turn answers it
                self.spent.add(row)
                self.pending.pop(row).future.set_exception(_overlong())
                out.append(Observation(end=True, over_limit=True))
                continue
            new = self.pending[row].messages
            before = self.last[row]
            tail = _extension(before, new, row)
            ids = self.renderer.tail(before[-1], tail)
            self.last[row] = new
            calls = sum(len(m.get("tool_calls") or []) for m in before[-1:])
            out.append(Observation(ids, tail, calls=calls, steps=0 if calls else 1))
        return out

    def finish(self, texts_of_cut_turns: dict[int, str]) -> list[Result]:
        """After sampling: the rows whose last turn the budget cut answer with it (a further
        request is refused as overlong), every loop runs to its end, and the groups' results
        (rewards, metrics, states) fill `environments`."""
        for row, text in texts_of_cut_turns.items():
            pending = self.pending.pop(row, None)
            if pending is not None:
                message = self.renderer.assistant(text)
                self.spent.add(row)
                pending.future.set_result(_response(message, "length", self.driver))
        while self.pending:  # a rollout that asked again after its last turn: nothing left
            row, pending = self.pending.popitem()
            self.spent.add(row)
            pending.future.set_exception(_overlong())
            self._run(asyncio.sleep(0))
        outputs = self._run(asyncio.gather(*self.groups))
        for g, group in enumerate(outputs):
            for k, output in enumerate(group):
                result = self.environments[g * self.G + k]
                result.reward = _per_turn(output)
                result.metrics = dict(output.get("metrics") or {})
                result.state = output
        self.loop.close()
        return self.environments

    # --- the event loop
    def _run(self, awaitable):
        asyncio.set_event_loop(self.loop)
        try:
            return self.loop.run_until_complete(awaitable)
        finally:
            asyncio.set_event_loop(None)

    def _settle(self, rows) -> None:
        """Run the loops until each of `rows` has asked again or its rollout is complete (its
        state says so; a complete rollout never asks again), or its group is done. A rollout
        that does neither within SETTLE_SECONDS (an environment waiting on something that never
        comes) is one line."""
        rows = set(rows)
        deadline = time.monotonic() + SETTLE_SECONDS

        def waiting() -> list[int]:
            return [r for r in rows if r not in self.pending and not self._complete(r)
                    and not self.groups[r // self.G].done()]  # fmt: skip

        async def wait() -> None:
            spins = 0
            while waiting():
                if time.monotonic() > deadline:
                    raise UserError(
                        f"a verifiers rollout neither asked the model nor finished within "
                        f"{SETTLE_SECONDS:g} s; check the environment's env_response and tools"
                    )
                spins += 1  # a tool running in a thread: yield the processor
                await asyncio.sleep(0 if spins < 1000 else 0.001)

        self._run(wait())
        for task in self.groups:  # an environment's error ends its group: say it now
            if task.done() and task.exception() is not None:
                err = task.exception()
                raise UserError(f"verifiers environment raised {type(err).__name__}: {err}")

    def _complete(self, row: int) -> bool:
        state = self.states.get(row)
        return bool(state is not None and state.get("is_completed"))


def _overlong():
    from verifiers.legacy.errors import OverlongPromptError

    return OverlongPromptError("grouprl's token budget for this rollout is spent")


def _extension(before: list[dict], new: list[dict], row: int) -> list[dict]:
    """The messages a request adds to the conversation so far; one line when it does not
    extend it (the environment rewrote its history: the ids sampled would not be its text)."""
    tail = extension(before, new)
    if tail is None:
        raise UserError(
            "a verifiers environment asked the model with a conversation that does not extend "
            f"the one so far (rollout {row}): grouprl trains on the ids it sampled and fed, "
            "turn by turn, so the environment must keep earlier turns as they were"
        )
    return tail


def _response(message: dict, finish: str, driver: VerifiersDriver) -> Any:
    """A verifiers Response carrying the model's turn."""
    from verifiers.legacy.types import Response, ResponseMessage, ToolCall

    calls = [ToolCall(id=c["id"], name=c["function"]["name"],
                      arguments=json.dumps(c["function"]["arguments"]))
             for c in message.get("tool_calls") or []]  # fmt: skip
    return Response(id=uuid.uuid4().hex, created=int(time.time()), model=MODEL,
                    message=ResponseMessage(content=message.get("content") or "",
                                            tool_calls=calls or None, finish_reason=finish,
                                            is_truncated=finish == "length"))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# What the trainer and `eval` hold: a ToolUse whose rollouts the environment drives


@dataclass(frozen=True)
class VerifiersUse(ToolUse):
    """A run's verifiers environment in the place of its tool use: `rollout` starts a batch
    (`VerifiersRollout`, the sampler's handler for it), `sampled` ends it after sampling and
    scores it."""

    driver: VerifiersDriver | None = None
    renderer: Renderer | None = None
    max_calls: int = 10

    @property
    def schemas(self) -> list[dict] | None:
        return self.renderer.schemas or None

    def rollout(self, rows, group_size, *seed_parts, keys=None) -> RolloutStart:
        batch = VerifiersRollout(self.driver, rows, group_size, self.renderer, self.max_calls)
        prompts = batch.start()
        firsts = [prompts[g * group_size] for g in range(len(rows))]
        return RolloutStart(firsts, batch, batch.environments, list(rows))

    def sampled(self, rollout: Any, handler: Any, resample: Any = None) -> None:
        """After sampling: the rows the budget stopped mid-turn answer with their last turn's
        text, the environments finish and the groups are scored (no branches: a rewritten
        history is one line)."""
        if not isinstance(handler, VerifiersRollout):
            return None
        cut = {}
        sampled = rollout.loss_mask & rollout.mask  # (N, T)
        for row in handler.pending:
            fed = (~rollout.loss_mask[row] & rollout.mask[row]).nonzero()
            start = int(fed[-1]) + 1 if len(fed) else 0
            ids = rollout.completion_ids[row, start:][sampled[row, start:]].tolist()
            cut[row] = self.renderer.tokenizer.decode(ids, skip_special_tokens=True)
        handler.finish(cut)
        return None


def verifiers_use(task: Task, tokenizer: Any, end_ids: Sequence[int], max_calls: int,
                  model: str = "the model") -> VerifiersUse:  # fmt: skip
    """The tool use of a verifiers task (see `VerifiersUse`)."""
    driver = task.driver
    renderer = Renderer(tokenizer, driver.tool_schemas(), end_ids, model)
    return VerifiersUse(handler=None, environment=None, chat=True, driver=driver,
                        renderer=renderer, max_calls=max_calls)  # fmt: skip
