"""Agent programs as rollouts: `--agent file.py:function` (`agent=` in the Python API).

An agent program is an async function `agent(client, row)`: `client` an `openai.AsyncOpenAI`
pointed at grouprl's endpoint, `row` the dataset row. It returns the episode's reward (a number;
or a list, one reward per turn, each request the model answered being a turn, which
`--adv-estimator process` credits turn by turn), or None and the run's reward functions score
its conversation (TRL's convention). A function
that also takes `model=` is given the name the endpoint serves (requests for another model are
refused).

How a rollout runs. Each of a batch's rows is played by G episodes, each an `agent` call on an
event loop of the batch's own, each with its own client (its base URL names the episode; its
transport calls the endpoint in-process, while the server on 127.0.0.1 answers clients the
agent makes itself). Every episode's requests wait until every live episode waits on the model
or is done; then the sampler answers all of them in one decode loop (a batch is formed by that
rule, never by arrival time, so a deterministic agent gives a run that is a function of its
seed). Exactness:

- An episode's first request is its group's prompt (rendered by the chat template with the
  request's tools; a completion's prompt string or the token route's ids as given), prefilled
  once for the group's G episodes, which must therefore ask the same first request.
- A turn ends at the model's end-of-turn token or, on the completions and token routes, at a
  stop string (`stop=`, the same in every request of the batch; the answer's text ends before
  it unless `include_stop_str_in_output`, the trajectory keeps its ids); its text (with the calls in it parsed in the
  template's convention into OpenAI `tool_calls`) answers the request.
- The next request must extend the conversation (the messages up to the last turn as they were
  sent and answered, the same tools; for completions, the prompt so far and the answer's text;
  for token ids, every id so far): only what it adds is rendered (after the model's end-of-turn
  token, up to the next assistant header) and fed into the row's running cache. Nothing sampled
  is encoded again: the ids trained on are the ids sampled and fed.
- A request that rewrites an earlier turn (its rendering does not extend the ids so far: a
  template that drops earlier reasoning, an agent that edits its history) splits the
  trajectory: its row ends where it is, and the episode goes on in a row of its own whose prompt
  is the request as rendered, sampled after the batch's rows (a branch, counted:
  `agent_prefix_breaks`). Each row is exact; a branch is trained with the advantage of the
  episode (its reward, normalised in its group with the group's first rows) as a sequence of
  its own, and never normalised or scored on its own. Where no branch can be sampled (a caller
  that gives no `resample`), the request is refused with HTTP 409 and the trajectory ends.
- The budget (`--max-new-tokens`) counts a row: the turn it cuts is answered with
  `finish_reason` "length", and a request after it is refused (HTTP 400). A branch row has a
  budget of its own; `--max-turns` counts the episode's turns over all its rows.

An episode whose agent raises is scored as failed (reward 0, the traceback in the log once per
run); one that neither asks nor finishes within `--agent-timeout` seconds is ended and scored as
failed, in one line. A step whose episodes all failed ends the run in one line.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from grouprl.endpoint.server import Endpoint, in_process_transport
from grouprl.endpoint.wire import Answer, Request, Sampling, WireError, before_stop
from grouprl.errors import UserError
from grouprl.messages import Observation, ToolRequest
from grouprl.tasks.live import is_live, live_object
from grouprl.tasks.tools.rendering import Renderer, conversation_key, extension, message_dict


def _say(message: str) -> None:
    """A warning line in the run's log (stderr, where the run's own warnings go)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


#: Seconds an episode may run between two requests (`--agent-timeout`).
AGENT_TIMEOUT = 300.0


def load_agent(spec: str) -> Callable:
    """The async function `spec` names: path/to/agent.py:function, package.module:function, or
    a live object (the Python API's `agent=`)."""
    from grouprl.tasks.loading import import_file, import_function, load_attribute

    if is_live(spec):
        fn = live_object(spec, "agent")
    else:
        where, _, attr = spec.rpartition(":")
        if not where or not attr:
            raise UserError(f"--agent {spec!r}: give a file and function "
                            "(path/to/agent.py:run) or a module and function")  # fmt: skip
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise UserError(f"agent file {path} does not exist (from --agent {spec})")
            fn = load_attribute(import_file(path, "agent"), attr, str(path))
        else:
            fn = import_function(where, attr, spec, "agent")
    if not inspect.iscoroutinefunction(fn):
        raise UserError(f"--agent {spec}: {getattr(fn, '__name__', fn)!r} is not an async "
                        "function; define it `async def agent(client, row)`")  # fmt: skip
    return fn


