"""gpt-oss's harmony output: messages on channels, read from the text with its special
tokens kept:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

The analysis channel is reasoning, a message to `functions.NAME` a tool call whose body is
its arguments, the final channel (and commentary to nobody, a preamble) content.

openai-harmony's StreamableParser reads the same messages from token ids, but it needs the
o200k vocabulary file, which it downloads on first use (no download on an offline box);
this parser reads the header and body markers from the text, as the format defines them
(https://cookbook.openai.com/articles/openai-harmony)."""

from __future__ import annotations

import re

from appliance.chat.chat_delta import CallDelta, ChatDelta
from appliance.chat.tool_parsers.base import held_back

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
FUNCTIONS = "functions."


class HarmonyOutput:
    needs_special_tokens = True

    def __init__(self, allow_calls: bool = True) -> None:
        self._allow_calls = allow_calls
        self._in_body = False
        self._header = ""
        self._body_kind = ""  # "reasoning", "content" or "call"
        self._held = ""
        self._calls = 0

    def feed(self, text: str) -> ChatDelta:
        text = self._held + text
        self._held = ""
        out = ChatDelta()
        while text:
            text = self._body(text, out) if self._in_body else self._head(text, out)
        return out

    def _head(self, text: str, out: ChatDelta) -> str:
        at = text.find(MESSAGE)
        if at < 0:
            keep = held_back(text, (MESSAGE,))
            self._header += text[: len(text) - keep]
            self._held = text[len(text) - keep :]
            return ""
        self._header += text[:at]
        self._open_body(out)
        return text[at + len(MESSAGE) :]

    def _open_body(self, out: ChatDelta) -> None:
        header, self._header = self._header, ""
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        name = recipient.group(1) if recipient else ""
        self._in_body = True
        if name.startswith(FUNCTIONS) and self._allow_calls:
            self._body_kind = "call"
            out.calls.append(CallDelta(self._calls, name=name[len(FUNCTIONS) :]))
            self._calls += 1
        elif channel is not None and channel.group(1) == "analysis":
            self._body_kind = "reasoning"
        else:
            self._body_kind = "content"

    def _body(self, text: str, out: ChatDelta) -> str:
        ends = [(text.find(e), e) for e in ENDS if e in text]
        if ends:
            at, end = min(ends)
            self._write(text[:at], out)
            self._in_body = False
            return text[at + len(end) :]
        keep = held_back(text, ENDS)
        self._write(text[: len(text) - keep], out)
        self._held = text[len(text) - keep :]
        return ""

    def _write(self, text: str, out: ChatDelta) -> None:
        if not text:
            return
        if self._body_kind == "call":
            out.calls.append(CallDelta(self._calls - 1, arguments=text))
        elif self._body_kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def finish(self) -> ChatDelta:
        held, self._held = self._held, ""
        out = ChatDelta()
        if self._in_body:
            self._write(held, out)
        elif "<|" not in self._header + held:
            out.content += self._header + held  # no harmony header at all: plain text
        self._header = ""
        return out
