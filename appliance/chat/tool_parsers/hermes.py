"""Qwen2.5's and Qwen3's tool calls (the Hermes format their templates describe):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call; text before the first block is content."""

from __future__ import annotations

from appliance.chat.tool_parsers.base import MarkedCalls


class HermesCalls(MarkedCalls):
    markers = ("<tool_call>",)
    dropped = ("</tool_call>",)
    call_depth = 0
