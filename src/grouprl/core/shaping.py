"""Reward shaping that depends only on the completion, not on the task."""

import torch

Tensor = torch.Tensor


def overlong_penalty(lengths: Tensor, *, max_len: int, cache_len: int) -> Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, §3.4), added to the task reward:

        R_len(y) = 0                              if |y| ≤ L_max − L_cache
                 = ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| ≤ L_max
                 = −1                             if |y| > L_max

    i.e. clamp(((L_max − L_cache) − |y|) / L_cache, −1, 0). ``lengths`` (N,) are completion
    lengths in tokens; returns (N,) floats. Needs 0 < cache_len ≤ max_len.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(
            f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}"
        )
    if not lengths.is_floating_point():
        lengths = lengths.to(torch.get_default_dtype())
    return (((max_len - cache_len) - lengths) / cache_len).clamp(min=-1.0, max=0.0)  # (N,)
