"""The sections of `grouprl train`'s options beyond the model, the data and the run's own
(`grouprl.config.options`): `TrainConfig` is composed of them, so each flag, config.yaml key and
`grouprl.Trainer` keyword is one field as before, and a function that needs one part of the
settings takes that section. Each section's fields, in order, are the flags `--help` lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from grouprl.config.choices import (
    AdvEstimator,
    AdvScale,
    CorrectionName,
    KLEstimator,
    LossAgg,
    LRSchedule,
    MaskLevel,
    Objective,
    Packing,
    Precision,
    Proximal,
    RatioLevel,
    RoutingReplay,
    Strategy,
    TeacherLoss,
    WeightLevel,
)


@dataclass(frozen=True)
class ComputeOptions:
    """How the run computes: its seed, threads, precision, memory and parallel strategy."""

    seed: int = 0
    """Seed for data order, sampling and initial evaluation; same seed, same run."""
    threads: int | None = None
    """torch CPU threads. None: torch's default (all cores)."""
    precision: Precision = "fp32"
    """Forward passes in fp32, or under bf16 autocast (weights, gradients and optimizer stay
    fp32). bf16 pays off where matmuls dominate (CPUs with AMX, larger models, GPUs); old_logp is
    then recomputed by the trainer, one no-grad forward per step."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them: less
    memory for long completions, about one more forward of compute."""
    micro_batch_size: int | None = None
    """Completions per forward/backward; gradients accumulate over a minibatch's chunks (the same
    update). None: a whole minibatch at once."""
    max_tokens_per_micro_batch: int | None = None
    """Positions per forward/backward (prompt and completion tokens): a minibatch's rows are
    bin-packed (first-fit decreasing) into micro-batches of at most this many, each run as one
    packed sequence where the model allows (--packing); memory follows tokens, not rows, and
    gradients accumulate (the same update). None: by --micro-batch-size, or as planned."""
    packing: Packing = "auto"
    """Packed forwards: a pass's completions as one sequence (each its prompt then its completion,
    positions restarting per row), no position spent on padding. auto: where the planner
    estimates it cheaper than shared prompts at per-row widths (on a CPU); on: every pass, any
    device; off: never. A model whose attention cannot keep packed rows apart runs padded."""
    strategy: Strategy = "ddp"
    """Under torchrun: ddp keeps a full model on every rank and sums gradients; fsdp shards the
    model across ranks (FSDP2), for models that do not fit one device. No effect in one process."""


@dataclass(frozen=True)
class LoraOptions:
    """LoRA: train low-rank adapters instead of the full model."""

    lora_r: int | None = None
    """LoRA rank: train low-rank adapters instead of the full model. None: full fine-tuning."""
    lora_alpha: float | None = None
    """LoRA scale numerator (the update is alpha/r * BA). None: 2 * lora_r."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input during updates (non-zero makes the first ratio differ
    from 1)."""
    lora_target_modules: list[str] | None = None
    """Module names that get adapters, e.g. q_proj v_proj. None: every linear layer but the head.
    On a vision-language model, only the language model's modules (and with
    --train-vision-tower the vision encoder's too)."""
    train_vision_tower: bool = False
    """A vision-language model's vision encoder trains too (full fine-tuning) or gets adapters
    (LoRA). Off: it stays as loaded; the projector and the language model train."""


@dataclass(frozen=True)
class SamplingOptions:
    """How much is sampled each step, and how."""

    steps: int | None = None
    """Number of training steps (one rollout batch each). None: the task's own (200; 120 for
    lookup)."""
    prompts_per_step: int = 16
    """Prompts per step (B). Each gets group_size completions: N = B*G completions a step."""
    group_size: int = 8
    """Completions sampled per prompt (G); the group mean is the baseline. At least 2."""
    temperature: float = 1.0
    """Sampling temperature; log-probs for the ratio are taken at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off)."""
    top_k: int = 0
    """Top-k sampling (0: off)."""


