"""How the tags format describes tools to the model (`--tool-prompt`), as a chat template renders
`tools=` for the chat format.

The description is a Jinja template over `tools`, the tools' JSON schemas as transformers'
`get_json_schema` builds them from signatures and Google-style docstrings (the chat format's
own): `tools[i].function.name`, `.description`, `.parameters.properties` (name → type,
description) and `.parameters.required`. `DEFAULT_TEMPLATE` says how a call is written and lists
each tool with its arguments. The rendered text goes where the prompt takes instructions: into
the system message of a chat prompt (after a system prompt that is there already, or as a new
first message), before a plain string prompt (with a blank line).

`--tool-prompt auto` (the default) describes the tools to a model with a chat template (one
that reads instructions) and to no other: a base or character-level model (the built-in
policies) reads only the prompts it was trained on. `default` describes them to any model,
`none` to none, and `path/to/template.jinja` replaces the default template.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grouprl.errors import UserError
from grouprl.tasks.tools.calls import Tool

#: The default description of the tags format's tools.
DEFAULT_TEMPLATE = """\
You can call tools: write a tool's name as a tag around its arguments, e.g. \
{% set first = tools[0].function %}<{{ first.name }}>\
{{ first.parameters.properties | list | join(', ') }}</{{ first.name }}>; its result follows.
{%- for tool in tools %}
- {{ tool.function.name }}({% for name, p in tool.function.parameters.properties.items() %}\
{{ name }}: {{ p.type }}{{ ', ' if not loop.last }}{% endfor %}): {{ tool.function.description }}
{%- for name, p in tool.function.parameters.properties.items() if p.get('description') %}
    {{ name }}: {{ p.description }}
{%- endfor %}
{%- endfor %}"""


def load_template(spec: str) -> str | None:
    """The template `--tool-prompt` names: auto or default (the default template), none, or a
    file's text."""
    if spec == "none":
        return None
    if spec in ("auto", "default"):
        return DEFAULT_TEMPLATE
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UserError(f"--tool-prompt {spec}: no such file; give auto, default, none, or a Jinja "
                        "template file rendered with `tools` (the tools' JSON schemas)")  # fmt: skip
    return path.read_text()


def describe_tools(tools: Sequence[Tool], template: str) -> str:
    """The template rendered for these tools (one line when it does not render)."""
    return describe_schemas([_schema(t) for t in tools], template)


def describe_schemas(schemas: Sequence[dict], template: str) -> str:
    """The template rendered for tools given by their JSON schemas (a dataset's `tools`)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=False, undefined=jinja2.StrictUndefined)
    try:
        return env.from_string(template).render(tools=list(schemas)).strip()
    except jinja2.TemplateError as err:
        raise UserError(f"--tool-prompt: the template does not render ({err}); it is Jinja with "
                        "`tools`, a list of JSON schemas ({'function': {'name', 'description', "
                        "'parameters'}})") from None  # fmt: skip


def _schema(tool: Tool) -> dict[str, Any]:
    """The chat format's schema of a tool; for one without type hints or a Google-style
    docstring, what its signature and docstring's first line say (the tags format takes any
    function)."""
    from grouprl.tasks.tools.chat import tool_schema

    try:
        return tool_schema(tool)
    except UserError:
        pass
    doc = (tool.fn.__doc__ or "").strip().split("\n")[0]
    properties = {}
    for name, parameter in tool.signature.parameters.items():
        kind = parameter.annotation
        kind = getattr(kind, "__name__", "string") if kind is not parameter.empty else "string"
        properties[name] = {"type": {"int": "integer", "float": "number", "str": "string",
                                     "bool": "boolean"}.get(kind, kind)}  # fmt: skip
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "function", "function": {"name": tool.name, "description": doc,
                                             "parameters": parameters}}  # fmt: skip


def with_tool_prompt(prompt: Any, description: str) -> Any:
    """The prompt with the tools' description where it takes instructions: chat messages get it
    in their system message, a string is prefixed with it; token ids are left as given."""
    if isinstance(prompt, str):
        return f"{description}\n\n{prompt}"
    if not prompt or not isinstance(prompt[0], dict):
        return prompt
    first = prompt[0]
    if first.get("role") == "system" and isinstance(first.get("content"), str):
        return [{**first, "content": f"{first['content']}\n\n{description}"}, *prompt[1:]]
    return [{"role": "system", "content": description}, *prompt]
