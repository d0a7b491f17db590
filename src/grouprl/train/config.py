"""The typed configurations of `grouprl train` and `grouprl eval`, presets, parsing, validation.

Precedence, lowest first: field defaults < `--config FILE.yaml` (or the saved config of the run
given to `--resume`) < command-line flags < the `--algo` preset, which fills only the fields
still left at `None`. Every field below becomes a flag (`group_size` -> `--group-size`) whose
help is the docstring under it.

One typed path: a YAML mapping is turned into the flags that say the same thing and parsed with
the command line by the same parser (tyro), so `lr: 1e-4` in a file is exactly `--lr 1e-4`, and
a bad value is one line naming the field and where it came from, wherever it came from. This
module imports neither torch nor transformers, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import types
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import tyro
import yaml

from grouprl.errors import UserError
from grouprl.tasks.specs import absolute_spec

# ---------------------------------------------------------------------------------------------
# Choices: every named option's values, once (tests/train/test_config.py checks that the core
# registries and the presets have exactly these names)

Algo = Literal["grpo", "gspo", "dr_grpo", "dapo", "gdpo"]
Dtype = Literal["fp32", "bf16", "fp16"]
Precision = Literal["fp32", "bf16"]
Strategy = Literal["ddp", "fsdp"]
LRSchedule = Literal["constant", "cosine"]
RatioLevel = Literal["token", "sequence", "sequence_token"]  # grouprl.core.RATIO_LEVELS
LossAgg = Literal[  # grouprl.core.AGGREGATIONS
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
# grouprl.core.ADVANTAGE_ESTIMATORS, and gdpo (grouprl.core.gdpo_advantages: one per reward)
AdvEstimator = Literal["grpo", "rloo", "gdpo"]
AdvScale = Literal["group", "batch", "none"]  # grouprl.core.ADVANTAGE_SCALES
KLEstimator = Literal["k1", "k2", "k3"]  # grouprl.core.KL_ESTIMATORS
EvalSplit = Literal["heldout", "train", "all"]
ToolFormat = Literal["tags", "chat"]


@dataclass(frozen=True)
class RunOptions:
    """Where a run's settings come from and where it writes (train only)."""

    config: Path | None = None
    """YAML file holding any of these fields; flags given on the command line override it."""
    algo: Algo = "gspo"
    """Algorithm preset. It fills every field below that is left at None (see the README)."""
    output_dir: Path | None = None
    """Run directory. None: runs/<algo>-<date>-<time>. It must not already hold a run."""
    resume: Path | None = None
    """Run directory to continue from its latest checkpoint (its saved config is the base)."""
    allow_change: list[str] | None = None
    """Fields --resume may change besides steps, eval/save/log settings, threads, progress,
    reward_timeout and device, e.g. --allow-change lr."""


@dataclass(frozen=True)
class ModelOptions:
    """The policy and where it runs (shared by train and eval)."""

    model: str | None = None
    """Policy to start from: a local Hugging Face model directory, builtin:NAME, or a hub id
    (Qwen/Qwen2.5-0.5B-Instruct), given to from_pretrained as it is. None: the task's own
    (builtin:arith; builtin:lookup for --task lookup)."""
    trust_remote_code: bool = False
    """Let from_pretrained run code shipped with the model (only for models you trust)."""
    device: str = "auto"
    """auto (CUDA when available, else CPU), cpu, cuda or cuda:N."""
    base_dtype: Dtype = "fp32"
    """dtype of frozen weights: the base model under LoRA and the reference model. Trainable
    weights and the optimizer stay fp32; bf16/fp16 forwards make the trainer recompute old_logp."""