@dataclass(frozen=True)
class UpdateOptions:
    """The optimiser and how a step's batch is cut into updates."""

    lr: float = 5e-5
    """Peak learning rate (AdamW)."""
    lr_schedule: LRSchedule = "constant"
    """Learning-rate shape after warm-up: constant, a linear decay to 0 after the last step (as
    transformers' "linear"), or a cosine decay to 0 at the last step."""
    warmup_steps: int = 5
    """Linear warm-up steps from 0 to lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0: off)."""
    epochs: int = 1
    """Policy updates over each rollout batch (mu in the GRPO paper)."""
    minibatches: int | None = None
    """Minibatches per epoch, each one optimizer step; must divide prompts_per_step. None: preset."""
    max_nonfinite_steps: int = 3
    """Steps in a row whose loss or gradient is NaN/inf (their updates are skipped) after which
    the run stops with one line; the last good checkpoint is kept."""
    skip_zero_advantage: bool = True
    """Leave groups whose advantages are all 0 out of the forward/backward: the same update to
    float rounding. Ignored when beta > 0 (the KL term has a gradient): every group is trained."""


@dataclass(frozen=True)
class ObjectiveOptions:
    """The per-token term maximised, its ratio and bounds, and the KL term."""

    objective: Objective = None
    """The per-token term maximised: PPO's clip (GRPO, GSPO, Dr. GRPO, DAPO, LUSPO), CISPO's
    capped-weight REINFORCE, SAPO's soft gate, GMPO's geometric mean, VESPO's gamma weight,
    GPG's plain Â·log π (no ratio, no clip), Clip-Cov's clip with the highest-covariance tokens
    held back, KL-Cov's unclipped r·Â with a |log r| penalty on them (arXiv 2505.22617). None:
    preset (--algo cispo, sapo, gmpo, vespo, gpg, clip_cov, kl_cov set their own; else clip)."""
    cispo_cap: float | None = None
    """CISPO: the cap on the detached importance weight (TRL's epsilon_high). None: 5.0."""
    sapo_tau_pos: float | None = None
    """SAPO: the gate's temperature where the advantage is > 0. None: 1.0."""
    sapo_tau_neg: float | None = None
    """SAPO: the gate's temperature where the advantage is <= 0. None: 1.05."""
    vespo_k_pos: float | None = None
    """VESPO: the gamma weight's shape k where the advantage is >= 0. None: 2."""
    vespo_lambda_pos: float | None = None
    """VESPO: its rate lambda where the advantage is >= 0. None: 3."""
    vespo_k_neg: float | None = None
    """VESPO: k where the advantage is < 0. None: 3."""
    vespo_lambda_neg: float | None = None
    """VESPO: lambda where the advantage is < 0. None: 2."""
    clip_cov_ratio: float | None = None
    """Clip-Cov: the share of each minibatch's tokens whose gradient is held back. None: 2e-4."""
    clip_cov_low: float | None = None
    """Clip-Cov: the covariance band's floor they are drawn from. None: 1."""
    clip_cov_high: float | None = None
    """Clip-Cov: the band's ceiling. None: 5."""
    kl_cov_ratio: float | None = None
    """KL-Cov: the share of each minibatch's tokens, by top covariance, penalised. None: 2e-4."""
    kl_cov_coef: float | None = None
    """KL-Cov: the coefficient of their |log r| penalty. None: 0.1 (verl's YAML)."""
    ratio_level: RatioLevel | None = None
    """Importance ratio: per token (GRPO), per sequence (GSPO), GSPO-token, or sequence_sum
    (the whole sequences' probability ratio, not length-normalised: TRL's RLOO). None: preset."""
    clip_low: float | None = None
    """Clip range below 1: ratios under 1-clip_low are clipped. None: preset."""
    clip_high: float | None = None
    """Clip range above 1: ratios over 1+clip_high are clipped. None: preset."""
    dual_clip: float | None = None
    """Dual clip c > 1: bounds the loss of negative-advantage tokens at c*|A| (None: off)."""
    beta: float | None = None
    """Weight of the KL penalty to the reference (initial) policy. None: preset."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator for the penalty (k3 is the GRPO paper's)."""
    kl_in_reward: bool = False
    """Apply --beta as a penalty on each completion's reward, β·Σ_t (log π_old − log π_ref) over
    its trained tokens (k1, summed), before the advantages, instead of a KL term in the loss (the
    RLOO paper and TRL's RLOOTrainer; verl's use_kl_in_reward)."""
    kl_ratio_weighted: bool = False
    """Multiply each token's KL term by its importance ratio, gradient included (DeepSeek-V3.2's
    unbiased KL estimate; TRL's use_bias_correction_kl). It changes the KL gradient even
    on-policy, where the ratio is 1 but differentiable."""


