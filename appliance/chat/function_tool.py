"""One function a request offers the model, as plain data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class FunctionTool:
    """One function a request offers the model."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def definition(self) -> dict[str, Any]:
        """{"name", "description", "parameters"}: OpenAI's function object."""
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        out["parameters"] = self.parameters if self.parameters is not None else EMPTY_PARAMETERS
        return out

    def as_openai(self) -> dict[str, Any]:
        """{"type": "function", "function": {...}}: how templates take a tool."""
        return {"type": "function", "function": self.definition()}

    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS
