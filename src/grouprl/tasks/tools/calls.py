"""Tools a policy calls while it writes: loading them, the tags call format, running them.

A tool is a typed Python function with a Google-style docstring, as TRL's `tools=[...]` takes
them, sync or `async def`; `--tools path/tools.py:fn` (or `package.module:fn`, or the name of a
tool the task ships) loads it like a reward file.

The tags format (`--tool-format tags`), for base and character-level models: a call is
`<NAME>ARGS</NAME>`; its closing tag ends the model's turn, and the observation follows as
plain text, encoded once by the tokenizer and fed to the model (see `grouprl.rollout.turns`).
ARGS map to the function's parameters:

- a JSON object (`<add>{"a": 2, "b": 3}</add>`): keyword arguments, as JSON gives them;
- otherwise comma-separated values (`<add>2, 3</add>`), positional, each stripped and converted
  by its parameter's annotation (int, float, bool as true/false/1/0, str; no annotation: str);
- nothing: no arguments.

Every complete call in a turn runs, in order; their observations are joined. A call inside an
unclosed `<think>` is not run: decoding just goes on. A call that cannot be parsed, names no
known tool, does not bind to the function's signature, raises, or runs out of time becomes an
error observation (`error: ...`), is counted as a failure, and never stops the run. After
`max_calls` calls in a trajectory a further call ends the trajectory instead (0: tools are
available to the format but never run).

How tools run: inside the decode loop, in the main process, when a row closes a call: every
row's calls of that decode step together, sync tools one after another and `async` ones
concurrently in one event loop, while the other rows wait for that step. An environment's
methods run with their rollout's global-random stream swapped in
(`grouprl.tasks.randomness`), its async ones one at a time, each in its own event loop (the
stream is process-wide state: interleaved coroutines would draw from each other's). Each call has
`timeout` seconds: sync tools through the same SIGALRM timer as reward functions (the main
thread's, which is where the decode loop runs), async tools through the event loop's timeout
as well. Nothing is evaluated: arguments are parsed, never `eval`'d.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import difflib
import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from grouprl.errors import UserError
from grouprl.messages import Observation, ToolRequest
from grouprl.tasks.base import TimeLimitExceeded, time_limit
from grouprl.tasks.live import is_live, live_name, live_object
from grouprl.tasks.specs import is_file_spec

#: Seconds a tool call may take before it returns an error observation.
TOOL_TIMEOUT = 10.0
#: What marks an observation cut at `max_response_tokens`.
TRUNCATED = "..."


@dataclass(frozen=True)
class Tool:
    """A function the policy may call by name; an environment's method carries its rollout's
    random stream (`grouprl.tasks.randomness`), swapped in while it runs."""

    name: str
    fn: Callable[..., Any]
    stream: Any = None  # a RandomStream, or None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    @property
    def signature(self) -> inspect.Signature:
        """The function's signature, string annotations (`from __future__ import annotations`)
        resolved where they can be."""
        try:
            return inspect.signature(self.fn, eval_str=True)
        except Exception:  # an annotation that names something not importable: keep the text
            return inspect.signature(self.fn)


def load_tool(spec: str, builtin: dict[str, Callable[..., Any]] | None = None) -> Tool:
    """The tool a spec names: a task's own tool by name, path/to/tools.py:fn, or module:fn."""
    from grouprl.tasks.loading import import_file, import_function, load_attribute

    if is_live(spec):
        return Tool(live_name(spec), live_object(spec, "tool"))
    if builtin and spec in builtin:
        return Tool(spec, builtin[spec])
    if is_file_spec(spec):
        path_text, _, attr = spec.rpartition(":")
        path = Path(path_text).expanduser()
        if not path.is_file():
            raise UserError(f"tool file {path} does not exist (from --tools {spec})")
        fn = load_attribute(import_file(path, "tool"), attr, str(path))
    else:
        module_name, sep, attr = spec.rpartition(":")
        if not (sep and module_name and attr):
            known = sorted(builtin or {})
            close = difflib.get_close_matches(spec, known, n=1)
            hint = f"did you mean {close[0]!r}? Or give" if close else "give"
            raise UserError(
                f"unknown tool {spec!r}; {hint} a file and function (path/to/tools.py:fn), a "
                f"module and function (package.module:fn){', or one of ' if known else ''}"
                f"{', '.join(known)}"
            )
        fn = import_function(module_name, attr, spec, "tool")
    name = getattr(fn, "__name__", attr)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise UserError(f"tool {spec!r}: its name {name!r} cannot be a tag; name the function")
    return Tool(name, fn)


