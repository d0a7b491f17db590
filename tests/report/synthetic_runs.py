"""Synthetic run directories: a healthy run's metrics, any of which a test replaces."""

import json

import yaml

STEPS = 60


def ramp(a, b):
    """A metric going linearly from a at step 1 to b at the last step."""
    return lambda s: a + (b - a) * (s - 1) / (STEPS - 1)


HEALTHY = {  # a run that learns: GRPO, on-policy, reward and held-out rising together
    "reward_mean": ramp(0.3, 0.7),
    "accuracy": ramp(0.3, 0.7),
    "entropy": ramp(0.3, 0.15),
    "frac_zero_std": lambda s: 0.2,
    "frac_none_pass": lambda s: 0.1,
    "frac_all_pass": lambda s: 0.1,
    "zero_std_token_frac": lambda s: 0.2,
    "clip_frac_low": lambda s: 0.0,
    "clip_frac_high": lambda s: 0.0,
    "approx_kl": lambda s: 1e-6,
    "ratio_min": lambda s: 1.0,
    "ratio_max": lambda s: 1.0,
    "grad_norm": lambda s: 0.2 + 0.05 * (s % 3),
    "loss": lambda s: 0.01,
    "nonfinite_updates": lambda s: 0,
    "completion_len_mean": lambda s: 20.0,
    "truncated_frac": lambda s: 0.0,
    "step_seconds": lambda s: 0.5,
    "tokens_per_s": lambda s: 1000.0,
}
HEALTHY_EVAL = {0: 0.3, 15: 0.4, 30: 0.5, 45: 0.6, 60: 0.68}


def make_run(path, config=None, evals=None, samples=(), **series):
    path.mkdir(parents=True)
    cfg = {"algo": "grpo", "minibatches": 1, "epochs": 1, "ratio_level": "token",
           "max_grad_norm": 1.0, **(config or {})}  # fmt: skip
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    funcs = {**HEALTHY, **series}
    with (path / "metrics.jsonl").open("w") as f:
        for s in range(1, STEPS + 1):
            record = {"step": s}
            for key, fn in funcs.items():
                if fn is not None:
                    record[key] = fn(s)
            f.write(json.dumps(record) + "\n")
    with (path / "eval.jsonl").open("w") as f:
        for s, v in (evals or HEALTHY_EVAL).items():
            f.write(json.dumps({"step": s, "pass_at_1": v}) + "\n")
    with (path / "samples.jsonl").open("w") as f:
        for sample in samples:
            f.write(json.dumps(sample) + "\n")
    return path
