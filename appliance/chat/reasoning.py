"""Qwen3's thinking: `<think>...</think>` first in the output is reasoning
(`reasoning_content`), the rest goes on to the tool-call parser as the reply. Without
thinking (`enable_thinking: false` puts an empty block in the prompt) there is no
`<think>` and everything is the reply."""

from __future__ import annotations

from appliance.chat.chat_delta import ChatDelta
from appliance.chat.tool_parsers.base import OutputParser, held_back

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """Reasoning in `<think>` first, then the reply through `inner`."""

    def __init__(self, inner: OutputParser) -> None:
        self._inner = inner
        self.needs_special_tokens = inner.needs_special_tokens
        self._state = "start"  # "start" (may open), "thinking", "reply"
        self._held = ""

    def feed(self, text: str) -> ChatDelta:
        text = self._held + text
        self._held = ""
        if self._state == "start":
            stripped = text.lstrip()
            if OPEN.startswith(stripped) and len(stripped) < len(OPEN):
                self._held = text  # maybe "<thi..." still coming
                return ChatDelta()
            if not stripped.startswith(OPEN):
                self._state = "reply"
                return self._inner.feed(text)
            self._state = "thinking"
            text = stripped[len(OPEN) :]
        if self._state == "thinking":
            at = text.find(CLOSE)
            if at < 0:
                keep = held_back(text, (CLOSE,))
                self._held = text[len(text) - keep :]
                return ChatDelta(reasoning=text[: len(text) - keep])
            self._state = "after"
            thought, text = text[:at], text[at + len(CLOSE) :]
            return ChatDelta(reasoning=thought) + self._after(text)
        if self._state == "after":
            return self._after(text)
        return self._inner.feed(text)

    def _after(self, text: str) -> ChatDelta:
        # The blank lines Qwen3 writes after </think> are no part of the reply.
        text = text.lstrip()
        if not text:
            return ChatDelta()
        self._state = "reply"
        return self._inner.feed(text)

    def finish(self) -> ChatDelta:
        held, self._held = self._held, ""
        if self._state == "thinking":
            return ChatDelta(reasoning=held) + self._inner.finish()
        delta = self._inner.feed(held) if held and self._state != "after" else ChatDelta()
        return delta + self._inner.finish()
