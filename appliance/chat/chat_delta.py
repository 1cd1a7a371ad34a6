"""The pieces a chat output parser yields: content, reasoning and tool-call fragments,
as OpenAI's stream carries them (a call's id and name first, then argument fragments)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CallDelta:
    """A fragment of tool call `index`: its name (once, first) or more of its arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ChatDelta:
    """What one step of parsing adds to the assistant's message."""

    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def __add__(self, other: ChatDelta) -> ChatDelta:
        return ChatDelta(
            self.content + other.content, self.reasoning + other.reasoning, self.calls + other.calls
        )


@dataclass
class ToolCall:
    """A whole call, in OpenAI's message shape once given an id."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}