@dataclass(frozen=True)
class DistillationOptions:
    """On-policy distillation from a teacher model."""

    teacher: str | None = None
    """On-policy distillation: a model (a directory, builtin:NAME or a hub id) sharing the
    policy's tokenizer scores each sampled token, and its advantage becomes
    --teacher-task-weight x the group's + --teacher-coef x (log teacher − log sampler), per token
    (Thinking Machines' on-policy distillation; tinker-cookbook's defaults). None: off."""
    teacher_coef: float = 1.0
    """On-policy distillation: the per-token reverse-KL reward's coefficient."""
    teacher_task_weight: float = 1.0
    """On-policy distillation: the task's group advantage's weight beside it (0: distillation
    alone)."""
    teacher_loss: TeacherLoss = "advantage"
    """On-policy distillation's loss: advantage (the sampled token's reverse-KL reward in the
    objective, above) or jsd (TRL's GKD: --teacher-coef x the generalized Jensen-Shannon
    divergence between the whole next-token distributions at every trained position, a
    supervised term with no ratio, added to the objective on the task's advantages x
    --teacher-task-weight; the teacher runs with each pass)."""
    teacher_beta: float = 0.5
    """--teacher-loss jsd's beta in [0, 1]: 0 is the forward KL(teacher || student), 1 the
    reverse KL(student || teacher), between them the mixture's JSD (TRL GKDTrainer's 0.5;
    TRL's DistillationTrainer uses 1)."""


@dataclass(frozen=True)
class EntropyOptions:
    """Entropy control: the high-entropy tokens, and the entropy bonus."""

    top_entropy_quantile: float = 1.0
    """Train only the tokens whose entropy (the sampler's) is in the top rho of the batch
    ("Beyond the 80/20 Rule", arXiv 2506.01939, trains the top 0.2; TRL's top_entropy_quantile):
    the others get weight 0 but keep their place in the loss's denominators, and the KL term
    still acts on them. 1: every token; 0: only the highest-entropy ones (as TRL). Needs the
    sampler's entropy (--engine hf)."""
    entropy_coef: float = 0.0
    """An entropy bonus: the loss minus this times the current policy's mean entropy over the
    trained (kept) tokens of the update. 0: off. With --entropy-target: the adaptive
    coefficient's start."""
    entropy_target: float | None = None
    """Adapt the entropy coefficient (Skywork-OR1, arXiv 2505.22312; TRL's
    use_adaptive_entropy): after each optimizer step it goes up by --entropy-coef-delta while the
    step's mean token entropy is at or below this (nats; TRL: 0.2), down otherwise, within
    [--entropy-coef-min, --entropy-coef-max], and applies only while at or below. None: fixed."""
    entropy_coef_delta: float = 0.005
    """The adaptive coefficient's step."""
    entropy_coef_min: float = 0.0
    """The adaptive coefficient's floor."""
    entropy_coef_max: float = 1.0
    """The adaptive coefficient's ceiling."""


@dataclass(frozen=True)
class AggregationOptions:
    """How the per-token losses are reduced to one."""

    loss_agg: LossAgg | None = None
    """How per-token losses are averaged; sets the implicit length weighting. None: preset."""
    norm_len: int | None = None
    """Constant divisor for seq_mean_token_sum_norm. None: max_new_tokens."""


