"""A request's tools as plain data, and what they ask of the prompt and the decoder:
the one interface the chat and Responses routes share.

    plan = plan_tools(fmt, tools, "required", parallel=True)
    messages = plan.messages(messages)      # with the tools where the template reads them
    rendered = tokenizer.render_chat(messages, plan.prompt_tools(), kwargs)
    params = replace(params, structured=plan.structured)
    parser = plan.parser()                  # feed(text) / finish() -> ChatDelta

Constrained decoding (vLLM's way): `required` forces an array of calls, each
{"name": one of the tools, "parameters": its schema}; a named function forces that
function's arguments; `auto` on a model without a tool format forces the generic format
(either {"tool_calls": [...]} or {"response": "..."}, llama.cpp's generic handler)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from appliance.chat import tool_prompt
from appliance.chat.formats import ChatFormat
from appliance.chat.function_tool import FunctionTool
from appliance.chat.tool_parsers.base import OutputParser
from appliance.chat.tool_parsers.generic import JsonCalls, NamedCall, generic_calls, required_calls
from appliance.engine.sequence import StructuredOutput

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice ask of the prompt, the decoder, the parser."""

    format: ChatFormat
    mode: Mode
    tools: tuple[FunctionTool, ...] = ()
    function: str | None = None  # mode "named": the function
    parallel: bool = True

    @property
    def generic(self) -> bool:
        """The model has no tool format: the generic one is used, constrained."""
        return self.format.name == "generic"

    @property
    def structured(self) -> StructuredOutput | None:
        """The constraint on the output, or None (`none`, `auto` in the family's format)."""
        if self.mode == "none" or not self.tools:
            return None
        if self.mode == "named":
            return _json(self._named().schema())
        if self.mode == "required":
            calls = _calls_schema(
                self.tools, "arguments" if self.generic else "parameters", self.parallel
            )
            return _json(_tool_calls_object(calls) if self.generic else calls)
        if self.format.name == "generic":
            calls = _calls_schema(self.tools, "arguments", self.parallel)
            reply = {
                "type": "object",
                "properties": {"response": {"type": "string"}},
                "required": ["response"],
                "additionalProperties": False,
            }
            return _json({"anyOf": [_tool_calls_object(calls), reply]})
        return None

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the template's `tools` variable (None: it reads none)."""
        if self.mode == "none" or not self.tools or self.format.tools_in != "template":
            return None
        return [t.as_openai() for t in self.tools]

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The template messages with the tools where a template without a `tools`
        variable reads them, and earlier calls in a form it renders."""
        if self.format.tools_in == "template":
            return messages
        style = "phi4_mini" if self.format.tools_in == "system_message" else "generic"
        messages = tool_prompt.calls_as_text(messages, style)
        if self.mode == "none" or not self.tools:
            return messages
        if style == "phi4_mini":
            return tool_prompt.with_phi4_tools(messages, list(self.tools))
        text = tool_prompt.generic_system_text(list(self.tools), self.mode, self.function)
        return tool_prompt.with_system_text(messages, text)

    def parser(self) -> OutputParser:
        """A fresh parser of one choice's output."""
        if self.mode == "none" or not self.tools:
            return self.format.text_parser()
        if self.mode == "named":
            return NamedCall(self._named().name)
        if self.mode == "required":
            return generic_required() if self.generic else required_calls()
        return (
            self.format.call_parser()
            if not self.generic
            else self.format.with_reasoning(generic_calls())
        )

    def _named(self) -> FunctionTool:
        return next(t for t in self.tools if t.name == self.function)


def generic_required() -> JsonCalls:
    return JsonCalls(call_depth=2)


def plan_tools(
    fmt: ChatFormat,
    tools: list[FunctionTool],
    tool_choice: str | None,
    parallel: bool = True,
) -> ToolPlan:
    """The plan for `tools` and `tool_choice` ("none", "auto", "required", or a function's
    name; None: "auto" with tools, "none" without, as OpenAI defaults). Raises ValueError
    for a choice the tools cannot meet (required without tools, an unknown function)."""
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: two tools have the same name")
    choice = tool_choice or ("auto" if tools else "none")
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise ValueError('tool_choice "required" needs tools')
        mode: Mode = choice  # type: ignore[assignment]
        return ToolPlan(fmt, mode, tuple(tools), None, parallel)
    if choice not in names:
        raise ValueError(f"tool_choice names the function {choice!r}, which is not in tools")
    return ToolPlan(fmt, "named", tuple(tools), choice, parallel)


def _calls_schema(tools: tuple[FunctionTool, ...], key: str, parallel: bool) -> dict[str, Any]:
    one_call = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.name]}, key: t.schema()},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": one_call[0] if len(one_call) == 1 else {"anyOf": one_call},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _tool_calls_object(calls: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }


def _json(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema, separators=(",", ":")))
