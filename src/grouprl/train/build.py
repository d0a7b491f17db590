"""What `train` and `eval` build from their options: the task, the policy, its precision, the
reward set and the prompt budget. One place, so both commands read data and models alike."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grouprl.config.options import DataOptions, ModelOptions, RunConfig
from grouprl.config.training import AdvantageOptions
from grouprl.config.validation import TASK_CONFIG_ALONE
from grouprl.core.registry import ADVANTAGE_ESTIMATORS
from grouprl.endpoint.agents import METRICS as AGENT_METRICS
from grouprl.endpoint.agents import agent_reward
from grouprl.endpoint.use import AgentUse, run_agent_use, v1_agent_use
from grouprl.errors import UserError, remedy
from grouprl.models import activation_checkpointing as checkpointing
from grouprl.models import load_model, load_tokenizer, vision
from grouprl.models.loading import DTYPES, context_length, with_pad_token, with_template_variables
from grouprl.models.lora import apply_lora
from grouprl.tasks import Task, get_task
from grouprl.tasks.builtin.code import BUILTIN_TOOLS
from grouprl.tasks.data import DEFAULT_MAX_NEW_TOKENS, RowFormat, dataset_task, environment_task
from grouprl.tasks.ecosystems.reasoning_gym import PREFIX as RG_PREFIX
from grouprl.tasks.ecosystems.verifiers import PREFIX as VF_PREFIX
from grouprl.tasks.ecosystems.verifiers import verifiers_use
from grouprl.tasks.ecosystems.verifiers_v1 import V1Driver
from grouprl.tasks.live import is_live, live_object, live_tokenizer
from grouprl.tasks.rewards.scoring import RewardSet, build_reward_set
from grouprl.tasks.tools.calls import PlainTurns, TagTools, ToolHandler, load_tools
from grouprl.tasks.tools.chat import ChatTools
from grouprl.tasks.tools.environments import load_environment
from grouprl.tasks.tools.prompt import describe_tools, load_template
from grouprl.tasks.tools.use import ToolUse


def task_defaults(opts: DataOptions) -> dict[str, Any]:
    """What a run takes from its task when the flags do not say (known before any data is
    read): `task_max_new_tokens`, the built-in task's budget or 256 for a dataset,
    `task_model`, the task's policy (builtin:arith for a dataset) and `task_steps`, its run's
    length. `resolve`'s keywords."""
    if opts.dataset is not None or owns_data(opts):
        return {"task_max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "task_model": "builtin:arith"}
    task = chosen_task(opts)
    return {"task_max_new_tokens": task.max_new_tokens, "task_model": task.default_model,
            "task_steps": task.default_steps}  # fmt: skip


def estimator_tools(cfg: AdvantageOptions, tools: ToolUse | None) -> ToolUse | None:
    """`tools`, once the advantage estimator is known to take them: one that compares with a
    greedy completion (ReMax) samples it without tools, and a task's own tools (lookup's) are
    known only here."""
    if tools is not None and "baselines" in ADVANTAGE_ESTIMATORS[cfg.adv_estimator].inputs():
        raise UserError(f"--adv-estimator {cfg.adv_estimator} samples its greedy baselines "
                        "without tools; use another estimator with tools or environments")  # fmt: skip
    return tools


def build_tools(
    opts: DataOptions, task: Task, tokenizer: Any, end_ids: Sequence[int] = ()
) -> ToolUse | None:
    """The tools a run's sampler answers calls with (`--tools`, default: the task's, and the
    `--environment`'s methods), in `--tool-format`; None without any. `end_ids`: the ids that
    end a turn (the sampler's EOS ids), for the chat format."""
    if task.driver is not None:  # a verifiers environment runs its own rollouts
        if opts.tools or opts.environment:
            raise UserError(f"{task.name} brings its own tools and loop: drop --tools and "
                            "--environment")  # fmt: skip
        if isinstance(task.driver, V1Driver):  # verifiers 0.4: through the endpoint
            return v1_agent_use(opts, task.driver, tokenizer, end_ids)
        if getattr(opts, "engine", "hf") != "hf":
            raise UserError(f"{task.name} runs on grouprl's own sampler (its turns answer the "
                            "environment's requests): drop --engine vllm")  # fmt: skip
        return verifiers_use(task, tokenizer, end_ids, opts.max_turns,
                             getattr(opts, "model", None) or "the model")  # fmt: skip
    if getattr(opts, "agent", None):
        return run_agent_use(opts, tokenizer, end_ids)
    environment = load_environment(opts.environment) if opts.environment else None
    # an environment brings its own tools: the task's are used only without one
    default = [] if environment is not None else sorted(task.tools or {})
    specs = opts.tools if opts.tools is not None else default
    if not specs and environment is None:
        return None
    tools = load_tools(specs, {**BUILTIN_TOOLS, **(task.tools or {})})
    if environment is not None:
        # the methods of one instance stand for every rollout's (names, schemas); each rollout
        # binds its own instances' (`ToolHandler.for_rollout`)
        # (reset on the first row: a reset that cannot take a row, or one that writes no
        # prompt for an environment that owns the data, is found now)
        (instance,) = environment.start(task.train[:1], 1, [0], chat=_chat(tokenizer)).instances
        probe = environment.tools_of(instance)
        environment.release([instance])
        clash = sorted(set(probe) & {t.name for t in tools})
        if clash:
            raise UserError(
                f"tool {clash[0]!r} is both in --tools and a method of environment "
                f"{environment.name}; a call names its tool, so rename one"
            )
        tools = [*tools, *probe.values()]
    limits = dict(
        max_calls=opts.max_turns,
        max_response_tokens=opts.max_tool_response_tokens,
        timeout=opts.tool_timeout,
    )
    description = tags_description(opts, tokenizer, tools)
    if opts.tool_format == "chat":
        handler: ToolHandler = ChatTools(
            tools,
            tokenizer,
            end_ids=end_ids,
            model=getattr(opts, "model", None) or "the model",
            **limits,
        )
    elif tools:
        handler = TagTools(tools, tokenizer, **limits)
    else:  # an environment played by step() alone
        handler = PlainTurns(tokenizer, **limits)
    return ToolUse(handler, environment, chat=_chat(tokenizer), description=description)


def tags_description(opts: DataOptions, tokenizer: Any, tools: list) -> str | None:
    """What the tags format puts before the prompts about the tools (`--tool-prompt`; auto:
    grouprl's description for a model with a chat template, one that reads instructions)."""
    spec = getattr(opts, "tool_prompt", "auto")
    if opts.tool_format == "chat":
        if spec != "auto":
            raise UserError(f"--tool-prompt {spec} is for the tags format; in the chat format "
                            "the model's chat template describes the tools")  # fmt: skip
        return None
    template = load_template(spec)
    if not tools or template is None or (spec == "auto" and not _chat(tokenizer)):
        return None
    return describe_tools(tools, template)


def _chat(tokenizer: Any) -> bool:
    """Whether the model's prompts are chat messages (its tokenizer has a template)."""
    return bool(getattr(tokenizer, "chat_template", None))


def owns_data(opts: DataOptions) -> bool:
    """An `--environment` with neither `--dataset` nor `--task`: its `reset` writes every
    prompt, as TRL trains an environment with no dataset."""
    return opts.environment is not None and opts.dataset is None and opts.task is None


def chosen_task(opts: DataOptions) -> Task:
    """`--task` (default arithmetic) with its knobs: a reasoning_gym:NAME task takes
    `--task-config` and the run's seed; `--task-config` on another task is one line."""
    name = opts.task or "arithmetic"
    if name.startswith(VF_PREFIX):
        return get_task(name, config=opts.task_config)
    if not name.startswith(RG_PREFIX):
        if opts.task_config:
            raise UserError(TASK_CONFIG_ALONE)
        return get_task(name)
    if getattr(opts, "model", "given") is None:
        raise UserError(f"--task {name} needs --model: an instruct model with a chat template "
                        "(the built-in policies know only their own task)")  # fmt: skip
    return get_task(name, config=opts.task_config, seed=getattr(opts, "seed", 0),
                    system_prompt=opts.system_prompt)  # fmt: skip


def build_task(opts: DataOptions) -> Task:
    """The built-in task (`--task`, default arithmetic), a task over `--dataset`, or the
    episodes of an environment that owns its data."""
    if owns_data(opts):
        return environment_task(opts.environment.rpartition(":")[2])
    if opts.dataset is None:
        return chosen_task(opts)
    fmt = RowFormat(
        prompt_column=opts.prompt_column,
        answer_column=opts.answer_column,
        prompt_template=opts.prompt_template,
        chat_template=opts.chat_template,
        system_prompt=opts.system_prompt,
    )
    same_source = opts.eval_dataset is not None and _same_source(opts.eval_dataset, opts.dataset)
    return dataset_task(
        opts.dataset,
        fmt,
        split=opts.dataset_split,
        eval_source=opts.eval_dataset,
        eval_split=opts.eval_split,
        eval_fraction=opts.eval_fraction,
        environment=opts.environment is not None,
        same_eval_source=same_source and opts.eval_split == opts.dataset_split,
    )


def _same_source(a: str, b: str) -> bool:
    """Whether two dataset specs name the same data (the same path, however it is written)."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def build_rewards(
    opts: DataOptions, task: Task, device: torch.device, tools: ToolUse | None = None
) -> RewardSet:
    """The reward functions `--rewards` names (default: the task's) and the pass reward. An
    agent program (`--agent`) adds its own reward, `agent` (weight 1 unless `--rewards` weights
    it; an episode whose agent returns None has none, and the others score it), and its
    episodes' counts (weight 0: logged). An environment with `get_reward` adds its reward, named after its class, with weight 1 unless
    `--rewards` weights it; without `--rewards` it is the only reward (the environment owns
    the reward, as in TRL)."""
    weights = dict(opts.rewards or task.reward_weights)
    environment = None if tools is None else tools.environment
    if isinstance(tools, AgentUse):  # the agent's reward, and its episodes' counts (logged)
        weights = {**weights, "agent": weights.get("agent", 1.0),
                   **{name: weights.get(name, 0.0) for name in AGENT_METRICS}}  # fmt: skip
        funcs = {**task.reward_funcs, "agent": agent_reward, **AGENT_METRICS}
        task = dataclasses.replace(task, reward_funcs=funcs)
    elif environment is not None and environment.has_reward:
        weights = {environment.name: 1.0, **(opts.rewards or {})}
        funcs = {**task.reward_funcs, environment.name: environment.reward()}
        task = dataclasses.replace(task, reward_funcs=funcs)
    elif environment is not None and not weights:
        raise UserError(
            f"environment {environment.name} has no get_reward and no --rewards are given: "
            "define get_reward(self) -> float, or name reward functions with --rewards"
        )
    rewards = build_reward_set(weights, task, pass_reward=opts.pass_reward, device=device)
    rewards.check_columns(task.train[0], task.name)
    rewards.check_rows(task.train, task.name)
    return rewards


def stop_strings(opts: DataOptions, task: Task) -> list[str] | None:
    """The task's stop strings and `--stop`'s, or None."""
    stop = [*(task.stop or []), *(opts.stop or [])]
    return stop or None


def forward_dtype(cfg: RunConfig) -> torch.dtype | None:
    """The autocast dtype of the policy's forward passes, None for plain float32.

    `--precision bf16` asks for it; so does a LoRA base in bf16/fp16 (its frozen weights are in
    that dtype, the fp32 adapters meet them under autocast).
    """
    if cfg.precision == "bf16":
        return torch.bfloat16
    if cfg.lora_r is not None and cfg.base_dtype != "fp32":
        return DTYPES[cfg.base_dtype]
    return None


def load_teacher(cfg: RunConfig, tokenizer: Any, policy: nn.Module, device: torch.device):
    """The frozen teacher of on-policy distillation (None without --teacher), in `base_dtype`
    on `device`; one line unless it shares the policy's tokenizer (the same vocabulary, id for
    id, and output size): it scores the policy's token ids."""
    if cfg.teacher is None:
        return None
    try:
        theirs = load_run_tokenizer(cfg, cfg.teacher)
    except UserError as err:  # the loader's words name --model
        raise UserError(f"--teacher: {str(err).replace('--model', '--teacher')}") from None
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise UserError(
            f"--teacher {cfg.teacher} has another tokenizer than the policy's ({len(theirs)} vs "
            f"{len(tokenizer)} tokens, or other ids): it must score the policy's token ids; "
            "give a teacher of the same model family"
        )
    teacher = load_run_model(cfg, DTYPES[cfg.base_dtype], device, spec=cfg.teacher)
    ours = policy.get_output_embeddings().weight.shape[0]
    if teacher.get_output_embeddings().weight.shape[0] != ours:
        raise UserError(
            f"--teacher {cfg.teacher}'s output has {teacher.get_output_embeddings().weight.shape[0]} "
            f"logits and the policy's {ours}: they must score the same vocabulary"
        )
    teacher.requires_grad_(False)
    return teacher.eval()


def load_policy(cfg: RunConfig, device: torch.device) -> tuple[nn.Module, Any, nn.Module | None]:
    """(policy, tokenizer, reference) on `device`, in eval mode.

    Full fine-tuning: the policy in float32, a frozen reference copy in `base_dtype` when
    beta > 0. LoRA: the base in `base_dtype` with float32 adapters; the reference is the same
    model with its adapters off (see `grouprl.models.lora.base_model_context`), so None here.
    """
    tokenizer = load_run_tokenizer(cfg)
    if cfg.lora_r is None:
        policy = load_run_model(cfg, torch.float32, device)
        if not cfg.train_vision_tower:
            vision.freeze_vision_tower(policy)
        reference = None
        if cfg.beta > 0:
            reference = load_run_model(cfg, DTYPES[cfg.base_dtype], device)
            reference.requires_grad_(False)
    else:
        base = load_run_model(cfg, DTYPES[cfg.base_dtype], device)
        if cfg.gradient_checkpointing:
            checkpointing.enable(base)
        targets = cfg.lora_target_modules
        if vision.vision_tower(base) is not None and not cfg.train_vision_tower:
            targets = vision.language_targets(base, targets)
        policy = apply_lora(
            base,
            r=cfg.lora_r,
            alpha=cfg.lora_alpha,
            dropout=cfg.lora_dropout,
            target_modules=targets,
        )
        reference = None
    if cfg.gradient_checkpointing and cfg.lora_r is None:
        checkpointing.enable(policy)
    return policy.eval(), tokenizer, reference


def load_run_model(
    opts: ModelOptions, dtype: torch.dtype, device: torch.device | str, spec: str | None = None
) -> nn.Module:
    """The model `spec` (default: `opts.model`) names, in `dtype` on `device`: loaded, or a copy
    of the live model a run from Python was given (the caller's object is never changed)."""
    spec = spec or opts.model
    if is_live(spec):
        given = live_object(spec, "model")
        return copy.deepcopy(given).to(device=device, dtype=dtype).eval()
    return load_model(spec, dtype=dtype, device=device, trust_remote_code=opts.trust_remote_code,
                      revision=opts.revision, attn_implementation=opts.attn_implementation)  # fmt: skip


def load_run_tokenizer(opts: ModelOptions, spec: str | None = None) -> Any:
    """The tokenizer of the model `spec` (default: `opts.model`) names: its own, or a copy of
    the live one (with a pad token, as `load_tokenizer` gives every tokenizer), rendering chat
    templates with `--chat-template-kwargs`."""
    spec = spec or opts.model
    if not is_live(spec):
        tokenizer = load_tokenizer(spec, trust_remote_code=opts.trust_remote_code,
                                   revision=opts.revision)  # fmt: skip
    else:
        given = copy.deepcopy(live_object(live_tokenizer(spec), "tokenizer"))
        tokenizer = with_pad_token(given, spec)
    vision.with_image_limit(tokenizer, opts.max_image_pixels)
    processor = vision.processor_of(tokenizer)
    if processor is not None:  # it renders prompts with images
        with_template_variables(processor, opts.chat_template_kwargs)
    return with_template_variables(tokenizer, opts.chat_template_kwargs)


#: vLLM's dtype for each forward dtype of the trainer (None: float32).
_VLLM_DTYPES = {None: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: The share of the machine's memory vLLM's KV cache may take on a CPU by default.
_CPU_KV_SHARE = 0.25


def build_engine(
    opts: ModelOptions,
    policy: nn.Module,
    tokenizer: Any,
    *,
    dtype: torch.dtype | None,
    rows: int,
    max_len: int | None,
    seed: int,
    tools: Any = None,
    lockstep: Any = None,
    processes: int = 1,
) -> Any:
    """The `RolloutEngine` `--engine` names, sampling `policy`'s completions: grouprl's own
    (the policy itself; `lockstep` keeps FSDP ranks in step), or vLLM's (its own copy of the
    weights; `dtype` is the trainer's forwards', `rows` the most completions one call samples,
    `max_len` the longest prompt + completion it must hold, None: the model's context).
    `tools`: the turn handler."""
    if opts.engine == "hf":
        from grouprl.rollout import HFRolloutEngine

        all_done = None if lockstep is None else lockstep.all_done
        return HFRolloutEngine(policy, tokenizer, lockstep=all_done, tools=tools)
    from grouprl.models.lora import adapts_parameters, is_lora

    if is_lora(policy) and adapts_parameters(policy):
        raise UserError(
            "vLLM cannot take this LoRA model's weights yet: its adapters act on parameters (a "
            "mixture-of-experts model's fused experts or router), not on linear layers; train "
            "it fully, or sample with --engine hf"
        )
    if opts.vllm_server is not None:
        dist = None if lockstep is None else lockstep.dist
        return server_engine(opts, policy, tokenizer, dtype=dtype, rows=rows, max_len=max_len,
                             seed=seed, tools=tools, dist=dist)  # fmt: skip
    if processes > 1:
        raise UserError(
            "--engine vllm runs in one process (TRL's colocate mode on one device); under "
            "torchrun use --vllm-server (vLLM servers) or --engine hf"
        )
    from grouprl.models.lora import checkpoint_weights

    options = vllm_options(opts, policy, dtype, rows, max_len, seed)
    if opts.vllm_mode == "server":
        from grouprl.rollout.vllm_process import VLLMProcessEngine

        if tools is not None:
            raise UserError(
                "--vllm-mode server runs vLLM in a process of its own, which answers no tool "
                "calls yet; use --vllm-mode colocate for tools and environments"
            )
        return VLLMProcessEngine(policy, tokenizer, options,
                                 weights=lambda: checkpoint_weights(policy))  # fmt: skip
    from grouprl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(policy, tokenizer, options, tools=tools,
                      weights=lambda: checkpoint_weights(policy))  # fmt: skip


def server_engine(
    opts: ModelOptions,
    policy: nn.Module,
    tokenizer: Any,
    *,
    dtype: torch.dtype | None,
    rows: int,
    max_len: int | None,
    seed: int,
    tools: Any = None,
    dist: Any = None,
) -> Any:
    """`--vllm-server`: the engine over the servers it names, or over one started here
    (`local`: by rank 0, from the policy's weights, sized as `--engine vllm` would be). Rank 0
    syncs the weights; under FSDP every rank gathers them."""
    from grouprl.models.lora import checkpoint_weights, disk_layout, is_lora
    from grouprl.rollout.vllm_server import LocalServer, VLLMServerEngine, save_model_directory

    lead = dist is None or dist.is_main
    fsdp = dist is not None and dist.fsdp
    if fsdp and is_lora(policy):
        raise UserError("--vllm-server with FSDP and LoRA is not supported yet; use --strategy "
                        "ddp with LoRA (its weights are small), or full fine-tuning")  # fmt: skip
    if fsdp:
        from grouprl.train.parallel.fsdp import gather_full_state

        def weights() -> dict[str, torch.Tensor]:
            return disk_layout(policy, gather_full_state(policy, None)[0])
    else:

        def weights() -> dict[str, torch.Tensor]:
            return checkpoint_weights(policy)

    local, urls = None, [u for u in opts.vllm_server.split(",") if u.strip()]
    if urls == ["local"]:
        url = None
        if lead:
            options = vllm_options(opts, policy, dtype, rows, max_len, seed)
            directory = Path(tempfile.mkdtemp(prefix="grouprl-vllm-model-"))
            save_model_directory(policy, tokenizer, weights(), directory)
            cuda = next(policy.parameters()).device.type == "cuda"
            local = LocalServer(directory, log=directory / "server.log", own_model=True,
                                announce=lambda line: print(line, file=sys.stderr),
                                dtype=options.dtype, max_model_len=options.max_model_len,
                                cpu=not cuda, kv_cache_bytes=options.kv_cache_bytes,
                                gpu_memory_utilization=None if options.kv_cache_bytes
                                else options.gpu_memory_utilization)  # fmt: skip
            url = local.url
        elif fsdp:
            weights()  # rank 0's save gathers: every rank takes part
        urls = [url if dist is None else dist.broadcast(url)]
    elif "local" in urls:
        raise UserError("--vllm-server local starts one server here; give it alone, or URLs")
    return VLLMServerEngine(policy, tokenizer, urls, weights=weights, lead=lead, tools=tools,
                            weights_dir=opts.vllm_weights_dir, local=local)  # fmt: skip


def vllm_options(
    opts: ModelOptions,
    policy: nn.Module,
    dtype: torch.dtype | None,
    rows: int,
    max_len: int | None,
    seed: int,
) -> Any:
    """vLLM's settings from the run's: its dtype (auto: the trainer's forwards'), its longest
    sequence, its KV cache (on a CPU by default room for `rows` sequences at full length, at
    most a quarter of the machine's memory: vLLM's own CPU default would reserve 92% of it),
    eager or compiled, its block size (32 on a CPU, where vLLM's default of 128 leaves a short
    prompt no full block for a group to share), no chunked prefill on a CPU (`VLLMOptions`)."""
    from grouprl.rollout.vllm_engine import VLLMOptions, kv_bytes_per_token

    device = next(policy.parameters()).device
    cpu = device.type != "cuda"
    if opts.vllm_sleep and cpu:
        raise UserError("--vllm-sleep: vLLM's sleep mode needs CUDA; drop it on a CPU")
    if not 0 < opts.vllm_gpu_memory_utilization <= 1:
        raise UserError("--vllm-gpu-memory-utilization must lie in (0, 1]")
    if opts.vllm_kv_cache_gb is not None and not opts.vllm_kv_cache_gb > 0:
        raise UserError("--vllm-kv-cache-gb must be > 0")
    name = opts.vllm_dtype if opts.vllm_dtype != "auto" else _VLLM_DTYPES[dtype]
    length = opts.vllm_max_model_length or max_len or context_length(policy)
    if length is None:
        raise UserError(
            "--engine vllm: the model's config does not say its context length; give "
            "--vllm-max-model-length"
        )
    per_token = kv_bytes_per_token(policy.config, getattr(torch, name))
    kv_bytes = None
    if opts.vllm_kv_cache_gb is not None:
        kv_bytes = int(opts.vllm_kv_cache_gb * 2**30)
    elif cpu:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        kv_bytes = max(min(rows * length * per_token, int(_CPU_KV_SHARE * memory)),
                       length * per_token)  # fmt: skip
    if kv_bytes is not None and kv_bytes < length * per_token:
        raise UserError(
            f"--vllm-kv-cache-gb {opts.vllm_kv_cache_gb:g} holds {kv_bytes // per_token} tokens, "
            f"fewer than one sequence of {length}; raise it or lower --vllm-max-model-length"
        )
    eager = opts.vllm_enforce_eager if opts.vllm_enforce_eager is not None else cpu
    return VLLMOptions(dtype=name, max_model_len=int(length), kv_cache_bytes=kv_bytes,
                       gpu_memory_utilization=opts.vllm_gpu_memory_utilization,
                       sleep=opts.vllm_sleep, enforce_eager=eager, seed=seed,
                       block_size=32 if cpu else None, chunked_prefill=not cpu)  # fmt: skip


def prompt_budget(opts: DataOptions, model: nn.Module, max_new_tokens: int) -> int | None:
    """The longest prompt (tokens) to sample from: `--max-prompt-length`, else what leaves room
    for `max_new_tokens` in the model's context (None when the model does not say), and with
    `--engine vllm` in `--vllm-max-model-length`."""
    context = context_length(model)
    engine_length = getattr(opts, "vllm_max_model_length", None)
    if getattr(opts, "engine", "hf") == "vllm" and engine_length is not None:
        context = engine_length if context is None else min(context, engine_length)
    if context is not None and max_new_tokens >= context:
        raise UserError(
            f"{max_new_tokens} new tokens leave no room for a prompt in the model's context of "
            f"{context} tokens; {remedy(('lower', 'max_new_tokens'), otherwise='use a model with a longer context')}"
        )
    if opts.max_prompt_length is not None:
        if context is not None and opts.max_prompt_length + max_new_tokens > context:
            ways = remedy(("lower", "max_prompt_length"), ("lower", "max_new_tokens"),
                          otherwise="use a model with a longer context")  # fmt: skip
            raise UserError(
                f"a prompt budget of {opts.max_prompt_length} tokens and {max_new_tokens} new "
                f"tokens exceed the model's context of {context} tokens; {ways}"
            )
        return opts.max_prompt_length
    return None if context is None else context - max_new_tokens


#: glibc mallopt parameters (malloc.h): the largest trim-free top of the heap, and how many
#: chunks may be mmap()ed.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory(device: torch.device) -> bool:
    """On a CPU with glibc, let freed tensors' memory be reused instead of returned to the OS.

    glibc serves allocations over its mmap threshold (at most 32 MB) with mmap() and unmaps
    them on free(), so every large activation or gradient of every step is a fresh mapping
    whose pages fault in on first touch: about 3 million minor page faults in 4 steps of a
    20M model at 150-token prompts and 128 new tokens, G = 8, where elementwise ops ran at
    2-3 GB/s. With mmap off and the heap never trimmed, the pages stay mapped and are reused:
    1.1 million faults, the update 17% faster, the same peak RSS (the heap grows to the peak
    working set, which the mappings reached anyway). No-op elsewhere (returns False)."""
    import ctypes
    import ctypes.util
    import sys

    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
