"""The algorithm families by name, each variant registered once: advantage estimators
(`register_estimator`) and objectives (`register_objective`), with what each needs, takes and
refuses. The trainer calls through these entries, the command line takes its choices from them
and the docs' algorithm table is made from them, so a new variant is one function and one entry
(and, to be an `--algo`, one preset in `grouprl.config.presets`).

No torch here: the command line reads the names and rules without loading it. A built-in's
function is named as "module:function" inside grouprl.core and imported when first called; a
variant registered from outside passes the function itself.

An estimator's function maps the rewards (B, G) of the whole job's batch to advantages (B, G)
and says by its parameter names what else it needs, which the trainer then gathers and passes:
`lengths` (B, G) trained tokens, `baselines` (B,) the reward of each prompt's greedy completion
(sampled only for an estimator that takes them), `components` (B, G, K) each reward function's
own scores with their `weights` (instead of `rewards`), `turn_rewards` (B, G, K) each
completion's rewards per turn (instead of `rewards`; it then returns (B, G, K), each turn's
advantage, `grouprl.train.turn_rewards`), and the run's `scale`, `eps`, `unbiased_std`. An objective's `term(opts, ratio, logp, old_logp, adv, mask)` is the per-token
quantity maximised (see `grouprl.core.loss`), and its `bound(opts, ratio, adv)` the tokens its
bound acted on, (below, above), for the clip fractions.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: What an estimator's function may take besides the rewards (each by this parameter name).
ESTIMATOR_INPUTS = ("lengths", "baselines", "components", "weights", "turn_rewards", "scale",
                    "eps", "unbiased_std")  # fmt: skip
#: --adv-scale's values (`grouprl.core.advantages.ADVANTAGE_SCALES`).
SCALES = ("group", "batch", "none", "whiten")


def _load(function: str | Callable[..., Any]) -> Callable[..., Any]:
    """A function given as itself, or as "module:function" of grouprl.core."""
    if callable(function):
        return function
    module, _, name = function.partition(":")
    return getattr(importlib.import_module(f".{module}", __package__), name)


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator (`--adv-estimator NAME`)."""

    name: str
    function: str | Callable[..., Any]  # see the module docstring
    summary: str  # one line: its baseline and scaling, for --help and the docs' table
    fixed: Mapping[str, Any] = field(default_factory=dict)  # keywords it is always called with
    scales: tuple[str, ...] = SCALES  # the --adv-scale values it takes; () = it scales itself
    exactly_on_policy: bool = False  # its baseline is right only for one on-policy update

    def load(self) -> Callable[..., Any]:
        """The function, with its fixed keywords bound."""
        fn = _load(self.function)
        return functools.partial(fn, **self.fixed) if self.fixed else fn

    def inputs(self) -> frozenset[str]:
        """What it takes besides the rewards (`ESTIMATOR_INPUTS`), read off its parameters."""
        names = set(inspect.signature(_load(self.function)).parameters) - set(self.fixed)
        return frozenset(names & set(ESTIMATOR_INPUTS))

    def call(self, given: Mapping[str, Any]) -> Any:
        """The function called with what it takes of `given` (by its parameter names: `rewards`
        and `ESTIMATOR_INPUTS`; None where the trainer has no such input)."""
        fn = self.load()
        args = {}
        for name, param in inspect.signature(fn).parameters.items():
            if given.get(name) is not None:
                args[name] = given[name]
            elif param.default is param.empty and param.kind not in (param.VAR_POSITIONAL,
                                                                       param.VAR_KEYWORD):  # fmt: skip
                raise TypeError(
                    f"advantage estimator {self.name!r} takes {name!r}, which the trainer does "
                    f"not give; it gives rewards, {', '.join(ESTIMATOR_INPUTS)}"
                )
        return fn(**args)

    @property
    def per_turn(self) -> bool:
        """It gives each turn of a completion its own advantage (it takes `turn_rewards`)."""
        return "turn_rewards" in self.inputs()

    @property
    def self_scaled(self) -> bool:
        return not self.scales


@dataclass(frozen=True)
class Objective:
    """One objective (`--objective NAME`): the per-token term that the clip's place holds."""

    name: str
    term: str | Callable[..., Any]  # term(opts, ratio, logp, old_logp, adv, mask) -> (N, T)
    summary: str  # one line, for --help and the docs' table
    bound: str | Callable[..., Any] | None = None  # (opts, ratio, adv) -> (below, above)
    knobs: tuple[str, ...] = ()  # the LossOptions fields that are its own
    clipped: bool = True  # --clip-low/--clip-high bound it (else they are refused)
    sequence_weighted: bool = False  # one weight per sequence: advantages (N,) only
    by_covariance: bool = False  # the trainer picks tokens by the covariance of log π and Â
    ratio: str | None = None  # what its ratio is, where it is not the preset's level

    def load_term(self) -> Callable[..., Any]:
        return _load(self.term)

    def load_bound(self) -> Callable[..., Any] | None:
        return None if self.bound is None else _load(self.bound)