@dataclass(frozen=True)
class AdvantageOptions:
    """The advantage estimator and its scaling."""

    adv_estimator: AdvEstimator = None
    """Baseline: the group mean (grpo), the mean of the other G-1 rewards (rloo), or gdpo: each
    reward normalised in its group, their weighted sum then over the batch (arXiv 2601.05242);
    verl's others (grouprl.core.estimators): reinforce_pp (the reward whitened over the batch's
    tokens, arXiv 2501.03262), reinforce_pp_baseline (the group mean first), opo (the
    length-weighted group mean, no std, exactly on-policy only: arXiv 2505.23585), gpg (the
    group mean, scaled by the share of non-zero rewards: arXiv 2504.02546), grpo_passk (only
    each group's best learns, by its margin over the second), remax (the reward of one more,
    greedy, completion per prompt: arXiv 2310.10505), process (rewards per turn: each turn's
    tokens get the group-normalised turn rewards summed from that turn on, DeepSeekMath's
    process supervision, arXiv 2402.03300; grpo without them). All but grpo, rloo and
    grpo_passk set their own scaling, so no --adv-scale. None: the preset's."""
    adv_scale: AdvScale | None = None
    """Advantage scaling: by the group std, the batch std, none (Dr. GRPO), or whiten (the
    baseline's advantages, then (Â − mean)/(std + eps) over the batch: TRL RLOOTrainer's
    normalize_advantages). None: preset."""
    unbiased_std: bool = False
    """Use the sample (Bessel) std, as TRL and verl do, instead of the population std."""
    adv_eps: float = 1e-4
    """Added to the std before dividing."""
    reward_clip: tuple[float, float] | None = None
    """Clamp each completion's weighted reward to [LOW, HIGH] before the advantages (TRL
    RLOOConfig's reward_clip_range). None: no clamp."""


@dataclass(frozen=True)
class RoutingOptions:
    """Mixture-of-experts policies: expert routing watched and replayed, the routers' balancing
    loss. Refused in one line for a dense model."""

    routing_replay: RoutingReplay = "off"
    """Routing replay: the trainer's forwards use fixed top-k expert choices while the routers'
    softmax stays live (they still get gradient). r2: the step's first forward of each
    completion chooses, its later forwards (old log-probs, minibatches, epochs) replay that;
    r3: the sampler's choices are replayed (grouprl's own sampler records them; vLLM's are not
    read). Off: every forward routes afresh. Needs a mixture-of-experts policy."""
    routing_metrics_every: int = 1
    """On a mixture-of-experts policy, log every this many steps how much routing moved: the
    share of (token, layer) expert sets of the completions that differ between the sampler and
    the trainer before the update, and between the policy before and after the step (one extra
    no-grad forward); 0: never."""
    router_aux_loss_coef: float | None = 0.0
    """Weight of the routers' load-balancing loss (Switch Transformer's, as transformers computes
    it over every layer's router logits) added to the update's loss, per forward, weighted by
    its share of the minibatch's completions. None: the model config's own coefficient (TRL's
    default); 0: off."""


@dataclass(frozen=True)
class OffPolicyOptions:
    """A sampler that is not the trainer: the correction of its log-probs."""

    correction: CorrectionName = "none"
    """Importance-sampling correction of the sampler's log-probs (the behaviour policy) against
    the trainer's (the proximal policy): token_tis (truncated at 2), seq_tis (the product of
    token ratios, truncated at 2), token_mis / seq_mis (the ratio, or 0 above 2 / 3: TRL's
    token_mask and its default sequence_mask), icepop (ρ_t, or 0 outside [0.5, 2]), token_band
    (icepop's band as a rejection alone, weight 1 inside: for --proximal behaviour), geo_mask
    (sequences whose geometric-mean ratio leaves [0.99, 1.01] masked), geo_mask_token_tis
    (verl's). The --correction-* fields below change a part. Needs something to correct:
    --engine vllm, --precision bf16 or --max-staleness > 0."""
    correction_weight: WeightLevel | None = None
    """The correction's truncated-IS weight: per token, or the sequence's product. None: the
    preset's."""
    correction_weight_low: float | None = None
    """Lower bound of the weight (None: the preset's; none in any preset)."""
    correction_weight_high: float | None = None
    """Upper bound of the weight (None: the preset's)."""
    correction_mask: MaskLevel | None = None
    """The correction's mask: tokens, sequences (product) or sequences (geometric mean) whose
    ratio leaves the band get no gradient. None: the preset's."""
    correction_mask_low: float | None = None
    """Lower edge of the mask's band (None: the preset's)."""
    correction_mask_high: float | None = None
    """Upper edge of the mask's band (None: the preset's)."""
    off_policy_mask: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask: a completion with a negative advantage whose
    mean log(sampler / current) per token exceeds this gets no gradient (TRL's
    off_policy_mask_threshold; it suggests 0.5). The drift is the sampler's gap and the
    updates' since sampling, so it also applies with --minibatches or --epochs > 1. None: off."""
    proximal: Proximal = "recompute"
    """The policy the ratio is clipped against when the sampler is not the trainer: recompute,
    the trainer's own no-grad forward (decoupled PPO: the correction weighs trainer/sampler);
    behaviour, the sampler's log-probs as they are (bypass: no extra forward; the clip then
    bounds the sampler's gap too, so only masks may be added)."""


