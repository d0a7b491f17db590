"""Each objective reaches the loss through the trainer: one update of `grouprl train`'s step, on
a sampled batch, calls core's policy_loss with that objective, and the gradient it gets at the
log-probs is the gradient of core's function on the same batch (recomputed here); the knobs of
another objective, or a clip range for one no clip bounds, are one line."""

from __future__ import annotations

import copy

import pytest
import torch

from grouprl.config import TrainConfig, resolve
from grouprl.config.validation import loss_options
from grouprl.core import policy_loss
from grouprl.errors import UserError
from grouprl.models import load_model, load_tokenizer
from grouprl.rollout import sample_groups
from grouprl.tasks import get_task
from grouprl.train import step as train_step
from grouprl.train import update as train_update
from grouprl.train.batch import Batch
from grouprl.train.parallel.distributed import SINGLE
from numerics import forward_bound, logit_magnitude


@pytest.fixture(scope="module")
def policy_and_batch():
    policy = load_model("builtin:arith").eval()
    rows = get_task("arithmetic").train[:4]
    rollout = sample_groups(policy, load_tokenizer("builtin:arith"), [r["prompt"] for r in rows],
                            group_size=4, max_new_tokens=20, seed=5)  # fmt: skip
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0.0])
    return policy, Batch(rollout, list(rows), rewards, {"correct": rewards}, rewards >= 1)


@pytest.fixture
def seen(monkeypatch):
    """Every call of the trainer's policy_loss: its inputs, options and the gradient it gave
    the log-probs."""
    calls = []
    original = train_update.policy_loss

    def spy(logp, old_logp, advantages, mask, **kwargs):
        logp.register_hook(lambda grad: calls.append((logp.detach(), old_logp, advantages, mask,
                                                      kwargs, grad)))  # fmt: skip
        return original(logp, old_logp, advantages, mask, **kwargs)

    monkeypatch.setattr(train_update, "policy_loss", spy)
    return calls


def recomputed(call) -> torch.Tensor:
    """core's gradient at the call's inputs."""
    logp, old, adv, mask, kwargs, _ = call
    x = logp.clone().requires_grad_(True)
    policy_loss(x, old, adv, mask, **kwargs).loss.backward()
    return x.grad


@pytest.mark.parametrize(("algo", "objective"), [("cispo", "cispo"), ("sapo", "sapo"),
                         ("gmpo", "gmpo"), ("luspo", "clip"), ("vespo", "vespo")])  # fmt: skip