#: The estimators and objectives by name, in the order the command line lists them.
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}
OBJECTIVES: dict[str, Objective] = {}


def register_estimator(
    name: str, function: str | Callable[..., Any], summary: str, **rules: Any
) -> Estimator:
    """Register (or replace) the estimator `name`; `rules` are `Estimator`'s other fields."""
    entry = Estimator(name, function, summary, **rules)
    ADVANTAGE_ESTIMATORS[name] = entry
    return entry


def register_objective(
    name: str, term: str | Callable[..., Any], summary: str, **rules: Any
) -> Objective:
    """Register (or replace) the objective `name`; `rules` are `Objective`'s other fields."""
    entry = Objective(name, term, summary, **rules)
    OBJECTIVES[name] = entry
    return entry


# --- the built-in estimators -----------------------------------------------------------------

register_estimator(
    "grpo", "advantages:group_advantages", "reward − group mean (GRPO)", fixed={"estimator": "grpo"}
)
register_estimator(
    "rloo", "advantages:group_advantages", "reward − the mean of the other G−1 rewards (RLOO)",
    fixed={"estimator": "rloo"},
)  # fmt: skip
register_estimator(
    "gdpo", "advantages:gdpo_advantages",
    "each reward by its group std, the weighted sum by the batch std", scales=(),
)  # fmt: skip
register_estimator(
    "reinforce_pp", "estimators:reinforce_pp_advantages",
    "the reward whitened over the batch's tokens", fixed={"baseline": False}, scales=(),
)  # fmt: skip
register_estimator(
    "reinforce_pp_baseline", "estimators:reinforce_pp_advantages",
    "reward − group mean, whitened over the batch's tokens", fixed={"baseline": True}, scales=(),
)  # fmt: skip
register_estimator(
    "opo", "estimators:opo_advantages", "reward − the length-weighted group mean", scales=(),
    exactly_on_policy=True,
)  # fmt: skip
register_estimator(
    "gpg", "estimators:gpg_advantages",
    "α·(reward − group mean), α = completions / rewarded ones", scales=(),
)  # fmt: skip
register_estimator(
    "grpo_passk", "estimators:passk_advantages",
    "only each group's best: its margin over the second", scales=("group", "none"),
)  # fmt: skip
register_estimator(
    "remax", "estimators:remax_advantages",
    "reward − the reward of one more, greedy, completion of the prompt", scales=(),
)  # fmt: skip

register_estimator(
    "process", "advantages:process_advantages",
    "per turn: turn rewards − the group's mean turn reward, summed from each turn on "
    "(DeepSeekMath's process supervision)", scales=(),
)  # fmt: skip

# --- the built-in objectives -------------------------------------------------------------------

register_objective("clip", "terms:clip_term", "PPO's clip", bound="terms:clip_bound")
register_objective(
    "cispo", "terms:cispo_term", "REINFORCE on log π, the detached ratio capped from above",
    bound="terms:cap_bound", knobs=("cispo_cap",), clipped=False,
)  # fmt: skip
register_objective(
    "sapo", "terms:sapo_term", "a smooth gate σ(τ(r − 1))·4/τ in place of the clip",
    knobs=("sapo_tau_pos", "sapo_tau_neg"), clipped=False,
)  # fmt: skip
register_objective(
    "gmpo", "terms:gmpo_term", "the geometric mean of token ratios, each clipped in log space",
    bound="terms:log_clip_bound", sequence_weighted=True, ratio="token, geometric mean",
)  # fmt: skip
register_objective(
    "vespo", "terms:vespo_term", "a detached gamma weight of the sequence ratio",
    knobs=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
    clipped=False, sequence_weighted=True, ratio="token, summed into a sequence weight",
)  # fmt: skip
register_objective(
    "gpg", "terms:gpg_term", "plain REINFORCE: Â·log π", clipped=False, ratio="none: Â·log π"
)
register_objective(
    "clip_cov", "terms:clip_term", "the clip, a few tokens of highest covariance held back",
    bound="terms:clip_bound", knobs=("clip_cov_ratio", "clip_cov_low", "clip_cov_high"),
    by_covariance=True,
)  # fmt: skip
register_objective(
    "kl_cov", "terms:kl_cov_term", "r·Â unclipped, |log r| added on the tokens of highest "
    "covariance", knobs=("kl_cov_ratio", "kl_cov_coef"), clipped=False, by_covariance=True,
    ratio="token, r·Â unclipped",
)  # fmt: skip
