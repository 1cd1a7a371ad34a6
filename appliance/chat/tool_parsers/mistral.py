"""Mistral's tool calls (v0.3 and Nemo templates, tokenizer v3):

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

`[TOOL_CALLS]` is a control token, so the text must keep special tokens. Mistral's
templates take tool-call ids of exactly nine letters and digits."""

from __future__ import annotations

from appliance.chat.tool_parsers.base import MarkedCalls


class MistralCalls(MarkedCalls):
    needs_special_tokens = True
    markers = ("[TOOL_CALLS]",)
    call_depth = 1
