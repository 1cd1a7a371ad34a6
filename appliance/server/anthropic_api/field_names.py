"""An error the chat route raised, in the Anthropic request's terms: a Messages request
is served as the chat completion it is made into (request.py), so an error that chat
body's checks raise names its fields (`stop`, `messages[3]` counting the system prompt,
`tools[0].function.parameters`). A client of Anthropic's API sent none of those: each
field path becomes the one it came from (`stop_sequences`, `messages[1]`,
`tools[0].input_schema`). Paths keep their style: `messages.1.content` as validation
errors write them, `messages[1].content` as the routes' own errors do."""

from __future__ import annotations

import re
from collections.abc import Sequence

from appliance.server.errors import APIError

# A field path's head: its name and, where it is a list, the index (either style).
_HEAD = re.compile(
    r"(?P<name>[a-z_]+)(?:\[(?P<bracket>\d+)\]|\.(?P<dotted>\d+))?(?P<rest>.*)", re.S
)
# One problem of a validation error's message: "path: what is wrong".
_PROBLEM = re.compile(r"(?P<path>[\w.\[\]-]+): (?P<text>.*)", re.S)
# The chat body's fields that came from one Anthropic field, the rest of the path dropped.
_RENAMED = {
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "continue_final_message": "messages",
    "add_generation_prompt": "messages",
}
_TOOL_FIELDS = {".function.parameters": ".input_schema", ".function.name": ".name"}
_TOOL_FIELDS |= {".function.description": ".description"}
_TEMPLATE_KWARGS = {".reasoning_effort": "output_config.effort", ".enable_thinking": "thinking"}


def in_anthropic_terms(exc: APIError, origins: Sequence[int | None]) -> APIError:
    """`exc` with every field path of the chat body renamed for the Anthropic request.
    `origins[k]`: the index in the request's `messages` of chat message k (None for the
    system prompt); turns merged into one chat message name the first."""
    param = None if exc.param is None else anthropic_path(exc.param, origins)
    problems = [_problem(p, origins) for p in exc.message.split("; ")]
    return APIError(exc.status, "; ".join(problems), param, exc.code, exc.retry_after)


def _problem(text: str, origins: Sequence[int | None]) -> str:
    found = _PROBLEM.fullmatch(text)
    if found is None:
        return text
    return f"{anthropic_path(found['path'], origins)}: {found['text']}"


def anthropic_path(path: str, origins: Sequence[int | None]) -> str:
    """A chat completion body's field path as the Anthropic request's field it came from
    (a path that names no renamed field comes back as it is)."""
    head = _HEAD.fullmatch(path)
    if head is None:
        return path
    name, rest = head["name"], head["rest"]
    index = head["bracket"] or head["dotted"]
    dotted = head["dotted"] is not None

    def at(field: str, i: int) -> str:
        return f"{field}.{i}" if dotted else f"{field}[{i}]"

    if name == "messages" and index is not None and int(index) < len(origins):
        origin = origins[int(index)]
        if origin is None:
            return "system"
        return at("messages", origin) + (".content" if rest else "")
    if name == "tools" and index is not None:
        for openai, anthropic in _TOOL_FIELDS.items():
            if rest.startswith(openai):
                return at("tools", int(index)) + anthropic + rest.removeprefix(openai)
        return at("tools", int(index))
    if name == "response_format" and rest.startswith(".json_schema.schema"):
        return "output_config.format.schema" + rest.removeprefix(".json_schema.schema")
    if name == "chat_template_kwargs":
        return next((v for k, v in _TEMPLATE_KWARGS.items() if rest.startswith(k)), path)
    if name in _RENAMED:
        return _RENAMED[name] + (path.removeprefix(name) if name == "stop" else "")
    return path