@dataclass(frozen=True)
class DataOptions:
    """What the model is asked and how its answers are scored (shared by train and eval)."""

    task: str | None = None
    """A built-in task (arithmetic). None: arithmetic, unless --dataset is given."""
    dataset: str | None = None
    """Prompts from a dataset: a JSONL/JSON/CSV/Parquet file, a save_to_disk directory, or a
    hub id given to datasets.load_dataset. Needs --rewards."""
    dataset_split: str = "train"
    """Split of --dataset to read (data files have only "train")."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of {role, content} messages; a.b for a
    nested field."""
    answer_column: str | None = None
    """Column holding the reference answer, passed to rewards as `answer` (a.b for a nested
    field, e.g. reward_model.ground_truth). None: the dataset's own `answer` column, if any."""
    prompt_template: str | None = None
    """Build string prompts from columns, e.g. "Question: {question} Answer:" (use a YAML
    config for a template with newlines)."""
    chat_template: bool = False
    """Send string prompts as a user message through the tokenizer's chat template."""
    system_prompt: str | None = None
    """System message put before every chat prompt that has none."""
    eval_dataset: str | None = None
    """Held-out prompts from another dataset (same loader and columns). None: a part of
    --dataset chosen by a hash of the prompt (see --eval-fraction)."""
    eval_split: str = "train"
    """Split of --eval-dataset to read."""
    eval_fraction: float = 0.05
    """Share of --dataset held out for evaluation when there is no --eval-dataset (at least 32
    and at most 500 rows)."""
    max_prompt_length: int | None = None
    """Prompts longer than this many tokens are skipped when drawn (counted and warned about).
    None: what leaves room for max_new_tokens in the model's context."""
    stop: list[str] | None = None
    """Stop strings that end a completion, besides the EOS tokens (for base models that never
    emit EOS), e.g. --stop "Question:"."""
    rewards: dict[str, float] | None = None
    """Reward functions and weights: a built-in name (correct, format, accuracy, think_format),
    path/to/rewards.py:function, package.module:function, or a reward model directory, e.g.
    --rewards accuracy 1.0 my_rewards.py:fmt 0.2. None: the task's."""
    pass_reward: str | None = None
    """The reward that decides correctness (a completion passes when its score is >= 1), for the
    accuracy metric and pass@k. None: accuracy if listed, else correct, else the first reward."""
    reward_timeout: float = 60.0
    """Seconds a reward function may take for one step's completions before the run stops."""
    max_new_tokens: int | None = None
    """Generation budget per completion (with tools: the whole trajectory, the tools'
    observations included). None: the task's own budget (256 for --dataset)."""
    tools: list[str] | None = None
    """Tools the policy may call while it writes: path/to/tools.py:fn, package.module:fn, or a
    tool the task ships (typed functions with docstrings, sync or async, as TRL takes them).
    None: the task's own tools (lookup's), else none."""
    tool_format: ToolFormat = "tags"
    """How calls are written: tags, <NAME>ARGS</NAME> with the observation following as plain
    text (for base and character-level models); chat, as the model's chat template writes tool
    calls and results (Hermes/Qwen2.5 <tool_call> JSON, Llama-3.1 JSON), the tools rendered
    into the prompt from their signatures and docstrings."""
    environment: str | None = None
    """A stateful environment, TRL's environment_factory shape: path/env.py:Class or
    package.module:Class, one instance per rollout; reset(**row) starts it, its public methods
    are tools, get_reward() (if any) is a reward named after the class, step(text) (if any)
    answers whole turns."""
    max_turns: int = 4
    """Tool calls (and environment steps) a trajectory may make; one more ends it (0: tools
    available, never run)."""
    max_tool_response_tokens: int | None = None
    """Observations longer than this many tokens are cut (with "..."). None: no limit but the
    budget."""
    tool_timeout: float = 10.0
    """Seconds a tool call may take; a call past it returns an error observation."""


@dataclass(frozen=True)
class TrainConfig(DataOptions, ModelOptions, RunOptions):
    """Train a causal LM with GRPO, GSPO, Dr. GRPO or DAPO on a task with verifiable rewards."""

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
    strategy: Strategy = "ddp"
    """Under torchrun: ddp keeps a full model on every rank and sums gradients; fsdp shards the
    model across ranks (FSDP2), for models that do not fit one device. No effect in one process."""

    # ----- LoRA -----
    lora_r: int | None = None
    """LoRA rank: train low-rank adapters instead of the full model. None: full fine-tuning."""
    lora_alpha: float | None = None
    """LoRA scale numerator (the update is alpha/r * BA). None: 2 * lora_r."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input during updates (non-zero makes the first ratio differ
    from 1)."""
    lora_target_modules: list[str] | None = None
    """Module names that get adapters, e.g. q_proj v_proj. None: every linear layer but the head."""

    # ----- sampling -----
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

    # ----- optimisation -----
    lr: float = 5e-5
    """Peak learning rate (AdamW)."""
    lr_schedule: LRSchedule = "constant"
    """Learning-rate shape after warm-up."""
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

    # ----- objective -----
    ratio_level: RatioLevel | None = None
    """Importance ratio: per token (GRPO), per sequence (GSPO), or GSPO-token. None: preset."""
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
    loss_agg: LossAgg | None = None
    """How per-token losses are averaged; sets the implicit length weighting. None: preset."""
    norm_len: int | None = None
    """Constant divisor for seq_mean_token_sum_norm. None: max_new_tokens."""
    adv_estimator: AdvEstimator | None = None
    """Baseline: the group mean (grpo), the mean of the other G-1 rewards (rloo), or gdpo: each
    reward normalised in its group, their weighted sum then over the batch (arXiv 2601.05242;
    sets its own scaling, so no --adv-scale). None: preset (gdpo for --algo gdpo, else grpo)."""
    adv_scale: AdvScale | None = None
    """Advantage scaling: by the group std, the batch std, or none (Dr. GRPO). None: preset."""
    unbiased_std: bool = False
    """Use the sample (Bessel) std, as TRL and verl do, instead of the population std."""
    adv_eps: float = 1e-4
    """Added to the std before dividing."""

    # ----- rewards and shaping -----
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

    # ----- evaluation, logging, checkpoints -----
    eval_every: int = 25
    """Evaluate held-out pass@1 every this many steps (and at the start and the end; 0: only those)."""
    eval_size: int = 200
    """Held-out problems per evaluation."""
    eval_samples: int = 4
    """Samples per held-out problem (pass@1 is their mean; pass@k uses all of them)."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end and on Ctrl-C)."""
    keep_last: int = 2
    """Checkpoints to keep; older ones are deleted."""
    log_samples: int = 2
    """Completions per step written to samples.jsonl."""
    log_ratios: int = 32
    """Completions whose sequence log-ratio against the sampling policy, after the step's last
    update, is written to ratios.jsonl (one no-grad forward on them); 0: none."""
    log_ratios_every: int = 5
    """Write ratios.jsonl every this many steps."""
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


