"""Expert routing in training: set-up (`routing_for`), each step's routes session (`StepRoutes`:
R2/R3 replay, the tables the metrics compare) and the routing metrics.

One table of routes per step (`grouprl.rollout.routes`), over the rows the update trains: `first`
holds each token's live experts at its first forward in the step (before any optimizer step:
where the update would first see a row after one, a no-grad forward records them first); R2
replays `first`, R3 the sampler's `Rollout.routes` (its gaps filled by `first`'s choices).
After the update, one no-grad forward records the updated policy's live routes; the metrics
compare them with `first` (how much one step moved routing, the GSPO paper's "about 10%") and
`first` with the sampler's (how far the sampler's routing is from the trainer's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from grouprl.config.options import RunConfig
from grouprl.errors import UserError
from grouprl.rollout import Rollout, routes
from grouprl.train.nograd import no_grad_logprobs
from grouprl.train.parallel.distributed import Dist
from grouprl.train.update import recomputes_old_logp


@dataclass
class Routing:
    """A mixture-of-experts run's routing settings: its policy's tap, the replay (off, r2,
    r3), the metrics' period (0: never) and the balancing loss's weight (0: off)."""

    tap: routes.RouteTap
    replay: str
    every: int
    aux_coef: float

    def due(self, step: int) -> bool:
        """Whether step `step` (0-based) logs the routing metrics."""
        return self.every > 0 and (step + 1) % self.every == 0


def routing_for(cfg: RunConfig, policy: nn.Module) -> Routing | None:
    """The run's `Routing`, or None for a dense policy (or one with nothing to do). One line
    (`UserError`) for what cannot work: replay or a balancing loss on a dense model, replay on
    routers whose scores no known rule reproduces or under activation checkpointing (whose
    recomputed forward would route afresh), R3 from an engine that does not return the
    routes it sampled (vLLM, in-process or a server). Installs the policy's route tap."""
    found = routes.routers(policy)
    coef = cfg.router_aux_loss_coef
    if not found:
        if cfg.routing_replay != "off":
            raise UserError(
                f"--routing-replay {cfg.routing_replay} replays expert routing, but "
                f"{type(policy).__name__} is not a mixture-of-experts model (no top-k router "
                "found); drop --routing-replay"
            )
        if coef:
            raise UserError(
                f"--router-aux-loss-coef {coef} weighs the routers' balancing loss, but "
                f"{type(policy).__name__} is not a mixture-of-experts model (no top-k router "
                "found); drop --router-aux-loss-coef"
            )
        return None
    if cfg.routing_replay != "off" and cfg.gradient_checkpointing:
        raise UserError(
            f"--routing-replay {cfg.routing_replay} with --gradient-checkpointing: backward "
            "recomputes each layer's forward, and the recomputed routers would choose afresh, "
            "not the replayed experts; drop one of the two"
        )
    if cfg.routing_replay == "r3" and (cfg.engine != "hf" or cfg.vllm_server is not None):
        raise UserError(
            "--routing-replay r3 replays the experts the sampler chose, and the vLLM engine "
            "does not return them to grouprl (vLLM returns routed experts only from its V2 model "
            "runner, enable_return_routed_experts, which its CPU build cannot run); use "
            "--routing-replay r2, or grouprl's own sampler (--engine hf)"
        )
    if coef is None:  # the model's own, as TRL takes it
        coef = float(getattr(policy.config.get_text_config(), "router_aux_loss_coef", 0.0) or 0.0)
    if cfg.routing_replay == "off" and cfg.routing_metrics_every == 0 and coef == 0:
        return None  # nothing to do: no hooks on the routers
    tap = routes.tap(policy)
    if cfg.routing_replay != "off" and not tap.replayable:
        raise UserError(
            f"--routing-replay {cfg.routing_replay}: the routers of {type(policy).__name__} "
            f"({', '.join(tap.classes)}) compute their scores in a way grouprl does not know "
            "(none of softmax-then-top-k, with or without renormalising, or top-k-then-softmax "
            "reproduces them), so their choices cannot be replayed; drop --routing-replay"
        )
    tap.sampling = cfg.routing_replay == "r3" or cfg.routing_metrics_every > 0
    return Routing(tap, cfg.routing_replay, cfg.routing_metrics_every, coef)


