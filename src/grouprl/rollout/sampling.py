"""Group sampling on a Hugging Face causal LM: each prompt prefilled once, B·G rows decoded together.

The loop is a plain KV-cache decode that calls the model's forward directly. Compared with
`model.generate(num_return_sequences=G)` it

- prefills the B prompts once and broadcasts their KV cache to the B·G rows (`generate` repeats
  the prompts first and prefills B·G rows, G times the prompt compute);
- writes the cache in place (`_hf.PreallocatedLayer`) instead of concatenating a new copy of it
  every step;
- runs no logits processors or stopping criteria objects: temperature, top-k and top-p are three
  tensor ops, EOS is one `isin`;
- drops finished rows from the batch once at least half of it has finished (compaction).
  Until then a finished row stays in the batch and is fed the pad token (its outputs discarded,
  its positions masked): a full row of compute per step. Compaction copies the kept cache rows
  once, so at most about as many wasted rows as running ones are carried, and there are at most
  log2(B·G) compactions.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from grouprl.errors import UserError
from grouprl.messages import is_conversational
from grouprl.rollout import _hf, chunks, prefix, routes
from grouprl.rollout.decoding import Decoded, Settings, stop_or_keep
from grouprl.rollout.draws import (  # noqa: F401 (the filters and the draw are public here)
    pick,
    sample_categorical,
    top_k_filter,
    top_p_filter,
)
from grouprl.rollout.llama_decode import llama_step
from grouprl.rollout.media import Media
from grouprl.rollout.narrow import narrow_linears
from grouprl.rollout.stops import StopStrings
from grouprl.rollout.turns import TurnHandler, TurnRecord, Turns
from grouprl.rollout.types import Rollout

Prompt = str | Sequence[int] | Sequence[dict]
#: Prompt width (tokens, padding included) from which decoding keeps one copy of each prompt's
#: keys and values per group instead of one per row (see `_hf.SharedPromptLayer`).
SHARED_PROMPT_MIN_TOKENS = 32


# ---------------------------------------------------------------------------------------------
# Prompts and special tokens


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    chat_template: bool = False,
    tools: list[dict] | None = None,
) -> tuple[list[list[int]], list[str]]:
    """Token ids and display texts for each prompt.

    A prompt is a string (tokenized with the tokenizer's own special tokens, so BOS is added
    exactly when the tokenizer adds it), a list of token ids (used as given), or a list of
    `{"role", "content"}` chat messages (TRL's conversational format), rendered with the
    tokenizer's chat template and `add_generation_prompt=True`. With `chat_template=True` a
    string becomes one user message and is rendered the same way. The rendered text already
    holds the template's special tokens, so none are added again. `tools`: JSON schemas the
    template renders into chat prompts (the chat tool format).
    """
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise UserError("prompts must be a non-empty list of strings or token-id lists")
    ids: list[list[int]] = []
    texts: list[str] = []
    for i, prompt in enumerate(prompts):
        if (isinstance(prompt, str) and chat_template) or is_conversational(prompt):
            if not getattr(tokenizer, "chat_template", None):
                raise UserError(
                    "the prompts are chat messages but the tokenizer has no chat template; use a "
                    "model whose tokenizer_config.json has one (an instruct model), or give "
                    "string prompts (e.g. with --prompt-template) and no --chat-template"
                )
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            rendered = tokenizer.apply_chat_template(
                list(messages), tools=tools, tokenize=False, add_generation_prompt=True
            )
            row = tokenizer(rendered, add_special_tokens=False)["input_ids"]
            texts.append(prompt if isinstance(prompt, str) else rendered)
        elif isinstance(prompt, str):
            row = tokenizer(prompt)["input_ids"]
            texts.append(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(x, int) for x in prompt):
            row = list(prompt)
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
        else:
            raise UserError(
                f"prompt {i} is a {type(prompt).__name__}; pass strings, token-id lists, or "
                "lists of {'role', 'content'} chat messages"
            )
        if not row:
            raise UserError(f"prompt {i} is empty after tokenization; give it at least one token")
        ids.append(list(row))
    return ids, texts


def left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) ids left-padded with `pad_id` and the (B, P) bool mask of real tokens."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # (B, P)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.as_tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = True
    return ids.to(device), mask.to(device)


def stop_token_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """EOS ids that end a completion: the tokenizer's EOS plus the model's generation-config EOS.

    Instruct models often end turns with a token (e.g. `<|im_end|>`) listed only in
    `generation_config.eos_token_id`; the union covers both.
    """
    ids: set[int] = set()
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return sorted(ids)


def pad_token_id(tokenizer: Any, eos_ids: Sequence[int]) -> int:
    """The tokenizer's pad id, else its first EOS id (finished rows repeat it, masked out)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    if eos_ids:
        return int(eos_ids[0])
    raise UserError(
        "the tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token"
    )


# ---------------------------------------------------------------------------------------------
# Sampling


def check_temperature(temperature: float, *, greedy: bool = False) -> None:
    """The sampling temperature's rule, for the sampler (where 0 decodes greedily) and for
    log-probs (which are taken at it, so it must be > 0)."""
    low_ok = temperature >= 0.0 if greedy else temperature > 0.0
    if not (low_ok and math.isfinite(temperature)):
        rule = ">= 0 (0 decodes greedily)" if greedy else "> 0"
        raise UserError(
            f"temperature must be {rule}: log-probs are taken at it; got {temperature!r}"
        )


def _validate(
    group_size: int, max_new_tokens: int, temperature: float, top_p: float, top_k: int, stop: Any
) -> None:
    if not isinstance(group_size, int) or group_size < 1:
        raise UserError(f"group_size must be an integer >= 1, got {group_size!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    check_temperature(temperature, greedy=True)
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise UserError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if stop is not None and (
        isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop)
    ):
        raise UserError(f"stop must be a list of non-empty strings, got {stop!r}")


def sample_groups(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop: Sequence[str] | None = None,
    seed: int | None = None,
    chat_template: bool = False,
    lockstep: Callable[[bool], bool] | None = None,
    tools: TurnHandler | None = None,
) -> Rollout:
    """Sample `group_size` completions for each prompt; returns a group-contiguous `Rollout`.

    Algorithm:
      1. Tokenize and left-pad the B prompts; positions = cumsum(prompt_mask) − 1 (the formula
         `completion_logprobs` uses too).
      2. Prefill the B prompts once (B rows, not B·G), keeping only the last position's logits.
      3. Broadcast each prompt's KV cache to its G rows (group-contiguous) in a pre-allocated
         buffer with room for `max_new_tokens` more positions.
      4. Decode all B·G rows together, one token per step: s = logits / temperature; the
         token is drawn from softmax(top_p(top_k(s))) by a `torch.Generator` seeded from
         `seed`; old_logp = log_softmax(s)[token] and the entropy of softmax(s) are taken
         *before* top-k / top-p. temperature = 0 is greedy (argmax; old_logp at temperature 1).
      5. A row finishes at an EOS token (the tokenizer's, or any in the model's
         generation_config) or at the token that completes a stop string.

    Stop strings are kept: `mask` ends at (and includes) the token that completed the stop
    string, and `texts` is cut right after the stop string (characters the same token added
    after it are dropped from the text only). Texts skip special tokens, so EOS never appears.

    `lockstep(done) -> bool`, when given, is asked at every check whether every participant is
    done (processes whose forwards are collectives, FSDP): this one keeps stepping, feeding pad
    tokens, until all are, under `no_grad` (FSDP's all-gathered buffers must not become
    inference tensors). `tools` answers tool calls inside the loop (`grouprl.rollout.turns`):
    observations are fed as forced tokens outside `loss_mask`; `Rollout.turns` holds the
    transcripts. Without it the loop runs exactly as above.

    Same model, prompts, settings and `seed` give the same completions (on the same device and
    library versions); `seed=None` uses the global torch RNG. The model is used in whatever mode
    it is in (`model.eval()` turns dropout off); sampling runs under `torch.inference_mode()`.
    """
    _validate(group_size, max_new_tokens, temperature, top_p, top_k, stop)
    device = _hf.model_device(model)
    eos_ids = stop_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    prompt_rows, prompt_texts = encode_prompts(tokenizer, prompts, chat_template=chat_template)
    prompt_ids, prompt_mask = left_pad(prompt_rows, pad_id, device)  # (B, P)
    media = Media.of(prompts)
    greedy = temperature == 0.0
    generator = None if seed is None or greedy else torch.Generator(device=device)
    if generator is not None:
        generator.manual_seed(int(seed))
    n = len(prompt_rows) * group_size
    settings = Settings(
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        temperature=1.0 if greedy else float(temperature),
        greedy=greedy,
        top_k=top_k,
        top_p=top_p,
        eos_ids=eos_ids,
        pad_id=pad_id,
        stopper=StopStrings(tokenizer, stop) if stop else None,
        generator=generator,
        lockstep=lockstep,
        turns=None if tools is None else Turns(tools, tokenizer, n, max_new_tokens, device),
        media=media,
        banned=None if media is None else media.banned(device),
    )
    with torch.inference_mode() if lockstep is None else torch.no_grad():
        out = _routed_decode(model, prompt_ids, prompt_mask, settings)
    width = int(out.lengths.max())  # T
    texts, record = _texts(tokenizer, out.tokens[:, :width], out.lengths, out.ended, eos_ids,
                           stop, settings.turns)  # fmt: skip
    return out.rollout(prompt_ids, prompt_mask, texts, prompt_texts, settings, record)


def _routed_decode(
    model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, settings: Settings
) -> Decoded:
    """`_tapped_decode`; on a CPU the model's linear layers fed few rows take
    `grouprl.rollout.narrow`'s products (accelerators keep their own kernels)."""
    if prompt_ids.device.type == "cpu":
        with narrow_linears(model):
            return _tapped_decode(model, prompt_ids, prompt_mask, settings)
    return _tapped_decode(model, prompt_ids, prompt_mask, settings)


def _tapped_decode(
    model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, settings: Settings
) -> Decoded:
    """`_decode`, recording the experts of every token fed (`Decoded.routes`) when the model's
    route tap asks for the sampler's (a mixture-of-experts policy, `grouprl.rollout.routes`)."""
    tap = routes.tap_of(model)
    if tap is None or not tap.sampling:
        return _decode(model, prompt_ids, prompt_mask, settings)
    n = prompt_ids.shape[0] * settings.group_size
    width = int(prompt_mask.sum(-1).max()) + settings.max_new_tokens
    recorder = routes.Session(record=(tap.empty(n, width, prompt_ids.device),))
    with routes.recording(recorder):
        out = _decode(model, prompt_ids, prompt_mask, settings)
    out.routes = recorder.record[0]
    return out


def _decode(
    model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, settings: Settings
) -> Decoded:
    """The decode loop (steps 1-5 of `sample_groups`)."""
    s, device = settings, prompt_ids.device
    num_prompts, prompt_width = prompt_ids.shape
    n, max_new = num_prompts * s.group_size, s.max_new_tokens
    eos = torch.tensor(list(s.eos_ids), dtype=torch.long, device=device)  # (E,)
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    out = Decoded(
        tokens=torch.full((n, max_new), s.pad_id, dtype=torch.long, device=device),
        old_logp=torch.zeros((n, max_new), dtype=dtype, device=device),
        entropy=torch.zeros((n, max_new), dtype=dtype, device=device),
        stop_at=torch.full((n,), max_new + 1, dtype=torch.long, device=device),
    )
    # Host-side checks (all finished? compact?) need a device sync; on CPU that is free, on an
    # accelerator it stalls the launch queue, so there they run every few steps. Stop strings
    # and tool calls read tokens on the host anyway, so with either, every step.
    check_every = 1 if device.type == "cpu" or s.stopper or s.turns else 4

    # 1-3. Prefill each prompt once, broadcast its cache to its group.
    inputs = None if s.media is None else s.media.inputs(prompt_width, device)
    cache, logits, shared, prompt_mask = _prefill(model, prompt_ids, prompt_mask, s.group_size,
                                                  max_new, inputs)  # fmt: skip
    # Batch state below is per *batch* row; `rows` maps batch rows to output rows once
    # compaction has dropped some (None = identity).
    logits = logits.repeat_interleave(s.group_size, dim=0)  # (n, V)
    if s.turns is not None and _hf.feeds_chunks(model, cache):  # observations in one forward
        chunks.decode(model, cache, logits, prompt_mask, shared, s, out)
        return out
    attn = torch.ones((n, prompt_width + max_new), dtype=torch.bool, device=device)
    attn[:, :prompt_width] = prompt_mask.repeat_interleave(s.group_size, dim=0)
    next_pos = prompt_mask.sum(-1).repeat_interleave(s.group_size)  # (n,) position of token 0
    done = torch.zeros(n, dtype=torch.bool, device=device)  # (n,)
    rows: torch.Tensor | None = None
    fast = llama_step(model) if device.type == "cpu" and s.media is None else None

    with _hf.SharedPromptDecoding(model, cache) if shared else contextlib.nullcontext():
        for t in range(max_new):
            # 4-5. Pick a token per row; finish rows at EOS / stop strings; answer tool calls.
            tok, hit = _step(out, logits, done, rows, eos, t, s)
            done |= hit
            if t == max_new - 1:
                break
            if (t + 1) % check_every == 0:
                stop, keep = stop_or_keep(done, s.lockstep)
                if stop:
                    break
                if keep is not None:  # compaction: drop finished rows
                    cache.batch_select_indices(keep)
                    rows = keep if rows is None else rows[keep]
                    done, attn, next_pos, tok = done[keep], attn[keep], next_pos[keep], tok[keep]
            position, seen = (
                (next_pos + t)[:, None],
                attn[:, : prompt_width + t + 1],
            )  # (n, 1), (n, L)
            if fast is not None and fast.takes(len(tok), device):  # a Llama's leaner step
                logits = fast.step(tok, position, seen, cache)  # (n, V)
                continue
            with (
                routes.feeding(position, rows=_batch_rows(rows, len(tok), device))
                if routes.active() else contextlib.nullcontext()
            ):  # fmt: skip
                logits = _hf.forward_last(model, tok[:, None], seen, position, cache)  # (n, V)
    return out


def _batch_rows(rows: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """The output row of each of the n batch rows (`rows`, or all of them before compaction)."""
    return rows if rows is not None else torch.arange(n, device=device)


def _step(
    out: Decoded,
    logits: torch.Tensor,
    done: torch.Tensor,
    rows: torch.Tensor | None,
    eos: torch.Tensor,
    t: int,
    s: Settings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode step t: a token per batch row (pad for finished rows; a row answering a tool call
    is fed its observation instead, never an end), written to the output rows; returns the
    tokens (n,) and which rows finished here (n,)."""
    tok, lp, ent = pick(logits, s.temperature, s.greedy, s.top_k, s.top_p, s.generator,
                        s.banned)  # fmt: skip
    tok = tok.masked_fill(done, s.pad_id)
    lp = lp.masked_fill(done, 0.0)
    ent = ent.masked_fill(done, 0.0)
    turns = s.turns
    fed = done if turns is None else turns.force(rows, tok, lp, ent, t) | done
    out_rows = slice(None) if rows is None else rows
    out.tokens[out_rows, t] = tok
    out.old_logp[out_rows, t] = lp
    out.entropy[out_rows, t] = ent
    hit = torch.isin(tok, eos) & ~fed  # (n,)
    if s.stopper is not None:
        since = None if turns is None else turns.since
        hit |= s.stopper.hits(out.tokens, rows, ~(fed | hit), t, since=since)
    if turns is not None:
        hit = turns.after_step(out.tokens, rows, ~fed, hit, t, out.old_logp)
    out.stop_at[out_rows] = torch.where(hit, t + 1, out.stop_at[out_rows])
    return tok, hit


def _prefill(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    group_size: int,
    max_new_tokens: int,
    inputs: dict[str, torch.Tensor] | None = None,
) -> tuple[Any, torch.Tensor, bool, torch.Tensor]:
    """Run the B prompts once and broadcast each one's KV cache to its G rows, with room for
    `max_new_tokens` more positions; `inputs`: the prompts' images' tensors. Returns the cache,
    the (B, V) logits of the prompts' last positions, whether the cache keeps one copy of each
    prompt per group, and the (B, P) mask of the cache's prompt columns: `prompt_mask`, or with
    the prompts' common prefix run once (`grouprl.rollout.prefix`) its layout.

    One copy per group where the architecture allows and the prompts are long enough for the
    copies to matter (measured, 2 CPU threads: 150-token prompts, G = 8, 128 new tokens on a 20M
    Llama, generation 7.05 -> 5.93 s; the built-in task's 10-token prompts, 0.182 -> 0.186 s,
    so short prompts keep per-row copies)."""
    prompt_pos = _hf.left_pad_positions(prompt_mask)  # (B, P)
    cache = _hf.new_cache(model)
    first = torch.arange(len(prompt_ids), device=prompt_ids.device) * group_size  # (B,)
    split = None
    if inputs is None and not routes.active():  # the prompts' common prefix run once
        packed = prefix.run_packed(model, prompt_ids, prompt_mask, cache)  # with the rest
        if packed is not None:
            split, logits = packed
        elif (split := prefix.run_prefix(model, prompt_ids, prompt_mask, cache)) is not None:
            logits = _hf.forward_last(model, split.ids, split.mask, split.positions, cache)
    if split is not None:
        prompt_mask = split.mask  # the cache's layout from here on
    else:
        with routes.feeding(prompt_pos, prompt_mask, first):  # each group's first row: copied
            logits = _hf.forward_last(
                model, prompt_ids, prompt_mask, prompt_pos, cache, inputs
            )  # (B, V) fmt: skip
    routes.share_prompts(group_size, int(prompt_mask.sum(-1).max()))
    shared = (
        group_size > 1
        and prompt_ids.shape[1] >= SHARED_PROMPT_MIN_TOKENS
        and _hf.shares_prompt_attention(model)
    )
    _hf.expand_cache(
        cache, group_size, extra=max_new_tokens, prompt_mask=prompt_mask if shared else None
    )
    return cache, logits, shared, prompt_mask


def _texts(
    tokenizer: Any,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    ended: torch.Tensor,
    eos_ids: Sequence[int],
    stop: Sequence[str] | None,
    turns: Turns | None,
) -> tuple[list[str], TurnRecord | None]:
    """The completions' texts, and with tools their transcripts: the text as the model and the
    tools wrote it (a stop string cuts the last turn)."""
    if turns is None:
        return _decode_texts(tokenizer, tokens, lengths, ended, eos_ids, stop), None
    cut = StopStrings(tokenizer, stop).cut if stop else None
    record = turns.record(tokens, lengths, ended, eos_ids, cut)
    return ["".join(m["content"] for m in t) for t in record.transcripts], record


def _decode_texts(
    tokenizer: Any,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    ended: torch.Tensor,
    eos_ids: Sequence[int],
    stop: Sequence[str] | None,
) -> list[str]:
    """Completion texts: masked tokens without a final EOS, cut after a stop string."""
    eos = set(eos_ids)
    rows = []
    for ids, length, is_ended in zip(tokens.tolist(), lengths.tolist(), ended.tolist()):
        ids = ids[:length]
        if is_ended and ids and ids[-1] in eos:
            ids = ids[:-1]
        rows.append(ids)
    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    if stop:
        cutter = StopStrings(tokenizer, stop)
        texts = [cutter.cut(text) if e else text for text, e in zip(texts, ended.tolist())]
    return texts