@dataclass
class AgentResult:
    """An episode's outcome, which reward functions receive as `environments`."""

    value: Any = None  # what the agent returned
    failed: str | None = None  # why the episode failed (raised, timed out), or None
    messages: list[dict] | None = None  # its chat conversation, with the model's last turn
    requests: int = 0
    prefix_breaks: int = 0

    @property
    def reward(self) -> float | list[float | None] | None:
        """The agent's reward: what it returned (a number, or a list: one per turn), 0 when it
        failed, None when it returned none."""
        if self.failed is not None:
            return 0.0
        return self.value


def agent_reward(completions, environments, **_) -> list[float | list[float | None] | None]:
    """The reward each agent episode returned (0 for a failed one; None: it returned none; a
    list: its rewards per turn)."""
    return [r.reward for r in environments]


def _count(name: str, of: Callable[[AgentResult], float]):
    def metric(completions, environments, **_) -> list[float]:
        return [of(r) for r in environments]

    metric.__name__ = name
    return metric


#: What an agent run logs of its episodes (weight 0: reported, not rewarded).
METRICS = {
    "agent_failed": _count("agent_failed", lambda r: float(r.failed is not None)),
    "agent_requests": _count("agent_requests", lambda r: float(r.requests)),
    "agent_prefix_breaks": _count("agent_prefix_breaks", lambda r: float(r.prefix_breaks)),
}


@dataclass(eq=False)
class _Episode:
    """One completion row's episode."""

    row: int
    key: str
    result: AgentResult = field(default_factory=AgentResult)
    task: asyncio.Task | None = None
    pending: tuple[Request, asyncio.Future] | None = None
    kind: str | None = None  # chat, completion or tokens: its first request's
    renderer: Renderer | None = None  # chat: the template with the episode's tools
    messages: list[dict] | None = None  # chat: the conversation so far, the model's turn last
    text: str | None = None  # completion: the prompt so far and the answers
    context: list[int] | None = None  # tokens: every id so far
    ended: str | None = None  # why its trajectory ended (a request after it is refused)
    since: float = 0.0  # when it last asked or was answered (monotonic)
    branch: list[int] | None = None  # a rewritten request's rendering, waiting for its row
    carried: int = 0  # the turns its earlier rows made (--max-turns counts them all)
    where: str = ""  # what its rewritten request rewrote


@dataclass
class AgentSettings:
    """What every batch of an agent run shares."""

    agent: Callable
    tokenizer: Any
    end_ids: tuple[int, ...]
    sampling: Sampling
    served: str
    timeout: float = AGENT_TIMEOUT
    port: int = 0
    max_calls: int = 10
    max_model_len: int | None = None
    model: str = "the model"


