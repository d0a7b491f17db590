"""The seeds' three worked examples (`grouprl explain`), every number computed live by grouprl.core.

1. Group-relative advantages (GRPO): rewards [1, 0, 1, 0] give [1, −1, 1, −1]; equal rewards give 0.
2. Why GSPO normalises by length: a mean token log-ratio of 0.1 is a sequence ratio e^0.1 for any
   length, while the product of 2000 token ratios is e^200 (kept in log space: no overflow).
3. Where the clip binds: token ratios 2.0 and 0.5 are clipped by a token-level clip (ε = 0.2);
   their geometric mean, GSPO's sequence ratio 1.0, is not.
4. The same two tokens under CISPO, SAPO and GPG: the gradient each token keeps, per unit of
   ∇log π. The clip stops one token each way; CISPO's capped weight, SAPO's gate and GPG's plain
   REINFORCE stop none.
5. Example 1's batch under verl's other baselines (grouprl.core.estimators): the group [1, 0, 0, 0]
   as GRPO, RLOO, OPO, GPG, REINFORCE++ (with and without its baseline) and Pass@k see it.
6. The entropy mechanism (grouprl.core.entropy): that group's GRPO advantages on two tokens per
   completion, a confident one (π 0.9) and an unlikely one (π 0.05); the covariance of log π and
   Â says which token's update lowers the entropy most, which Clip-Cov holds back and KL-Cov
   penalises.
7. A changed route in a mixture-of-experts model: one token of 64 sent to another expert by an
   update (probability 0.5 -> 0.2) has token ratio 0.4, far outside GRPO's clip range, while the
   sequence ratio moves by 1/64 of that token's log-ratio (GSPO's case for MoE models).
"""

import math

import torch
from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table

from grouprl.core import (
    cispo_objective,
    clipped_objective,
    gpg_advantages,
    gpg_objective,
    group_advantages,
    log_ratio,
    opo_advantages,
    passk_advantages,
    policy_loss,
    reinforce_pp_advantages,
    sapo_objective,
)
from grouprl.core.entropy import clip_cov_candidates, covariance_count, token_covariance

EPSILON = 0.2  # the clip range of example 3
SIGNS = {"A=+1": 1.0, "A=-1": -1.0}


def _exp_text(log_value: float) -> str:
    """e^x written from x alone, so e^200 needs no float that could overflow."""
    if abs(log_value) < 10:
        return f"{math.exp(log_value):.3g}"
    exponent = math.floor(log_value / math.log(10))
    mantissa = 10 ** (log_value / math.log(10) - exponent)
    return f"e^{log_value:.0f} ≈ {mantissa:.1f}e{exponent}"


def _advantages_example() -> dict:
    groups = [
        [1.0, 0.0, 1.0, 0.0],
        [1.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 1.0, 1.0],
        [0.0, 0.0, 0.0, 0.0],
    ]
    rewards = torch.tensor(groups, dtype=torch.float64)  # (B, G)
    advantages = group_advantages(rewards, eps=0.0)  # (B, G): eps 0 gives the seeds' exact numbers
    return {
        "std": "population",
        "eps": 0.0,
        "groups": [
            {
                "rewards": r,
                "mean": rewards[b].mean().item(),
                "std": rewards[b].std(unbiased=False).item(),
                "advantages": advantages[b].tolist(),
            }
            for b, r in enumerate(groups)
        ],
    }


def _sequence_ratio_example() -> dict:
    lengths, mean_log_ratio = [5, 2000], 0.1
    old_logp = torch.full((2, max(lengths)), math.log(0.5), dtype=torch.float64)  # (N, T)
    logp = old_logp + mean_log_ratio  # (N, T)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]  # (N, T)
    sequence = log_ratio(logp, old_logp, mask, level="sequence")[:, 0]  # (N,)
    token_sum = log_ratio(logp, old_logp, mask, level="token").sum(-1)  # (N,) log of the product
    return {
        "mean_log_ratio": mean_log_ratio,
        "completions": [
            {
                "tokens": n,
                "sequence_log_ratio": sequence[i].item(),
                "sequence_ratio": sequence[i].exp().item(),
                "token_log_ratio_sum": token_sum[i].item(),
                "token_ratio_product": _exp_text(token_sum[i].item()),
            }
            for i, n in enumerate(lengths)
        ],
    }


