"""Group sampling on Hugging Face causal LMs and exact completion log-probs.

- `sample_groups`: B prompts × G completions, each prompt prefilled once, KV-cached decoding of
  all B·G rows together; returns a `Rollout` with `old_logp` and the sampling entropy.
- `completion_logprobs`: teacher-forced log-probs (and entropy) of the completion tokens, with
  the prompt shared across its group and the vocab projection chunked; differentiable.
- `RolloutEngine`: the interface the trainer samples through; `HFRolloutEngine` implements it.
"""

from grouprl.rollout._hf import model_device
from grouprl.rollout.engine import HFRolloutEngine
from grouprl.rollout.logprobs import completion_logprobs
from grouprl.rollout.sampling import encode_prompts, sample_groups, stop_token_ids
from grouprl.rollout.types import Rollout, RolloutEngine

__all__ = [
    "HFRolloutEngine",
    "Rollout",
    "RolloutEngine",
    "completion_logprobs",
    "encode_prompts",
    "model_device",
    "sample_groups",
    "stop_token_ids",
]
