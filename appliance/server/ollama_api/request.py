"""Ollama's /api/chat and /api/generate bodies, validated and made into the chat
completion body the OpenAI route serves (routes.prepared_chat), so both APIs share
one path: the template, tools, structured outputs, sampling and stops.

Ollama's `options` under OpenAI's or llama.cpp's names: num_predict -> max_tokens
(-1 and -2: until the context is full), repeat_penalty, temperature, top_k, top_p,
min_p, typical_p, mirostat, mirostat_tau, mirostat_eta, seed, stop, presence_penalty,
frequency_penalty. Options that size or place the model (num_ctx, num_gpu, num_thread,
...) are fixed by the server's settings: accepted, not applied. tfs_z (sampling this
server does not have, gone from llama.cpp too) is refused unless at its "off" value,
naming the option; penalize_newline (deprecated, ignored by Ollama) is accepted."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any, Literal

from pydantic import Field

from appliance.server.errors import APIError
from appliance.server.protocol import Body

LATEST = ":latest"  # Ollama's default tag

# Options that say where and how big the model runs: the server's settings decide.
PLACEMENT_OPTIONS = frozenset(
    {
        "num_ctx",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "num_thread",
        "numa",
        "use_mmap",
        "use_mlock",
        "vocab_only",
        "num_keep",
        "repeat_last_n",
    }
)
# Sampling this server does not have: refused unless at the value that turns it off.
REFUSED_OPTIONS = MappingProxyType({"tfs_z": 1.0})
# Ollama's own engine ignores this (a deprecated flag).
IGNORED_OPTIONS = frozenset({"penalize_newline"})
SAMPLING_OPTIONS = {  # Ollama's name -> the chat completion field (llama.cpp's names)
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "typical_p": "typical_p",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}


class OllamaCall(Body):
    """A tool call as Ollama writes it: arguments an object, not JSON text."""

    function: dict[str, Any]


class OllamaMessage(Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] = Field(default_factory=list)
    tool_calls: list[OllamaCall] = Field(default_factory=list)
    tool_name: str | None = None  # a tool result: the function it answers


class OllamaRequest(Body):
    """What both routes take."""

    model: str
    stream: bool = True  # Ollama streams unless told not to
    format: Literal["", "json"] | dict[str, Any] | None = None  # "": none
    options: dict[str, Any] = Field(default_factory=dict)
    keep_alive: str | int | float | None = None  # the model stays loaded: accepted
    # A reasoning model's switch, as its chat template reads it: Qwen3's enable_thinking,
    # gpt-oss's reasoning_effort (the levels); a template without either ignores it.
    think: bool | Literal["low", "medium", "high"] | None = None

    def sampling(self) -> dict[str, Any]:
        """The options, format and think as chat completion fields."""
        fields: dict[str, Any] = {}
        for name, value in self.options.items():
            if name in REFUSED_OPTIONS:
                if value != REFUSED_OPTIONS[name] or isinstance(value, bool):
                    raise APIError(
                        400,
                        f"option {name} is not supported by this server: send "
                        f"{REFUSED_OPTIONS[name]} or leave it out",
                        f"options.{name}",
                    )
            elif name == "seed" and isinstance(value, int) and value < 0:
                continue  # Ollama's -1: a random seed, as none
            elif name in SAMPLING_OPTIONS:
                fields[SAMPLING_OPTIONS[name]] = value
            elif name == "num_predict":
                if not isinstance(value, int) or isinstance(value, bool):
                    raise APIError(400, "num_predict must be an integer", "options.num_predict")
                if value > 0:
                    fields["max_tokens"] = value
                elif value not in (-1, -2):
                    raise APIError(
                        400,
                        f"num_predict must be > 0, or -1 or -2 (until the context is full); "
                        f"got {value}",
                        "options.num_predict",
                    )
            elif name not in PLACEMENT_OPTIONS | IGNORED_OPTIONS:
                raise APIError(400, f"unknown option {name}", f"options.{name}")
        if isinstance(self.think, bool):
            fields["chat_template_kwargs"] = {"enable_thinking": self.think}
        elif self.think is not None:
            fields["chat_template_kwargs"] = {"reasoning_effort": self.think}
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif self.format:
            schema = {"name": "format", "schema": self.format}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        return fields


class OllamaChat(OllamaRequest):
    """POST /api/chat."""

    messages: list[OllamaMessage]
    tools: list[dict[str, Any]] | None = None  # OpenAI's function tools, as Ollama sends

    def chat_body(self) -> dict[str, Any]:
        """The chat completion body of this request (streamed with usage when it is)."""
        body = {"model": self.model, "messages": openai_messages(self.messages)}
        if self.tools:
            body["tools"] = self.tools
        return body | self.sampling() | _stream_fields(self.stream)


class OllamaGenerate(OllamaRequest):
    """POST /api/generate: a prompt (and a system message) through the chat template;
    raw: the prompt as it is, no template."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] = Field(default_factory=list)
    template: str | None = None
    context: list[int] | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat completion body of this request (neither raw nor an insert)."""
        self._refuse_unserved()
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.prompt})
        body = {"model": self.model, "messages": messages}
        return body | self.sampling() | _stream_fields(self.stream)

    def text_body(self) -> dict[str, Any]:
        """The text completion body of a raw request, or of an insert at a cursor (the
        prompt before it, `suffix` after it: the model's infill, server/infill.py)."""
        self._refuse_unserved()
        body = {"model": self.model, "prompt": self.prompt}
        if self.suffix and not self.raw:  # raw: the prompt as it is (Ollama's)
            body["suffix"] = self.suffix
        return body | self.sampling() | _stream_fields(self.stream)

    def _refuse_unserved(self) -> None:
        for name in ("template", "context"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by this server", name)
        if self.images:
            raise APIError(400, "images are not supported: this server serves text", "images")


def served_name(body: dict[str, Any], served: str) -> dict[str, Any]:
    """The body with its model named as the OpenAI routes name it: `served` for
    `served:latest` (Ollama's clients add the default tag to a bare name)."""
    name = body.get("model")
    if isinstance(name, str) and name.removesuffix(LATEST) == served:
        return body | {"model": served}
    return body


def _stream_fields(stream: bool) -> dict[str, Any]:
    # Ollama's last line carries the token counts: the stream's usage chunk gives them.
    return {"stream": True, "stream_options": {"include_usage": True}} if stream else {}


def openai_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: a call's arguments as JSON text, each call an id,
    each tool result the id of the call it answers (the next unanswered one of its
    function's name, else the next unanswered one)."""
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (call id, function name)
    for i, message in enumerate(messages):
        if message.images:
            raise APIError(
                400, "images are not supported: this server serves text", f"messages[{i}].images"
            )
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            calls = []
            for j, call in enumerate(message.tool_calls):
                name = call.function.get("name")
                call_id = f"call_{i}_{j}"
                arguments = call.function.get("arguments", {})
                text = arguments if isinstance(arguments, str) else json.dumps(arguments)
                function = {"name": name, "arguments": text}
                calls.append({"id": call_id, "type": "function", "function": function})
                unanswered.append((call_id, str(name)))
            entry["tool_calls"] = calls
        if message.role == "tool":
            entry["tool_call_id"] = _answered(unanswered, message.tool_name, i)
        out.append(entry)
    return out


def _answered(unanswered: list[tuple[str, str]], name: str | None, index: int) -> str:
    for k, (call_id, called) in enumerate(unanswered):
        if name is None or called == name:
            del unanswered[k]
            return call_id
    return f"call_result_{index}"  # a result of no call seen: its own id
