"""A chat request's choices read as OpenAI assistant messages: content, reasoning_content
and tool_calls, whole or as stream deltas (a call's index, id, type and name first, then
its argument fragments; finish_reason "tool_calls" when a reply that stopped made calls).

A request that sent OpenAI's deprecated `functions` gets its one call as `function_call`
(`{name, arguments}`, streamed as the name then argument fragments) and finish_reason
"function_call", OpenAI's shapes before tools.

One ChatOutputs per request, one parser per choice. Where the format's markers are
special tokens (harmony, Mistral, Llama 3, Phi-4-mini), the choice's text is decoded again
from its token ids with special tokens kept (the workers' text has them skipped): the
model's end-of-turn tokens left out, cut at the request's stop strings as the workers'
text is."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from appliance.chat.chat_delta import ChatDelta, ToolCall
from appliance.chat.tool_calls import ToolPlan
from appliance.chat.tool_parsers.base import OutputParser
from appliance.engine.stop_strings import StopStringMatcher
from appliance.model.tokenizer import IncrementalDetokenizer, Tokenizer


class GeneratedPiece(Protocol):
    """What a chunk of a choice's stream carries (appliance.api.Chunk)."""

    token_ids: list[int]
    text: str
    finished: bool


class ChoiceOutput:
    """One choice's output as an assistant message, fed as it streams."""

    def __init__(
        self,
        parser: OutputParser,
        call_id: Callable[[], str],
        reasoning: bool,
        max_calls: int | None = None,
    ) -> None:
        self._parser = parser
        self._call_id = call_id
        self._reasoning = reasoning
        # parallel_tool_calls false: calls after the first are dropped (the family's own
        # format is not constrained, and a model may write several).
        self._max_calls = max_calls
        self.content = ""
        self.reasoning = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> dict[str, Any]:
        """More output; the OpenAI delta fields it adds (may be none: held back)."""
        return self._accept(self._parser.feed(text)) if text else {}

    def finish(self) -> dict[str, Any]:
        """The output ended; the delta fields of what was held back."""
        return self._accept(self._parser.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict[str, Any]:
        """The whole assistant message, after finish()."""
        content: str | None = self.content
        if self.calls and not self.content.strip():
            content = None  # OpenAI: a message that only calls has no content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.calls:
            message["tool_calls"] = [c.as_openai() for c in self.calls]
        if self._reasoning:
            message["reasoning_content"] = self.reasoning or None
        return message

    def _accept(self, delta: ChatDelta) -> dict[str, Any]:
        self.content += delta.content
        self.reasoning += delta.reasoning
        fields: dict[str, Any] = {}
        if delta.reasoning:
            fields["reasoning_content"] = delta.reasoning
        if delta.content:
            fields["content"] = delta.content
        calls = self._call_deltas(delta)
        if calls:
            fields["tool_calls"] = calls
        return fields

    def _call_deltas(self, delta: ChatDelta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for piece in delta.calls:
            if self._max_calls is not None and piece.index >= self._max_calls:
                continue
            if piece.name is not None:
                call = ToolCall(self._call_id(), piece.name, piece.arguments)
                self.calls.append(call)
                function = {"name": call.name, "arguments": piece.arguments}
                out.append(
                    {"index": piece.index, "id": call.id, "type": "function", "function": function}
                )
                continue
            self.calls[piece.index].arguments += piece.arguments
            if out and out[-1]["index"] == piece.index:
                out[-1]["function"]["arguments"] += piece.arguments
            else:
                out.append({"index": piece.index, "function": {"arguments": piece.arguments}})
        return out


class ChatOutputs:
    """Every choice of one chat request, read through `plan`'s parser."""

    def __init__(
        self,
        plan: ToolPlan,
        tokenizer: Tokenizer,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        legacy: bool = False,
    ) -> None:
        self._plan = plan
        self._tokenizer = tokenizer
        self._legacy = legacy  # the request sent `functions`: calls read as `function_call`
        # The request's stop strings, for the text decoded here (kept in it if include_stop)
        self._stop = stop
        self._include_stop = include_stop
        self._special = plan.parser().needs_special_tokens
        self._streams: dict[int, ChoiceOutput] = {}
        self._detokenizers: dict[int, tuple[IncrementalDetokenizer, StopStringMatcher]] = {}

    def text_of(self, index: int, piece: GeneratedPiece) -> str:
        """The text the parser reads of choice `index`'s next piece."""
        if not self._special:
            return piece.text
        if index not in self._detokenizers:
            detokenizer = IncrementalDetokenizer(self._tokenizer, skip_special_tokens=False)
            stops = StopStringMatcher(self._stop, self._include_stop)
            self._detokenizers[index] = (detokenizer, stops)
        detokenizer, stops = self._detokenizers[index]
        ends = self._tokenizer.stop_token_ids
        text = "".join(detokenizer.add(i) for i in piece.token_ids if i not in ends)
        if piece.finished:
            text += detokenizer.flush()
        # The workers cut their text at a stop string: this text is cut there too.
        text = stops.feed(text)
        return text + stops.flush() if piece.finished else text

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The delta fields of choice `index`'s next text, and its finish_reason."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self._new()
        fields = stream.feed(text)
        if finish_reason is not None:
            fields = _merged(fields, stream.finish())
        return self._shaped(fields, stream.finish_reason(finish_reason))

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole message of a choice's whole text, and its finish_reason."""
        output = self._new()
        output.feed(text)
        output.finish()
        return self._shaped(output.message(), output.finish_reason(finish_reason))

    def _shaped(
        self, fields: dict[str, Any], reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """A message's or delta's fields and finish_reason as the request asked for them:
        a legacy request's call as `function_call` (it makes one at most)."""
        if not self._legacy:
            return fields, reason
        fields = dict(fields)
        calls = fields.pop("tool_calls", [])
        if calls:
            fields["function_call"] = dict(calls[0]["function"])
        return fields, "function_call" if reason == "tool_calls" else reason

    def _new(self) -> ChoiceOutput:
        plan = self._plan
        max_calls = None if plan.parallel else 1
        return ChoiceOutput(plan.parser(), plan.format.call_id, plan.format.reasoning, max_calls)


def _merged(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two deltas' fields as one: texts joined, call pieces one after the other."""
    out = dict(first)
    for key, value in second.items():
        if key == "tool_calls":
            out[key] = _joined_calls(out.get(key, []), value)
        else:
            out[key] = out.get(key, "") + value
    return out


def _joined_calls(
    first: Sequence[dict[str, Any]], second: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    out = [dict(c, function=dict(c["function"])) for c in first]
    for call in second:
        if out and out[-1]["index"] == call["index"] and "id" not in call:
            out[-1]["function"]["arguments"] += call["function"]["arguments"]
        else:
            out.append(call)
    return out
