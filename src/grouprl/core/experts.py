"""Mixture-of-experts terms: the routers' load-balancing loss.

Switch Transformer (Fedus, Zoph and Shazeer, 2021, arXiv 2101.03961, eqs. 4-6): with f_e the
share of routed assignments that go to expert e and P_e the mean router probability of e,

    loss = E · Σ_e f_e · P_e,

which is 1 when routing is uniform (f_e = P_e = 1/E per choice) and grows as it concentrates.
With top-k routing each token makes k assignments, so Σ_e f_e = k. Transformers'
`load_balancing_loss_func` (the aux_loss that Qwen-MoE, OLMoE and Mixtral models return, and TRL
adds as router_aux_loss_coef · aux_loss) pools every layer before the product: f_e and P_e are
sums over all layers' real tokens divided by (layers × real tokens), not a mean of per-layer
losses. This is that formula.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor


def load_balancing_loss(gates: Sequence[tuple[Tensor, Tensor]], top_k: int) -> Tensor:
    """The balancing loss of routers' logits: `gates` holds each layer's (logits (M, E), real
    (M,) bool: the tokens that count, padding excluded); top-k taken from the softmax of the
    logits, as the routers choose. Returns a 0-dim float32 tensor, differentiable in the logits
    through P_e (f_e counts choices: no gradient). 0 with no real token."""
    if not gates:
        raise ValueError("no router logits to balance")
    experts = gates[0][0].shape[-1]
    device = gates[0][0].device
    assigned = torch.zeros(experts, dtype=torch.float32, device=device)  # Σ_l Σ_t one-hot top-k
    prob = torch.zeros(experts, dtype=torch.float32, device=device)  # Σ_l Σ_t softmax
    count = torch.zeros((), dtype=torch.float32, device=device)  # Σ_l real tokens
    for logits, real in gates:
        weight = real.to(device=device, dtype=torch.float32)  # (M,)
        probs = torch.softmax(logits.float(), dim=-1)  # (M, E)
        chosen = torch.topk(probs, top_k, dim=-1).indices  # (M, k)
        assigned = assigned.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        prob = prob + (probs * weight[:, None]).sum(0)
        count = count + weight.sum()
    count = count.clamp(min=1)  # no real token: 0 (both sums are 0)
    return experts * torch.sum((assigned / count) * (prob / count))