@dataclass(frozen=True)
class EvalConfig(DataOptions, ModelOptions):
    """Measure pass@1 (sampled and greedy) and pass@k of a model on a task or dataset split."""

    split: EvalSplit = "heldout"
    """Which rows to evaluate: the held-out rows `grouprl train` holds out (the same ones for
    the same data options), the training rows, or all."""
    samples: int = 8
    """Completions sampled per problem (k of pass@k)."""
    limit: int = 200
    """Number of problems (the first LIMIT rows of the split)."""
    temperature: float = 1.0
    """Sampling temperature of the k samples (greedy pass@1 always uses temperature 0)."""
    greedy: bool = True
    """Also decode one greedy completion per problem for greedy pass@1."""
    batch_prompts: int = 64
    """Problems sampled together (each with SAMPLES completions)."""
    seed: int = 0
    """Sampling seed; the same seed gives the same numbers on the same machine."""
    threads: int | None = None
    """torch CPU threads. None: torch's default."""
    json: bool = False
    """Print one JSON object on stdout instead of a table."""


@dataclass(frozen=True)
class Preset:
    """The algorithm-defining fields that an `--algo` preset fills."""

    ratio_level: str
    clip_low: float
    clip_high: float
    loss_agg: str
    adv_scale: str
    beta: float
    minibatches: int
    dynamic_sampling: bool = False
    mask_truncated: bool = False
    overlong_penalty: bool = False
    adv_estimator: str = "grpo"


PRESETS: dict[str, Preset] = {
    # DeepSeekMath (arXiv 2402.03300): token ratio, per-sequence token mean, group std, one
    # on-policy update per batch. beta = 0 rather than the paper's 0.04: TRL, DAPO and Dr. GRPO
    # found the KL term unnecessary with verifiable rewards, and it costs a reference forward.
    "grpo": Preset("token", 0.2, 0.2, "seq_mean_token_mean", "group", 0.0, minibatches=1),
    # GSPO (arXiv 2507.18071): sequence ratio, the paper's clip range, and the rollout split into
    # 4 minibatches so that updates after the first are off-policy and the clip matters.
    "gspo": Preset("sequence", 3e-4, 4e-4, "seq_mean_token_mean", "group", 0.0, minibatches=4),
    # Dr. GRPO (arXiv 2503.20783): no std scaling, a constant length normaliser.
    "dr_grpo": Preset("token", 0.2, 0.2, "seq_mean_token_sum_norm", "none", 0.0, minibatches=1),
    # DAPO (arXiv 2503.14476): clip-higher, token-level loss, dynamic sampling, overlong penalty.
    "dapo": Preset(
        "token",
        0.2,
        0.28,
        "token_mean",
        "group",
        0.0,
        minibatches=1,
        dynamic_sampling=True,
        overlong_penalty=True,
    ),
    # GDPO (arXiv 2601.05242): GRPO with each reward normalised inside its group before the
    # weighted sum, which is then normalised over the batch; for runs with several rewards.
    "gdpo": Preset(
        "token", 0.2, 0.2, "seq_mean_token_mean", "group", 0.0, minibatches=1, adv_estimator="gdpo"
    ),
}


def field_names(cls: type | None = None) -> list[str]:
    return [f.name for f in dataclasses.fields(cls or TrainConfig)]


# ---------------------------------------------------------------------------------------------
# Parsing: YAML mappings and flags through one parser

#: Launch directives: what a command does, not what a run is. Never read from or written to a
#: run's config.yaml, so that a saved config is a record and can never resume or overwrite.
LAUNCH_FIELDS = ("config", "resume", "allow_change")
#: Fields a resumed run may change: how long, how often to evaluate and save, how much to log,
#: and where it runs. Anything else would make the rest of the run a different run.
RESUMABLE_FIELDS = (
    "steps", "eval_every", "eval_size", "eval_samples", "save_every", "keep_last",
    "log_samples", "log_ratios", "log_ratios_every", "doctor", "threads", "progress",
    "reward_timeout", "tool_timeout", "device", "strategy", "report_to", "run_name",
)  # fmt: skip

Config = TypeVar("Config")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_plain_bool(annotation: Any) -> bool:
    return annotation is bool