def _clipping_example() -> dict:
    old_p, new_p = [0.20, 0.50], [0.40, 0.25]
    old_logp = torch.tensor([old_p], dtype=torch.float64).log()  # (1, 2)
    logp = torch.tensor([new_p], dtype=torch.float64).log()  # (1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)  # (1, 2)
    token_ratio = log_ratio(logp, old_logp, mask, level="token").exp()[0]  # (2,)
    seq_ratio = log_ratio(logp, old_logp, mask, level="sequence").exp()[0, :1]  # (1,)
    data: dict = {
        "epsilon": EPSILON,
        "old_probs": old_p,
        "new_probs": new_p,
        "token_ratios": token_ratio.tolist(),
        "clipped_token_ratios": token_ratio.clamp(1 - EPSILON, 1 + EPSILON).tolist(),
        "sequence_ratio": seq_ratio.item(),
    }
    for unit, ratio in (("token", token_ratio), ("sequence", seq_ratio)):
        for sign, a in SIGNS.items():
            objective = clipped_objective(
                ratio, torch.tensor(a, dtype=ratio.dtype), clip_low=EPSILON, clip_high=EPSILON
            )
            data.setdefault(f"{unit}_objective", {})[sign] = objective.tolist()
            data.setdefault(f"{unit}_clip_binds", {})[sign] = (objective != ratio * a).tolist()
            level = "token" if unit == "token" else "sequence"
            out = policy_loss(
                logp,
                old_logp,
                torch.tensor([a], dtype=torch.float64),
                mask,
                level=level,
                clip_low=EPSILON,
                clip_high=EPSILON,
            )
            data.setdefault(f"{unit}_clip_frac", {})[sign] = {
                "low": out.clip_frac_low.item(),
                "high": out.clip_frac_high.item(),
            }
    return data


