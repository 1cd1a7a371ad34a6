"""Ollama's answer shapes, from the OpenAI ones the shared path produces: a chat's
`message` (content, `thinking`, `tool_calls` with arguments as objects) or a generate's
`response`; streamed as newline-delimited JSON, one object a piece and a last one with
`done: true`, `done_reason` and the counts and durations (nanoseconds) Ollama reports."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

Kind = Literal["chat", "generate"]
NS = 1_000_000_000


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class OllamaReply:
    """One request's answer in Ollama's shape. `arrival`: time.monotonic() when it came."""

    kind: Kind
    model: str
    arrival: float
    first_token_at: float | None = None
    _calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's, as they stream

    def piece(self, delta: dict[str, Any]) -> dict[str, Any] | None:
        """A streamed OpenAI chat delta ({"content": text} for a text completion's piece)
        as an Ollama line; None where it says nothing yet (a tool call's fragments are
        gathered and sent whole before the last line)."""
        calls = delta.get("tool_calls") or []
        self._gather(calls)
        text = delta.get("content") or ""
        thinking = delta.get("reasoning_content") or ""
        if self.first_token_at is None and (text or thinking or calls):
            self.first_token_at = time.monotonic()
        if not text and not thinking:
            return None
        return self._line(text, thinking, []) | {"done": False}

    def last(self, finish_reason: str | None, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The stream's end: its tool calls, if any, then the `done` line."""
        lines = []
        if self._calls:
            calls = [_ollama_call(c) for c in self._calls]
            lines.append(self._line("", "", calls) | {"done": False})
        lines.append(self._line("", "", []) | self._done(finish_reason, usage))
        return lines

    def loaded(self) -> dict[str, Any]:
        """/api/generate's answer to an empty prompt: the model is loaded (it is)."""
        return self._line("", "", []) | self._done(None, None) | {"done_reason": "load"}

    def _line(self, text: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        line: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self.kind == "generate":
            line["response"] = text
            if thinking:
                line["thinking"] = thinking
            return line
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        line["message"] = message
        return line

    def _done(self, finish_reason: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
        now = time.monotonic()
        first = self.first_token_at or now
        counts = usage or {}
        return {
            "done": True,
            "done_reason": "length" if finish_reason == "length" else "stop",
            "total_duration": int((now - self.arrival) * NS),
            "load_duration": 0,  # the model is loaded before the server answers
            "prompt_eval_count": counts.get("prompt_tokens", 0),
            "prompt_eval_duration": int((first - self.arrival) * NS),
            "eval_count": counts.get("completion_tokens", 0),
            "eval_duration": int((now - first) * NS),
        }

    def _gather(self, pieces: list[dict[str, Any]]) -> None:
        # OpenAI's stream: a call's index, id and name first, then its argument fragments.
        for piece in pieces:
            function = piece.get("function") or {}
            if piece.get("id") is not None:
                name = function.get("name", "")
                self._calls.append({"function": {"name": name, "arguments": ""}})
            call = self._calls[piece.get("index", len(self._calls) - 1)]
            call["function"]["arguments"] += function.get("arguments") or ""


def _ollama_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as Ollama's: the arguments an object (the JSON text parsed;
    {} where it is no JSON object)."""
    function = call["function"]
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        arguments = {}  # cut off (length) or not an object: Ollama's clients read an object
    return {"function": {"name": function["name"], "arguments": arguments}}


def merged(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's lines as the one object Ollama answers with `stream: false`: the last
    line's counts and reason, every line's text, thinking and calls joined."""
    whole = dict(lines[-1])
    key = "message" if "message" in whole else "response"
    text = thinking = ""
    calls: list[dict[str, Any]] = []
    for line in lines:
        part = line["message"] if key == "message" else line
        text += part.get("content" if key == "message" else "response", "")
        thinking += part.get("thinking", "")
        calls += part.get("tool_calls", [])
    part = {"content": text} if key == "message" else {"response": text}
    if thinking:
        part["thinking"] = thinking
    if calls:
        part["tool_calls"] = calls
    if key == "message":
        whole["message"] = whole["message"] | part
    else:
        whole |= part
    return whole