def _text_kind(annotation: Any) -> type | None:
    """str, Path or list for fields that hold text (plain, Optional, or a list of strings)."""
    options = [a for a in typing.get_args(annotation) if a is not type(None)]
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    if union and len(options) != 1:
        return None
    base = options[0] if union else annotation
    if base in (str, Path):
        return base
    if typing.get_origin(base) is list and typing.get_args(base) == (str,):
        return list
    return None


def split_mapping(
    values: dict[str, Any], cls: type, *, source: str
) -> tuple[list[str], dict[str, Any]]:
    """What a YAML mapping says: command-line tokens for the parser, and the text fields as
    they are (see the module docstring).

    Text (strings, paths, lists of strings) needs no parsing, and as a token it could be taken
    for a flag (`stop: ["-x"]`) or for None (`"None"`); every other value becomes the flag that
    says the same thing, so the parser types and checks it. Unknown keys are errors with a
    suggestion; launch directives (`resume`, `config`) are ignored with a warning, so an earlier
    run's saved config can only ever start a new run.
    """
    known = field_names(cls)
    hints = typing.get_type_hints(cls)
    args: list[str] = []
    text: dict[str, Any] = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name in LAUNCH_FIELDS:
            warnings.warn(
                f"{source}: '{key}' ignored: a config file only describes a run; pass --{name} "
                "on the command line",
                stacklevel=2,
            )
            continue
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(known)}"
            raise UserError(f"unknown config key {key!r} in {source}{hint}")
        flag = _flag(name)
        kind = _text_kind(hints[name])
        if kind is not None and value is not None:
            if kind is list:
                items = value if isinstance(value, (list, tuple)) else [value]
                if any(isinstance(v, (dict, list)) for v in items):
                    raise UserError(f"{key} in {source} takes a list of strings, got {value!r}")
                text[name] = [str(v) for v in items] or None
            elif isinstance(value, (dict, list)):
                raise UserError(f"{key} in {source} takes a string, got {value!r}")
            else:
                text[name] = kind(str(value))
        elif _is_plain_bool(hints[name]):
            if not isinstance(value, bool):
                raise UserError(f"{key} in {source} must be true or false, got {value!r}")
            args.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            args.append(f"{flag}=None")
        elif isinstance(value, dict):
            args += [flag, *(str(t) for kv in value.items() for t in kv)]
        elif isinstance(value, (list, tuple)):
            args += [flag, *(str(v) for v in value)] if value else [f"{flag}=None"]
        else:
            args.append(f"{flag}={value}")
    return args, text


def _expected(cls: type, name: str) -> str:
    """What a field takes, in words, for error messages."""
    annotation = typing.get_type_hints(cls).get(name)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if len(args) == 1 else annotation
    origin = typing.get_origin(base)
    if base is int:
        return "an integer"
    if base is float:
        return "a number"
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(base)))
    if origin is tuple:
        return f"{len(typing.get_args(base))} numbers"
    if origin is dict:
        return "NAME VALUE pairs"
    if origin is list:
        return "one or more values"
    return "a value"


def _one_line(event: Any, cls: type, source: str) -> UserError:
    """A tyro parse error as one line naming the field, what it takes and where it came from."""
    kind = type(event).__name__
    argument = getattr(event, "argument", None)
    flags = getattr(getattr(argument, "lowered", None), "name_or_flags", None) or ()
    name = next((f[2:].replace("-", "_") for f in flags if f.startswith("--")), None)
    where = f" in {source}" if source != "the command line" else ""
    if kind == "UnrecognizedArgs":
        tokens = list(getattr(event, "tokens", []))
        first = tokens[0] if tokens else ""
        if first.startswith("--"):
            options = [_flag(n) for n in field_names(cls)]
            close = difflib.get_close_matches(first.split("=")[0], options, n=1)
            hint = f"; did you mean {close[0]}?" if close else "; see --help"
            return UserError(f"unknown flag {first}{where}{hint}")
        return UserError(f"unexpected value {first!r}{where}; a switch like --progress takes none")
    if name is None:
        return UserError(f"invalid arguments{where}; see --help")
    label = name if source != "the command line" else _flag(name)
    if kind == "InvalidChoice":
        return UserError(f"{label}{where}: {event.value!r} is not {_expected(cls, name)}")
    if kind == "BadValue":
        return UserError(f"{label}{where} takes {_expected(cls, name)}")
    detail = str(getattr(event, "message", "")).strip().splitlines()
    readable = detail and len(detail[0]) < 80 and "type matching" not in detail[0]
    got = f" ({detail[0]})" if readable else ""
    return UserError(f"{label}{where} takes {_expected(cls, name)}{got}")


