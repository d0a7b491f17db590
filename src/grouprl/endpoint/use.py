"""An agent program in a run's place of tool use (`--agent`, and verifiers 0.4's episodes): a
`ToolUse` whose rollouts `AgentRollout` drives (`grouprl.endpoint.agents`), and the branches of
its split trajectories sampled after a batch's rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grouprl.endpoint.agents import AGENT_TIMEOUT, AgentRollout, AgentSettings, load_agent
from grouprl.endpoint.wire import Sampling
from grouprl.errors import UserError
from grouprl.rollout.types import Branches, Rollout
from grouprl.tasks.tools.use import RolloutStart, ToolUse


@dataclass(frozen=True)
class AgentUse(ToolUse):
    """A run's agent program in the place of its tool use: `rollout` starts a batch
    (`AgentRollout`), `sampled` ends it after sampling."""

    settings: AgentSettings | None = None
    warned: set = field(default_factory=set)

    @property
    def schemas(self) -> list[dict] | None:
        return None  # the prompts are the episodes' first requests, as ids

    def rollout(self, rows, group_size, *seed_parts, keys=None) -> RolloutStart:
        batch = AgentRollout(self.settings, rows, group_size, self.warned)
        prompts = batch.start()
        return RolloutStart(prompts, batch, batch.environments, list(rows))

    def sampled(self, rollout: Any, handler: Any,
                resample: Callable[[list[list[int]], int], Any] | None = None) -> Branches | None:  # fmt: skip
        """After sampling: the episodes waiting on a turn the budget cut get it; the episodes
        whose request rewrote their trajectory go on in rows of their own, sampled by
        `resample(prompts, k)` (k: 0, 1, ... the branch round; a rollout of groups of one with
        this handler), round after round while any does; then all end. Returns the branch rows
        (None: none), each with the batch row of its episode."""
        if not isinstance(handler, AgentRollout):
            return None
        tokenizer = self.settings.tokenizer
        handler.cut(_cut_turns(rollout, handler, tokenizer))
        parts, parents = [], []
        while resample is not None and (prompts := handler.branches()):
            rows = [ep.row for ep in handler.live]
            try:
                branch = resample(prompts, len(parts))
            except BaseException:
                handler.close()
                raise
            handler.cut(_cut_turns(branch, handler, tokenizer))
            parts.append(branch)
            parents += rows
        handler.finish()
        if not parts:
            return None
        return Branches(Rollout.concat(parts), torch.tensor(parents, dtype=torch.long))


def _cut_turns(rollout: Any, handler: AgentRollout,
               tokenizer: Any) -> dict[int, tuple[list[int], list[float], str]]:  # fmt: skip
    """The turns the budget cut in `rollout`'s rows whose episode waits on its answer: row ->
    the turn's ids, log-probs and text."""
    cut = {}
    sampled = rollout.loss_mask & rollout.mask  # (N, T)
    for row, ep in enumerate(handler.live):
        if ep.pending is None or ep.branch is not None:
            continue
        fed = (~rollout.loss_mask[row] & rollout.mask[row]).nonzero()
        start = int(fed[-1]) + 1 if len(fed) else 0
        keep = sampled[row, start:]
        ids = rollout.completion_ids[row, start:][keep].tolist()
        logps = rollout.old_logp[row, start:][keep].tolist()
        cut[row] = (ids, logps, tokenizer.decode(ids, skip_special_tokens=True))
    return cut


def agent_use(spec: str | Callable, tokenizer: Any, end_ids: Sequence[int], sampling: Sampling,
              *, served: str, timeout: float = AGENT_TIMEOUT, port: int = 0, max_calls: int = 10,
              max_model_len: int | None = None, model: str = "the model") -> AgentUse:  # fmt: skip
    """The tool use of `--agent SPEC` (see the module docstring), or of an agent function."""
    agent = spec if callable(spec) else load_agent(spec)
    settings = AgentSettings(agent, tokenizer, tuple(int(i) for i in end_ids),
                             sampling, served, timeout, port, max_calls, max_model_len, model)  # fmt: skip
    chat = bool(getattr(tokenizer, "chat_template", None))
    return AgentUse(handler=None, environment=None, chat=chat, settings=settings)


def _run_sampling(opts: Any) -> Sampling:
    return Sampling(getattr(opts, "temperature", 1.0), getattr(opts, "top_p", 1.0),
                    getattr(opts, "top_k", 0) or 0)  # fmt: skip


def v1_agent_use(opts: Any, driver: Any, tokenizer: Any, end_ids: Sequence[int]) -> AgentUse:
    """A verifiers 0.4 run's tool use: its episodes are the driver's
    (`grouprl.tasks.ecosystems.verifiers_v1`), asking the run's endpoint."""
    from grouprl.tasks.ecosystems.verifiers_v1 import V1Episodes

    sampling = _run_sampling(opts)
    model = getattr(opts, "model", None)
    if not model:
        raise UserError(f"{driver.spec}: verifiers 0.4 renders with the model's tokenizer; "
                        "give --model")  # fmt: skip
    asked = {"temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.top_k:
        asked["top_k"] = sampling.top_k
    episodes = V1Episodes(driver, str(model), asked)
    return agent_use(episodes.episode, tokenizer, end_ids, sampling, served=str(model),
                     timeout=opts.agent_timeout, port=opts.agent_port,
                     max_calls=opts.max_turns, model=str(model))  # fmt: skip


def run_agent_use(opts: Any, tokenizer: Any, end_ids: Sequence[int]) -> AgentUse:
    """`--agent`'s tool use in a run (`opts`: its data, sampling and model options)."""
    if opts.tools or opts.environment:
        raise UserError("--agent plays the episodes with its own tools and loop: drop --tools "
                        "and --environment")  # fmt: skip
    sampling = _run_sampling(opts)
    model = getattr(opts, "model", None)
    return agent_use(opts.agent, tokenizer, end_ids, sampling, served=model or "grouprl",
                     timeout=opts.agent_timeout, port=opts.agent_port, max_calls=opts.max_turns,
                     model=model or "the model")  # fmt: skip
