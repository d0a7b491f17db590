"""How far the sampler's log-probs are from the trainer's: the training-inference mismatch.

When the policy that sampled a batch (its *behaviour* policy: an inference engine such as vLLM,
another precision, another kernel) is not the trainer's own forward, the two compute different
log-probs for the same tokens. With d_t = old_logp_t − behaviour_logp_t on every sampled token
(old_logp: the trainer's, the proximal policy the ratio is clipped against):

    abs_sum = Σ_t |d_t|,   abs_max = max_t |d_t|,
    k3_sum  = Σ_t (e^{d_t} − 1 − d_t)

k3 (Schulman, "Approximating KL divergence", 2020) is an unbiased, non-negative estimate of
KL(π_behaviour ‖ π_old) per token from tokens the behaviour policy sampled: with r = π_old/π_b,
E_b[r − 1 − log r] = E_b[r] − 1 + KL(π_b‖π_old) = KL(π_b‖π_old). These are diagnostics only (TRL
logs `sampling/sampling_logp_difference/mean` and `max`, verl `rollout_probs_diff_*`): sums and
a count, so that chunks and ranks add up before one division. A mean |d| near 0 can hide a few
tokens whose probability differs by a factor of 2; the max and k3 show them (Yao et al., "Your
efficient RL framework secretly brings you off-policy RL training", 2025).
"""

import math
from dataclasses import dataclass

import torch

from .advantages import over_tokens

Tensor = torch.Tensor


@dataclass(frozen=True)
class MismatchSums:
    """Σ|d|, max|d|, Σ k3 and the token count over the sampled tokens of some rows."""

    abs_sum: float = 0.0
    abs_max: float = float("-inf")  # -inf over no token (the identity of max)
    k3_sum: float = 0.0
    tokens: int = 0

    def __add__(self, other: "MismatchSums") -> "MismatchSums":
        return MismatchSums(
            self.abs_sum + other.abs_sum,
            max(self.abs_max, other.abs_max),
            self.k3_sum + other.k3_sum,
            self.tokens + other.tokens,
        )


def logp_mismatch(behaviour_logp: Tensor, old_logp: Tensor, mask: Tensor) -> MismatchSums:
    """The mismatch sums over the tokens where `mask` (N, T) bool is True; behaviour_logp and
    old_logp are (N, T) log-probs of the same tokens. Computed in float64 (a difference of two
    float32 log-probs is exact in float64, so the statistic adds no rounding of its own)."""
    d = (old_logp.double() - behaviour_logp.double())[mask]  # (M,)
    if d.numel() == 0:
        return MismatchSums()
    k3 = torch.expm1(d) - d  # e^d − 1 − d, accurate near d = 0
    stats = torch.stack([d.abs().sum(), d.abs().max(), k3.sum()]).tolist()  # one host sync
    return MismatchSums(stats[0], stats[1], stats[2], int(d.numel()))


# --- corrections: a weight or a mask per token from d_t = log π_old − log π_b -----------------
#
# The three policies (AReaL's decoupled PPO, arXiv 2505.24298): the behaviour policy π_b that
# sampled, the proximal policy π_old the ratio is clipped against, the current π_θ. The loss
# per token becomes  w_t · l_t  with l_t the objective's term and w_t (detached) one of:
#
#   truncated IS (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings you
#   off-policy RL training"):  token      w_t = clamp(ρ_t, low, high),  ρ_t = π_old/π_b
#                              sequence   w_t = clamp(Π_t ρ_t, low, high)       (the product)
#   rejection masks (RS): w_t = 0 outside a band, 1 inside, the statistic being ρ_t (token),
#   Π_t ρ_t (sequence) or (Π_t ρ_t)^(1/|y|) (geometric: SkyRL's mask, verl's seq_mean_k1
#   "Geo-RS");
#   DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556): w = 0 on a sequence with
#   Â < 0 whose mean log(π_b/π_θ) over its tokens exceeds δ.
#
# A weight and masks compose (they multiply). Masked IS (MIS; Liu, Li et al. 2025, "When speed
# kills stability": ρ·1[ρ in band]) is a weight and a mask of one level and one band (the
# weight's clamp never acts on a token the mask keeps): TRL's token_mask and sequence_mask, and
# IcePop (arXiv 2510.18855: M(ρ_t) = ρ_t inside [α, β], 0 outside) as the token one. Everything is computed in log space and float64:
# a product of 100 ratios of 1.1 is 13,780 (the "length trap" of sequence products), and a
# bound is a comparison of logs, so nothing overflows. Denominators are not touched: a masked
# token keeps its place in the loss's token and sequence counts (AReaL's rule: the counts are
# taken before rejection), which is why masks are zero weights, not a smaller loss mask.

