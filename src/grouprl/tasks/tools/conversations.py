"""Conversations with tool calls for `grouprl sft --data`, encoded as `grouprl train` samples
them, so a warm start teaches exactly the tokens RL then trains.

A row is TRL's conversational SFT shape: `messages`, a list of `{"role", "content"}` with roles
system, user, assistant and tool; an assistant message may carry `tool_calls`
(`[{"type": "function", "function": {"name": ..., "arguments": {...}}}]`), answered by the tool
messages after it. An optional `tools` column holds the tools' JSON schemas. The messages before
the first assistant message are the prompt; what follows is the completion, and only the
assistant's tokens carry loss.

- Tags format (`--tool-format tags`): the prompt is rendered as `grouprl train` renders a chat
  prompt in that format (the tools' description in its system message, `--tool-prompt`); the
  completion is one assistant turn: the assistant's text with each call written
  `<NAME>v1, v2</NAME>`, each tool result as plain text right after (no loss), the final text,
  then EOS. Every piece is encoded on its own, as the sampler feeds observations.
- Chat format (`--tool-format chat`): the whole conversation rendered by the chat template with
  the tools' schemas; an assistant message's tokens (through its end-of-turn token) carry loss,
  the tool results and turn headers between them do not. The template must be
  prefix-preserving, as the chat format requires in training.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grouprl.errors import UserError
from grouprl.tasks.tools.prompt import with_tool_prompt

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Encoded:
    """One conversation's prompt ids and its completion as (ids, carries loss) pieces."""

    prompt: list[int]
    pieces: list[tuple[list[int], bool]]


def checked_messages(row: dict, where: str) -> list[dict]:
    """The row's messages, checked: roles known, an assistant turn after the prompt, tool
    results only after a call."""
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: a conversation row needs `messages`, a list of "
                        "{'role', 'content'} dicts (TRL's conversational SFT shape)")  # fmt: skip
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise UserError(f"{where}: message {i} is not a {{'role', 'content'}} dict with a "
                            f"role of {', '.join(ROLES)}")  # fmt: skip
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise UserError(f"{where}: the conversation has no assistant message to train on")
    first = roles.index("assistant")
    if first == 0 or "tool" in roles[:first]:
        raise UserError(f"{where}: the messages before the first assistant message are the "
                        "prompt: give a user message there, and tool results only after a "
                        "call")  # fmt: skip
    return messages


def _arguments(call: dict, where: str) -> tuple[str, dict]:
    fn = call.get("function", call)
    name, args = fn.get("name"), fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise UserError(f"{where}: the arguments of a call to {name!r} are not JSON") from None
    if not isinstance(name, str) or not isinstance(args, dict):
        raise UserError(f"{where}: a tool call is {{'function': {{'name': str, 'arguments': "
                        "dict}}}")  # fmt: skip
    return name, args


def tags_turns(messages: Sequence[dict], where: str) -> list[tuple[str, str]]:
    """The completion of a conversation in the tags format, as (role, text) turns."""
    turns: list[tuple[str, str]] = []
    for m in messages:
        text = m.get("content") or ""
        if m["role"] == "assistant":
            for call in m.get("tool_calls") or []:
                name, args = _arguments(call, where)
                text += f"<{name}>{', '.join(_value(v) for v in args.values())}</{name}>"
            turns.append(("assistant", text))
        elif m["role"] == "tool":
            turns.append(("tool", str(text)))
        else:
            raise UserError(f"{where}: a {m['role']} message after the first assistant message "
                            "cannot be written in the tags format (one assistant turn with "
                            "tool results inside); use --tool-format chat")  # fmt: skip
    return turns


def _value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


#: The prompt ids the sampler feeds for chat messages (with the tools' schemas, chat format):
#: `grouprl.rollout.encode_prompts`, given by the caller.
PromptEncoder = Callable[[list[dict], list[dict] | None], list[int]]


def encode_tags(
    tokenizer: Any, row: dict, description: str | None, where: str, encode: PromptEncoder
) -> Encoded:
    messages = checked_messages(row, where)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = messages[:first]
    if description is not None:
        prompt = with_tool_prompt(prompt, description)
    ids = encode(prompt, None)
    pieces = [(tokenizer(text, add_special_tokens=False)["input_ids"], role == "assistant")
              for role, text in tags_turns(messages[first:], where) if text]  # fmt: skip
    pieces.append(([tokenizer.eos_token_id], True))
    return Encoded(ids, pieces)


def encode_chat(
    tokenizer: Any, row: dict, schemas: list[dict] | None, where: str, encode: PromptEncoder
) -> Encoded:
    messages = checked_messages(row, where)
    schemas = row.get("tools") or schemas

    def render(upto: int, generation: bool) -> str:
        return tokenizer.apply_chat_template(
            messages[:upto], tools=schemas or None, tokenize=False, add_generation_prompt=generation
        )

    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = encode(messages[:first], schemas or None)
    done = render(first, True)
    end = tokenizer.eos_token
    pieces: list[tuple[list[int], bool]] = []
    for k in range(first, len(messages)):
        if messages[k]["role"] != "assistant":
            continue
        before, after = render(k, True), render(k + 1, False)
        if not (before.startswith(done) and after.startswith(before)):
            raise UserError(f"{where}: the chat template is not prefix-preserving (a later "
                            "rendering rewrites an earlier turn), so its turns cannot be "
                            "trained as the sampler writes them; use --tool-format tags")  # fmt: skip
        own = after[len(before) :]
        cut = own.find(end) + len(end) if end and end in own else len(own)
        for text, trained in ((before[len(done) :], False), (own[:cut], True)):
            if text:
                pieces.append((tokenizer(text, add_special_tokens=False)["input_ids"], trained))
        done = before + own[:cut]
    return Encoded(ids, pieces)