def test_an_update_trains_cores_objective(policy_and_batch, algo, objective, seen):
    policy, batch = policy_and_batch
    cfg = resolve(TrainConfig(algo=algo, prompts_per_step=4, group_size=4, lr=1e-2),
                  task_max_new_tokens=20)  # fmt: skip
    model = copy.deepcopy(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    advantages = train_step.batch_advantages(cfg, batch, SINGLE)
    train_update.update(cfg, model, optimizer, batch, advantages, None)
    assert len(seen) == cfg.minibatches == 4  # the last ones off-policy
    for call in seen:
        options = call[4]["options"]
        assert options == loss_options(cfg) and options.objective == objective
        assert torch.equal(recomputed(call), call[5])
    last_logp, last_old, *_ = seen[-1]
    assert not torch.equal(last_logp, last_old)  # the last minibatch was off-policy


@pytest.mark.parametrize(("algo", "flags", "expected"), [
    ("cispo", ["--cispo-cap", "3"], {"objective": "cispo", "cispo_cap": 3.0}),
    ("sapo", ["--sapo-tau-neg", "2"], {"objective": "sapo", "sapo_tau_neg": 2.0}),
    ("gmpo", [], {"objective": "gmpo", "clip_low": 0.4, "clip_high": 0.4}),
    ("luspo", [], {"objective": "clip", "agg": "seq_mean_token_sum", "level": "sequence"}),
    ("vespo", ["--vespo-k-neg", "4"], {"objective": "vespo", "vespo_k_neg": 4.0}),
])  # fmt: skip
def test_the_command_line_trains_cores_objective(algo, flags, expected, tmp_path, seen):
    """`grouprl train --algo X --steps 1`: every update of the step calls core's loss with the
    flags' objective and knobs, and core's function on the same inputs gives its gradient."""
    from grouprl.cli import main

    assert main(["train", "--algo", algo, *flags, "--steps", "1", "--prompts-per-step", "4",
                 "--group-size", "4", "--eval-size", "2", "--eval-samples", "1", "--no-progress",
                 "--report-to", "none", "--output-dir", str(tmp_path / "run")]) == 0  # fmt: skip
    assert seen
    for call in seen:
        options = call[4]["options"]
        assert {k: getattr(options, k) for k in expected} == expected
        assert torch.equal(recomputed(call), call[5])


def test_knobs_of_another_objective_are_one_line():
    def run(**options):
        return resolve(TrainConfig(**options), task_max_new_tokens=8)

    assert run(algo="sapo").sapo_tau_neg == 1.05 and run(algo="sapo").cispo_cap is None
    assert run(algo="cispo", cispo_cap=3.0).cispo_cap == 3.0
    with pytest.raises(UserError, match="--sapo-tau-pos is a knob of --objective sapo"):
        run(algo="grpo", sapo_tau_pos=2.0)
    with pytest.raises(UserError, match="--clip-high does not apply to --objective cispo"):
        run(algo="cispo", clip_high=0.3)
    with pytest.raises(UserError, match="needs ratio level 'token'"):
        run(algo="vespo", ratio_level="sequence")
    assert run(algo="grpo", objective="sapo").objective == "sapo"  # any preset, any objective


@pytest.mark.parametrize("algo", ["reinforce_pp", "reinforce_pp_baseline", "opo", "gpg",
                                  "grpo_passk"])  # fmt: skip
def test_an_update_trains_on_verls_other_estimators(policy_and_batch, algo, seen):
    """The trainer's advantages are core's estimator on the batch's rewards and trained-token
    counts (over the whole batch), and each update's gradient is core's loss on them."""
    from grouprl.core import estimators

    policy, batch = policy_and_batch
    cfg = resolve(TrainConfig(algo=algo, prompts_per_step=4, group_size=4, lr=1e-2),
                  task_max_new_tokens=20)  # fmt: skip
    rewards, lengths = batch.rewards.view(4, 4), batch.rollout.sampled_lengths.view(4, 4)
    expected = {
        "reinforce_pp": lambda: estimators.reinforce_pp_advantages(rewards, lengths, baseline=False),
        "reinforce_pp_baseline": lambda: estimators.reinforce_pp_advantages(rewards, lengths,
                                                                            baseline=True),
        "opo": lambda: estimators.opo_advantages(rewards, lengths),
        "gpg": lambda: estimators.gpg_advantages(rewards),
        "grpo_passk": lambda: estimators.passk_advantages(rewards, eps=cfg.adv_eps,
                                                          unbiased_std=cfg.unbiased_std),
    }[algo]().reshape(-1).float()  # fmt: skip
    advantages = train_step.batch_advantages(cfg, batch, SINGLE)
    assert torch.equal(advantages, expected) and advantages.abs().sum() > 0
    model = copy.deepcopy(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    train_update.update(cfg, model, optimizer, batch, advantages, None)
    assert seen
    for call in seen:
        assert call[4]["options"].objective == ("gpg" if algo == "gpg" else "clip")
        assert torch.equal(recomputed(call), call[5])


@pytest.mark.parametrize(("options", "message"), [
    ({"algo": "opo", "minibatches": 2}, "opo's baseline is optimal only exactly on-policy"),
    ({"algo": "opo", "beta": 0.04}, "no KL term"),
    ({"algo": "reinforce_pp", "adv_scale": "group"}, r"reinforce_pp sets its own scale \(the "
     r"reward whitened over the batch's tokens\); drop --adv-scale"),
    ({"algo": "grpo", "adv_estimator": "gpg", "adv_scale": "batch"}, "gpg sets its own scale"),
    ({"algo": "grpo_passk", "adv_scale": "batch"}, "grpo_passk takes --adv-scale group or none"),
])  # fmt: skip
def test_estimators_refuse_what_they_cannot_do_in_one_line(options, message):
    with pytest.raises(UserError, match=message):
        resolve(TrainConfig(prompts_per_step=4, group_size=4, **options), task_max_new_tokens=8)


def test_only_the_high_entropy_tokens_keep_a_weight(policy_and_batch, seen):
    """--top-entropy-quantile 0.25: the loss's token weight is 1 exactly on the trained tokens
    whose sampling entropy reaches the batch's 0.75 quantile (core's mask), the denominators
    are the whole minibatch's, and the gradient is core's."""
    from grouprl.core.entropy import entropy_threshold, high_entropy_mask

    policy, batch = policy_and_batch
    cfg = resolve(TrainConfig(algo="grpo", prompts_per_step=4, group_size=4, lr=1e-2,
                              top_entropy_quantile=0.25), task_max_new_tokens=20)  # fmt: skip
    mask = batch.rollout.loss_mask
    threshold = entropy_threshold(batch.rollout.entropy[mask], 0.25)
    keep = high_entropy_mask(batch.rollout.entropy, mask, threshold)
    assert 0 < keep.sum() < mask.sum()
    advantages = train_step.batch_advantages(cfg, batch, SINGLE)
    metrics = train_update.update(cfg, copy.deepcopy(policy),
                                  torch.optim.AdamW(policy.parameters(), lr=0.0), batch,
                                  advantages, None)  # fmt: skip
    assert metrics["entropy_threshold"] == threshold  # the same quantile of the same values
    for call in seen:
        weight = call[4]["token_weight"]
        assert weight is not None and set(weight.unique().tolist()) <= {0.0, 1.0}
        assert call[4]["num_tokens"] == int(mask.sum())  # the kept and the dropped
        assert torch.equal(recomputed(call), call[5])
    weights = torch.cat([call[4]["token_weight"] for call in seen]).bool()
    assert int(weights.sum()) == int(
        keep[advantages.view(4, 4).ne(0).any(-1).repeat_interleave(4)].sum()
    )


def test_the_entropy_bonus_trains_every_completion(policy_and_batch):
    """With every advantage 0 the policy term is 0 and its groups are skipped; the entropy
    bonus trains them all, its loss −c · the mean entropy of the trained tokens."""
    policy, batch = policy_and_batch
    flat = Batch(batch.rollout, batch.rows, torch.ones(16), {"correct": torch.ones(16)},
                 torch.ones(16, dtype=torch.bool))  # fmt: skip

    def run(**options):
        cfg = resolve(TrainConfig(algo="grpo", prompts_per_step=4, group_size=4, lr=1e-3,
                                  **options), task_max_new_tokens=20)  # fmt: skip
        advantages = train_step.batch_advantages(cfg, flat, SINGLE)
        assert advantages.abs().sum() == 0
        model = copy.deepcopy(policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        return train_update.update(cfg, model, optimizer, flat, advantages, None), model

    plain, _ = run()
    assert plain["trained_frac"] == 0.0  # nothing to learn: skipped
    bonus, model = run(entropy_coef=0.05)
    assert bonus["trained_frac"] == 1.0 and bonus["entropy_coef"] == 0.05
    # the loss sums float32 entropies in float32 (at most tokens·2^-24 relative), the metric
    # the same values in float64
    tokens = int(batch.rollout.loss_mask.sum())
    assert bonus["loss"] == pytest.approx(-0.05 * bonus["policy_entropy"], rel=tokens * 2**-24)
    before = dict(policy.named_parameters())
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_adaptive_coefficient_moves_per_optimizer_step(policy_and_batch):
    """Four minibatches, a target above every entropy: the coefficient rises by delta after
    each optimizer step (none applied before the first measurement), to its ceiling."""
    policy, batch = policy_and_batch
    cfg = resolve(TrainConfig(algo="grpo", prompts_per_step=4, group_size=4, minibatches=4,
                              entropy_coef=0.01, entropy_target=50.0, entropy_coef_delta=0.004,
                              entropy_coef_max=0.02), task_max_new_tokens=20)  # fmt: skip
    advantages = train_step.batch_advantages(cfg, batch, SINGLE)
    model = copy.deepcopy(policy)
    metrics = train_update.update(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  batch, advantages, None)  # fmt: skip
    assert metrics["entropy_coef"] == pytest.approx(0.02)  # 0.01 + 0.004·4, capped at 0.02
    assert 0 < metrics["entropy_last"] < 50
    again = train_update.update(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                batch, advantages, None, entropy_state=(0.001, 60.0))  # fmt: skip
    assert again["entropy_coef"] == pytest.approx(0.001 + 0.016)  # from the state given


@pytest.mark.parametrize(("options", "message"), [
    ({"top_entropy_quantile": 1.5}, "top_entropy_quantile must lie in"),
    ({"top_entropy_quantile": 0.2, "engine": "vllm"}, "does not give"),
    ({"entropy_coef": -0.1}, "entropy_coef must be >= 0"),
    ({"entropy_coef": 2.0, "entropy_target": 0.2}, "entropy_coef_min <= entropy_coef"),
])  # fmt: skip
def test_entropy_options_refuse_what_they_cannot_do_in_one_line(options, message):
    with pytest.raises(UserError, match=message):
        resolve(TrainConfig(prompts_per_step=4, group_size=4, **options), task_max_new_tokens=8)


def test_a_resumed_run_continues_the_adaptive_coefficient_exactly(tmp_path):
    """The coefficient and the last entropy are in the checkpoint's state: stopped after 2
    steps and resumed, a run's metrics equal the straight run's."""
    import json

    from grouprl.cli import main

    flags = ["--prompts-per-step", "4", "--group-size", "4", "--eval-size", "2",
             "--eval-samples", "1", "--eval-every", "0", "--no-progress", "--threads", "1",
             "--entropy-coef", "0.01", "--entropy-target", "5", "--top-entropy-quantile", "0.5"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", "--steps", "3", "--output-dir", str(straight), *flags]) == 0
    assert main(["train", "--steps", "2", "--output-dir", str(resumed), *flags]) == 0
    assert main(["train", "--resume", str(resumed), "--steps", "3"]) == 0

    def rows(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items()
                 if not k.endswith(("_seconds", "tokens_per_s"))} for line in lines]  # fmt: skip

    assert rows(straight) == rows(resumed)
    assert [round(m["entropy_coef"], 6) for m in rows(straight)] == [0.03, 0.05, 0.07]


@pytest.mark.parametrize("algo", ["clip_cov", "kl_cov"])
def test_the_covariance_objectives_select_over_each_minibatch(policy_and_batch, algo, seen):
    """Each minibatch's selection is over its trained tokens: KL-Cov penalises the int(n·ratio)
    of highest covariance, Clip-Cov holds back as many drawn from its band (fewer if the band
    has fewer); the same seed draws the same tokens; the gradient is core's."""
    policy, batch = policy_and_batch
    share = {"kl_cov_ratio": 0.1} if algo == "kl_cov" else {"clip_cov_ratio": 0.1,
                                                             "clip_cov_low": -5.0}  # fmt: skip
    cfg = resolve(TrainConfig(algo=algo, prompts_per_step=4, group_size=4, lr=1e-2, **share),
                  task_max_new_tokens=20)  # fmt: skip
    advantages = train_step.batch_advantages(cfg, batch, SINGLE)

    def run():
        seen.clear()
        model = copy.deepcopy(policy)
        metrics = train_update.update(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      batch, advantages, None, step=3)  # fmt: skip
        if algo == "kl_cov":
            return [c[4]["penalty_mask"] for c in seen], metrics
        return [c[4]["token_weight"] == 0 for c in seen], metrics

    picked, metrics = run()
    assert len(seen) == cfg.minibatches == 4
    tokens = [int(c[3].sum()) for c in seen]  # one pass a minibatch here
    assert [int(p.sum()) for p in picked] == [max(int(0.1 * n), 1) for n in tokens]
    assert metrics["cov_selected_frac"] == pytest.approx(
        sum(int(p.sum()) for p in picked) / sum(tokens)
    )
    for call in seen:
        assert torch.equal(recomputed(call), call[5])
    again, _ = run()
    assert all(torch.equal(a, b) for a, b in zip(picked, again, strict=True))  # seeded


def test_a_teachers_per_token_advantages_reach_the_loss(policy_and_batch, seen):
    """With a teacher's log-probs the loss's advantages are core's per-token ones (the task's
    weighted, plus the teacher's gap to the sampler), no group is skipped for a zero task
    advantage, and `teacher_kl` is the sampler's k1 to the teacher."""
    from grouprl.core import distillation_advantages, reverse_kl

    policy, batch = policy_and_batch
    cfg = resolve(TrainConfig(algo="grpo", prompts_per_step=4, group_size=4, lr=1e-2,
                              teacher="builtin:arith", teacher_coef=0.5,
                              teacher_task_weight=0.25), task_max_new_tokens=20)  # fmt: skip
    teacher_logp = batch.rollout.old_logp + 0.1 * torch.randn(batch.rollout.old_logp.shape,
                                                              generator=torch.Generator().manual_seed(1))  # fmt: skip
    advantages = train_step.batch_advantages(cfg, batch, SINGLE)
    mask = batch.rollout.loss_mask
    model = copy.deepcopy(policy)
    metrics = train_update.update(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  batch, advantages, None, teacher_logp=teacher_logp)  # fmt: skip
    expected = distillation_advantages(advantages, batch.rollout.sampler_logp, teacher_logp, mask,
                                       coef=0.5, task_weight=0.25)  # fmt: skip
    assert metrics["trained_frac"] == 1.0
    given = torch.cat([call[2] for call in seen])  # one pass, every row, in order
    assert given.shape == mask.shape and torch.equal(given, expected)
    gap, tokens = reverse_kl(batch.rollout.sampler_logp, teacher_logp, mask)
    assert metrics["teacher_kl"] == pytest.approx(gap / tokens)
    for call in seen:
        assert torch.equal(recomputed(call), call[5])


def test_a_teacher_with_another_tokenizer_is_one_line(tmp_path, capsys):
    from grouprl.cli import main
    from grouprl.models.tiny import save_tiny_chat_model

    save_tiny_chat_model(tmp_path / "other")
    capsys.readouterr()
    assert main(["train", "--steps", "1", "--teacher", str(tmp_path / "other"), "--output-dir",
                 str(tmp_path / "run"), "--no-progress"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has another tokenizer than the policy's" in err[0]
    assert not (tmp_path / "run").exists()  # refused before anything is written
    # a teacher's run directory rather than its model: the error says where the model is
    (tmp_path / "teacher" / "final").mkdir(parents=True)
    (tmp_path / "teacher" / "config.yaml").write_text("algo: gspo\n")
    assert main(["train", "--steps", "1", "--teacher", str(tmp_path / "teacher"), "--output-dir",
                 str(tmp_path / "run"), "--no-progress"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.startswith("grouprl train: error: --teacher:") and "its trained model is" in err
    assert str(tmp_path / "teacher" / "final") in err
    with pytest.raises(UserError, match="weighs whole sequences"):
        resolve(TrainConfig(algo="vespo", teacher="builtin:arith"), task_max_new_tokens=8)


def test_remax_baselines_are_the_greedy_completions_rewards(tmp_path):
    """A ReMax step scores one more completion per prompt, sampled greedily, and each group's
    advantages are its rewards minus that one's; an asynchronous ReMax is one line."""
    import json

    import yaml

    from grouprl.cli import main
    from grouprl.models import load_model, load_tokenizer
    from grouprl.rollout import sample_groups

    run = tmp_path / "run"
    assert main(["train", "--algo", "remax", "--steps", "1", "--prompts-per-step", "4",
                 "--group-size", "4", "--eval-size", "2", "--eval-samples", "1", "--no-progress",
                 "--log-samples", "16", "--output-dir", str(run)]) == 0  # fmt: skip
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    by_prompt: dict[str, list[dict]] = {}
    for sample in samples:
        by_prompt.setdefault(sample["prompt"], []).append(sample)
    assert len(by_prompt) == 4  # a logged completion of each group
    budget = yaml.safe_load((run / "config.yaml").read_text())["max_new_tokens"]
    greedy = sample_groups(load_model("builtin:arith"), load_tokenizer("builtin:arith"),
                           list(by_prompt), group_size=1, max_new_tokens=budget,
                           temperature=0.0)  # fmt: skip
    for (prompt, group), text in zip(by_prompt.items(), greedy.texts, strict=True):
        solved = float(text.rsplit("|", 1)[-1].strip() == group[0]["answer"])  # `correct`
        assert {round(g["reward"] - g["advantage"], 6) for g in group} == {solved}, prompt
    with pytest.raises(UserError, match="remax's baseline is the current policy's greedy"):
        resolve(TrainConfig(algo="remax", max_staleness=1), task_max_new_tokens=8)
    # a task's own tools (lookup's): refused at set-up, before anything is written
    other = tmp_path / "lookup"
    assert main(["train", "--algo", "remax", "--task", "lookup", "--steps", "1",
                 "--output-dir", str(other)]) == 2  # fmt: skip
    assert not other.exists()


def test_the_jsd_loss_is_the_teachers_divergence_over_the_trained_positions(policy_and_batch):
    """--teacher-loss jsd: with the task's weight 0 the objective's terms are 0, so the update's
    loss is coef · Σ JSD / the trained tokens, with JSD of both models' whole distributions
    (recomputed here from their full logits); `teacher_jsd` is the mean per position; a
    teacher equal to the policy gives 0."""
    from grouprl.core import generalized_jsd

    policy, batch = policy_and_batch
    cfg = resolve(TrainConfig(algo="grpo", prompts_per_step=4, group_size=4, lr=1e-2,
                              teacher="builtin:arith", teacher_loss="jsd", teacher_beta=0.3,
                              teacher_coef=0.5, teacher_task_weight=0.0),
                  task_max_new_tokens=20)  # fmt: skip
    teacher = copy.deepcopy(policy)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    advantages = train_step.batch_advantages(cfg, batch, SINGLE)
    mask = batch.rollout.loss_mask
    rollout = batch.rollout
    with torch.no_grad():
        theirs, mine = (_log_softmax(m, rollout, cfg.temperature) for m in (teacher, policy))
    per_position = torch.where(mask, generalized_jsd(mine.double(), theirs.double(), 0.3), 0.0)
    expected = float(per_position.sum()) / int(mask.sum())
    model = copy.deepcopy(policy)
    metrics = train_update.update(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  batch, advantages, None, teacher=teacher)  # fmt: skip
    # float32 forwards on two paths (shared prompt, chunked head against one full forward):
    # each log-prob moves by at most ε = forward_bound; JSD_β's derivative in the student's
    # log-probs is p·(1 − β)·log(p / M) with M ≥ (1 − β)·p, so Σ|·| ≤ (1 − β)·log(1 / (1 − β))
    # ≤ 1/e, and in the teacher's β·log(1/β) ≤ 1/e: the JSD moves by at most 2ε/e < ε; then
    # its float32 sum over the vocabulary against this float64 one, V + 8 roundings of terms < 1
    vocab = mine.shape[-1]
    bound = forward_bound(policy.config, logit_magnitude(policy)) + (vocab + 8) * 2**-24
    assert metrics["teacher_jsd"] == pytest.approx(expected, abs=bound)
    assert metrics["loss"] == pytest.approx(0.5 * metrics["teacher_jsd"], rel=4 * 2**-24)
    assert metrics["trained_frac"] == 1.0 and "teacher_kl" not in metrics
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), policy.parameters()))
    same = copy.deepcopy(policy)
    metrics = train_update.update(cfg, same, torch.optim.AdamW(same.parameters(), lr=1e-2),
                                  batch, advantages, None, teacher=policy)  # fmt: skip
    assert abs(metrics["teacher_jsd"]) <= bound


def _log_softmax(model, rollout, temperature):
    """log-softmax (N, T, V) of one forward of the N full sequences."""
    g = rollout.group_size
    ids = torch.cat([rollout.prompt_ids.repeat_interleave(g, 0), rollout.completion_ids], 1)
    attn = torch.cat([rollout.prompt_mask.repeat_interleave(g, 0), torch.ones_like(rollout.mask)],
                     1)  # fmt: skip
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    return torch.log_softmax(logits[:, rollout.prompt_ids.shape[1] - 1 : -1] / temperature, -1)


def test_jsd_through_the_cli_and_its_mistakes(tmp_path, capsys):
    """`grouprl train --teacher M --teacher-loss jsd` trains and logs teacher_jsd; its knobs
    without it, or without a teacher, are one line each."""
    import json

    from grouprl.cli import main

    run = tmp_path / "run"
    assert main(["train", "--steps", "2", "--prompts-per-step", "4", "--teacher", "builtin:arith",
                 "--teacher-loss", "jsd", "--teacher-beta", "1", "--eval-every", "0",
                 "--output-dir", str(run), "--no-progress"]) == 0  # fmt: skip
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["teacher_jsd"] >= 0 for r in rows)
    for flags, message in [
        (["--teacher-loss", "jsd"], "--teacher-loss jsd distils from a teacher"),
        (["--teacher", "builtin:arith", "--teacher-beta", "0"], "add --teacher-loss jsd"),
        (["--teacher", "builtin:arith", "--teacher-loss", "jsd", "--teacher-beta", "2"],
         "teacher_beta must lie in [0, 1]"),
    ]:  # fmt: skip
        capsys.readouterr()
        assert main(["train", *flags, "--output-dir", str(tmp_path / "no"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / "no").exists()
    # vespo weighs whole sequences, which the jsd loss's per-sequence advantages allow
    resolve(TrainConfig(algo="vespo", teacher="builtin:arith", teacher_loss="jsd"),
            task_max_new_tokens=8)  # fmt: skip
