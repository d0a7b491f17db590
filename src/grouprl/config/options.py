"""The options of `grouprl train`, `eval` and `generate`, each a typed, frozen dataclass whose
fields become flags (`group_size` -> `--group-size`) with the docstring under each as its help;
and `RunConfig`, a `TrainConfig` with every field the preset or the task fills filled (what
`grouprl.config.resolution.resolve` returns and the only config `grouprl.train` reads).

Imports neither torch nor transformers, so `--help` answers at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from grouprl.config.choices import (
    AdvScale,
    Algo,
    Dtype,
    Engine,
    EvalSplit,
    LossAgg,
    RatioLevel,
    ToolFormat,
    VllmDtype,
    VllmMode,
)
from grouprl.config.training import (
    AdvantageOptions,
    AggregationOptions,
    AsyncOptions,
    CheckpointOptions,
    ComputeOptions,
    DistillationOptions,
    EntropyOptions,
    EvaluationOptions,
    LoggingOptions,
    LoraOptions,
    ObjectiveOptions,
    OffPolicyOptions,
    RoutingOptions,
    SamplingOptions,
    ShapingOptions,
    UpdateOptions,
)


@dataclass(frozen=True)
class RunOptions:
    """Where a run's settings come from and where it writes (train only)."""

    config: Path | None = None
    """YAML file holding any of these fields; flags given on the command line override it."""
    algo: Algo = "gspo"
    """Algorithm preset. It fills every field below that is left at None (the docs' Algorithms
    page lists what each fills)."""
    output_dir: Path | None = None
    """Run directory. None: runs/<algo>-<date>-<time>. It must not already hold a run."""
    resume: Path | None = None
    """Run directory to continue from its latest checkpoint (its saved config is the base)."""
    allow_change: list[str] | None = None
    """Fields --resume may change besides steps, eval/save/log settings, threads, progress,
    reward_timeout and device, e.g. --allow-change lr."""


@dataclass(frozen=True)
class PolicyOptions:
    """The policy: where it loads from, how, and where it runs."""

    model: str | None = None
    """Policy to start from: a local Hugging Face model directory, builtin:NAME, or a hub id
    (Qwen/Qwen2.5-0.5B-Instruct), given to from_pretrained as it is. None: the task's own
    (builtin:arith; builtin:lookup for --task lookup)."""
    trust_remote_code: bool = False
    """Let from_pretrained run code shipped with the model (only for models you trust)."""
    revision: str | None = None
    """The hub revision (branch, tag or commit) of a hub --model and its tokenizer, as
    from_pretrained's revision. None: the default branch. Not used for a local directory."""
    attn_implementation: str | None = None
    """The attention kernels the policy and reference model load with, as from_pretrained's
    attn_implementation (eager, sdpa, flash_attention_2, ...). None: transformers' choice."""
    device: str = "auto"
    """auto (CUDA when available, else CPU), cpu, cuda or cuda:N."""
    base_dtype: Dtype = "fp32"
    """dtype of frozen weights: the base model under LoRA and the reference model. Trainable
    weights and the optimizer stay fp32; bf16/fp16 forwards make the trainer recompute old_logp."""
    chat_template_kwargs: dict[str, bool | int | float | str] | None = None
    """Variables for the tokenizer's chat template wherever it renders (prompts, tool turns,
    reward models), e.g. --chat-template-kwargs enable_thinking False for Qwen3."""
    max_image_pixels: int = 4096 * 4096
    """A vision-language model's prompt images may have at most this many pixels (width times
    height); a larger one stops the run with a line naming its row. The processor resizes
    every image anyway; this guards memory and time."""


@dataclass(frozen=True)
class EngineOptions:
    """What samples completions: grouprl's decode loop or vLLM, and vLLM's settings."""

    engine: Engine = "hf"
    """What samples completions: hf, grouprl's own decode loop on the policy itself (the
    sampler is the trainer); vllm, vLLM's offline engine in this process (TRL's colocate mode:
    its own copy of the weights, synced after every update; the trainer recomputes old_logp and
    logs how far vLLM's log-probs are from it). pip install 'grouprl[vllm]'."""
    vllm_mode: VllmMode = "colocate"
    """Where --engine vllm runs: colocate, in the training process (TRL's colocate mode);
    server, in a process of its own beside the trainer, weights pushed to it after each update
    (TRL's server mode, on the trainer's device; answers no tool calls). An asynchronous run
    (--max-staleness > 0) always runs vLLM in its own process."""
    vllm_dtype: VllmDtype = "auto"
    """vLLM's weight and activation dtype. auto: the trainer's forwards' (float32; bfloat16
    under --precision bf16 or a bf16 LoRA base)."""
    vllm_gpu_memory_utilization: float = 0.3
    """On a GPU, the share of its memory vLLM may hold (weights, activations, KV cache), as
    TRL's vllm_gpu_memory_utilization; the trainer needs the rest. Not used on a CPU."""
    vllm_kv_cache_gb: float | None = None
    """vLLM's KV cache in GiB. None: on a GPU, what --vllm-gpu-memory-utilization leaves; on a
    CPU, room for every row of the largest batch the run samples at full length (vLLM's own
    CPU default reserves most of the machine's RAM)."""
    vllm_max_model_length: int | None = None
    """Longest prompt + completion vLLM holds a sequence for; prompts longer than it leaves for
    max_new_tokens are skipped, as --max-prompt-length skips them. None: the model's context."""
    vllm_sleep: bool = False
    """Put vLLM to sleep while the trainer updates (its KV cache freed, weights reloaded on
    waking), as TRL's vllm_enable_sleep_mode: memory for the update on a shared GPU, at a wake
    per step. CUDA only."""
    vllm_enforce_eager: bool | None = None
    """Run vLLM's model eagerly. None: eager on a CPU (compiling takes minutes on a few cores
    and LoRA needs eager there), CUDA graphs on a GPU."""
    vllm_server: str | None = None
    """Sample on vLLM servers: URL[,URL...] of running vLLM servers (started as the docs' vLLM
    servers guide shows, on any machine this one reaches), or local: one grouprl starts on this
    machine. Implies --engine vllm; each prompt's group goes to one server, groups are spread
    over them, and every server reloads each new weight version (--vllm-weights-dir) before it
    samples again. Works under torchrun."""
    vllm_weights_dir: str | None = None
    """Where the trainer writes each weight version for --vllm-server to reload: a directory
    the servers read (on other machines: a shared filesystem). None: a temporary directory,
    which only servers on this machine can read."""


@dataclass(frozen=True)
class TaskOptions:
    """The prompts: a built-in task or a dataset, its columns and held-out rows, prompts' rendering."""

    task: str | None = None
    """A built-in task (arithmetic, lookup), or reasoning_gym:NAME, any of reasoning-gym's
    generators (its extra: pip install 'grouprl[reasoning-gym]'). None: arithmetic, unless
    --dataset is given."""
    task_config: dict[str, str] | None = None
    """Config keywords of a reasoning_gym:NAME task's generator, e.g. --task-config
    min_animals 1 max_animals 3 (values read as YAML: 3 is a number, [1, 2] a list)."""
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


@dataclass(frozen=True)
class RewardOptions:
    """The reward functions, what counts as correct, and how long they may take."""

    rewards: dict[str, float] | None = None
    """Reward functions and weights: a built-in name (correct, format, accuracy, think_format),
    path/to/rewards.py:function, package.module:function, or a reward model directory, e.g.
    --rewards accuracy 1.0 my_rewards.py:fmt 0.2. None: the task's."""
    pass_reward: str | None = None
    """The reward that decides correctness (a completion passes when its score is >= 1), for the
    accuracy metric and pass@k. None: accuracy if listed, else correct, else the first reward."""
    reward_timeout: float = 60.0
    """Seconds a reward function may take for one step's completions before the run stops."""


@dataclass(frozen=True)
class BudgetOptions:
    """How long a completion may be."""

    max_new_tokens: int | None = None
    """Generation budget per completion (with tools: the whole trajectory, the tools'
    observations included). None: the task's own budget (256 for --dataset)."""


