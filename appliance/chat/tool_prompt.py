"""The conversation as a template without a tool format of its own can render it.

For such a template (SmolLM2's, Llama 3's first one, Gemma 3's, Phi-3's) the tools go into
a generic system message (as llama.cpp's generic handler and vLLM do for models without a
tool template), earlier calls become the assistant's JSON reply in the generic format, and
tool results become a user turn. Phi-4-mini's template reads the tools from the system
message's own `tools` key, as its model card shows, and its calls as `functools[...]`."""

from __future__ import annotations

import json
from typing import Any

from appliance.chat.function_tool import FunctionTool

GENERIC_INTRO = (
    "You can call the following tools. Each is given with the JSON schema of its arguments:\n\n"
)
GENERIC_AUTO = (
    "\n\nReply with one JSON object: either "
    '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]} '
    'to call tools, or {"response": "<your answer>"} to answer without a tool.'
)
GENERIC_REQUIRED = (
    "\n\nCall one or more of the tools: reply with one JSON object "
    '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}.'
)
GENERIC_NAMED = "\n\nCall the tool {name}: reply with the JSON object of its arguments."
PHI4_MINI_SYSTEM = "You are a helpful assistant with some tools."


def generic_system_text(tools: list[FunctionTool], mode: str, name: str | None) -> str:
    """The system message text describing `tools` and the reply format of `mode`
    ("auto", "required" or "named" with `name`)."""
    listed = json.dumps([t.definition() for t in tools], indent=2, ensure_ascii=False)
    if mode == "named":
        ending = GENERIC_NAMED.format(name=name)
    elif mode == "required":
        ending = GENERIC_REQUIRED
    else:
        ending = GENERIC_AUTO
    return GENERIC_INTRO + listed + ending


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` added to the first system message, or a new system message first."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        content = first.get("content") or ""
        first["content"] = f"{content}\n\n{text}" if content else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def with_phi4_tools(
    messages: list[dict[str, Any]], tools: list[FunctionTool]
) -> list[dict[str, Any]]:
    """Phi-4-mini: the tools as JSON text under the system message's `tools` key."""
    listed = json.dumps([t.definition() for t in tools], ensure_ascii=False)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "tools": listed}, *messages[1:]]
    return [{"role": "system", "content": PHI4_MINI_SYSTEM, "tools": listed}, *messages]


def calls_as_text(messages: list[dict[str, Any]], style: str) -> list[dict[str, Any]]:
    """Earlier tool calls and results as plain turns, for a template with no tool turns:
    calls as the assistant's JSON (`style` "generic": {"tool_calls": [...]}, "phi4_mini":
    functools[...]); tool results as a user turn of {"tool_response": ...} lines (results
    in a row share one turn, so roles still alternate)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            out.append(_call_turn(message, style))
        elif role == "tool" and style == "generic":
            line = json.dumps({"tool_response": _result(message)}, ensure_ascii=False)
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line, "_tool_results": True})
        else:
            out.append(message)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def _call_turn(message: dict[str, Any], style: str) -> dict[str, Any]:
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message["tool_calls"]
    ]
    written = json.dumps(
        calls if style == "phi4_mini" else {"tool_calls": calls}, ensure_ascii=False
    )
    text = f"functools{written}" if style == "phi4_mini" else written
    content = message.get("content")
    turn = {k: v for k, v in message.items() if k != "tool_calls"}
    turn["content"] = f"{content}\n{text}" if content else text
    return turn


def _result(message: dict[str, Any]) -> dict[str, Any]:
    result = {"tool_call_id": message.get("tool_call_id"), "content": message.get("content")}
    if message.get("name"):
        result["name"] = message["name"]
    return result
