"""grouprl.core: the math of GRPO and GSPO, in plain functions of tensors.

Imports torch and the standard library only: no models, configs, I/O or torch.distributed, so
the trainer, the distributed code and the tests all call the same few functions. See
advantages.py (group-relative advantages), estimators.py (REINFORCE++, OPO, GPG, Pass@k), entropy.py (entropy control), distill.py (on-policy distillation), experts.py (the routers' balancing loss), loss.py (ratios, KL, aggregation, the clipped loss),
objectives.py (CISPO, SAPO, GMPO, VESPO), shaping.py (DAPO's overlong penalty) and offpolicy.py
(how far a sampler's log-probs are from the trainer's, and the corrections for it) for the formulas and their papers;
registry.py names the estimators and objectives (torch-free: the command line reads it).

The names below load on first use, so `grouprl.core.registry` stays importable without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each public name and the module of grouprl.core that defines it.
_HOMES = {
    "ADVANTAGE_SCALES": "advantages",
    "BASELINES": "advantages",
    "gdpo_advantages": "advantages",
    "group_advantages": "advantages",
    "mixed_groups": "advantages",
    "process_advantages": "advantages",
    "over_tokens": "advantages",
    "zero_variance_groups": "advantages",
    "distillation_advantages": "distill",
    "load_balancing_loss": "experts",
    "generalized_jsd": "distill",
    "reverse_kl": "distill",
    "gpg_advantages": "estimators",
    "opo_advantages": "estimators",
    "passk_advantages": "estimators",
    "reinforce_pp_advantages": "estimators",
    "remax_advantages": "estimators",
    "AGGREGATIONS": "loss",
    "KL_ESTIMATORS": "loss",
    "MAX_LOG_RATIO": "loss",
    "RATIO_LEVELS": "loss",
    "LossOptions": "loss",
    "LossStats": "loss",
    "PolicyLoss": "loss",
    "aggregate": "loss",
    "bounded_tokens": "loss",
    "cispo_objective": "objectives",
    "clipped_objective": "loss",
    "gmpo_objective": "objectives",
    "gpg_objective": "objectives",
    "importance_ratio": "loss",
    "kl_penalty": "loss",
    "kl_reward_penalty": "loss",
    "log_ratio": "loss",
    "mean_over": "loss",
    "policy_loss": "loss",
    "sapo_objective": "objectives",
    "vespo_objective": "objectives",
    "kl_cov_objective": "objectives",
    "CORRECTIONS": "offpolicy",
    "MASK_LEVELS": "offpolicy",
    "WEIGHT_LEVELS": "offpolicy",
    "Correction": "offpolicy",
    "CorrectionSums": "offpolicy",
    "MismatchSums": "offpolicy",
    "correction_weights": "offpolicy",
    "logp_mismatch": "offpolicy",
    "ADVANTAGE_ESTIMATORS": "registry",
    "OBJECTIVES": "registry",
    "Estimator": "registry",
    "Objective": "registry",
    "register_estimator": "registry",
    "register_objective": "registry",
    "overlong_penalty": "shaping",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'grouprl.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