def parse_args(
    cls: type[Config],
    args: Sequence[str],
    *,
    prog: str,
    source: str,
    text: dict[str, Any] | None = None,
) -> Config:
    """`cls` from command-line tokens with tyro, starting from the `text` fields of a file (see
    `split_mapping`); a bad value is one UserError line. `--help` prints the help and exits
    (SystemExit 0) as usual."""
    default = cls(**(text or {}))
    hook_api = getattr(getattr(tyro, "_errors", None), "on_parse_error", None)
    if hook_api is None:  # pragma: no cover - tyro without parse-error hooks: its own message
        return tyro.cli(cls, args=list(args), prog=prog, default=default)

    def raise_one_line(event: Any) -> None:
        raise _one_line(event, cls, source)

    with hook_api(raise_one_line):
        return tyro.cli(cls, args=list(args), prog=prog, default=default)


def from_mapping(values: dict[str, Any], *, source: str, cls: type | None = None) -> Any:
    """A config from a YAML-like mapping, parsed as the flags that say the same thing."""
    cls = cls or TrainConfig
    args, text = split_mapping(values, cls, source=source)
    return parse_args(cls, args, prog="grouprl", source=source, text=text)


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a config file written by hand or saved by an earlier run."""
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; check the path given to --config")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise UserError(f"config file {path} is not valid YAML{where}; fix its syntax") from None
    if not isinstance(values, dict):
        raise UserError(f"config file {path} must hold a mapping of field: value")
    return values


def config_record(cfg: TrainConfig) -> dict[str, Any]:
    """The config a run records, as plain values: every field but the launch directives and the
    output directory (copied as a template, it starts a new run in a new directory)."""
    skip = {*LAUNCH_FIELDS, "output_dir"}  # the record lives in its directory: no need to say
    values = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}
    for key, value in values.items():
        if isinstance(value, Path):
            values[key] = str(value)
        elif isinstance(value, tuple):
            values[key] = list(value)
    return values


def to_yaml(cfg: TrainConfig) -> str:
    """`config_record` as the YAML a run directory's config.yaml holds."""
    return yaml.safe_dump(config_record(cfg), sort_keys=False)


def parse_train_args(argv: Sequence[str]) -> TrainConfig:
    """`grouprl train`'s config from its flags, a `--config` file, or the run to `--resume`.

    With `--resume RUN`, the run's saved config is the base and only RESUMABLE_FIELDS (and those
    named by `--allow-change`) may differ from it; `--config` and `--output-dir` are refused
    (the run's own directory and config are what continues).
    """
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        return parse_args(TrainConfig, argv, prog="grouprl train", source="the command line")
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for name in ("--config", "--resume", "--output-dir"):
        pre.add_argument(name)
    try:
        known, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise UserError(f"{err}; see grouprl train --help") from None
    cli = "the command line"
    if known.resume is not None:
        for flag, value in (("--config", known.config), ("--output-dir", known.output_dir)):
            if value is not None:
                raise UserError(
                    f"--resume continues a run in its own directory with its own config; drop "
                    f"{flag} (to start a new run from its config: --config "
                    f"{Path(known.resume) / 'config.yaml'} --output-dir NEW)"
                )
        saved_path = Path(known.resume) / "config.yaml"
        if not saved_path.is_file():
            raise UserError(
                f"{known.resume} is not a run directory (no config.yaml); check --resume"
            )
        base, text = split_mapping(load_yaml(saved_path), TrainConfig, source=str(saved_path))
        saved = parse_args(
            TrainConfig, base, prog="grouprl train", source=str(saved_path), text=text
        )
        cfg = parse_args(TrainConfig, [*base, *argv], prog="grouprl train", source=cli, text=text)
        cfg = dataclasses.replace(cfg, output_dir=Path(known.resume))
        _check_resume_changes(saved, cfg)
        return cfg
    base, text = [], {}
    if known.config is not None:
        path = Path(known.config)
        base, text = split_mapping(load_yaml(path), TrainConfig, source=str(path))
        parse_args(TrainConfig, base, prog="grouprl train", source=str(path), text=text)
    return parse_args(TrainConfig, [*base, *argv], prog="grouprl train", source=cli, text=text)


def _check_resume_changes(saved: TrainConfig, cfg: TrainConfig) -> None:
    allowed = {*RESUMABLE_FIELDS, *LAUNCH_FIELDS, "output_dir", *(cfg.allow_change or [])}
    unknown = sorted(set(cfg.allow_change or []) - set(field_names()))
    if unknown:
        raise UserError(f"--allow-change names no field {unknown[0]!r}; see --help for fields")
    saved, cfg = local_paths_absolute(saved), local_paths_absolute(cfg)  # as resolve() records
    for f in dataclasses.fields(TrainConfig):
        before, after = getattr(saved, f.name), getattr(cfg, f.name)
        if f.name not in allowed and before != after:
            raise UserError(
                f"--resume: {f.name} would change from {before!r} to {after!r}, which makes the "
                f"rest of the run a different run; resume may change {', '.join(RESUMABLE_FIELDS)} "
                f"(add --allow-change {f.name} if you mean it, or start a new run)"
            )


