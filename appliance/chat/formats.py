"""Which tool-call format a model writes, chosen from its chat template: the registry of
the parsers in tool_parsers/.

- `<|channel|>`: harmony (gpt-oss); tools through the template; analysis is reasoning.
- `<tool_call>`: hermes (Qwen2.5, Qwen3); tools through the template; `<think>` reasoning
  where the template writes it (Qwen3).
- `[TOOL_CALLS]`: mistral (v0.3, Nemo); tools through the template.
- `<|python_tag|>`, or Llama 3's headers and a `tools` variable: llama3_json (Llama 3.1,
  3.2); tools through the template.
- `<|tool|>` and no `tools` variable: phi4_mini; tools in the system message's `tools` key.
- anything else: generic; tools in a generic system message (tool_prompt.py), or through
  the template where it reads `tools`; calls in the generic JSON format, constrained.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Literal

from appliance.chat.reasoning import ThinkSplitter
from appliance.chat.tool_parsers.base import MarkedCalls, OutputParser, PlainText
from appliance.chat.tool_parsers.generic import generic_calls
from appliance.chat.tool_parsers.harmony import HarmonyOutput
from appliance.chat.tool_parsers.hermes import HermesCalls
from appliance.chat.tool_parsers.llama3 import Llama3JsonCalls
from appliance.chat.tool_parsers.mistral import MistralCalls
from appliance.chat.tool_parsers.phi4_mini import Phi4MiniCalls

FormatName = Literal["harmony", "hermes", "mistral", "llama3_json", "phi4_mini", "generic"]
ToolsIn = Literal["template", "system_message", "generic"]
_ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ChatFormat:
    """A family's way of writing tool calls and reasoning."""

    name: FormatName
    tools_in: ToolsIn
    think: bool = False  # Qwen3's <think> block

    @property
    def reasoning(self) -> bool:
        """Whether replies carry reasoning_content."""
        return self.think or self.name == "harmony"

    def call_parser(self) -> OutputParser:
        """The parser of `auto` tool calls in this format (reasoning split off first)."""
        parsers: dict[str, type[MarkedCalls]] = {
            "hermes": HermesCalls,
            "mistral": MistralCalls,
            "llama3_json": Llama3JsonCalls,
            "phi4_mini": Phi4MiniCalls,
        }
        if self.name == "harmony":
            return HarmonyOutput(allow_calls=True)
        if self.name == "generic":
            return self.with_reasoning(generic_calls())
        return self.with_reasoning(parsers[self.name]())

    def text_parser(self) -> OutputParser:
        """The parser of a reply that may call no tool: reasoning, and the rest content."""
        if self.name == "harmony":
            return HarmonyOutput(allow_calls=False)
        return self.with_reasoning(PlainText())

    def with_reasoning(self, parser: OutputParser) -> OutputParser:
        return ThinkSplitter(parser) if self.think else parser

    def call_id(self) -> str:
        """A new tool call's id: Mistral's templates take nine letters and digits only."""
        if self.name == "mistral":
            return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
        return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def chat_format(template: str | None, takes_tools: bool) -> ChatFormat:
    """The format of the model whose chat template is `template`; `takes_tools`: the
    template reads a `tools` variable (Tokenizer.takes_tools)."""
    text = template or ""
    tools_in: ToolsIn = "template" if takes_tools else "generic"
    if "<|channel|>" in text:
        return ChatFormat("harmony", tools_in)
    if "<tool_call>" in text:
        return ChatFormat("hermes", tools_in, think="<think>" in text)
    if "[TOOL_CALLS]" in text:
        return ChatFormat("mistral", tools_in)
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and takes_tools):
        return ChatFormat("llama3_json", tools_in)
    if "<|tool|>" in text and not takes_tools:
        return ChatFormat("phi4_mini", "system_message")
    return ChatFormat("generic", tools_in)