class AgentRollout:
    """One batch of agent episodes (rows, each played `group_size` times) on an event loop of
    their own, the endpoint's backend and the sampler's `TurnHandler` (see the module
    docstring). `start` runs every episode to its first request; `respond` answers turns;
    `finish` (after sampling) answers the turns the budget cut and runs what is left."""

    closers: list[str]  # the stop strings of the episodes' first requests (completions, ids)
    ends_turns = True
    keeps_content = True
    wants_turn_ids = True
    serial: ClassVar[int] = 0

    def __init__(self, settings: AgentSettings, rows: Sequence[dict], group_size: int,
                 warned: set[str]) -> None:  # fmt: skip
        self.s, self.rows, self.G, self.warned = settings, list(rows), group_size, warned
        self.tokenizer = settings.tokenizer
        self.served, self.sampling = settings.served, settings.sampling
        self.max_model_len = settings.max_model_len
        AgentRollout.serial += 1
        tag = f"{AgentRollout.serial}"
        self.episodes = [_Episode(r, f"{tag}-{r}") for r in range(len(self.rows) * group_size)]
        self.by_key = {e.key: e for e in self.episodes}
        self.results = [e.result for e in self.episodes]
        self.live = list(self.episodes)  # the episode of each row the sampler samples now
        self.environments = self.results  # the rows' (a branch rollout's: its episodes')
        self.loop = asyncio.new_event_loop()
        self.endpoint = Endpoint(self, settings.port)
        self._renderer: Renderer | None = None
        self.closers = []

    # --- the endpoint's backend
    async def answer(self, episode: str | None, request: Request) -> Answer:
        ep = self.by_key.get(episode or "")
        if ep is None:
            raise WireError(404, f"no live episode {episode!r}: each episode's client names it "
                            "in its base URL (…/e/EPISODE/v1) or the X-Episode-ID header",
                            "not_found_error")  # fmt: skip
        if ep.pending is not None:
            raise WireError(409, "this episode has a request waiting: send one request at a "
                            "time per episode (each is its next turn)")  # fmt: skip
        if ep.ended is not None:
            raise WireError(400, ep.ended)
        if ep.kind is not None and request.kind != ep.kind:
            raise WireError(400, f"this episode asked on the {ep.kind} route first; its turns "
                            "are one trajectory, so ask every turn on the same route")  # fmt: skip
        if ep.kind is not None and request.stop != self.closers:
            raise WireError(400, f"stop={request.stop}: this batch's turns end at the stop "
                            f"strings its episodes' first requests named ({self.closers}); "
                            "give every request of an episode the same stop=")  # fmt: skip
        if ep.kind is None and request.kind == "chat":
            self._check_chat(request)
        future = self.loop.create_future()
        ep.pending, ep.since = (request, future), time.monotonic()
        ep.result.requests += 1
        return await future

    def _check_chat(self, request: Request) -> None:
        """Refuse a chat request the model's template cannot render: no template, or tools=
        with a template that renders no tool calls."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise WireError(400, f"{self.s.model} has no chat template, so chat requests cannot "
                            "be rendered; ask on /v1/completions (client.completions.create) "
                            "with a prompt string")  # fmt: skip
        if request.tools:
            try:
                self.renderer().with_tools(request.tools)
            except UserError:
                raise WireError(400, f"tools=: the chat template of {self.s.model} renders no "
                                "tool calls (neither Hermes/Qwen2.5 <tool_call> blocks nor "
                                "Llama-3.1 ipython turns); ask without tools=, or train a model "
                                "whose template renders them") from None  # fmt: skip

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]

    # --- the episodes
    async def _play(self, ep: _Episode, client: Any) -> None:
        row = self.rows[ep.row // self.G]
        kwargs = {"model": self.served} if _takes_model(self.s.agent) else {}
        try:
            ep.result.value = _reward_value(await self.s.agent(client, dict(row), **kwargs))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            ep.result.failed = f"{type(err).__name__}: {err}"
            if "raised" not in self.warned:
                self.warned.add("raised")
                _say("an agent episode raised (scored as failed; later ones are only counted: "
                     f"agent_failed):\n{traceback.format_exc().rstrip()}")  # fmt: skip
        finally:
            await client.close()

    def _client(self, ep: _Episode) -> Any:
        import httpx
        import openai

        # the endpoint in-process: no socket, no HTTP parsing (the server on 127.0.0.1 answers
        # the same for clients an agent makes itself)
        http = httpx.AsyncClient(transport=in_process_transport(self.endpoint), trust_env=False,
                                 timeout=None)  # fmt: skip
        return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.endpoint.port}/e/{ep.key}/v1",
                                  api_key="grouprl", max_retries=0, http_client=http)  # fmt: skip

    def start(self) -> list[list[int]]:
        """Every episode to its first request; each group's prompt ids."""
        self._run(self.endpoint.start())
        for ep in self.episodes:
            ep.since = time.monotonic()
            ep.task = self.loop.create_task(self._play(ep, self._client(ep)))
        try:
            self._settle(self.episodes)
            return self._prompts()
        except BaseException:
            self.close()
            raise

    def _prompts(self) -> list[list[int]]:
        prompts = []
        for g in range(len(self.rows)):
            group = self.episodes[g * self.G : (g + 1) * self.G]
            asked = [ep for ep in group if ep.pending is not None]
            if len(asked) < len(group):
                why = next(ep.result.failed for ep in group if ep.pending is None)
                raise UserError(
                    f"agent episode {group[0].row + len(asked)} ended before asking the model "
                    f"anything ({why or 'it returned'}); an agent's episode asks the model first"
                )
            ids = [self._first(ep, ep.pending[0]) for ep in group]
            if any(i != ids[0] for i in ids[1:]):
                raise UserError(
                    "the agent asked the model differently in the episodes of one group (row "
                    f"{g}); a group shares its prompt (prefilled once), so an episode's first "
                    "request must depend on its row only, not on chance"
                )
            prompts.append(ids[0])
        stops = {tuple(ep.pending[0].stop) for ep in self.episodes}
        if len(stops) > 1:
            raise UserError(
                "the agent's first requests name different stop strings "
                f"({' and '.join(repr(list(s)) for s in sorted(stops))}); a batch's turns end "
                "at one set of stop strings, so give every episode the same stop="
            )
        self.closers = list(stops.pop())
        return prompts

    def _first(self, ep: _Episode, request: Request) -> list[int]:
        ep.kind = request.kind
        if request.kind == "chat":
            ep.renderer = self.renderer().with_tools(request.tools)
            ep.messages = [message_dict(m) for m in request.messages]
            ids = ep.renderer.prompt_ids(ep.messages)
        elif request.kind == "completion":
            ep.text = request.prompt
            ids = self.tokenizer(request.prompt)["input_ids"]
        else:
            ids = list(request.token_ids)
        ep.context = list(ids)
        return ids

    def renderer(self) -> Renderer:
        if self._renderer is None:
            self._renderer = Renderer(self.tokenizer, None, self.s.end_ids, self.s.model)
        return self._renderer

    # --- the sampler's side
    def respond(self, requests: Sequence[ToolRequest]) -> list[Observation]:
        resumed = []
        for q in requests:
            ep = self.live[q.row]
            if ep.pending is None:  # done with its model (it will not ask again)
                continue
            request, future = ep.pending
            ep.pending = None
            future.set_result(self._answer(ep, request, q.ids, q.logps, q.text, "stop"))
            resumed.append(ep)
        self._settle(resumed)
        out = []
        for q in requests:
            ep = self.live[q.row]
            if ep not in resumed or ep.pending is None:
                ep.ended = ep.ended or "the episode's trajectory has ended"
                out.append(Observation(end=True))
                continue
            if q.calls_made + ep.carried >= self.s.max_calls:  # answered empty: "length"
                ep.ended = (f"the episode made as many turns as a trajectory may "
                            f"(--max-turns {self.s.max_calls}); end the episode")  # fmt: skip
                request, future = ep.pending
                ep.pending = None
                future.set_result(self._answer(ep, request, [], [], "", "length"))
                out.append(Observation(end=True, over_limit=True, empty_turn=True))
                continue
            fed = self._feed(ep, ep.pending[0])
            if fed is None:  # a branch: the row ends, the episode goes on in a row of its own
                ep.carried += q.calls_made + 1  # the turn this request answers counts
                out.append(Observation(end=True))
                continue
            ids, messages, calls = fed
            out.append(Observation(ids, messages, calls=calls, steps=0 if calls else 1))
        return out

    def _answer(self, ep: _Episode, request: Request, ids: Sequence[int],
                logps: Sequence[float], text: str, finish: str) -> Answer:  # fmt: skip
        """The answer to `request`: the turn's ids, log-probs and text; the episode's record
        extended by it."""
        before = len(ep.context)
        ep.context = [*(request.token_ids or ep.context), *ids] if ep.kind == "tokens" else (
            [*ep.context, *ids])  # fmt: skip
        message = None
        if ep.kind == "chat":
            message = ep.renderer.assistant(text)
            ep.messages = [*(message_dict(m) for m in request.messages), message]
            if message.get("tool_calls") and finish == "stop":
                finish = "tool_calls"
        elif ep.kind == "completion":
            ep.text = request.prompt + text  # as sampled: with the stop string that ended it
        ids, logps = list(ids), list(logps)
        if ep.kind != "tokens" and ids and ids[-1] in self.s.end_ids:  # not in the text
            ids, logps = ids[:-1], logps[:-1]
        text = before_stop(text, request.stop, request.include_stop)
        ep.since = time.monotonic()
        return Answer(ids, logps, text, finish, message, prompt_tokens=before)

    def _feed(self, ep: _Episode, request: Request) -> tuple[list[int], list[dict], int] | None:
        """What `request` adds to the episode's trajectory: the ids to feed, the turn as the
        transcript shows it, and the calls the model's last turn made; None where it rewrites
        the trajectory (the request refused, its trajectory ended, counted)."""
        calls = 0
        if ep.kind == "chat":
            new = [message_dict(m) for m in request.messages]
            tail = extension(ep.messages, new)
            same_tools = (request.tools or []) == ep.renderer.schemas
            if tail is None or not same_tools:
                renderer = self.renderer().with_tools(request.tools)
                where = _where(ep.messages, new) if same_tools else "its tools"
                return self._broken(ep, where, renderer.prompt_ids(new), renderer)
            calls = len(ep.messages[-1].get("tool_calls") or [])
            ids = ep.renderer.tail(ep.messages[-1], tail)
            ep.context.extend(ids)
            return ids, tail, calls
        if ep.kind == "completion":
            if not request.prompt.startswith(ep.text):
                return self._broken(
                    ep, "the prompt so far", self.tokenizer(request.prompt)["input_ids"]
                )
            added = request.prompt[len(ep.text) :]
            ids = self.tokenizer(added, add_special_tokens=False)["input_ids"]
            ep.context.extend(ids)
            return ids, [{"role": "user", "content": added}], 0
        given = list(request.token_ids)
        if given[: len(ep.context)] != ep.context:
            return self._broken(ep, "the ids so far", given)
        ids = given[len(ep.context) :]
        ep.context = given
        return ids, [{"role": "user", "content": self.tokenizer.decode(ids)}], 0

    def _broken(self, ep: _Episode, where: str, ids: list[int],
                renderer: Renderer | None = None) -> None:  # fmt: skip
        """`ep`'s pending request rewrites its trajectory (`where`): its row ends; the request,
        rendered as `ids`, waits for a row of its own (`branches`). Counted."""
        ep.result.prefix_breaks += 1
        ep.branch, ep.where = list(ids), where
        if renderer is not None:
            ep.renderer = renderer
        if "broken" not in self.warned:
            self.warned.add("broken")
            _say(f"an agent rewrote an earlier turn ({where}); its trajectory goes on in a row "
                 "of its own (counted: agent_prefix_breaks)")  # fmt: skip
        return None

    def branches(self) -> list[list[int]]:
        """The rows the sampler samples next: the episodes whose request rewrote their
        trajectory, each from that request's rendering (their prompts; [] when none)."""
        todo = [ep for ep in self.episodes if ep.branch is not None and ep.pending is not None]
        prompts = []
        for ep in todo:
            ep.context, ep.branch = ep.branch, None
            prompts.append(list(ep.context))
        if todo:
            self.live = todo
            self.environments = [ep.result for ep in todo]
        return prompts

    def refuse_branches(self) -> None:
        """Where no branch can be sampled: the rewritten requests refused (HTTP 409), their
        trajectories ended."""
        for ep in self.episodes:
            if ep.branch is None or ep.pending is None:
                continue
            ep.branch, ep.ended = None, "the episode's trajectory ended at its rewritten request"
            _, future = ep.pending
            ep.pending = None
            future.set_exception(WireError(409, (
                f"this request rewrites {ep.where} (not as sent and answered before): grouprl "
                "trains on the ids it sampled and fed, turn by turn, so this episode's "
                "trajectory ends here; send earlier turns back as the server returned them")))  # fmt: skip

    def cut(self, cut: dict[int, tuple[list[int], list[float], str]]) -> None:
        """After a sampling call: the episodes of its rows waiting on a turn the budget cut get
        it (`cut`: row -> its ids, log-probs and text) with finish_reason "length"; their
        trajectories end (a further request is refused, one that rewrote it waits for its
        branch)."""
        spent = ("the episode's token budget (--max-new-tokens counts the whole trajectory) "
                 "is spent; end the episode")  # fmt: skip
        answered = []
        for row, ep in enumerate(self.live):
            if ep.branch is not None:
                continue
            ep.ended = ep.ended or spent
            if ep.pending is not None:
                request, future = ep.pending
                ep.pending = None
                ids, logps, text = cut.get(row, ([], [], ""))
                future.set_result(self._answer(ep, request, ids, logps, text, "length"))
                answered.append(ep)
        self._settle(answered)

    def finish(self) -> list[AgentResult]:
        """Every episode to its end (a further request is refused); the results."""
        self.refuse_branches()
        for ep in self.episodes:
            ep.ended = ep.ended or "the episode's trajectory has ended"
        self._settle(self.episodes, to_end=True)
        for ep in self.episodes:
            ep.result.messages = ep.messages
        self.close()
        failed = [r.failed for r in self.results if r.failed is not None]
        if len(failed) == len(self.results):
            raise UserError(f"every agent episode of this batch failed; the first: {failed[0]}")
        return self.results

    def close(self) -> None:
        """Cancel what still runs, stop the server, close the loop."""
        if self.loop.is_closed():
            return
        tasks = [ep.task for ep in self.episodes if ep.task is not None and not ep.task.done()]
        for task in tasks:
            task.cancel()
        for ep in self.episodes:  # the server's handlers of requests never answered
            if ep.pending is not None:
                ep.pending[1].cancel()
                ep.pending = None

        async def drain() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.endpoint.close()

        self._run(drain())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    # --- the event loop
    def _run(self, awaitable: Any) -> Any:
        asyncio.set_event_loop(self.loop)
        try:
            return self.loop.run_until_complete(awaitable)
        finally:
            asyncio.set_event_loop(None)

    def _settle(self, eps: Sequence[_Episode], *, to_end: bool = False) -> None:
        """Run the episodes until each of `eps` waits on the model or is done (`to_end`: is
        done). One that does neither within the timeout is ended as failed, in one line."""

        def waiting() -> list[_Episode]:
            return [ep for ep in eps if not ep.task.done()
                    and (to_end or ep.pending is None)]  # fmt: skip

        async def wait() -> None:
            spins = 0
            while True:
                left = waiting()
                if not left:
                    return
                now = time.monotonic()
                for ep in left:
                    if now - ep.since > self.s.timeout:
                        ep.result.failed = (f"neither asked the model nor finished within "
                                            f"{self.s.timeout:g} s (--agent-timeout)")  # fmt: skip
                        _say(f"agent episode {ep.row}: {ep.result.failed}; ended, scored as "
                             "failed")  # fmt: skip
                        ep.task.cancel()
                spins += 1  # a request on its way through the loopback socket: yield
                await asyncio.sleep(0 if spins < 200 else 0.0005)

        self._run(wait())
        for ep in eps:  # let cancelled episodes unwind
            if ep.task.done() and not ep.task.cancelled():
                ep.task.exception()


def _where(before: list[dict], new: list[dict]) -> str:
    keys, got = conversation_key(before), conversation_key(new)
    for i, (a, b) in enumerate(zip(keys, got)):
        if a != b:
            return f"message {i} ({before[i].get('role')})"
    return "the conversation (it is not longer than before)"


def _takes_model(fn: Callable) -> bool:
    try:
        return "model" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _reward_value(value: Any) -> float | list[float | None] | None:
    """What an agent returned as its reward: None, a finite number, or a list of them (or None),
    one per turn; TypeError for anything else."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and all(v is None or _finite(v) for v in value):
        return [None if v is None else float(v) for v in value]
    if not _finite(value):
        raise TypeError(f"the agent returned {value!r}; return a finite number (its reward), "
                        "a list of them (one per turn: each request answered is a turn), or "
                        "None (the run's reward functions score it)")  # fmt: skip
    return float(value)


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
