"""Anthropic's answer shapes, from the OpenAI chat chunks the shared path produces: the
stream's events (message_start, a content block's start, deltas and stop for each of
thinking, text and tool_use, message_delta with the stop reason and usage, message_stop)
and, whole, the message those events build (`message`, as Anthropic's SDK folds them)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # else end_turn


@dataclass
class AnthropicReply:
    """One request's answer in Anthropic's shape."""

    model: str
    input_tokens: int
    stop_sequences: tuple[str, ...] = ()
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex[:24]}")
    _open: str | None = None  # the kind of the content block open: "text" or "thinking"
    _index: int = -1  # its index
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # OpenAI's, gathered

    def start(self) -> Event:
        started: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return {"type": "message_start", "message": started}

    def piece(self, delta: dict[str, Any]) -> list[Event]:
        """An OpenAI chat delta's events: reasoning and text as they come (a block each
        time the kind changes); tool calls gathered, sent whole at the end."""
        events: list[Event] = []
        for call in delta.get("tool_calls") or []:
            gathered = self._calls.setdefault(call["index"], {"id": "", "name": "", "args": ""})
            function = call.get("function") or {}
            gathered["id"] = call.get("id") or gathered["id"]
            gathered["name"] += function.get("name") or ""
            gathered["args"] += function.get("arguments") or ""
        for kind, text in (
            ("thinking", delta.get("reasoning_content")),
            ("text", delta.get("content")),
        ):
            if not text:
                continue
            if self._open != kind:
                events += self._close()
                block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
                events.append(self._open_block(kind, block))
            key = "thinking_delta" if kind == "thinking" else "text_delta"
            events.append(self._delta({"type": key, kind: text}))
        return events

    def last(
        self, finish_reason: str | None, stop_reason: Any, usage: dict[str, Any]
    ) -> list[Event]:
        """The calls, each a tool_use block, then the stop reason, the usage, the end."""
        events = self._close()
        for index in sorted(self._calls):
            call = self._calls[index]
            try:
                arguments = json.loads(call["args"] or "{}")
            except json.JSONDecodeError:  # a call cut off by max_tokens
                arguments = {}
            block = {"type": "tool_use", "id": call["id"], "name": call["name"], "input": {}}
            events.append(self._open_block("tool_use", block))
            events.append(
                self._delta({"type": "input_json_delta", "partial_json": json.dumps(arguments)})
            )
            events += self._close()
        reason = STOP_REASONS.get(finish_reason or "", "end_turn")
        sequence = stop_reason if stop_reason in self.stop_sequences else None
        if sequence is not None:
            reason = "stop_sequence"
        # Anthropic's input_tokens leave out what the cache read (its total is their sum).
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        counts = {
            "input_tokens": self.input_tokens - cached,
            "cache_read_input_tokens": cached,
            "output_tokens": usage.get("completion_tokens", 0),
        }
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return [
            *events,
            {"type": "message_delta", "delta": delta, "usage": counts},
            {"type": "message_stop"},
        ]

    def _open_block(self, kind: str, block: dict[str, Any]) -> Event:
        self._open, self._index = kind, self._index + 1
        return {"type": "content_block_start", "index": self._index, "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._index}]


def message(events: list[Event]) -> dict[str, Any]:
    """The whole message the events build (a non-streamed answer)."""
    built: dict[str, Any] = {}
    for event in events:
        kind = event["type"]
        if kind == "message_start":
            built = dict(event["message"])
            built["content"] = []
        elif kind == "content_block_start":
            built["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            _apply(built["content"][event["index"]], event["delta"])
        elif kind == "message_delta":
            built |= event["delta"]
            built["usage"] = built["usage"] | event["usage"]
    for block in built.get("content", []):
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("partial_json", "{}") or "{}")
    return built


def _apply(block: dict[str, Any], delta: dict[str, Any]) -> None:
    if delta["type"] == "text_delta":
        block["text"] += delta["text"]
    elif delta["type"] == "thinking_delta":
        block["thinking"] += delta["thinking"]
    elif delta["type"] == "input_json_delta":
        block["partial_json"] = block.get("partial_json", "") + delta["partial_json"]
