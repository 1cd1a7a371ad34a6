"""Phi-4-mini's tool calls, as its function-calling examples (and vLLM's phi4_mini_json
parser) read them:

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]

and the `<|tool_call|>[...]<|/tool_call|>` special-token spelling of later revisions."""

from __future__ import annotations

from appliance.chat.tool_parsers.base import MarkedCalls


class Phi4MiniCalls(MarkedCalls):
    needs_special_tokens = True
    markers = ("functools", "<|tool_call|>")
    dropped = ("<|/tool_call|>",)
    call_depth = 1
