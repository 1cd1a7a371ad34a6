"""What every output parser does, and the shape most tool-call formats share: content until
a marker, then JSON calls (Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`, Llama 3's
`<|python_tag|>`, Phi-4-mini's `functools`)."""

from __future__ import annotations

from typing import ClassVar, Protocol

from appliance.chat.chat_delta import ChatDelta
from appliance.chat.json_calls import JsonCallScanner


class OutputParser(Protocol):
    """Reads one choice's output. `needs_special_tokens`: the text must keep special tokens
    (the format's markers are special tokens), so the caller decodes the ids with them."""

    needs_special_tokens: bool

    def feed(self, text: str) -> ChatDelta:
        """More of the output; what it adds to the message so far."""
        ...

    def finish(self) -> ChatDelta:
        """The output ended: whatever was held back."""
        ...


class PlainText:
    """No tool format: everything is content."""

    needs_special_tokens = False

    def feed(self, text: str) -> ChatDelta:
        return ChatDelta(content=text)

    def finish(self) -> ChatDelta:
        return ChatDelta()


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `markers`."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


class MarkedCalls:
    """Content until a marker, then calls as JSON at `call_depth` (see JsonCallScanner).

    `markers` start the calls; `dropped` are further markers skipped inside them (closing
    tags, a repeated start marker). `leading` are characters that, first in the output,
    start calls without a marker (Llama 3 writes bare JSON). Calls that never parse to a
    named call turn back into content at the end."""

    needs_special_tokens: bool = False
    markers: ClassVar[tuple[str, ...]] = ()
    dropped: ClassVar[tuple[str, ...]] = ()
    call_depth: ClassVar[int] = 0
    leading: ClassVar[str] = ""

    def __init__(self) -> None:
        self._held = ""  # text not yet judged: it may begin a marker
        self._scanner: JsonCallScanner | None = None
        self._raw = ""  # the text since the calls began, as written
        self._any_content = False

    def feed(self, text: str) -> ChatDelta:
        text = self._held + text
        self._held = ""
        if self._scanner is not None:
            return self._feed_calls(text)
        if not self._any_content and self.leading:
            stripped = text.lstrip()
            if stripped and stripped[0] in self.leading:
                return self._begin_calls(text, "")
        starts = [(text.find(m), m) for m in self.markers if m in text]
        if starts:
            at, marker = min(starts)
            before = text[:at]
            delta = ChatDelta(content=before)
            return delta + self._begin_calls(text[at + len(marker) :], marker)
        keep = held_back(text, self.markers)
        if not self._any_content and self.leading and not text.strip():
            keep = len(text)  # only whitespace so far: bare JSON may still follow
        content = text[: len(text) - keep]
        self._held = text[len(text) - keep :]
        self._any_content = self._any_content or bool(content.strip())
        return ChatDelta(content=content)

    def _begin_calls(self, text: str, marker: str) -> ChatDelta:
        self._scanner = JsonCallScanner(self.call_depth)
        self._raw = marker
        return self._feed_calls(text)

    def _feed_calls(self, text: str) -> ChatDelta:
        assert self._scanner is not None
        self._raw += text
        skip = self.markers + self.dropped
        keep = held_back(text, skip)
        ready, self._held = text[: len(text) - keep], text[len(text) - keep :]
        for marker in skip:
            ready = ready.replace(marker, " ")
        self._raw = self._raw[: len(self._raw) - keep]
        return self._scanner.feed(ready)

    def finish(self) -> ChatDelta:
        held, self._held = self._held, ""
        if self._scanner is None:
            return ChatDelta(content=held)
        delta = self._feed_calls(held) if held else ChatDelta()
        if not any(c.named for c in self._scanner.calls):
            return ChatDelta(content=self._raw)  # no call after all: it was text
        return delta + ChatDelta(calls=self._scanner.string_argument_deltas())
