"""The JSON call formats of constrained decoding, for every model:

- `required`: an array of calls, `[{"name": "get_weather", "parameters": {...}}]` (vLLM's);
- a named function: the output is that function's arguments object;
- `auto` for a model with no tool format of its own (llama.cpp's generic handler): either
  `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or `{"response": "text"}`."""

from __future__ import annotations

from appliance.chat.chat_delta import CallDelta, ChatDelta
from appliance.chat.json_calls import JsonCallScanner


class JsonCalls:
    """Calls in JSON written by a constrained decoder (`required`, or generic `auto` with
    its `response` text streamed as content)."""

    needs_special_tokens = False

    def __init__(self, call_depth: int, text_key: str | None = None) -> None:
        self._scanner = JsonCallScanner(call_depth, text_key)
        self._raw: list[str] = []

    def feed(self, text: str) -> ChatDelta:
        self._raw.append(text)
        return self._scanner.feed(text)

    def finish(self) -> ChatDelta:
        scanner = self._scanner
        if not any(c.named for c in scanner.calls) and not scanner.saw_text:
            # Neither calls nor a reply in the format (an output the constraint did not
            # hold, or one cut off before either began): the text is the content.
            return ChatDelta(content="".join(self._raw))
        return ChatDelta(calls=scanner.string_argument_deltas())


def required_calls() -> JsonCalls:
    return JsonCalls(call_depth=1)


def generic_calls() -> JsonCalls:
    return JsonCalls(call_depth=2, text_key="response")


class NamedCall:
    """The output is the arguments of the one function named by tool_choice."""

    needs_special_tokens = False

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> ChatDelta:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ChatDelta()
            self._started = True
            return ChatDelta(calls=[CallDelta(0, name=self._name), CallDelta(0, arguments=text)])
        return ChatDelta(calls=[CallDelta(0, arguments=text)] if text else [])

    def finish(self) -> ChatDelta:
        if self._started:
            return ChatDelta()
        # Nothing was written (cut off at once): still the call asked for, with no arguments.
        return ChatDelta(calls=[CallDelta(0, name=self._name), CallDelta(0, arguments="{}")])
