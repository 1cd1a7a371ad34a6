"""Anthropic's Messages API body, validated and made into the chat completion body the
OpenAI route serves (routes.prepared_chat), so both share one path: the template, tools,
reasoning, stops and sampling.

Content blocks become OpenAI's message parts: `text` the content, an assistant's
`tool_use` its tool_calls (the input as JSON text), a user's `tool_result` a `tool`
message answering that call, `thinking` the assistant's reasoning_content. `system` is a
system message first; `tools` (name, description, input_schema) are function tools;
`tool_choice` auto, any (OpenAI's required), tool (a named function) or none;
`stop_sequences` the stops; `thinking` enabled or disabled the template's
enable_thinking; `output_config` its `format` (a JSON schema) the structured output, its
`effort` the template's reasoning_effort. Images and documents, server tools (web
search, code execution) and MCP servers are refused, naming the field."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from appliance.server.errors import APIError
from appliance.server.protocol import Body

PASSED = ("temperature", "top_p", "top_k", "max_tokens")
JOIN = "\n"  # between text blocks of one turn, as vLLM joins a message's text parts


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(Body):
    """POST /v1/messages (and /v1/messages/count_tokens, without max_tokens)."""

    model: str
    messages: list[AnthropicMessage]
    max_tokens: int | None = Field(None, ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] = Field(default_factory=list)
    stream: bool = False
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    mcp_servers: list[Any] = Field(default_factory=list)
    container: Any = None

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completion body (`body`: the request as it came, for the sampling
        fields passed as they are)."""
        if self.mcp_servers:
            raise APIError(400, "MCP servers are not served", "mcp_servers", "unsupported")
        if self.container is not None:
            raise APIError(400, "containers are not served", "container", "unsupported")
        chat = self.openai_messages()
        out: dict[str, Any] = {"model": self.model, "messages": chat}
        if self.messages and self.messages[-1].role == "assistant":  # a prefill, continued
            _check_prefill(chat[-1], len(self.messages) - 1)
            out |= {"continue_final_message": True, "add_generation_prompt": False}
        out |= {name: body[name] for name in PASSED if body.get(name) is not None}
        if self.stop_sequences:
            out["stop"] = self.stop_sequences
        if self.tools:
            out["tools"] = [_function_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            out |= _tool_choice(self.tool_choice)
        # Anthropic's models think only when asked: a template's switch off unless enabled
        # (Qwen3's; a template without one ignores it).
        thinking = self.thinking or {}
        kwargs: dict[str, Any] = {"enable_thinking": thinking.get("type") == "enabled"}
        config = self.output_config or {}
        if config.get("effort") is not None:  # gpt-oss's template reads a level
            kwargs["reasoning_effort"] = config["effort"]
        out["chat_template_kwargs"] = kwargs
        if config.get("format") is not None:
            out["response_format"] = _response_format(config["format"])
        if self.stream:
            out |= {"stream": True, "stream_options": {"include_usage": True}}
        return out

    def openai_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI's messages, consecutive turns of one role merged
        (Anthropic's; templates that require turns to alternate refuse them otherwise)."""
        return self._conversation()[0]

    def message_origins(self) -> list[int | None]:
        """Where each of openai_messages() came from: its index in `messages` (the first
        of turns merged into it), None for the system prompt; an error names that."""
        return self._conversation()[1]

    def _conversation(self) -> tuple[list[dict[str, Any]], list[int | None]]:
        out: list[dict[str, Any]] = []
        origins: list[int | None] = []
        if self.system:
            system = _joined_text(self.system, "system")
            out.append({"role": "system", "content": system})
            origins.append(None)
        for i, message in enumerate(self.messages):
            where = f"messages[{i}].content"
            if isinstance(message.content, str):
                turns = [{"role": message.role, "content": message.content}]
            elif message.role == "assistant":
                turns = [_assistant(message.content, where)]
            else:
                turns = _user(message.content, where)
            for turn in turns:
                if not _joined(out, turn):
                    out.append(turn)
                    origins.append(i)
        return out, origins


def _check_prefill(last: dict[str, Any], index: int) -> None:
    """A last assistant message is the start of the answer, continued: text to go on from.
    A tool_use ends a turn (a tool_result answers it), so it cannot be continued."""
    if last.get("tool_calls") or not isinstance(last.get("content"), str):
        message = (
            "a last assistant message is a prefill the answer continues: it holds text; "
            "a tool_use block is answered by a user's tool_result"
        )
        raise APIError(400, message, f"messages[{index}].content")


def _joined(messages: list[dict[str, Any]], turn: dict[str, Any]) -> bool:
    """Whether `turn` joined the last message (both plain text of one role)."""
    last = messages[-1] if messages else None
    plain = ("user", "assistant")
    if (
        last is not None
        and last["role"] == turn["role"] in plain
        and isinstance(last.get("content"), str)
        and isinstance(turn.get("content"), str)
        and not last.get("tool_calls")
        and not turn.get("tool_calls")
        and not turn.get("reasoning_content")
    ):
        last["content"] = f"{last['content']}\n\n{turn['content']}"
        return True
    return False


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            text.append(_text(block, f"{where}[{j}]"))
        elif kind == "thinking":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise APIError(400, "a tool_use block has a name and an object input", where)
            function = {"name": name, "arguments": json.dumps(arguments)}
            call_id = str(block.get("id") or f"toolu_{j}")
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind != "redacted_thinking":
            raise _unserved_block(kind, f"{where}[{j}]")
    message: dict[str, Any] = {"role": "assistant", "content": JOIN.join(text) or None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn's tool results (each a tool message, first) and its text."""
    results, text = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            text.append(_text(block, f"{where}[{j}]"))
        elif kind == "tool_result":
            content = block.get("content") or ""
            answer = content if isinstance(content, str) else _result_text(content, where)
            if block.get("is_error"):
                answer = f"Error: {answer}"
            call_id = str(block.get("tool_use_id", ""))
            results.append({"role": "tool", "tool_call_id": call_id, "content": answer})
        else:
            raise _unserved_block(kind, f"{where}[{j}]")
    return results + ([{"role": "user", "content": JOIN.join(text)}] if text else [])


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise APIError(400, "a text block has a string text", where)
    return text


def _joined_text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, "text or a list of text blocks", where)
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _unserved_block(block.get("type") if isinstance(block, dict) else None, where)
    return JOIN.join(_text(block, f"{where}[{j}]") for j, block in enumerate(blocks))


def _result_text(blocks: Any, where: str) -> str:
    """A tool result's blocks as text: an image or document a tool returned (a screenshot
    a coding agent read) is named in its place, not refused: the conversation goes on."""
    if not isinstance(blocks, list):
        raise APIError(400, "a tool result is text or a list of blocks", where)
    parts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("image", "document"):
            parts.append(f"[{kind} omitted: this server reads text]")
        else:
            parts.append(_joined_text([block], f"{where}[{j}]"))
    return JOIN.join(parts)


def _unserved_block(kind: Any, where: str) -> APIError:
    if kind in ("image", "document"):
        return APIError(400, f"{kind} blocks are not served: this server serves text", where)
    return APIError(400, f"content blocks of type {kind!r} are not served", where)


def _function_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A custom tool as OpenAI's function tool; a server tool is refused."""
    if tool.get("type") not in (None, "custom"):
        message = (
            f"Anthropic-defined tools ({tool.get('type')}) are not served: define custom "
            "tools with an input_schema"
        )
        raise APIError(400, message, f"tools[{i}]", "unsupported")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema", {})}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _response_format(fmt: Any) -> dict[str, Any]:
    """output_config.format (a JSON schema) as OpenAI's response_format."""
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        message = 'output_config.format is {"type": "json_schema", "schema": {...}}'
        raise APIError(400, message, "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    named = {"type": "function", "function": {"name": choice.get("name")}}
    mapped = {"auto": "auto", "any": "required", "none": "none", "tool": named}.get(str(kind))
    if mapped is None:
        raise APIError(400, f"tool_choice type {kind!r}: auto, any, tool or none", "tool_choice")
    out: dict[str, Any] = {"tool_choice": mapped}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out