WEIGHT_LEVELS = ("token", "sequence")
MASK_LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class Correction:
    """One correction: an optional truncated-IS weight, an optional band mask, and an optional
    off-policy sequence mask. Bounds are on ratios (not logs); None is no bound on that side."""

    weight: str | None = None  # WEIGHT_LEVELS: truncated importance sampling
    weight_low: float | None = None
    weight_high: float | None = None
    mask: str | None = None  # MASK_LEVELS: masked importance sampling
    mask_low: float | None = None
    mask_high: float | None = None
    opsm_delta: float | None = None  # DeepSeek-V3.2's threshold on mean log(π_b/π_θ)

    def __post_init__(self) -> None:
        if self.weight is not None and self.weight not in WEIGHT_LEVELS:
            raise ValueError(f"weight level must be one of {WEIGHT_LEVELS}; got {self.weight!r}")
        if self.mask is not None and self.mask not in MASK_LEVELS:
            raise ValueError(f"mask level must be one of {MASK_LEVELS}; got {self.mask!r}")
        for what, level, low, high in (("weight", self.weight, self.weight_low, self.weight_high),
                                       ("mask", self.mask, self.mask_low, self.mask_high)):  # fmt: skip
            if level is None:
                continue
            if low is None and high is None:
                raise ValueError(f"a {level} {what} needs a bound (low, high or both)")
            if any(b is not None and not b > 0 for b in (low, high)):
                raise ValueError(
                    f"the {what}'s bounds are ratios and must be > 0; got {low}, {high}"
                )
            if low is not None and high is not None and not low < high:
                raise ValueError(f"the {what}'s band needs low < high; got [{low}, {high}]")
        if self.opsm_delta is not None and not self.opsm_delta >= 0:
            raise ValueError(f"the off-policy mask's delta must be >= 0; got {self.opsm_delta}")

    @property
    def active(self) -> bool:
        return self.weight is not None or self.mask is not None or self.opsm_delta is not None


#: Named corrections, each with its source's default bounds.
CORRECTIONS: dict[str, Correction] = {
    "none": Correction(),
    # Yao et al.'s TIS-2 (verl rollout_is_threshold 2.0, slime --tis-clip 2.0)
    "token_tis": Correction(weight="token", weight_high=2.0),
    # verl's decoupled_seq_is (the sequence product, truncated at 2)
    "seq_tis": Correction(weight="sequence", weight_high=2.0),
    # token MIS: ρ_t where ρ_t <= 2, else 0 (TRL's token_mask, at 2)
    "token_mis": Correction(weight="token", weight_high=2.0, mask="token", mask_high=2.0),
    # TRL 1.16's default sequence_mask: Π ρ_t where it is <= 3, else 0 (the product)
    "seq_mis": Correction(weight="sequence", weight_high=3.0, mask="sequence", mask_high=3.0),
    # IcePop: ρ_t inside [0.5, 2], else 0 (arXiv 2510.18855; verl's icepop presets use [0.5, 5])
    "icepop": Correction(
        weight="token", weight_low=0.5, weight_high=2.0, mask="token", mask_low=0.5, mask_high=2.0
    ),
    # IcePop's band as a rejection alone: weight 1 inside (for --proximal behaviour, where a
    # weight would count the sampler's gap twice)
    "token_band": Correction(mask="token", mask_low=0.5, mask_high=2.0),
    # SkyRL's geometric sequence mask
    "geo_mask": Correction(mask="geometric", mask_low=0.99, mask_high=1.01),
    # verl's decoupled_geo_rs_token_tis: Geo-RS at ±0.1% and token TIS at 2
    "geo_mask_token_tis": Correction(
        weight="token", weight_high=2.0, mask="geometric", mask_low=0.999, mask_high=1.001
    ),
}