@dataclass(frozen=True)
class AsyncOptions:
    """Asynchronous sampling on a fixed schedule."""

    max_staleness: int = 0
    """Sample ahead asynchronously: batch k is sampled by the policy of step max(0, k - K) while
    the trainer updates, always (the faster side waits), so the run is a function of its seed
    and K. 0: every batch by the current policy (synchronous)."""
    sampler_threads: int | None = None
    """torch threads of the asynchronous sampler (its own copy of the weights, in a thread of
    this process, overlapping the update; the trainer keeps --threads); 0: it samples in the
    trainer's thread between updates (the same schedule, no overlap). None: half the cores, at
    least 2 (on 2 cores, 2 beside the trainer's 2 was measured fastest)."""


@dataclass(frozen=True)
class ShapingOptions:
    """Which groups and completions train: dynamic sampling, truncation, length penalty."""

    dynamic_sampling: bool | None = None
    """Drop zero-variance groups and sample more prompts until the batch is full. None: preset."""
    max_resample_rounds: int = 4
    """Extra sampling rounds dynamic sampling may spend per step before training on fewer groups."""
    mask_truncated: bool | None = None
    """Leave completions that hit max_new_tokens out of the loss. None: preset."""
    overlong_penalty: bool | None = None
    """DAPO soft overlong penalty on completions close to max_new_tokens. None: preset."""
    overlong_cache: int | None = None
    """Length of the soft-penalty zone before max_new_tokens. None: max_new_tokens // 4."""


@dataclass(frozen=True)
class EvaluationOptions:
    """The held-out evaluations during training."""

    eval_every: int = 25
    """Evaluate held-out pass@1 every this many steps (and at the start and the end; 0: only those)."""
    eval_size: int = 200
    """Held-out problems per evaluation."""
    eval_samples: int = 4
    """Samples per held-out problem (pass@1 is their mean; pass@k uses all of them)."""


@dataclass(frozen=True)
class CheckpointOptions:
    """Checkpoints."""

    save_every: int = 50
    """Checkpoint every this many steps (and at the end and on Ctrl-C)."""
    keep_last: int = 2
    """Checkpoints to keep; older ones are deleted."""


@dataclass(frozen=True)
class LoggingOptions:
    """What the run logs, shows and reports to trackers."""

    log_samples: int = 2
    """Completions per step written to samples.jsonl."""
    log_ratios: int = 32
    """Completions whose sequence log-ratio against the sampling policy, after the step's last
    update, is written to ratios.jsonl (one no-grad forward on them); 0: none."""
    log_ratios_every: int = 5
    """Write ratios.jsonl every this many steps."""
    log_groups: int = 4
    """Whole groups written token by token to groups/ for `grouprl view` on a logged step: each
    token's sampling log-prob, the log-prob and ratio the loss used, whether the clip acted, the
    entropy, the loss mask and the log-prob after the step (one extra no-grad forward on their
    completions); 0: none."""
    log_groups_every: int = 10
    """Write groups/ every this many steps (and at the first and the last step)."""
    doctor: bool = True
    """Run `grouprl doctor`'s checks at each evaluation and print a line per new warning."""
    progress: bool = True
    """Show a live progress bar (off: one plain line per eval)."""
    report_to: list[str] | None = None
    """Trackers that also get the run: any of tensorboard, wandb, trackio, mlflow (space- or
    comma-separated), or none. None: tensorboard. The run directory's JSONL logs and plots are
    written whatever this says."""
    run_name: str | None = None
    """The run's name in the trackers. None: the run directory's name."""
    trl_metrics: bool = False
    """Also send the trackers each step's metrics under TRL's GRPOTrainer names (reward,
    rewards/NAME/mean, completions/mean_length, clip_ratio/..., frac_reward_zero_std, ...), for
    dashboards made for TRL; metrics.jsonl keeps grouprl's names. grouprl.trl turns it on."""
