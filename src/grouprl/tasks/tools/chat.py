"""The chat format of tool calls (`--tool-format chat`): tools, calls and results as the model's
own chat template writes them.

- **Tools** are rendered into the prompt by the template (`apply_chat_template(tools=...)`),
  each described by the JSON schema transformers' `get_json_schema` builds from the function's
  signature and Google-style docstring, as TRL and transformers do.
- **Calls** are read in the template's convention, found in the template's own text:
  Hermes/Qwen2.5 (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number in a
  turn) or Llama-3.1 (the whole turn one JSON object `{"name": ..., "parameters": {...}}`,
  after an optional `<|python_tag|>`). The model writes its calls and then ends its turn (its
  end-of-turn token, e.g. `<|im_end|>`); the turn's calls then run. A call that is not valid
  JSON, or names no tool, is answered with an error observation; a turn without a call is the
  model's final answer and ends the trajectory.
- **Results** are rendered as the template renders tool messages after an assistant turn with
  calls, from just after the model's end-of-turn token to the next assistant header, and that
  text is encoded once: the boundary tokens between turns (the newline after `<|im_end|>`, the
  `<|im_start|>user` the results open with, the `<|im_start|>assistant` that hands the turn
  back) are all in the observation's ids, none re-derived from decoded text.

A template is checked once, before any sampling, on a probe conversation: it must render the
tools, an assistant turn with a call, and a tool result, and it must be prefix-preserving (each
rendering a prefix of the next, so the ids a trajectory holds are the ids the template gives
the conversation). One that is not (Qwen3's drops earlier turns' `<think>` blocks) is refused
in one line; grouprl ships no training variants of such templates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from grouprl.errors import UserError
from grouprl.tasks.tools.calls import TRUNCATED, Call, Tool, ToolHandler

#: Call conventions grouprl reads, and a string each one's templates contain.
STYLES = {"hermes": "<tool_call>", "llama3": "ipython"}
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PROBE = {"question": "PROBE-QUESTION", "result": "PROBE-RESULT", "answer": "PROBE-ANSWER",
          "thought": "<think>PROBE-THOUGHT</think>"}  # fmt: skip


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of a tool, as transformers builds it; one line when it cannot."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(tool.fn)
    except Exception as err:  # DocstringParsingException, TypeHintParsingException
        raise UserError(
            f"tool {tool.name!r}: {err} The chat format describes each tool to the model from "
            "its type hints and a Google-style docstring (a summary line, then Args: with one "
            "line per parameter), as transformers' get_json_schema reads them"
        ) from None


def call_style(template: str | None, model: str = "the model") -> str:
    """Which call convention a chat template uses; one line when it uses none grouprl reads."""
    if not template:
        raise UserError(
            f"--tool-format chat needs a chat template, and {model}'s tokenizer has none; use "
            "an instruct model with a tool-capable template, or --tool-format tags"
        )
    for style, marker in STYLES.items():
        if marker in template:
            return style
    raise UserError(
        f"the chat template of {model} does not render tool calls (neither Hermes/Qwen2.5 "
        "<tool_call> blocks nor Llama-3.1 ipython turns); use a model with a tool-capable "
        "template, or --tool-format tags"
    )


def parse_calls(text: str, style: str) -> list[Call]:
    """The calls of one model turn, in order (see the module docstring). A call's JSON that
    does not parse, or lacks a name, is a Call with `error` set; text with no call: []."""
    if style == "hermes":
        visible = _outside_think(text)
        found = [_json_call(body, "arguments") for body in _HERMES.findall(visible)]
        opened = visible.count("<tool_call>")
        if opened > len(found):  # a call never closed
            found.append(Call("", "", error="a <tool_call> was opened and never closed"))
        return found
    body = _outside_think(text).strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    return [_json_call(body, "parameters")]


def _outside_think(text: str) -> str:
    """The text with an unclosed `<think>` and what follows it removed: calls written while
    thinking are not run."""
    opened, closed = text.rfind("<think>"), text.rfind("</think>")
    return text[:opened] if opened > closed else text


def _json_call(body: str, arguments_key: str) -> Call:
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError as err:
        return Call("", "", error=f"the tool call is not valid JSON ({err.msg})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return Call("", "", error='a tool call is a JSON object with a "name" string')
    args = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return Call(value["name"], "", error="the call's arguments are not a JSON object")
    if not isinstance(args, dict):
        return Call(value["name"], "", error="the call's arguments are not a JSON object")
    return Call(value["name"], json.dumps(args))


class ChatTools(ToolHandler):
    """The chat format as the sampler's `TurnHandler`: calls end with the turn."""

    keeps_content = True

    def __init__(
        self,
        tools: Sequence[Tool],
        tokenizer: Any,
        *,
        end_ids: Sequence[int] = (),
        model: str = "the model",
        **limits: Any,
    ) -> None:
        """`end_ids`: the ids that end a turn (the sampler's EOS ids; the tokenizer's EOS is
        always one)."""
        super().__init__(tools, tokenizer, **limits)
        self.schemas = [tool_schema(t) for t in tools]
        self.style = call_style(getattr(tokenizer, "chat_template", None), model)
        self.model = model
        self._end_texts = _end_texts(tokenizer, end_ids)
        self._after_call, self._after_answer = self._probe(tools[0].name if tools else "tool")

    @property
    def ends_turns(self) -> bool:
        return True

    def calls(self, text: str) -> list[Call]:
        return parse_calls(text, self.style)

    def render(self, messages: list[dict], *, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.schemas or None, tokenize=False, add_generation_prompt=generation
        )

    def observation(self, results: Sequence[tuple[str, str]]) -> list[int]:
        messages, prefix = self._after_call
        tool_turns = [{"role": "tool", "name": name, "content": text} for name, text in results]
        return self._suffix(messages + tool_turns, prefix)

    def user_turn(self, text: str) -> list[int]:
        messages, prefix = self._after_answer
        return self._suffix([*messages, {"role": "user", "content": text}], prefix)

    def _suffix(self, messages: list[dict], prefix: str) -> list[int]:
        """The ids the template writes after `prefix` (a conversation up to an assistant's
        end-of-turn token) up to the next assistant header, encoded once."""
        rendered = self.render(messages, generation=True)
        return self._encode(rendered[len(prefix) :])

    def _cut(self, text: str) -> str:
        limit = self.max_response_tokens
        if limit is None:
            return text
        ids = self._encode(text)
        if len(ids) <= limit:
            return text
        return self.tokenizer.decode(ids[: max(0, limit - len(self._marker))]) + TRUNCATED

    def _probe(self, name: str) -> tuple[tuple[list[dict], str], tuple[list[dict], str]]:
        """Check the template on a probe conversation (see the module docstring) and return,
        for an assistant turn with a call and for one without, the conversation and its
        rendering up to that turn's end-of-turn token (what observations are rendered after)."""
        user = {"role": "user", "content": _PROBE["question"]}
        call = {"type": "function", "function": {"name": name, "arguments": {}}}
        with_call = {"role": "assistant", "content": _PROBE["thought"], "tool_calls": [call]}
        result = {"role": "tool", "name": name, "content": _PROBE["result"]}
        answer = {"role": "assistant", "content": _PROBE["answer"]}
        refuse = f"the chat template of {self.model}"
        try:
            prompt = self.render([user], generation=True)
            turn = self.render([user, with_call], generation=False)
            after = self.render([user, with_call, result], generation=True)
            final = self.render([user, with_call, result, answer], generation=False)
            plain = self.render([user, answer], generation=False)
            next_user = self.render([user, answer, user], generation=True)
        except Exception as err:
            raise UserError(
                f"{refuse} cannot render an assistant turn with a tool call and then a tool "
                f"result ({type(err).__name__}: {err}); use a tool-capable template, or "
                "--tool-format tags"
            ) from None
        if name not in prompt:
            raise UserError(f"{refuse} does not render the tools; use a tool-capable template")
        if not turn.startswith(prompt) or name not in turn[len(prompt) :]:
            raise UserError(
                f"{refuse} does not render an assistant turn's tool calls after the prompt; use "
                "a tool-capable template, or --tool-format tags"
            )
        cut = self._turn_end(turn, len(prompt))
        if not after.startswith(turn[:cut]) or _PROBE["result"] not in after[cut:]:
            raise UserError(
                f"{refuse} is not prefix-preserving: a tool result changes how the turn before "
                "it renders, so a trajectory's ids would not be the conversation's"
            )
        if not final.startswith(after):
            raise UserError(
                f"{refuse} is not prefix-preserving: it renders earlier turns differently once "
                "later ones follow (e.g. drops their <think> blocks), so a trajectory's ids "
                "would not be the conversation's; use a template that keeps earlier turns as "
                "they were, or --tool-format tags"
            )
        plain_cut = self._turn_end(plain, len(prompt))
        if not next_user.startswith(plain[:plain_cut]):
            raise UserError(f"{refuse} is not prefix-preserving across a user turn")
        return ([user, with_call], turn[:cut]), ([user, answer], plain[:plain_cut])

    def _turn_end(self, rendered: str, start: int) -> int:
        """Where the first end-of-turn token after `start` ends in `rendered`."""
        ends = [rendered.find(e, start) for e in self._end_texts]
        found = [i + len(e) for i, e in zip(ends, self._end_texts) if i >= 0]
        if not found:
            raise UserError(
                f"the chat template of {self.model} ends an assistant turn with none of the "
                f"model's end-of-turn tokens ({', '.join(self._end_texts)})"
            )
        return min(found)


def _end_texts(tokenizer: Any, end_ids: Sequence[int]) -> list[str]:
    """The text of each token that ends a turn."""
    ids = {int(i) for i in end_ids}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted({t for t in tokenizer.convert_ids_to_tokens(sorted(ids)) if t})