@dataclass(frozen=True)
class ToolOptions:
    """Tools and environments the policy uses while it writes."""

    tools: list[str] | None = None
    """Tools the policy may call while it writes: path/to/tools.py:fn, package.module:fn, or a
    tool the task ships (typed functions with docstrings, sync or async, as TRL takes them).
    None: the task's own tools (lookup's), else none."""
    tool_format: ToolFormat = "tags"
    """How calls are written: tags, <NAME>ARGS</NAME> with the observation following as plain
    text (for base and character-level models); chat, as the model's chat template writes tool
    calls and results (Hermes/Qwen2.5 <tool_call> JSON, Llama-3.1 JSON), the tools rendered
    into the prompt from their signatures and docstrings."""
    tool_prompt: str = "auto"
    """How the tags format describes the tools to the model, in the system message of chat
    prompts or before plain ones: auto (grouprl's description, for a model with a chat
    template), default (grouprl's, for any model), none, or path/to/template.jinja rendered
    with `tools` (their JSON schemas). In the chat format the chat template describes them."""
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
    agent: str | None = None
    """An agent program plays each episode: path/agent.py:function or package.module:function,
    an async function agent(client, row) given an openai.AsyncOpenAI client pointed at
    grouprl's endpoint (the policy, answered by the run's sampler) and the dataset row. It
    returns the episode's reward, or None and the run's rewards score its conversation."""
    agent_timeout: float = 300.0
    """Seconds an agent episode may run between two requests; past it the episode ends and
    scores as failed."""
    agent_port: int = 0
    """The port on 127.0.0.1 the endpoint agents talk to listens on. 0: a free one."""


@dataclass(frozen=True)
class ModelOptions(EngineOptions, PolicyOptions):
    """The policy and where it runs (shared by train and eval)."""


@dataclass(frozen=True)
class DataOptions(ToolOptions, BudgetOptions, RewardOptions, TaskOptions):
    """What the model is asked and how its answers are scored (shared by train and eval)."""


@dataclass(frozen=True)
class TrainConfig(
    LoggingOptions,
    CheckpointOptions,
    EvaluationOptions,
    ShapingOptions,
    AsyncOptions,
    RoutingOptions,
    OffPolicyOptions,
    AdvantageOptions,
    AggregationOptions,
    EntropyOptions,
    DistillationOptions,
    ObjectiveOptions,
    UpdateOptions,
    SamplingOptions,
    LoraOptions,
    ComputeOptions,
    DataOptions,
    ModelOptions,
    RunOptions,
):
    """Train a causal LM with GRPO, GSPO, Dr. GRPO or DAPO on a task with verifiable rewards."""


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
class GenerateConfig(DataOptions, ModelOptions):
    """Print a model's completions for a prompt, or for rows of a task or dataset."""

    prompt: str | None = None
    """The prompt (a string; a user message with --chat-template). None: rows of --split, or
    an interactive prompt on a terminal when no --dataset or --task is given either."""
    answer: str | None = None
    """The reference answer of --prompt, given to --rewards as `answer`."""
    image: list[str] | None = None
    """Image files shown with --prompt, in order (a vision-language model)."""
    split: EvalSplit = "heldout"
    """Which rows to take without --prompt: held-out (as train holds them out), train, or all."""
    limit: int = 3
    """Rows to take without --prompt."""
    samples: int = 1
    """Completions per prompt."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    seed: int = 0
    """Sampling seed."""
    threads: int | None = None
    """torch CPU threads. None: torch's default."""
    json: bool = False
    """Print one JSON object per prompt instead of text."""


@dataclass(frozen=True)
class RunConfig(TrainConfig):
    """A `TrainConfig` after `resolve`: every field the preset or the task fills is filled, and
    the whole config is validated. The only config type `grouprl.train` reads.

    The fields below are the ones `TrainConfig` leaves at None for the preset (or the task) to
    fill; here they are required, so no placeholder reaches a training function.
    """

    ratio_level: RatioLevel = field(kw_only=True)
    objective: str = field(kw_only=True)
    clip_low: float = field(kw_only=True)
    clip_high: float = field(kw_only=True)
    beta: float = field(kw_only=True)
    loss_agg: LossAgg = field(kw_only=True)
    norm_len: int = field(kw_only=True)
    adv_scale: AdvScale = field(kw_only=True)
    adv_estimator: str = field(kw_only=True)
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


def field_names(cls: type | None = None) -> list[str]:
    return [f.name for f in dataclasses.fields(cls or TrainConfig)]