def load_tools(
    specs: Sequence[str], builtin: dict[str, Callable[..., Any]] | None = None
) -> list[Tool]:
    tools = [load_tool(spec, builtin) for spec in specs]
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"two tools are named {twice[0]!r}; a call names its tool, so rename one")
    return tools


@dataclass(frozen=True)
class Call:
    """A parsed call: the tool's name and its argument text."""

    name: str
    args: str
    error: str | None = None  # a call that could not be parsed: what was wrong with it


def _converted(value: str, annotation: Any) -> Any:
    if annotation in (inspect.Parameter.empty, str, Any, "str"):
        return value
    if annotation in (int, "int"):
        return int(value)
    if annotation in (float, "float"):
        return float(value)
    if annotation in (bool, "bool"):
        lowered = value.lower()
        if lowered in ("true", "1"):
            return True
        if lowered in ("false", "0"):
            return False
        raise ValueError(f"{value!r} is not true or false")
    return value  # another annotation: given as text


def bind(tool: Tool, args: str) -> inspect.BoundArguments:
    """ARGS of a tags call bound to the tool's signature (see the module docstring); ValueError
    or TypeError, with a message for the error observation, when they do not fit."""
    signature, text = tool.signature, args.strip()
    if text.startswith("{"):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"arguments are not valid JSON ({err.msg})") from None
        if not isinstance(values, dict):
            raise ValueError("JSON arguments must be an object")
        return signature.bind(**values)
    parts = [p.strip() for p in text.split(",")] if text else []
    params = [p for p in signature.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    if len(parts) > len(params):
        raise TypeError(f"takes {len(params)} argument(s), got {len(parts)}")
    return signature.bind(*(_converted(v, p.annotation) for v, p in zip(parts, params)))


def describe(tool: Tool) -> str:
    """`name(a: int, b: int)`: how an error observation names what a tool takes."""
    return f"{tool.name}{tool.signature}".split(" ->")[0]


def run_calls(calls: Sequence[tuple[Tool | None, Call]], timeout: float) -> list[tuple[str, bool]]:
    """Run calls (a None tool: an unknown name) and return (observation text, failed) for each,
    in order: sync tools one after another, async ones concurrently."""
    out: list[tuple[str, bool] | None] = [None] * len(calls)
    pending: dict[int, Any] = {}
    for i, (tool, call) in enumerate(calls):
        if call.error is not None:
            out[i] = (f"error: {call.error}", True)
            continue
        if tool is None:
            out[i] = (f"error: no tool named {call.name!r}", True)
            continue
        try:
            bound = bind(tool, call.args)
        except (TypeError, ValueError) as err:
            out[i] = (f"error: {describe(tool)}: {err}", True)
            continue
        if tool.is_async and tool.stream is None:
            pending[i] = (tool, bound)
            continue
        with _stream(tool):
            out[i] = _run_one(tool, bound, timeout)
    if pending:
        for i, result in _run_async(pending, timeout).items():
            out[i] = result
    return [o for o in out if o is not None]


def _stream(tool: Tool) -> contextlib.AbstractContextManager:
    """The tool's random stream swapped in, if it has one."""
    return tool.stream.swapped() if tool.stream is not None else contextlib.nullcontext()


def _run_one(tool: Tool, bound: inspect.BoundArguments, timeout: float) -> tuple[str, bool]:
    """One call on its own: a sync tool under the time limit; an async one (an environment's,
    which runs one at a time while its rollout's stream is swapped in) in an event loop of its
    own."""
    if tool.is_async:
        return _run_async({0: (tool, bound)}, timeout)[0]
    try:
        with time_limit(timeout):
            return _text(tool.fn(*bound.args, **bound.kwargs)), False
    except TimeLimitExceeded:
        return f"error: {tool.name} did not return within {timeout:g} s", True
    except Exception as err:  # a tool's failure is the model's observation, never a crash
        return f"error: {tool.name} raised {type(err).__name__}: {err}", True


def _run_async(pending: dict[int, Any], timeout: float) -> dict[int, tuple[str, bool]]:
    async def one(tool: Tool, bound: inspect.BoundArguments) -> tuple[str, bool]:
        try:
            value = await asyncio.wait_for(tool.fn(*bound.args, **bound.kwargs), timeout)
            return _text(value), False
        except asyncio.TimeoutError:
            return f"error: {tool.name} did not return within {timeout:g} s", True
        except Exception as err:
            return f"error: {tool.name} raised {type(err).__name__}: {err}", True

    async def all_of() -> list[tuple[str, bool]]:
        return await asyncio.gather(*(one(tool, bound) for tool, bound in pending.values()))

    try:
        with time_limit(timeout + 1.0):  # a tool that blocks the event loop itself
            results = asyncio.run(all_of())
    except TimeLimitExceeded:
        results = [(f"error: {t.name} did not return within {timeout:g} s", True)
                   for t, _ in pending.values()]  # fmt: skip
    return dict(zip(pending, results, strict=True))


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


class ToolHandler:
    """The sampler's `TurnHandler` (see `grouprl.rollout.turns`) for one call format: finds a
    turn's calls (`calls`), runs them with the row's tools, and answers with the observation's
    ids (`observation`); the formats differ only in those two and in what ends a turn.

    With an environment (`grouprl.tasks.tools.environments`) each row has its own tools, the bound
    methods of its instance (`row_tools`), and, for games played a whole turn at a time, its
    `step` (`steps`): a turn that ends with no call in it is the action, and what `step`
    returns is the next observation (None: the episode is over). Tool calls and steps both
    count against `max_calls`.
    """

    closers: ClassVar[list[str]] = []
    keeps_content = False  # transcripts show the tool's text (True) or the decoded ids fed

    def __init__(
        self,
        tools: Sequence[Tool],
        tokenizer: Any,
        *,
        max_calls: int,
        max_response_tokens: int | None = None,
        timeout: float = TOOL_TIMEOUT,
    ) -> None:
        self.tools = {t.name: t for t in tools}
        self.tokenizer = tokenizer
        self.max_calls = max_calls
        self.max_response_tokens = max_response_tokens
        self.timeout = timeout
        self.row_tools: list[dict[str, Tool]] | None = None
        self.steps: list[Callable[[str], str | None]] | None = None
        self.environments: list[Any] | None = None
        self._marker = tokenizer(TRUNCATED, add_special_tokens=False)["input_ids"]

    @property
    def ends_turns(self) -> bool:
        """Whether the sampler asks at every turn end (EOS, a stop string), not only at closers."""
        return self.steps is not None

    def for_rollout(
        self,
        row_tools: list[dict[str, Tool]] | None,
        steps: list[Callable[[str], str | None]] | None,
        environments: list[Any] | None = None,
    ) -> ToolHandler:
        """This handler for one rollout whose rows have their own tools and steps (the bound
        methods of `environments`, one per row, which the rollout's record then carries)."""
        bound = copy.copy(self)
        bound.steps, bound.environments = steps, environments
        bound.row_tools = None if row_tools is None else [{**self.tools, **r} for r in row_tools]
        return bound

    # what a format defines
    def calls(self, text: str) -> list[Call]:
        raise NotImplementedError

    def observation(self, results: Sequence[tuple[str, str]]) -> list[int]:
        """The ids that follow a turn's calls: (tool name, result text) for each."""
        raise NotImplementedError

    def user_turn(self, text: str) -> list[int]:
        """The ids that follow a turn an environment's `step` answered with `text`."""
        raise NotImplementedError

    def respond(self, requests: Sequence[ToolRequest]) -> list[Observation]:
        plans: list[tuple[list[Call], bool]] = []  # the calls each row runs; ended by the limit
        for request in requests:
            calls = self.calls(request.text)
            room = self.max_calls - request.calls_made
            plans.append((calls[: max(room, 0)], len(calls) > room))
        flat = []
        for request, (calls, _) in zip(requests, plans):
            tools = self.tools if self.row_tools is None else self.row_tools[request.row]
            flat += [(tools.get(c.name), c) for c in calls]
        results = iter(run_calls(flat, self.timeout))
        out = []
        for request, (calls, over) in zip(requests, plans, strict=True):
            if calls:
                done = [next(results) for _ in calls]
                named = [(c.name, self._cut(t)) for c, (t, _) in zip(calls, done)]
                messages = [{"role": "tool", "name": name, "content": text, "error": failed}
                            for (name, text), (_, failed) in zip(named, done)]  # fmt: skip
                failures = sum(failed for _, failed in done)
                out.append(
                    Observation(
                        self.observation(named), messages, calls=len(calls), failures=failures
                    )
                )
            elif over:  # a call past the limit of calls ends the trajectory
                out.append(Observation(end=True, over_limit=True))
            elif request.at_end and self.steps is not None:
                out.append(self._step(request))
            else:  # nothing to run (inside <think>), or a final answer: as the turn ends
                out.append(Observation())
        return out

    def _step(self, request: ToolRequest) -> Observation:
        """An environment's `step` on a turn that ended without a call."""
        assert self.steps is not None
        if request.calls_made >= self.max_calls:
            return Observation(end=True, over_limit=True)
        step = self.steps[request.row]
        try:
            with time_limit(self.timeout):
                reply = step(request.text)
        except TimeLimitExceeded:
            raise UserError(
                f"environment step did not return within {self.timeout:g} s; make it faster "
                "or raise --tool-timeout"
            ) from None
        except Exception as err:
            raise UserError(
                f"environment step raised {type(err).__name__}: {err}; fix the environment "
                "(step(text) returns the next observation, or None to end the episode)"
            ) from None
        if reply is None:
            return Observation(end=True, steps=1)
        text = self._cut(_text(reply))
        return Observation(self.user_turn(text), [{"role": "user", "content": text}], steps=1)

    def _cut(self, text: str) -> str:
        """A result as the observation shows it (the chat format cuts long ones here)."""
        return text

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


class PlainTurns(ToolHandler):
    """Plain text turns and no tools: an environment played through `step` alone, its
    observations encoded as they are."""

    def __init__(self, tokenizer: Any, **limits: Any) -> None:
        super().__init__([], tokenizer, **limits)

    def calls(self, text: str) -> list[Call]:
        return []

    def observation(self, results: Sequence[tuple[str, str]]) -> list[int]:
        return self._observed("".join(text for _, text in results))

    def user_turn(self, text: str) -> list[int]:
        return self._observed(text)

    def _observed(self, text: str) -> list[int]:
        """Text's ids, encoded once; cut at `max_response_tokens` with `TRUNCATED`."""
        ids = self._encode(text)
        limit = self.max_response_tokens
        if limit is not None and len(ids) > limit:
            keep = max(0, limit - len(self._marker))
            ids = ids[:keep] + self._marker[: limit - keep]
        return ids


class TagTools(PlainTurns):
    """The tags format (see the module docstring)."""

    def __init__(self, tools: Sequence[Tool], tokenizer: Any, **limits: Any) -> None:
        if not tools:
            raise ValueError("TagTools needs at least one tool")
        ToolHandler.__init__(self, tools, tokenizer, **limits)
        self.closers = [f"</{name}>" for name in self.tools]
        names = "|".join(re.escape(n) for n in self.tools)
        self._call = re.compile(rf"<({names})>(.*?)</\1>", re.DOTALL)

    def calls(self, text: str) -> list[Call]:
        """The complete calls of a turn, in order, leaving out those inside an unclosed
        `<think>` (one opened before the call and not closed before it)."""
        found = []
        for match in self._call.finditer(text):
            before = text[: match.start()]
            if before.rfind("<think>") > before.rfind("</think>"):
                continue
            found.append(Call(match.group(1), match.group(2)))
        return found
