"""Llama 3.1's and 3.2's JSON tool calls (Meta's "JSON based tool calling"):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

as the whole reply, optionally after the `<|python_tag|>` special token, several separated
by `;` (Llama 3.2). A reply that starts with `{` but is no call stays content."""

from __future__ import annotations

from appliance.chat.tool_parsers.base import MarkedCalls


class Llama3JsonCalls(MarkedCalls):
    needs_special_tokens = True
    markers = ("<|python_tag|>",)
    call_depth = 0
    leading = "{"
