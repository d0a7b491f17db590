"""The clipped policy-gradient loss of GRPO and GSPO: importance ratios, KL, aggregation.

GRPO (DeepSeekMath, arXiv 2402.03300, eq. 3), a ratio per token:

    J(θ) = E[ 1/G Σ_i 1/|y_i| Σ_t { min(ρ_it Â_i, clip(ρ_it, 1−ε, 1+ε) Â_i) − β D_KL[π_θ‖π_ref] } ]
    ρ_it = π_θ(y_it | x, y_i<t) / π_old(y_it | x, y_i<t)

GSPO (Qwen, arXiv 2507.18071), one length-normalised ratio per completion:

    J(θ) = E[ 1/G Σ_i min(s_i Â_i, clip(s_i, 1−ε_low, 1+ε_high) Â_i) ]
    s_i  = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|) = exp(1/|y_i| Σ_t log ρ_it)

GSPO-token: s_it = sg[s_i] · π_θ(y_it) / sg[π_θ(y_it)] (sg = detach): the value of s_i, a gradient
per token; with per-sequence advantages its loss and gradient equal GSPO's.

``policy_loss`` minimises −J: per token l_it = −min(r_it Â_i, clip(r_it) Â_i) + β·KL_it, with r_it
the ratio at the chosen level (RATIO_LEVELS), then one of AGGREGATIONS reduces l to a scalar; that
choice sets an implicit length weighting (DAPO, arXiv 2503.14476; Dr. GRPO, arXiv 2503.20783).

Padding: every (N, T) input is replaced by 0 at masked positions with ``torch.where`` before any
arithmetic, so NaN, ±inf or 1e9 there reach neither values nor gradients (masking by multiplication
would not do: NaN · 0 = NaN). A row without a valid token contributes nothing.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._registry import choose
from .advantages import over_tokens
from .objectives import MAX_LOG_RATIO
from .registry import OBJECTIVES

Tensor = torch.Tensor


# --- importance-ratio levels: (token log-ratio, logp, mask), each (N, T) -> (N, T) log-ratio ---


def _token_level(token_log_ratio: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """log ρ_it = log π_θ(y_it) − log π_old(y_it) (GRPO, arXiv 2402.03300; PPO)."""
    return token_log_ratio


def _sequence_level(token_log_ratio: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """log s_i = 1/|y_i| Σ_t log ρ_it on every token of y_i (GSPO, arXiv 2507.18071)."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # (N, 1)
    return torch.where(mask, token_log_ratio.sum(-1, keepdim=True) / lengths, 0.0)  # (N, T)


def _sequence_sum_level(token_log_ratio: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """log r_i = Σ_t log ρ_it on every token of y_i: the ratio of the whole sequences'
    probabilities, not length-normalised (RLOO as TRL's RLOOTrainer computes it, arXiv
    2402.14740)."""
    return torch.where(mask, token_log_ratio.sum(-1, keepdim=True), 0.0)  # (N, T)


def _sequence_token_level(token_log_ratio: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """log s_it = sg[log s_i] + log π_θ(y_it) − sg[log π_θ(y_it)] (GSPO-token, arXiv 2507.18071)."""
    # The bracket is exactly 0 in value, so the value equals "sequence" bit for bit.
    return _sequence_level(token_log_ratio, logp, mask).detach() + (logp - logp.detach())


RATIO_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": _token_level,
    "sequence": _sequence_level,
    "sequence_token": _sequence_token_level,
    "sequence_sum": _sequence_sum_level,
}


def log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, *, level: str = "token") -> Tensor:
    """Per-token log importance weights (N, T) at the given level, 0 at masked positions.

        "token":          log ρ_it = logp_it − old_logp_it                       (GRPO)
        "sequence":       log s_i  = Σ_t m_it log ρ_it / Σ_t m_it on every token  (GSPO)
        "sequence_token": sg[log s_i] + logp_it − sg[logp_it]                    (GSPO-token)
        "sequence_sum":   log r_i  = Σ_t m_it log ρ_it on every token            (RLOO, TRL's)

    Sources: arXiv 2402.03300 (GRPO), arXiv 2507.18071 (GSPO and GSPO-token), arXiv 2402.14740
    and TRL 1.16's RLOOTrainer (the unnormalised sequence ratio). ``mask`` may be
    bool or float (nonzero = valid); padded values never reach the result or its gradient.
    """
    level_fn = choose(RATIO_LEVELS, level, "ratio level")
    _check_same_shape(logp=logp, old_logp=old_logp, mask=mask)
    mask = mask.bool()  # (N, T)
    logp = torch.where(mask, logp, 0.0)  # (N, T)
    token_log_ratio = logp - torch.where(mask, old_logp, 0.0)  # (N, T)
    return level_fn(token_log_ratio, logp, mask)