def local_paths_absolute(cfg: Any) -> Any:
    """The config with its local model, dataset and reward-file paths made absolute (hub ids and
    builtin:NAME unchanged), as a run records them."""
    local = {
        name: str(Path(value).expanduser().resolve())
        for name in ("model", "dataset", "eval_dataset")
        if (value := getattr(cfg, name, None)) is not None and Path(value).expanduser().exists()
    }
    cfg = dataclasses.replace(cfg, **local)
    if cfg.rewards:
        cfg = dataclasses.replace(
            cfg, rewards={absolute_spec(spec): w for spec, w in cfg.rewards.items()}
        )
    if cfg.pass_reward is not None:
        cfg = dataclasses.replace(cfg, pass_reward=absolute_spec(cfg.pass_reward))
    if getattr(cfg, "tools", None):
        cfg = dataclasses.replace(cfg, tools=[absolute_spec(spec) for spec in cfg.tools])
    if getattr(cfg, "environment", None):
        cfg = dataclasses.replace(cfg, environment=absolute_spec(cfg.environment))
    return cfg


@dataclass(frozen=True)
class RunConfig(TrainConfig):
    """A `TrainConfig` after `resolve`: every field the preset or the task fills is filled, and
    the whole config is validated. The only config type `grouprl.train` reads.

    The fields below are the ones `TrainConfig` leaves at None for the preset (or the task) to
    fill; here they are required, so no placeholder reaches a training function.
    """

    ratio_level: RatioLevel = field(kw_only=True)
    clip_low: float = field(kw_only=True)
    clip_high: float = field(kw_only=True)
    beta: float = field(kw_only=True)
    loss_agg: LossAgg = field(kw_only=True)
    norm_len: int = field(kw_only=True)
    adv_scale: AdvScale = field(kw_only=True)
    adv_estimator: AdvEstimator = field(kw_only=True)
    minibatches: int = field(kw_only=True)
    dynamic_sampling: bool = field(kw_only=True)
    mask_truncated: bool = field(kw_only=True)
    overlong_penalty: bool = field(kw_only=True)
    overlong_cache: int = field(kw_only=True)
    max_new_tokens: int = field(kw_only=True)
    model: str = field(kw_only=True)
    steps: int = field(kw_only=True)

    def __post_init__(self) -> None:
        fields = dataclasses.fields(self)
        empty = [f.name for f in fields if f.kw_only and getattr(self, f.name) is None]
        if empty:
            raise ValueError(f"RunConfig fields left unresolved: {', '.join(empty)}; use resolve()")