class StepRoutes:
    """One step's routes: the tables and the session its policy forwards run under."""

    def __init__(self, routing: Routing, rollout: Rollout, step: int, device: torch.device):
        self.routing = routing
        self.rollout = rollout
        self.watch = routing.due(step)
        n = rollout.completion_ids.shape[0]
        self.width = int(rollout.prompt_mask.sum(-1).max()) + rollout.completion_ids.shape[1]
        self.first = routing.tap.empty(n, self.width, device)
        replay = None
        if routing.replay == "r2":
            replay = self.first
        elif routing.replay == "r3":
            given = rollout.routes
            replay = (self.first if given is None
                      else routes.widened(given.to(device), self.width).clone())  # fmt: skip
        self.session = routes.Session(record=(self.first,), replay=replay)

    @property
    def needed(self) -> bool:
        """Whether the step's forwards must run under the session at all."""
        r = self.routing
        return self.watch or r.replay != "off" or r.aux_coef != 0

    def records_first(self, cfg: RunConfig, dtype) -> bool:
        """Whether the step needs a no-grad forward of its own before the update to record
        each row's first routes (for R2 or the metrics): when some rows' first forward in the
        update would come after an optimizer step (several minibatches, and no recomputed
        old log-probs, whose pass comes first)."""
        wanted = self.watch or self.routing.replay == "r2"
        return wanted and cfg.minibatches > 1 and not recomputes_old_logp(cfg, self.rollout, dtype)

    def recording(self) -> contextlib.AbstractContextManager:
        return routes.recording(self.session) if self.needed else contextlib.nullcontext()

    def metrics(
        self, cfg: RunConfig, policy: nn.Module, rollout: Rollout, dtype, dist: Dist
    ) -> dict[str, float]:
        """The step's routing metrics (after the update): the share of the completions' (token,
        layer) expert sets that changed from the sampler's to the trainer's first forward
        (`routing_sampler_changed`, when the sampler recorded its own) and from the first
        forward to the updated policy's (`routing_update_changed`), overall and per layer
        (`..._layer{l}`), every rank's tokens together. One no-grad forward."""
        if not self.watch:
            return {}
        tap = self.routing.tap
        after = tap.empty(self.first.shape[0], self.width, self.first.device)
        with routes.recording(routes.Session(record=(after,))):
            no_grad_logprobs(cfg, policy, rollout, dtype)
        prompt = rollout.prompt_mask.sum(-1).repeat_interleave(rollout.group_size)
        counted = routes.completion_tokens(prompt.to(after.device), rollout.lengths.to(after.device),
                                           self.width)  # fmt: skip
        out = _shares("routing_update_changed", *routes.route_changes(self.first, after, counted),
                      dist)  # fmt: skip
        if rollout.routes is not None:
            sampled = routes.widened(rollout.routes.to(after.device), self.width)
            changed, compared = routes.route_changes(sampled, self.first, counted)
            out.update(_shares("routing_sampler_changed", changed, compared, dist))
        return out


def _shares(name: str, changed: torch.Tensor, compared: torch.Tensor, dist: Dist) -> dict:
    """`name` (all layers) and `name_layer{l}`: changed / compared, summed over ranks."""
    layers = len(changed)
    totals = dist.sum(*changed.tolist(), *compared.tolist())
    changed, compared = totals[:layers], totals[layers:]
    out = {name: sum(changed) / max(sum(compared), 1)}
    out.update(
        {f"{name}_layer{i}": c / max(n, 1) for i, (c, n) in enumerate(zip(changed, compared))}
    )
    return out