# --- KL estimators (Schulman, "Approximating KL divergence", 2020): d = logp − ref_logp ---


def _k1(d: Tensor) -> Tensor:
    """k1 = d: unbiased for KL[π_θ‖π_ref], but single samples can be negative."""
    return d


def _k2(d: Tensor) -> Tensor:
    """k2 = d²/2: biased, low variance, always ≥ 0."""
    return d.square() / 2


def _k3(d: Tensor) -> Tensor:
    """k3 = e^(−d) + d − 1 = π_ref/π_θ − log(π_ref/π_θ) − 1: unbiased and ≥ 0 (GRPO's choice)."""
    return torch.expm1(-d) + d  # expm1 keeps precision for small d


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_reward_penalty(old_logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """Each completion's KL penalty as a reward (N,): Σ_t m_it (log π_old(y_it) − log π_ref(y_it)),
    the first-order (k1) estimate summed over its tokens, which the caller scales by β and
    subtracts from the reward before the advantages (the RLOO paper, arXiv 2402.14740, and TRL
    1.16's RLOOTrainer; verl's use_kl_in_reward). Single samples can be negative. No gradient."""
    _check_same_shape(old_logp=old_logp, ref_logp=ref_logp, mask=mask)
    mask = mask.bool()
    d = torch.where(mask, old_logp.detach() - ref_logp.detach(), 0.0)  # (N, T)
    return d.sum(-1)


def kl_penalty(logp: Tensor, ref_logp: Tensor, *, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL[π_θ‖π_ref] from samples of π_θ, with d = logp − ref_logp:

        k1 = d,   k2 = d²/2,   k3 = e^(−d) + d − 1

    (Schulman's estimators; GRPO, arXiv 2402.03300, eq. 4, uses k3). Elementwise, no mask:
    callers mask the result (``policy_loss`` does). Swap the arguments for KL[π_old‖π_θ].
    """
    return choose(KL_ESTIMATORS, estimator, "KL estimator")(logp - ref_logp)


# --- loss aggregation: (loss zeroed at padding, mask) -> scalar ---


def _count(local: Tensor, given: int | float | Tensor | None) -> Tensor | int | float:
    if given is None:
        return local.clamp(min=1)
    return given.clamp(min=1) if isinstance(given, Tensor) else max(given, 1)


def _token_mean(loss: Tensor, mask: Tensor, norm_len, num_tokens, num_seqs) -> Tensor:
    """Σ_it m·l / Σ_it m (DAPO, arXiv 2503.14476; TRL "dapo", verl "token-mean")."""
    return loss.sum() / _count(mask.sum(), num_tokens)


def _seq_mean_token_mean(loss: Tensor, mask: Tensor, norm_len, num_tokens, num_seqs) -> Tensor:
    """1/N Σ_i (Σ_t m·l / Σ_t m) (GRPO, arXiv 2402.03300; GSPO, arXiv 2507.18071)."""
    per_seq = loss.sum(-1) / mask.sum(-1).clamp(min=1)  # (N,)
    return per_seq.sum() / _count(mask.any(-1).sum(), num_seqs)


def _seq_mean_token_sum(loss: Tensor, mask: Tensor, norm_len, num_tokens, num_seqs) -> Tensor:
    """1/N Σ_i Σ_t m·l."""
    return loss.sum() / _count(mask.any(-1).sum(), num_seqs)


def _seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, norm_len, num_tokens, num_seqs) -> Tensor:
    """1/N Σ_i Σ_t m·l / L, L a constant such as max_new_tokens (Dr. GRPO, arXiv 2503.20783)."""
    return _seq_mean_token_sum(loss, mask, norm_len, num_tokens, num_seqs) / norm_len


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def aggregate(
    per_token: Tensor,  # (N, T)
    mask: Tensor,  # (N, T)
    *,
    mode: str,
    norm_len: int | None = None,
    num_tokens: int | Tensor | None = None,
    num_seqs: int | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss l (N, T) to a scalar (modes in AGGREGATIONS, m = mask):

        token_mean:              Σ_i Σ_t m l / Σ_i Σ_t m                  (DAPO, arXiv 2503.14476)
        seq_mean_token_mean:     1/N Σ_i (Σ_t m l / Σ_t m)                (GRPO, GSPO)
        seq_mean_token_sum:      1/N Σ_i Σ_t m l
        seq_mean_token_sum_norm: 1/N Σ_i Σ_t m l / norm_len               (Dr. GRPO, arXiv 2503.20783)

    N counts the rows with at least one valid token: an empty row contributes nothing, not even
    to a denominator. Under data parallelism pass the *global* ``num_tokens`` (Σ m over all
    ranks) or ``num_seqs``: each rank divides its local sum by the global count, so the full-batch
    loss is the *sum* of the rank losses. DDP averages gradients over ranks: multiply each rank's
    loss (or its gradients) by the world size to compensate.
    """
    LossOptions(agg=mode, norm_len=norm_len)  # the rules (a known mode, its norm_len)
    reduce = AGGREGATIONS[mode]
    _check_same_shape(per_token=per_token, mask=mask)
    mask = mask.bool()
    loss = torch.where(mask, per_token, 0.0)  # (N, T)
    return reduce(loss, mask, norm_len, num_tokens, num_seqs)


# --- the clipped surrogate and the policy loss ---


def clipped_objective(
    ratio: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> Tensor:
    """PPO's clipped surrogate (arXiv 1707.06347), the per-token term GRPO and GSPO maximise:

        min(r·Â, clip(r, 1 − clip_low, 1 + clip_high)·Â)

    Dual clip (Ye et al., arXiv 1912.09729; verl ``clip_ratio_c``): for Â < 0 the objective is kept
    ≥ c·Â, i.e. the loss is bounded by c·|Â| (no gradient once r > c). Elementwise on the broadcast
    of ``ratio`` and ``advantages``; the loss is the negative of this.
    """
    LossOptions(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)  # the rules
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    if dual_clip is None:
        return objective
    return torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)


def importance_ratio(
    logp: Tensor, old_logp: Tensor, mask: Tensor, *, level: str = "token"
) -> Tensor:
    """The ratio r (N, T) the loss weighs: exp(log_ratio(level)) with the log-ratio clamped to
    ±MAX_LOG_RATIO first (as verl does); 1 at masked positions. Differentiable in `logp`."""
    return log_ratio(logp, old_logp, mask, level=level).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def bounded_tokens(opts: "LossOptions", ratio: Tensor, adv: Tensor) -> tuple[Tensor, Tensor]:
    """The tokens (N, T) bool the objective's bound acted on, (below, above), from the ratio
    (`importance_ratio`) and the advantages (N, T), 0 at padding: the clip's (Â < 0 and
    r < 1 − clip_low; Â > 0 and r > 1 + clip_high), CISPO's cap (above, whatever Â's sign),
    GMPO's log-space clip (on token ratios), none for SAPO's, VESPO's, GPG's or KL-Cov's (an
    objective without a `bound` in `grouprl.core.registry`). The clip fractions `policy_loss`
    reports count these."""
    bound = OBJECTIVES[opts.objective].load_bound()
    if bound is None:
        none = torch.zeros_like(ratio, dtype=torch.bool)
        return none, none
    return bound(opts, ratio, adv)


def mean_over(total: Tensor | float, count: Tensor | float) -> Tensor | float:
    """`total / count`, NaN where `count` is 0: the one definition of a metric over nothing (a
    mean over no token, no row, no update is undefined, and is logged as null), for the loss's
    diagnostics and the trainer's metrics alike. Tensors (elementwise) or numbers."""
    if isinstance(total, Tensor) or isinstance(count, Tensor):
        count = torch.as_tensor(count, device=total.device if isinstance(total, Tensor) else None)
        return torch.where(count > 0, total / count.clamp(min=1), math.nan)
    return total / count if count else math.nan


@dataclass(frozen=True)
class LossOptions:
    """The settings of ``policy_loss`` as one frozen object, for callers that keep them (a
    trainer builds it once from its config). Field names are ``policy_loss``'s keywords; unknown
    names and impossible values fail here, at construction."""

    level: str = "token"  # RATIO_LEVELS
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"  # KL_ESTIMATORS
    kl_ratio_weighted: bool = False  # KL_it times the importance ratio r_it
    objective: str = "clip"  # OBJECTIVES
    cispo_cap: float = 5.0  # CISPO's cap on the detached weight
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature where Â > 0
    sapo_tau_neg: float = 1.05  # and where Â <= 0
    vespo_k_pos: float = 2.0  # VESPO's gamma shape and rate where Â >= 0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0  # and where Â < 0
    vespo_lambda_neg: float = 2.0
    clip_cov_ratio: float = 2e-4  # Clip-Cov: the share of tokens held back (verl's YAML)
    clip_cov_low: float = 1.0  # and the covariance band they are drawn from
    clip_cov_high: float = 5.0
    kl_cov_ratio: float = 2e-4  # KL-Cov: the share of tokens penalised (verl's YAML)
    kl_cov_coef: float = 0.1  # and the penalty's coefficient (verl's YAML; its code's None: 1)
    agg: str = "seq_mean_token_mean"  # AGGREGATIONS
    norm_len: int | None = None  # the constant of seq_mean_token_sum_norm

    def __post_init__(self) -> None:
        """The loss's rules, here only: `clipped_objective` and `aggregate` check their settings
        by building one of these, and a trainer's config turns these errors into its own."""
        choose(RATIO_LEVELS, self.level, "ratio level")
        choose(KL_ESTIMATORS, self.kl_estimator, "KL estimator")
        choose(AGGREGATIONS, self.agg, "loss aggregation")
        choose(OBJECTIVES, self.objective, "objective")
        rules = (
            (0 <= self.clip_low < 1, f"clip_low must lie in [0, 1): the ratio's lower bound is "
             f"1 - clip_low; got {self.clip_low}"),
            (self.clip_high >= 0, f"clip_high must be >= 0; got {self.clip_high}"),
            (self.dual_clip is None or self.dual_clip > 1,
             f"dual_clip must be > 1 (or unset; verl's default is 3); got {self.dual_clip}"),
            (self.beta >= 0, f"beta must be >= 0; got {self.beta}"),
            (self.cispo_cap > 0, f"cispo_cap must be > 0; got {self.cispo_cap}"),
            (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0,
             f"SAPO's temperatures must be > 0; got {self.sapo_tau_pos}, {self.sapo_tau_neg}"),
            (min(self.vespo_lambda_pos, self.vespo_lambda_neg) > 0
             and min(self.vespo_k_pos, self.vespo_k_neg) >= 0,
             "VESPO's rates (lambda) must be > 0 and its shapes (k) >= 0"),
            (0 < self.clip_cov_ratio <= 1 and 0 < self.kl_cov_ratio <= 1,
             "the covariance ratios (clip_cov_ratio, kl_cov_ratio) must lie in (0, 1]"),
            (self.clip_cov_low < self.clip_cov_high,
             f"Clip-Cov's band needs clip_cov_low < clip_cov_high; got {self.clip_cov_low}, "
             f"{self.clip_cov_high}"),
            (self.kl_cov_coef >= 0, f"kl_cov_coef must be >= 0; got {self.kl_cov_coef}"),
            (self.objective not in ("gmpo", "vespo") or self.level == "token",
             f"{self.objective} builds its own sequence weight from token ratios: it needs "
             f"ratio level 'token'; got {self.level!r}"),
            (self.agg != "seq_mean_token_sum_norm" or (self.norm_len or 0) > 0,
             "loss aggregation 'seq_mean_token_sum_norm' needs norm_len > 0 (e.g. "
             f"max_new_tokens); got {self.norm_len}"),
        )  # fmt: skip
        for ok, message in rules:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class LossStats:
    """What a loss computation saw, as sums over its valid tokens and the ratio's extremes.

    Sums add and extremes take the max, so the stats of micro-batch chunks and of data-parallel
    ranks combine exactly (`combine`), and a trainer divides once, after combining: a share is
    never averaged twice. Every field is in exactly one of ``SUMS`` and ``EXTREMES``, so a new
    statistic has to say how it combines. Detached 0-dim tensors on the loss's device.
    """

    tokens: Tensor  # valid tokens
    clipped_low: Tensor  # valid tokens the lower bound acted on (the clip: Â < 0, r < 1 − ε_low)
    clipped_high: Tensor  # and the upper (the clip: Â > 0, r > 1 + ε_high; CISPO: r > cap)
    ratio_sum: Tensor  # Σ r over valid tokens (r at the chosen level)
    approx_kl_sum: Tensor  # Σ k3 estimate of KL[π_old‖π_θ] (token level)
    kl_sum: Tensor  # Σ KL estimate against the reference (0 without one)
    ratio_max: Tensor  # −inf without a valid token
    neg_ratio_min: Tensor  # −min r (a max, like ratio_max); −inf without a valid token

    SUMS = ("tokens", "clipped_low", "clipped_high", "ratio_sum", "approx_kl_sum", "kl_sum")
    EXTREMES = ("ratio_max", "neg_ratio_min")

    def sums(self) -> Tensor:
        """(len(SUMS),) float64: the fields that combine by addition."""
        return torch.stack([getattr(self, n) for n in self.SUMS]).double()

    def extremes(self) -> Tensor:
        """(len(EXTREMES),) float64: the fields that combine by max."""
        return torch.stack([getattr(self, n) for n in self.EXTREMES]).double()

    @staticmethod
    def combine(sums: Tensor, extremes: Tensor) -> dict[str, float]:
        """Means and extremes over every token of combined `sums()` and `extremes()` (added and
        maxed over chunks and ranks): ``ratio_mean``, ``ratio_min``, ``ratio_max``,
        ``approx_kl``, ``kl`` per valid token (NaN without one) and the clipped counts as they
        are (their denominator is the caller's: it may include tokens that were not computed)."""
        s = dict(zip(LossStats.SUMS, sums.tolist()))
        e = dict(zip(LossStats.EXTREMES, extremes.tolist()))
        tokens = s["tokens"]
        return {
            "clipped_low": s["clipped_low"],
            "clipped_high": s["clipped_high"],
            "ratio_mean": mean_over(s["ratio_sum"], tokens),
            "ratio_min": -e["neg_ratio_min"] if tokens > 0 else math.nan,
            "ratio_max": e["ratio_max"] if tokens > 0 else math.nan,
            "approx_kl": mean_over(s["approx_kl_sum"], tokens),
            "kl": mean_over(s["kl_sum"], tokens),
        }


@dataclass(frozen=True)
class PolicyLoss:
    """The loss to minimise, and what it saw (`stats`: sums and extremes, see `LossStats`).

    The properties are the usual diagnostics of one computation: shares and means over its valid
    tokens, each a detached 0-dim tensor (NaN when there is no valid token at all: `mean_over`);
    ``metrics()`` turns them into floats with one host sync. The loss itself is then 0.
    """

    loss: Tensor  # () differentiable
    stats: LossStats
    has_kl: bool = False  # a reference was given, so `kl` means something

    def _mean(self, total: Tensor) -> Tensor:
        return mean_over(total, self.stats.tokens)

    @property
    def clip_frac_low(self) -> Tensor:
        """Share of valid tokens the objective's lower bound acted on (the clip: Â < 0 and
        r < 1 − clip_low)."""
        return self._mean(self.stats.clipped_low)

    @property
    def clip_frac_high(self) -> Tensor:
        """Share of valid tokens with Â > 0 and r > 1 + clip_high."""
        return self._mean(self.stats.clipped_high)

    @property
    def ratio_mean(self) -> Tensor:
        return self._mean(self.stats.ratio_sum)

    @property
    def ratio_min(self) -> Tensor:
        return torch.where(self.stats.tokens > 0, -self.stats.neg_ratio_min, math.nan)

    @property
    def ratio_max(self) -> Tensor:
        return torch.where(self.stats.tokens > 0, self.stats.ratio_max, math.nan)

    @property
    def approx_kl(self) -> Tensor:
        """Mean k3 estimate of KL[π_old‖π_θ] over valid tokens (token level)."""
        return self._mean(self.stats.approx_kl_sum)

    @property
    def kl(self) -> Tensor | None:
        """Mean KL estimate against the reference, when ref_logp was given."""
        return self._mean(self.stats.kl_sum) if self.has_kl else None

    METRICS = ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max",
               "approx_kl", "kl")  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """The loss value and every diagnostic as Python floats (one host sync), for logging."""
        names = [n for n in self.METRICS if getattr(self, n) is not None]
        values = torch.stack([getattr(self, n).detach().float() for n in names]).tolist()
        return dict(zip(names, values))


def policy_loss(
    logp: Tensor,  # (N, T) current policy, differentiable
    old_logp: Tensor,  # (N, T) sampling policy
    advantages: Tensor,  # (N,), or (N, T) per token (on-policy distillation)
    mask: Tensor,  # (N, T) the tokens the loss trains
    *,
    options: LossOptions | None = None,
    ref_logp: Tensor | None = None,  # (N, T)
    num_tokens: int | Tensor | None = None,
    num_seqs: int | Tensor | None = None,
    token_weight: Tensor | None = None,  # (N, T) constant
    penalty_mask: Tensor | None = None,  # (N, T) bool: KL-Cov's penalised tokens
    **settings,
) -> PolicyLoss:
    """GRPO / GSPO loss −J(θ) (arXiv 2402.03300 eq. 3; arXiv 2507.18071), per token

        l_it = −min(r_it Â_i, clip(r_it, 1 − clip_low, 1 + clip_high) Â_i) + β·KL_it

    with r_it = exp(log_ratio(level)) (log-ratio clamped to ±MAX_LOG_RATIO before exp, as verl
    does), the dual clip of ``clipped_objective`` when set, KL_it = kl_penalty(logp, ref_logp)
    added when ``beta > 0`` (times r_it with ``kl_ratio_weighted``: DeepSeek-V3.2's unbiased KL
    estimate, arXiv 2512.02556); then ``aggregate(l, mask, mode=agg, ...)``.

    ``objective`` replaces the clipped term (OBJECTIVES); ``token_weight`` (N, T) multiplies
    that term (not β·KL), the denominators unchanged; ``penalty_mask`` adds KL-Cov's
    kl_cov_coef·|log π − log π_old| on its tokens (before the weight, as verl orders them). The settings are a
    `LossOptions`, given as ``options`` or as its fields by keyword (``level="sequence"``).
    Defaults: GRPO's token ratio and seq_mean_token_mean; GSPO is level="sequence" (or
    "sequence_token") with its clip range, e.g. 3e-4 / 4e-4. Gradients flow to ``logp`` only
    (old_logp, ref_logp, advantages are constants); padding never touches loss or diagnostics.
    """
    if options is not None and settings:
        raise TypeError("give the loss settings as options= or as keywords, not both")
    opts = options if options is not None else LossOptions(**settings)
    _check_same_shape(logp=logp, old_logp=old_logp, mask=mask, ref_logp=ref_logp)
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages must have shape (N,) = {tuple(logp.shape[:1])} or (N, T) (per token), "
            f"got {tuple(advantages.shape)}"
        )
    if advantages.dim() == 2 and OBJECTIVES[opts.objective].sequence_weighted:
        raise ValueError(f"{opts.objective} weighs whole sequences: it takes advantages (N,)")
    if opts.beta > 0 and ref_logp is None:
        raise ValueError(f"beta > 0 needs ref_logp; got beta={opts.beta}")
    mask = mask.bool()  # (N, T)
    old_logp = torch.where(mask, old_logp.detach(), 0.0)  # (N, T)
    adv = torch.where(mask, over_tokens(advantages.detach()), 0.0)  # (N, T)
    ratio = importance_ratio(logp, old_logp, mask, level=opts.level)  # (N, T)
    term = OBJECTIVES[opts.objective].load_term()
    per_token = -term(opts, ratio, logp, old_logp, adv, mask)  # (N, T)
    if penalty_mask is not None:
        drift = (torch.where(mask, logp, 0.0) - old_logp).abs()
        per_token = per_token + opts.kl_cov_coef * torch.where(penalty_mask & mask, drift, 0.0)
    if token_weight is not None:  # the denominators stay the mask's
        per_token = per_token * torch.where(mask, token_weight.detach(), 0.0)
    if ref_logp is not None:
        ref_logp = torch.where(mask, ref_logp.detach(), 0.0)  # (N, T)
        kl_tok = kl_penalty(torch.where(mask, logp, 0.0), ref_logp, estimator=opts.kl_estimator)
        if opts.beta > 0:
            weight = ratio if opts.kl_ratio_weighted else 1.0  # x * 1.0 is x, to the bit
            per_token = per_token + opts.beta * kl_tok * weight
    loss = aggregate(
        per_token, mask, mode=opts.agg, norm_len=opts.norm_len, num_tokens=num_tokens,
        num_seqs=num_seqs,
    )  # fmt: skip
    kl = None if ref_logp is None else kl_tok.detach()
    with torch.no_grad():
        stats = _stats(opts, mask, ratio.detach(), adv, old_logp, logp.detach(), kl)
    return PolicyLoss(loss=loss, stats=stats, has_kl=ref_logp is not None)


def _stats(
    opts: LossOptions, mask: Tensor, ratio: Tensor, adv: Tensor, old_logp: Tensor,
    new_logp: Tensor, kl_tok: Tensor | None,
) -> LossStats:  # fmt: skip
    """What the loss saw, over its valid tokens (all (N, T), detached)."""

    def total(x: Tensor) -> Tensor:  # over valid tokens
        return torch.where(mask, x, 0.0).sum()

    def highest(x: Tensor) -> Tensor:  # −inf without a valid token (the extra −inf keeps an
        # empty N·T = 0 batch reducible)
        filled = torch.where(mask, x, -torch.inf).flatten()
        return torch.cat([filled, x.new_full((1,), -torch.inf)]).amax()

    below, above = bounded_tokens(opts, ratio, adv)
    new_logp = torch.where(mask, new_logp, 0.0)  # (N, T)
    return LossStats(
        tokens=mask.sum().to(ratio.dtype),
        clipped_low=total(below.to(ratio.dtype)),
        clipped_high=total(above.to(ratio.dtype)),
        ratio_sum=total(ratio),
        approx_kl_sum=total(kl_penalty(old_logp, new_logp, estimator="k3")),
        kl_sum=ratio.new_zeros(()) if kl_tok is None else total(kl_tok),
        ratio_max=highest(ratio),
        neg_ratio_min=highest(-ratio),
    )


def _check_same_shape(**tensors: Tensor | None) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"expected equal (N, T) shapes, got {shapes}")
