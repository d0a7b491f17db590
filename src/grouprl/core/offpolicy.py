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

from dataclasses import dataclass

import torch

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
