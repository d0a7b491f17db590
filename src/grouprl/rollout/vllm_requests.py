"""The requests of a vLLM rollout, whatever runs vLLM: `sample_through` turns a `sample` call
into rounds of token-in/token-out requests and their answers into a `Rollout`, by the rules the
in-process engine's docstring (`grouprl.rollout.vllm_engine`) sets out: one request per prompt
with n = G, seeds per request, grouprl's own ends, tool turns as new requests. What answers the
requests is the engine's `generate`: vLLM's `LLM` in this process, or vLLM servers over HTTP
(`grouprl.rollout.vllm_server`). Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from grouprl.errors import UserError, remedy
from grouprl.rollout.decoding import Decoded, Settings
from grouprl.rollout.media import Media
from grouprl.rollout.sampling import _texts, _validate, encode_prompts, left_pad
from grouprl.rollout.stops import StopStrings
from grouprl.rollout.turns import TurnHandler, Turns
from grouprl.rollout.types import Rollout


@dataclass(frozen=True)
class Request:
    """One request: prompt ids, vLLM's sampling parameters (as `vllm.SamplingParams` takes them:
    plain values, JSON-ready), and the prompt (of the call) it samples for, so that an engine of
    several servers can keep a group on one."""

    ids: list[int]
    params: dict[str, Any]
    group: int
    images: tuple[Any, ...] = ()  # the prompt's images (RGB PIL), vLLM's multi-modal data
    #: with images: `ids` hold one placeholder an image, which vLLM expands; this is the
    #: prompt's length expanded as the trainer's processor did (0: no images)
    expanded: int = 0


@dataclass(frozen=True)
class Completion:
    """One completion of a request: its token ids and their processed log-probs."""

    ids: list[int]
    logprobs: list[float]


class Answers(Protocol):
    """What `sample_through` needs of an engine."""

    tokenizer: Any
    eos_ids: list[int]
    pad_id: int
    vllm_stop_ids: list[int]
    device: torch.device

    @property
    def max_model_len(self) -> int: ...

    def before_sampling(self) -> None: ...

    def after_sampling(self) -> None: ...

    def generate(self, requests: list[Request]) -> list[list[Completion]]: ...


def sample_through(
    engine: Answers,
    prompts: Sequence[Sequence[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    stop: Sequence[str] | None,
    seed: int | None,
    tools: TurnHandler | None,
) -> Rollout:
    """`RolloutEngine.sample` through `engine.generate`; its log-probs are the rollout's
    `behaviour_logp` too (the trainer recomputes `old_logp` with its own forward)."""
    _validate(group_size, max_new_tokens, temperature, top_p, top_k, stop)
    prompt_rows, prompt_texts = encode_prompts(engine.tokenizer, prompts)
    media = Media.of(prompts)
    longest = max(len(r) for r in prompt_rows)
    if longest + max_new_tokens > engine.max_model_len:
        ways = remedy(("raise", "vllm_max_model_length"), ("lower", "max_prompt_length"),
                      ("lower", "max_new_tokens"), otherwise="shorten the prompts")  # fmt: skip
        raise UserError(
            f"a prompt of {longest} tokens and {max_new_tokens} new tokens exceed vLLM's "
            f"max model length {engine.max_model_len}; {ways}"
        )
    engine.before_sampling()
    try:
        out, settings = _Rollouts(engine, prompt_rows, group_size, max_new_tokens, temperature,
                                  top_p, top_k, stop, seed, tools, media).run()  # fmt: skip
    finally:
        engine.after_sampling()
    prompt_ids, prompt_mask = left_pad(prompt_rows, engine.pad_id, torch.device("cpu"))
    width = int(out.lengths.max())
    texts, record = _texts(engine.tokenizer, out.tokens[:, :width], out.lengths, out.ended,
                           engine.eos_ids, stop, settings.turns)  # fmt: skip
    rollout = out.rollout(prompt_ids, prompt_mask, texts, prompt_texts, settings, record)
    return dataclasses.replace(rollout, entropy=None, behaviour_logp=rollout.old_logp.clone()).to(
        engine.device
    )


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


class _Rollouts:
    """One `sample` call's requests and rows: the first round one request per prompt (n = G),
    then a request of n = 1 for each row that goes on (after a tool's observation, or past a
    point where vLLM stopped and grouprl's rules do not), until every row has ended or spent
    its budget. Rows are output rows 0 … N−1, group-contiguous, written into a `Decoded` as the
    HF loops write them."""

    def __init__(self, engine: Answers, prompt_rows: list[list[int]], group_size: int,
                 max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                 stop: Sequence[str] | None, seed: int | None,
                 tools: TurnHandler | None, media: Media | None = None) -> None:  # fmt: skip
        self.engine, self.prompt_rows, self.seed = engine, prompt_rows, seed
        self.media = [None] * len(prompt_rows) if media is None else list(media.prompts)
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
            media=media,
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

    def _params(self, n: int, max_tokens: int, seed: int | None) -> dict[str, Any]:
        s = self.settings
        return dict(
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
        )

    def _request(self, b: int, prefix: list[int], params: dict[str, Any]) -> Request:
        """Prompt b's request going on after `prefix`: its ids, or with images its ids with one
        placeholder an image and the images, which vLLM expands and embeds itself."""
        media = self.media[b]
        if media is None:
            return Request(self.prompt_rows[b] + prefix, params, group=b)
        if media.image_token_ids:  # never sampled (`PromptMedia.image_token_ids`)
            params = {**params, "logit_bias": {i: -100.0 for i in media.image_token_ids}}
        return Request(list(media.placeholder_ids) + prefix, params, group=b,
                       images=media.images, expanded=len(self.prompt_rows[b]) + len(prefix))  # fmt: skip

    def _round(self, requests: list[tuple[int, list[int]]], round_: int) -> list[int]:
        """Run `requests` ((prompt, its rows), one request each: n = len(rows)), write what
        they sampled, apply grouprl's ends and the tools; returns the rows that go on."""
        s, out = self.settings, self.out
        max_new = s.max_new_tokens
        batch = []
        for b, rows in requests:
            prefix = out.tokens[rows[0], : self.written[rows[0]]].tolist()
            seed = None if self.seed is None else row_seed(self.seed, round_, rows[0])
            params = self._params(len(rows), max_new - self.written[rows[0]], seed)
            batch.append(self._request(b, prefix, params))
        results = self.engine.generate(batch)
        events: dict[int, tuple[int, bool]] = {}  # row -> (position, ended by EOS / stop)
        going = []
        for (_, rows), completions in zip(requests, results, strict=True):
            for row, completion in zip(rows, completions, strict=True):
                event = self._write(row, completion.ids, completion.logprobs)
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
            hit = turns.after_step(out.tokens, None, asked, hit, at, out.old_logp)
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

    def _write(self, row: int, ids: list[int], logprobs: list[float]) -> tuple[int, bool] | None:
        """Write a request's tokens to `row` from its written length on, cut at the first
        event grouprl's rules see in them (EOS, a stop string, a tool call closed); returns the
        event's (position, whether it ends the row as EOS or a stop string does), or None."""
        s, out = self.settings, self.out
        begin = self.written[row]
        ids = ids[: s.max_new_tokens - begin]
        if not ids:
            return None
        lp = logprobs[: len(ids)]
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