@dataclass(frozen=True)
class CorrectionSums:
    """What a correction did over some trained tokens: Σ w, min w and max w over the tokens it
    kept, tokens truncated (the weight's bound acted on a kept token), tokens masked, tokens
    seen."""

    weight_sum: float = 0.0
    weight_min: float = float("inf")
    weight_max: float = float("-inf")
    truncated: int = 0
    masked: int = 0
    tokens: int = 0

    def __add__(self, other: "CorrectionSums") -> "CorrectionSums":
        return CorrectionSums(
            self.weight_sum + other.weight_sum,
            min(self.weight_min, other.weight_min),
            max(self.weight_max, other.weight_max),
            self.truncated + other.truncated,
            self.masked + other.masked,
            self.tokens + other.tokens,
        )


def _row_statistic(d: Tensor, mask: Tensor, level: str) -> Tensor:
    """(N, T) log statistic of a level: d_t itself, or the row's Σ d (sequence) or mean d
    (geometric) on each of its tokens."""
    if level == "token":
        return d
    total = d.sum(-1, keepdim=True)  # (N, 1)
    if level == "geometric":
        total = total / mask.sum(-1, keepdim=True).clamp(min=1)
    return total.expand_as(d)


def correction_weights(
    proximal_logp: Tensor,  # (N, T) π_old (or, in bypass mode, the current policy, detached)
    behaviour_logp: Tensor,  # (N, T) π_b
    mask: Tensor,  # (N, T) the trained tokens
    correction: Correction,
    *,
    logp: Tensor | None = None,  # (N, T) current policy (the off-policy sequence mask's π_θ)
    advantages: Tensor | None = None,  # (N,)
) -> tuple[Tensor, CorrectionSums]:
    """The detached weight (N, T) float32 that multiplies each token's objective term, 0 at
    padding and on masked tokens, and what it did over the trained tokens. See the section's
    comment for the formulas; all in float64 log space."""
    mask = mask.bool()
    d = torch.where(mask, proximal_logp.detach().double() - behaviour_logp.detach().double(), 0.0)
    log_w = torch.zeros_like(d)  # (N, T)
    truncated = torch.zeros_like(mask)
    keep = mask.clone()
    if correction.weight is not None:
        stat = _row_statistic(d, mask, correction.weight)
        lo = -math.inf if correction.weight_low is None else math.log(correction.weight_low)
        hi = math.inf if correction.weight_high is None else math.log(correction.weight_high)
        log_w = stat.clamp(lo, hi)
        truncated = mask & ((stat < lo) | (stat > hi))
    if correction.mask is not None:
        stat = _row_statistic(d, mask, correction.mask)
        lo = -math.inf if correction.mask_low is None else math.log(correction.mask_low)
        hi = math.inf if correction.mask_high is None else math.log(correction.mask_high)
        keep &= (stat >= lo) & (stat <= hi)
    if correction.opsm_delta is not None:
        if logp is None or advantages is None:
            raise ValueError("the off-policy sequence mask needs the current logp and advantages")
        drift = torch.where(mask, behaviour_logp.detach().double() - logp.detach().double(), 0.0)
        mean_drift = drift.sum(-1) / mask.sum(-1).clamp(min=1)  # (N,)
        # a sequence (or, with per-token advantages, a token) that is punished and has drifted
        keep &= (
            over_tokens(advantages.detach() >= 0) | (mean_drift <= correction.opsm_delta)[:, None]
        )
    truncated &= keep  # a masked token was not truncated: it was dropped
    weight = torch.where(keep, log_w.exp(), 0.0)  # (N, T) float64
    kept = torch.cat([weight[keep], weight.new_full((1,), math.nan)])  # NaN: never a min or max
    stats = torch.stack([kept.nansum(), kept.nan_to_num(math.inf).min(),
                         kept.nan_to_num(-math.inf).max(), truncated.sum(),
                         (mask & ~keep).sum(), mask.sum()]).tolist()  # one host sync  # fmt: skip
    sums = CorrectionSums(stats[0], stats[1], stats[2], *(int(c) for c in stats[3:]))
    return weight.float(), sums
