"""Conversations in OpenAI's message shape over a model's chat template, prefix-preserving: what
a driver of someone else's loop (a verifiers environment, an agent program behind grouprl's
endpoint) needs to answer chat requests token-exactly.

- `Renderer.assistant(text)`: a model turn as the message an OpenAI-compatible server with the
  template's tool parser returns (calls read in the template's convention, `--tool-format
  chat`'s parser).
- `Renderer.tail(turn, messages)`: the ids the template writes after a model turn ends, for the
  messages that follow it, up to the next assistant header: fed into the row's running cache, so
  nothing sampled is ever encoded again.
- `extension(before, new)`: the messages a request adds to the conversation so far, or None
  when it does not extend it (a program that rewrote earlier turns). Messages compare by role,
  stripped content and the names of their calls, as a client that re-sends a server's reply
  writes them (ids, JSON spacing and `None` fields differ between clients).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from grouprl.errors import UserError
from grouprl.tasks.tools.chat import _HERMES, _end_texts, call_style, parse_calls

#: The fields of a message the chat template reads.
FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name")


def message_dict(message: Any) -> dict[str, Any]:
    """A message (a pydantic model, as clients build them, or a dict) as the chat template takes
    it: calls in OpenAI's shape with their arguments parsed from JSON."""
    data = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else (
        dict(message))  # fmt: skip
    calls = data.get("tool_calls")
    if calls:
        data["tool_calls"] = [openai_call(arguments(c)) for c in calls]
    return {k: v for k, v in data.items() if k in FIELDS}


def openai_call(call: dict[str, Any]) -> dict[str, Any]:
    """A call (OpenAI's `{"function": {...}}` or a flat `{"name", "arguments"}`) in OpenAI's
    shape with parsed arguments."""
    if "function" in call:
        function = call["function"]
        return {**call, "function": {**function, "arguments": arguments(function.get(
            "arguments"))}}  # fmt: skip
    return {"id": call.get("id"), "type": "function",
            "function": {"name": call.get("name"), "arguments": arguments(call.get(
                "arguments"))}}  # fmt: skip


def arguments(text: Any) -> Any:
    """A call's arguments parsed from JSON text (as given when they are not JSON text)."""
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text


def message_key(message: dict) -> tuple:
    """What two renderings of one message share (see the module docstring)."""
    calls = message.get("tool_calls") or []
    names = tuple(str(c.get("function", {}).get("name")) for c in calls)
    content = message.get("content")
    return (message.get("role"), (content or "").strip() if isinstance(content, str) else
            json.dumps(content, sort_keys=True, default=str), names)  # fmt: skip


def conversation_key(messages: Sequence[dict]) -> list[tuple]:
    return [message_key(m) for m in messages]


def extension(before: Sequence[dict], new: Sequence[dict]) -> list[dict] | None:
    """The messages `new` adds to `before`, or None when it does not extend it."""
    head = new[: len(before)]
    if len(new) <= len(before) or any(message_key(a) != message_key(b) for a, b in zip(head,
                                                                                      before)):  # fmt: skip
        return None
    return list(new[len(before) :])


class Renderer:
    """The model's chat template over OpenAI-shaped conversations: a turn's calls read in the
    template's convention, and the ids of the messages that follow a model turn."""

    def __init__(self, tokenizer: Any, schemas: list[dict] | None, end_ids: Sequence[int],
                 model: str = "the model", *, style: str | None = None) -> None:  # fmt: skip
        self.tokenizer, self.schemas, self.model = tokenizer, schemas or [], model
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise UserError(f"chat messages need a chat template, and {model}'s tokenizer has "
                            "none; use an instruct model")  # fmt: skip
        self.template = template
        self.style = style or (call_style(template, model) if self.schemas else None)
        self.ends = _end_texts(tokenizer, end_ids)

    def with_tools(self, schemas: list[dict] | None) -> Renderer:
        """The same renderer over another list of tools (the calls' convention read once)."""
        if (schemas or []) == self.schemas:
            return self
        style = self.style or (call_style(self.template, self.model) if schemas else None)
        out = Renderer.__new__(Renderer)
        out.__dict__.update(self.__dict__, schemas=schemas or [], style=style)
        return out

    def render(self, messages: list[dict], *, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.schemas or None, tokenize=False, add_generation_prompt=generation
        )

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """A conversation's ids, rendered with the generation prompt (its special tokens are in
        the text: none added)."""
        text = self.render(messages, generation=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def assistant(self, text: str) -> dict[str, Any]:
        """A model turn as a message, as an OpenAI-compatible server with the template's tool
        parser returns it: the calls in it as `tool_calls`, its text outside them as content."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.style is not None:
            calls = [c for c in parse_calls(text, self.style) if c.error is None]
            if calls:
                message["content"] = _HERMES.sub("", text).strip() if self.style == "hermes" else ""
                message["tool_calls"] = [
                    {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                     "function": {"name": c.name, "arguments": arguments(c.args)}}
                    for c in calls
                ]  # fmt: skip
        return message

    def tail(self, turn: dict[str, Any], messages: list[dict]) -> list[int]:
        """The ids the template writes after a model turn (`turn`) ends, for `messages`, up to
        the next assistant header: rendered after a probe conversation of the same shape (a
        user turn, then an assistant turn with calls or without), encoded once."""
        probe_user = {"role": "user", "content": "PROBE-QUESTION"}
        probe_turn = {"role": "assistant", "content": "PROBE-ANSWER"}
        if turn.get("tool_calls"):
            probe_turn["tool_calls"] = turn["tool_calls"]
        before = self.render([probe_user, probe_turn], generation=False)
        after = self.render([probe_user, probe_turn, *messages], generation=True)
        prompt = self.render([probe_user], generation=True)
        cut = self._turn_end(before, len(prompt))
        if not after.startswith(before[:cut]):
            raise UserError(f"the chat template of {self.model} is not prefix-preserving: what "
                            "follows a turn changes how the turn renders")  # fmt: skip
        return self.tokenizer(after[cut:], add_special_tokens=False)["input_ids"]

    def _turn_end(self, rendered: str, start: int) -> int:
        found = [rendered.find(e, start) for e in self.ends]
        found = [i + len(e) for i, e in zip(found, self.ends) if i >= 0]
        if not found:
            raise UserError(f"the chat template of {self.model} ends an assistant turn with none "
                            f"of the model's end-of-turn tokens ({', '.join(self.ends)})")  # fmt: skip
        return min(found)