def _term(name: str, ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """The objective's term with core's defaults (CISPO cap 5; SAPO τ 1 and 1.05)."""
    if name == "cispo":
        return cispo_objective(ratio, logp, adv)
    if name == "sapo":
        return sapo_objective(ratio, adv)
    if name == "gpg":
        return gpg_objective(logp, adv)
    return clipped_objective(ratio, adv, clip_low=EPSILON, clip_high=EPSILON)


def _objectives_example() -> dict:
    """d(term)/d(log π) of each token under the clip (ε = 0.2), CISPO (cap 5) and SAPO (τ 1 and
    1.05), by autograd through grouprl.core's functions."""
    old_p, new_p = [0.20, 0.50], [0.40, 0.25]
    old_logp = torch.tensor(old_p, dtype=torch.float64).log()
    slopes: dict = {}
    for name in ("clip", "cispo", "sapo", "gpg"):
        for sign, a in SIGNS.items():
            logp = torch.tensor(new_p, dtype=torch.float64).log().requires_grad_(True)
            ratio, adv = (logp - old_logp).exp(), torch.full((2,), a, dtype=torch.float64)
            term = _term(name, ratio, logp, adv)
            (grad,) = torch.autograd.grad(term.sum(), logp)
            slopes.setdefault(name, {})[sign] = grad.tolist()
    return {"old_probs": old_p, "new_probs": new_p, "epsilon": EPSILON, "cispo_cap": 5.0,
            "sapo_tau": [1.0, 1.05], "slopes": slopes}  # fmt: skip


#: Example 1's groups with a trained-token count per completion (OPO and REINFORCE++ weigh by it).
_LENGTHS = [[4, 8, 4, 8], [4, 8, 8, 8], [6, 6, 6, 6], [6, 6, 6, 6]]


def _estimators_example() -> dict:
    """Example 1's batch (eps 0) under each estimator; the group shown is [1, 0, 0, 0]."""
    groups = _advantages_example()["groups"]
    rewards = torch.tensor([g["rewards"] for g in groups], dtype=torch.float64)  # (B, G)
    lengths = torch.tensor(_LENGTHS)
    estimates = {
        "grpo": group_advantages(rewards, eps=0.0),
        "rloo": group_advantages(rewards, estimator="rloo", eps=0.0),
        "opo": opo_advantages(rewards, lengths),
        "gpg": gpg_advantages(rewards),
        "reinforce_pp_baseline": reinforce_pp_advantages(rewards, lengths, baseline=True),
        "reinforce_pp": reinforce_pp_advantages(rewards, lengths, baseline=False),
        "grpo_passk": passk_advantages(rewards, eps=0.0),
    }
    return {"rewards": rewards.tolist(), "lengths": _LENGTHS, "shown": 1,
            "advantages": {name: a.tolist() for name, a in estimates.items()}}  # fmt: skip


#: Example 6: each completion's two tokens' probabilities, and verl's Clip-Cov band and KL-Cov share
_COV_PROBS, _COV_BAND, _KL_COV_RATIO = [0.9, 0.05], (1.0, 5.0), 2e-4


def _covariance_example() -> dict:
    """Example 1's group [1, 0, 0, 0] with GRPO's advantages, each completion the tokens
    `_COV_PROBS`: cov_t = (Â − mean Â)·(log π_t − mean log π) over the 8 tokens; Clip-Cov's
    candidates lie in the band, KL-Cov's choice is the top covariance."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    adv = group_advantages(rewards, eps=0.0)[0]  # (4,)
    logp = torch.tensor(_COV_PROBS, dtype=torch.float64).log().expand(4, 2)  # (4, 2)
    mask = torch.ones(4, 2, dtype=torch.bool)
    mean_adv, mean_logp = float(adv.mean()), float(logp.mean())
    cov = token_covariance(adv, logp, mask, mean_adv, mean_logp)  # (4, 2)
    k = covariance_count(_KL_COV_RATIO, int(mask.sum()))
    top = torch.zeros(8, dtype=torch.bool)
    top[cov.flatten().topk(k).indices] = True
    return {"probs": _COV_PROBS, "advantages": adv.tolist(), "mean_logp": mean_logp,
            "covariance": cov.tolist(), "band": list(_COV_BAND), "kl_cov_ratio": _KL_COV_RATIO,
            "clip_cov_candidates": clip_cov_candidates(cov, *_COV_BAND).tolist(),
            "kl_cov_selected": top.view(4, 2).tolist()}  # fmt: skip


def _route_example() -> dict:
    """One completion of 64 tokens after an update that sends token 10 to another expert (its
    probability 0.50 -> 0.20) and leaves every other token's near where it was (×1.01): the
    token's own ratio, and the sequence ratio that GSPO takes instead."""
    length, changed = 64, 9
    old_p = torch.full((1, length), 0.5, dtype=torch.float64)
    new_p = old_p * 1.01
    new_p[0, changed] = 0.2
    mask = torch.ones(1, length, dtype=torch.bool)
    token = log_ratio(new_p.log(), old_p.log(), mask, level="token")[0]  # (T,)
    sequence = log_ratio(new_p.log(), old_p.log(), mask, level="sequence")[0, 0]
    rest = torch.cat([token[:changed], token[changed + 1 :]])
    return {
        "tokens": length,
        "rerouted_token": changed + 1,
        "old_prob": 0.5,
        "new_prob": 0.2,
        "rerouted_log_ratio": token[changed].item(),
        "rerouted_ratio": token[changed].exp().item(),
        "other_log_ratio": rest.mean().item(),
        "sequence_log_ratio": sequence.item(),
        "sequence_ratio": sequence.exp().item(),
        "sequence_without_reroute": rest.mean().exp().item(),
        "epsilon": EPSILON,
    }


def _route_table(route: dict) -> tuple[Table, list[str]]:
    table = _table(
        f"7. A changed route (mixture of experts): token {route['rerouted_token']} of "
        f"{route['tokens']} goes to another expert",
        ["", "log-ratio", "ratio"],
    )
    table.add_row(f"token {route['rerouted_token']} (rerouted)",
                  _num(route["rerouted_log_ratio"]), _num(route["rerouted_ratio"]))  # fmt: skip
    table.add_row("every other token", _num(route["other_log_ratio"], 4),
                  _num(math.exp(route["other_log_ratio"]), 4))  # fmt: skip
    table.add_row("the sequence (GSPO)", _num(route["sequence_log_ratio"], 4),
                  _num(route["sequence_ratio"], 4))  # fmt: skip
    eps = route["epsilon"]
    notes = [
        f"The rerouted token's ratio {route['rerouted_ratio']:.2f} is far outside GRPO's "
        f"[{1 - eps:g}, {1 + eps:g}]: one expert choice decides whether that token learns.",
        f"In the sequence ratio the same change is 1/{route['tokens']} of its log: "
        f"{route['sequence_ratio']:.4f} against {route['sequence_without_reroute']:.4f} without "
        "it (GSPO's argument for MoE models, Zheng et al. 2025: no routing replay needed).",
    ]
    return table, notes


def worked_examples() -> dict:
    """All numbers of the seven examples (what ``grouprl explain --json`` prints)."""
    return {
        "advantages": _advantages_example(),
        "sequence_ratio": _sequence_ratio_example(),
        "clipping": _clipping_example(),
        "objectives": _objectives_example(),
        "estimators": _estimators_example(),
        "covariance": _covariance_example(),
        "route": _route_example(),
    }


def _num(x: float, digits: int = 3) -> str:
    return f"{x + 0.0:.{digits}f}"  # + 0.0 turns -0.0 into 0.0


def _vector(xs: list[float], digits: int = 3) -> str:
    return "[" + ", ".join(_num(x, digits) for x in xs) + "]"


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    return table


def _objectives_table(obj: dict) -> tuple[Table, list[str]]:
    table = _table(
        "4. The gradient each token keeps, per unit of ∇log π: clip, CISPO, SAPO, GPG",
        ["token", "r", "clip Â=+1", "-1", "CISPO +1", "-1", "SAPO +1", "-1", "GPG +1", "-1"],
    )
    names = ("clip", "cispo", "sapo", "gpg")
    for i, (old, new) in enumerate(zip(obj["old_probs"], obj["new_probs"], strict=True)):
        slopes = [obj["slopes"][n][s][i] for n in names for s in SIGNS]
        table.add_row(str(i + 1), _num(new / old, 2), *(_num(x, 2) for x in slopes))
    notes = [
        f"The clip (ε = {obj['epsilon']:g}) stops token 1 when Â > 0 and token 2 when Â < 0.",
        f"CISPO: sg(min(r, {obj['cispo_cap']:g}))·Â·log π: every token keeps r·Â.",
        "SAPO: σ(τ(r−1))·4/τ·Â: slope Â at r = 1, fading away from it, never 0.",
        "GPG: Â·log π, no ratio: slope Â however far the policy moved.",
    ]
    return table, notes


def _estimators_table(est: dict) -> tuple[Table, list[str]]:
    b = est["shown"]
    rewards, lengths = est["rewards"][b], est["lengths"][b]
    table = _table(
        f"5. Example 1's group {_vector(rewards, 0)}, by estimator",
        ["estimator", *(f"o{i + 1}" for i in range(len(rewards)))],
    )
    for name, advantages in est["advantages"].items():
        table.add_row(name, *(_num(x) for x in advantages[b]))
    notes = [
        f"Its completions' tokens: {', '.join(map(str, lengths))} (opo and reinforce_pp weigh by them).",
        "rloo: against the others' mean; opo: the length-weighted mean 4/28, no std.",
        "gpg: α = 16 completions / 7 rewarded = 2.29 times R − mean, no std.",
        "reinforce_pp: R whitened over the batch's tokens; _baseline: R − mean first.",
        "grpo_passk: only the best learns: its margin over the second / the std.",
    ]
    return table, notes


def _covariance_table(cov: dict) -> tuple[Table, list[str]]:
    table = _table(
        "6. The entropy mechanism: cov(log π, Â) per token of example 1's group",
        ["token", "π", "Â", "log π − mean", "cov", "Clip-Cov band", "KL-Cov top"],
    )
    for i, label in ((0, "o1"), (1, "o2-o4")):
        for j, p in enumerate(cov["probs"]):
            centred = math.log(p) - cov["mean_logp"]
            table.add_row(f"{label} t{j + 1}", _num(p, 2), _num(cov["advantages"][i]),
                          _num(centred), _num(cov["covariance"][i][j]),
                          "in" if cov["clip_cov_candidates"][i][j] else "-",
                          "top" if cov["kl_cov_selected"][i][j] else "-")  # fmt: skip
    low, high = cov["band"]
    notes = [
        "The entropy falls by this covariance (Cui et al. 2025): rewarding a likely",
        "token (o1 t1) or penalising an unlikely one (o2-o4 t2) sharpens the policy;",
        "o1 t2 and o2-o4 t1 have negative covariance: their updates raise it.",
        f"Clip-Cov: a random share of the tokens with {low:g} < cov < {high:g} lose their gradient.",
        f"KL-Cov: the top {cov['kl_cov_ratio']:g} of the tokens by cov (at least 1) pay coef·|log r|.",
    ]
    return table, notes


def _advantages_table(adv: dict) -> tuple[Table, list[str]]:
    table = _table(
        "1. Group-relative advantages (GRPO): Â_i = (R_i − mean R) / std R",
        ["rewards R", "mean", "std", "advantages Â"],
    )
    for g in adv["groups"]:
        table.add_row(
            _vector(g["rewards"], 0), _num(g["mean"], 2), _num(g["std"]), _vector(g["advantages"])
        )
    notes = [
        "The group mean is the baseline (no critic needed); the advantages sum to 0.",
        "Equal rewards give all zeros: a zero-variance group adds no gradient.",
        f"({adv['std']} std, eps = {adv['eps']:g} here; training adds eps = 1e-4 to the std)",
    ]
    return table, notes


def _sequence_ratio_table(seq: dict) -> tuple[Table, list[str]]:
    table = _table(
        f"2. GSPO's sequence ratio vs the product of token ratios (mean log-ratio {seq['mean_log_ratio']:g})",
        ["tokens |y|", "mean log-ratio", "GSPO ratio e^mean", "product of token ratios"],
    )
    for c in seq["completions"]:
        table.add_row(
            str(c["tokens"]),
            _num(c["sequence_log_ratio"]),
            _num(c["sequence_ratio"]),
            c["token_ratio_product"],
        )
    notes = [
        "GSPO's ratio is a geometric mean: its range does not grow with length.",
        "The product is kept in log space (multiplied out, float32 overflows at e^89).",
    ]
    return table, notes


def _clipping_table(clip: dict) -> tuple[Table, list[str]]:
    eps = clip["epsilon"]
    table = _table(
        f"3. Where the clip binds (ε = {eps:g}): objective min(r·Â, clip(r, {1 - eps:g}, {1 + eps:g})·Â)",
        ["", "old p", "new p", "ratio r", "clip(r)", "Â=+1", "Â=-1", "clip binds"],
    )
    rows = [(f"token {i + 1}", "token", i) for i in range(2)] + [("sequence", "sequence", 0)]
    olds = [*clip["old_probs"], math.prod(clip["old_probs"])]
    news = [*clip["new_probs"], math.prod(clip["new_probs"])]
    ratios = [*clip["token_ratios"], clip["sequence_ratio"]]
    for k, (name, unit, i) in enumerate(rows):
        objective = clip[f"{unit}_objective"]
        binds = [s for s in SIGNS if clip[f"{unit}_clip_binds"][s][i]]
        table.add_row(
            name,
            _num(olds[k], 2),
            _num(news[k], 2),
            _num(ratios[k], 2),
            _num(min(max(ratios[k], 1 - eps), 1 + eps), 2),
            _num(objective["A=+1"][i], 2),
            _num(objective["A=-1"][i], 2),
            " and ".join("if Â > 0" if SIGNS[s] > 0 else "if Â < 0" for s in binds) or "never",
        )
    frac = clip["token_clip_frac"]
    notes = [
        "Where the clip binds, the clipped term wins: that token gets no gradient.",
        f"Token level (GRPO): clipped share {frac['A=+1']['high']:.2f} for Â > 0, "
        f"{frac['A=-1']['low']:.2f} for Â < 0.",
        f"Sequence level (GSPO): s = √(2.0·0.5) = {clip['sequence_ratio']:.2f}, in "
        f"[{1 - eps:g}, {1 + eps:g}]: not clipped.",
    ]
    return table, notes


def render(data: dict, console: Console) -> None:
    """The seven examples as tables, each with its notes."""
    examples = [
        _advantages_table(data["advantages"]),
        _sequence_ratio_table(data["sequence_ratio"]),
        _clipping_table(data["clipping"]),
        _objectives_table(data["objectives"]),
        _estimators_table(data["estimators"]),
        _covariance_table(data["covariance"]),
        _route_table(data["route"]),
    ]
    console.print("GRPO and GSPO in seven worked examples (every number computed by grouprl.core)")
    for table, notes in examples:
        console.print()
        console.print(table)
        for note in notes:
            console.print(Padding(note, (0, 0, 0, 2), expand=False))
