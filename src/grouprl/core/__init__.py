"""grouprl.core: the math of GRPO and GSPO, in plain functions of tensors.

Imports torch and the standard library only: no models, configs, I/O or torch.distributed, so
the trainer, the distributed code and the tests all call the same few functions. See
advantages.py (group-relative advantages), estimators.py (REINFORCE++, OPO, GPG, Pass@k), entropy.py (entropy control), distill.py (on-policy distillation), loss.py (ratios, KL, aggregation, the clipped loss),
objectives.py (CISPO, SAPO, GMPO, VESPO), shaping.py (DAPO's overlong penalty) and offpolicy.py
(how far a sampler's log-probs are from the trainer's, and the corrections for it) for the formulas and their papers.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    gdpo_advantages,
    group_advantages,
    mixed_groups,
    zero_variance_groups,
)
from .distill import distillation_advantages, generalized_jsd, reverse_kl
from .estimators import (
    ESTIMATORS,
    gpg_advantages,
    opo_advantages,
    passk_advantages,
    reinforce_pp_advantages,
    remax_advantages,
)
from .loss import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    MAX_LOG_RATIO,
    OBJECTIVES,
    RATIO_LEVELS,
    LossOptions,
    LossStats,
    PolicyLoss,
    aggregate,
    bounded_tokens,
    cispo_objective,
    clipped_objective,
    gmpo_objective,
    gpg_objective,
    importance_ratio,
    kl_penalty,
    log_ratio,
    mean_over,
    policy_loss,
    sapo_objective,
    vespo_objective,
)
from .objectives import COVARIANCE_OBJECTIVES, kl_cov_objective
from .offpolicy import (
    CORRECTIONS,
    MASK_LEVELS,
    WEIGHT_LEVELS,
    Correction,
    CorrectionSums,
    MismatchSums,
    correction_weights,
    logp_mismatch,
)
from .shaping import overlong_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "CORRECTIONS",
    "COVARIANCE_OBJECTIVES",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "MASK_LEVELS",
    "MAX_LOG_RATIO",
    "OBJECTIVES",
    "RATIO_LEVELS",
    "WEIGHT_LEVELS",
    "Correction",
    "CorrectionSums",
    "LossOptions",
    "LossStats",
    "MismatchSums",
    "PolicyLoss",
    "aggregate",
    "bounded_tokens",
    "cispo_objective",
    "clipped_objective",
    "correction_weights",
    "distillation_advantages",
    "gdpo_advantages",
    "generalized_jsd",
    "gmpo_objective",
    "gpg_advantages",
    "gpg_objective",
    "group_advantages",
    "importance_ratio",
    "kl_cov_objective",
    "kl_penalty",
    "log_ratio",
    "logp_mismatch",
    "mean_over",
    "mixed_groups",
    "opo_advantages",
    "overlong_penalty",
    "passk_advantages",
    "policy_loss",
    "reinforce_pp_advantages",
    "remax_advantages",
    "reverse_kl",
    "sapo_objective",
    "vespo_objective",
    "zero_variance_groups",
]