def resolve(
    cfg: TrainConfig,
    *,
    task_max_new_tokens: int,
    world_size: int = 1,
    task_model: str = "builtin:arith",
    task_steps: int = 200,
) -> RunConfig:
    """Fill every field left at None from the preset and the task (its budget and its model),
    then `validate` for a job of `world_size` processes.

    Local paths (model, datasets, reward files) are recorded absolute, so a resumed run reads
    the same files from any working directory; hub ids and builtin:NAME stay as they are.
    """
    if cfg.algo not in PRESETS:
        raise UserError(f"invalid config: algo {cfg.algo!r} is not one of {', '.join(PRESETS)}")
    if cfg.algo == "gdpo" and cfg.adv_estimator not in (None, "gdpo"):
        raise UserError(
            f"--algo gdpo is its own advantage estimator; drop --adv-estimator "
            f"{cfg.adv_estimator}, or use --algo grpo --adv-estimator {cfg.adv_estimator}"
        )
    # (a saved config, resumed, holds the preset's scale: that one is no choice of the user's)
    if "gdpo" in (cfg.algo, cfg.adv_estimator) and cfg.adv_scale not in (
        None, PRESETS[cfg.algo].adv_scale
    ):  # fmt: skip
        raise UserError(
            "gdpo scales each reward by its group's std and the sum by the batch's; drop "
            "--adv-scale, or use another --adv-estimator"
        )
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)}
    for name, value in dataclasses.asdict(PRESETS[cfg.algo]).items():
        if values[name] is None:
            values[name] = value
    if values["max_new_tokens"] is None:
        values["max_new_tokens"] = task_max_new_tokens
    if values["model"] is None:
        values["model"] = task_model
    if values["steps"] is None:
        values["steps"] = task_steps
    if values["norm_len"] is None:
        values["norm_len"] = values["max_new_tokens"]
    if values["overlong_cache"] is None:
        values["overlong_cache"] = max(1, values["max_new_tokens"] // 4)
    if values["lora_r"] is not None and values["lora_alpha"] is None:
        values["lora_alpha"] = 2.0 * values["lora_r"]
    from grouprl.report.trackers import report_targets

    values["report_to"] = list(report_targets(values["report_to"], installed=False))
    resolved = local_paths_absolute(RunConfig(**values))
    validate(resolved, world_size)
    return resolved


#: The one rule for a sampling temperature wherever a command takes one (the sampler itself
#: also decodes greedily at 0, which no command exposes).
TEMPERATURE_RULE = "temperature must be > 0: log-probs are taken at it"


def _choice_problems(cfg: Any) -> list[str]:
    """Values outside their Literal choices: the parser checks flags and files, but a config
    built in Python bypasses it."""
    problems = []
    for name, annotation in typing.get_type_hints(type(cfg)).items():
        options = [annotation, *typing.get_args(annotation)]  # Literal, or Optional[Literal]
        literal = next((a for a in options if typing.get_origin(a) is Literal), None)
        value = getattr(cfg, name, None)
        if literal is not None and value is not None and value not in typing.get_args(literal):
            valid = ", ".join(map(str, typing.get_args(literal)))
            problems.append(f"{name} {value!r} is not one of {valid}")
    return problems


def _data_checks(opts: DataOptions) -> list[tuple[bool, str]]:
    """The rules between the data fields, shared by train and eval."""
    given = [
        flag
        for flag, value in (
            ("--eval-dataset", opts.eval_dataset),
            ("--prompt-template", opts.prompt_template),
            ("--answer-column", opts.answer_column),
        )
        if value is not None
    ]
    return [
        (
            opts.dataset is None or opts.task is None,
            f"--task {opts.task} and --dataset are exclusive: a dataset brings its own prompts; "
            "drop --task",
        ),
        (
            # an environment may own the reward (get_reward); build_rewards checks it has one
            opts.dataset is None or bool(opts.rewards) or opts.environment is not None,
            "--dataset needs --rewards: name the functions that score your data, e.g. "
            "--rewards accuracy 1.0, or --rewards path/to/rewards.py:my_reward 1.0",
        ),
        (
            opts.dataset is not None or not given,
            f"{given[0] if given else ''} applies to --dataset, which is not given",
        ),
        (0 < opts.eval_fraction < 1, "eval_fraction must lie in (0, 1)"),
        (
            opts.max_prompt_length is None or opts.max_prompt_length >= 1,
            "max_prompt_length must be at least 1",
        ),
        (
            opts.stop is None or all(isinstance(s, str) and s for s in opts.stop),
            "stop strings must be non-empty",
        ),
        (opts.rewards is None or len(opts.rewards) > 0, "rewards must name at least one function"),
        (opts.reward_timeout > 0, "reward_timeout must be > 0 seconds"),
        (opts.max_turns >= 0, "max_turns must be >= 0 (0: tools available, never run)"),
        (
            opts.max_tool_response_tokens is None or opts.max_tool_response_tokens >= 1,
            "max_tool_response_tokens must be at least 1",
        ),
        (opts.tool_timeout > 0, "tool_timeout must be > 0 seconds"),
        (opts.tools is None or len(opts.tools) > 0, "tools must name at least one tool"),
        (
            opts.max_new_tokens is None or opts.max_new_tokens >= 1,
            "max_new_tokens must be at least 1",
        ),
    ]


def _raise_first(checks: list[tuple[bool, str]], problems: Sequence[str] = ()) -> None:
    for ok, message in checks:
        if not ok:
            raise UserError(message if message.startswith("--") else f"invalid config: {message}")
    for problem in problems:
        raise UserError(f"invalid config: {problem}")


def validate_eval(cfg: EvalConfig) -> None:
    """`grouprl eval`'s settings: one line for the first that is impossible."""
    _raise_first(
        [
            *_data_checks(cfg),
            (cfg.limit >= 1, "--limit must be at least 1"),
            (cfg.samples >= 1, "samples must be at least 1"),
            (cfg.batch_prompts >= 1, "batch_prompts must be at least 1"),
            (cfg.temperature > 0, TEMPERATURE_RULE),
            (cfg.threads is None or cfg.threads >= 1, "threads must be at least 1"),
        ],
        _choice_problems(cfg),
    )


def validate(cfg: RunConfig, world_size: int = 1) -> None:
    """Every check a run's settings need before a model is loaded, for a job of `world_size`
    processes: one line for the first that is impossible; a warning for each dubious one. (What
    needs the model or tokenizer, such as the context length, is checked where they load.)"""
    parts = world_size * cfg.minibatches
    checks = [
        *_data_checks(cfg),
        (cfg.group_size >= 2, "group_size must be at least 2: a group of one has no baseline"),
        (cfg.prompts_per_step >= 1, "prompts_per_step must be at least 1"),
        (cfg.steps >= 1, "steps must be at least 1"),
        (cfg.temperature > 0, TEMPERATURE_RULE),
        (0 < cfg.top_p <= 1, "top_p must lie in (0, 1]"),
        (cfg.top_k >= 0, "top_k must be >= 0 (0 turns it off)"),
        (cfg.lr > 0 and math.isfinite(cfg.lr), "lr must be a positive number"),
        (0 <= cfg.weight_decay < math.inf, "weight_decay must be >= 0"),
        (cfg.warmup_steps >= 0, "warmup_steps must be >= 0"),
        (cfg.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0 turns clipping off)"),
        (cfg.epochs >= 1, "epochs must be at least 1"),
        (cfg.minibatches >= 1, "minibatches must be at least 1"),
        (
            cfg.prompts_per_step % cfg.minibatches == 0,
            f"minibatches ({cfg.minibatches}) must divide prompts_per_step "
            f"({cfg.prompts_per_step}): each minibatch holds whole groups",
        ),
        (
            cfg.prompts_per_step % parts == 0,
            f"prompts_per_step {cfg.prompts_per_step} must be divisible by the world size "
            f"{world_size} times minibatches {cfg.minibatches} (= {parts}): every rank trains "
            "whole groups, as many in each minibatch; change --prompts-per-step, --minibatches "
            "or --nproc-per-node",
        ),
        (
            world_size == 1 or cfg.strategy != "fsdp" or cfg.lora_r is None,
            "--strategy fsdp does not shard LoRA models; use --strategy ddp (each rank holds the "
            "base model, and only the small adapters are reduced)",
        ),
        (0 <= cfg.clip_low < 1, "clip_low must lie in [0, 1): the ratio's lower bound 1-clip_low"),
        (cfg.clip_high >= 0, "clip_high must be >= 0"),
        (cfg.dual_clip is None or cfg.dual_clip > 1, "dual_clip must be > 1 (or unset)"),
        (cfg.beta >= 0, "beta must be >= 0"),
        (cfg.adv_eps >= 0, "adv_eps must be >= 0"),
        (cfg.norm_len >= 1, "norm_len must be at least 1"),
        (
            0 < cfg.overlong_cache <= cfg.max_new_tokens,
            "overlong_cache must lie in [1, max_new_tokens]",
        ),
        (cfg.max_resample_rounds >= 0, "max_resample_rounds must be >= 0"),
        (cfg.eval_every >= 0, "eval_every must be >= 0"),
        (cfg.eval_size >= 1, "eval_size must be at least 1"),
        (cfg.eval_samples >= 1, "eval_samples must be at least 1"),
        (cfg.save_every >= 1, "save_every must be at least 1"),
        (cfg.keep_last >= 1, "keep_last must be at least 1"),
        (cfg.log_ratios >= 0, "log_ratios must be >= 0"),
        (cfg.log_ratios_every >= 1, "log_ratios_every must be at least 1"),
        (cfg.threads is None or cfg.threads >= 1, "threads must be at least 1"),
        (
            cfg.micro_batch_size is None or cfg.micro_batch_size >= 1,
            "micro_batch_size must be at least 1",
        ),
        (cfg.lora_r is None or cfg.lora_r >= 1, "lora_r must be at least 1 (or unset)"),
        (cfg.lora_alpha is None or cfg.lora_alpha > 0, "lora_alpha must be > 0"),
        (0 <= cfg.lora_dropout < 1, "lora_dropout must lie in [0, 1)"),
        (cfg.max_nonfinite_steps >= 1, "max_nonfinite_steps must be at least 1"),
    ]
    _raise_first(checks, _choice_problems(cfg))
    from grouprl.report.trackers import report_targets

    report_targets(cfg.report_to)  # a tracker that is unknown or not installed: one line
    _warn_dubious(cfg)


def _warn_dubious(cfg: RunConfig) -> None:
    if cfg.lora_dropout > 0:
        warnings.warn(
            "lora_dropout > 0: the update's forward differs from the sampling policy even before "
            "the first optimizer step, so the on-policy ratio is not 1",
            stacklevel=2,
        )
    if cfg.base_dtype != "fp32" and cfg.lora_r is None and cfg.beta == 0:
        warnings.warn(
            "base_dtype sets the dtype of frozen weights (a LoRA base, a reference model); with "
            "full fine-tuning and beta = 0 there are none, so it changes nothing",
            stacklevel=2,
        )
    if cfg.ratio_level != "token" and (cfg.top_k > 0 or cfg.top_p < 1):
        warnings.warn(
            "top_k/top_p with a sequence-level ratio: completions come from the truncated "
            "distribution while old_logp is the full one's, which biases every sequence ratio "
            "(about 0.989 at top-p 0.9, far outside GSPO's clip range); leave them off for GSPO",
            stacklevel=2,
        )
    if cfg.ratio_level != "token" and cfg.loss_agg == "token_mean":
        warnings.warn(
            "a sequence-level ratio with loss_agg=token_mean weights each completion by its "
            "length; seq_mean_token_mean is GSPO's own aggregation",
            stacklevel=2,
        )
    if (
        cfg.epochs == 1
        and cfg.minibatches == 1
        and cfg.ratio_level != "token"
        and cfg.clip_high < 0.01
    ):
        warnings.warn(
            "with one on-policy update per batch every sequence ratio is 1, so GSPO's clip never "
            "acts; use minibatches > 1 or epochs > 1 as the GSPO paper does",
            stacklevel=2,
        )
