"""The body of POST /v1/responses: its fields, what is refused (a 400 naming the field),
and the chat messages and sampling parameters it becomes.

The server keeps its newest responses (store.py) for `previous_response_id`; what needs
a stored conversation, prompt template or item is refused, as are OpenAI's built-in tools
and image, file or audio inputs."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from appliance.api import SamplingParams
from appliance.engine.sequence import MAX_TOP_LOGPROBS, StructuredOutput
from appliance.engine.structured.compile import UnsupportedSpec, check
from appliance.server.errors import APIError
from appliance.server.protocol import Body, cache_salt_of
from appliance.server.tool_fields import (
    FUNCTION_NAME,
    MessageToolFields,
    ToolFields,
    template_message,
)

# Raw-body fields that need state this server does not keep (each with why), refused when
# sent with a value that asks for it.
STATEFUL_FIELDS = {
    "conversation": "this server stores no conversations: send the earlier turns' items in "
    "`input` instead",
    "prompt": "this server stores no prompt templates: send the prompt in `input`",
}
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for logprobs
# Items a client replays from an earlier response that carry nothing a prompt needs: a
# reasoning item is the model's own thinking, which chat templates drop from earlier turns.
SKIPPED_ITEMS = ("reasoning",)


def refuse_unserved(body: dict[str, Any]) -> None:
    """Raise a 400 naming the first field of the raw body that asks for something this
    server does not do (checked before validation, so the answer names it plainly)."""
    served = {info.alias or name for name, info in ResponsesRequest.model_fields.items()}
    for name in served & body.keys():  # the served fields: read, or echoed in the reply
        _check_unicode(body[name], name)
    for name, why in STATEFUL_FIELDS.items():
        if body.get(name) is not None:
            raise _refused(name, f"{name} is not supported: {why}")
    if body.get("background") is True:
        raise _refused(
            "background",
            "background is not supported: this server stores no "
            "responses to poll; send background: false or leave it out",
        )
    if body.get("truncation") == "auto":
        raise _refused(
            "truncation",
            'truncation "auto" is not supported: this server never '
            'drops input; send "disabled" or leave it out',
        )
    _refuse_built_in_tools(body.get("tools"))
    _refuse_tool_choice(body.get("tool_choice"))


def _refuse_built_in_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        return  # not a list: validation names it (422)
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind is not None and kind != "function":
            raise _refused(
                f"tools[{i}].type",
                f"tools[{i}] has type {kind!r}: this server runs no built-in tools (web "
                "search, file search, code interpreter, computer use, image generation, MCP, "
                'shell...); only {"type": "function"} tools are served',
            )


def _refuse_tool_choice(choice: Any) -> None:
    if not isinstance(choice, dict):
        return  # a string: validation checks it
    kind = choice.get("type")
    if kind != "function":
        raise _refused(
            "tool_choice",
            f"tool_choice of type {kind!r} is not supported: send none, auto, required or "
            '{"type": "function", "name": ...}',
        )


def _refused(param: str, message: str) -> APIError:
    return APIError(400, message, param, "unsupported")


class TextFormat(Body):
    """text.format: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    # `schema` would shadow pydantic's BaseModel.schema: the body's key is its alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    _spec: StructuredOutput | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _compiles(self) -> TextFormat:
        # Checked as the workers will compile it, before any tokenizing: what the engine
        # cannot compile is a 400 naming the reason (an APIError passes pydantic as it is).
        if self.type == "text":
            return self
        if self.type == "json_object":
            spec = StructuredOutput("json_object")
        elif self.json_schema is None:
            raise APIError(
                400,
                "text.format.schema is required for json_schema",
                "text.format.schema",
                "missing_required_parameter",
            )
        else:
            spec = StructuredOutput("json", json.dumps(self.json_schema))
        try:
            check(spec)
        except UnsupportedSpec as exc:
            raise APIError(
                400, f"text.format: unsupported: {exc}", "text.format", "unsupported"
            ) from None
        self._spec = spec
        return self

    def structured(self) -> StructuredOutput | None:
        """What the grammar engine must hold the output to (None: plain text)."""
        return self._spec

    def echoed(self) -> dict[str, Any]:
        """As the response object repeats it."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {
            "type": "json_schema",
            "name": self.name,
            "description": self.description,
            "schema": self.json_schema,
            "strict": self.strict,
        }


class TextConfig(Body):
    format: TextFormat = Field(default_factory=TextFormat)


class FunctionTool(Body):
    """A function tool in this API's flat shape (chat completions nests it in `function`)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def echoed(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=False)

    def as_chat_tool(self) -> dict[str, Any]:
        """The same function in chat completions' shape, as templates and parsers take it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class NamedFunction(Body):
    type: Literal["function"]
    name: str


class Reasoning(Body):
    """`reasoning`: the effort goes to the template as reasoning_effort (gpt-oss's reads
    it); a summary of the reasoning is not made (its text comes as it is)."""

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Body):
    """The served fields of a /v1/responses body; others are ignored, as on the other
    routes, except those `refuse_unserved` refuses.

    `store` (the API's default true): the response is kept for a later request's
    `previous_response_id` (store.py); the response says whether it was (not where the
    server keeps none). The input of a request with `previous_response_id` holds that
    response's conversation first by the time it is validated (store.continued)."""

    # As SamplingFields': what the model's sampling defaults fill where left out.
    DEFAULTED: ClassVar[dict[str, tuple[str, ...]]] = {
        "temperature": ("temperature",),
        "top_p": ("top_p",),
    }

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    text: TextConfig = Field(default_factory=TextConfig)
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    # Logprobs come back where `include` names LOGPROBS, with top_logprobs alternatives;
    # other include entries name what only built-in tools and images produce: nothing here.
    include: list[str] = Field(default_factory=list)
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    cache_salt: str = ""  # vLLM's: different salts share no cached prefix block
    reasoning: Reasoning = Field(default_factory=Reasoning)

    @field_validator("cache_salt")
    @classmethod
    def _salt_is_given(cls, value: str) -> str:
        return cache_salt_of(value)

    def wants_logprobs(self) -> bool:
        return LOGPROBS in self.include

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            logprobs=self.top_logprobs if self.wants_logprobs() else None,
            structured=self.text.format.structured(),
            cache_salt=self.cache_salt,
        )

    def tool_fields(self) -> ToolFields:
        """The tools and tool_choice in chat completions' shape, as the chat route's tool
        handling (tool_fields.ChatTurn) takes them."""
        choice: str | dict[str, Any] | None = (
            {"type": "function", "function": {"name": self.tool_choice.name}}
            if isinstance(self.tool_choice, NamedFunction)
            else self.tool_choice
        )
        if choice == "auto" and not self.tools:
            choice = None  # this API's default: no tools, so nothing to choose from
        return ToolFields.model_validate(
            {
                "tools": [tool.as_chat_tool() for tool in self.tools] or None,
                "tool_choice": choice,
                "parallel_tool_calls": self.parallel_tool_calls,
                "reasoning_effort": self.reasoning.effort,
            }
        )

    def echoed_tool_choice(self) -> str | dict[str, Any]:
        if isinstance(self.tool_choice, NamedFunction):
            return self.tool_choice.model_dump()
        return self.tool_choice


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates read it: `instructions` as a system message
    first, then each input item (a string input is one user message); an earlier call
    becomes an assistant turn's tool_calls, its output a `tool` turn."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    if not req.input:
        raise APIError(400, "input is empty", "input")
    for i, item in enumerate(req.input):
        _add_item(messages, item, f"input[{i}]")
    return [_for_template(m) for m in messages]


def _check_unicode(value: Any, param: str) -> None:
    """400 naming `param` where its text holds a lone surrogate: JSON can escape one
    ("\\ud800"), but it is no character: the tokenizer refused it, and the reply that echoes
    it could not be encoded (500s the API fuzzer found)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(
            400, f"{param} is not valid Unicode (a lone surrogate escape?)", param
        ) from None


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        messages.append(_message(item, where))
    elif kind == "function_call":
        call = {
            "id": _text_field(item, "call_id", where),
            "type": "function",
            "function": {
                "name": _text_field(item, "name", where),
                "arguments": _text_field(item, "arguments", where),
            },
        }
        last = messages[-1] if messages else None
        # One assistant turn holds its text and the calls after it (parallel calls arrive
        # as consecutive items), as a chat completion's message does.
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _joined_text(output, f"{where}.output")
        messages.append(
            {"role": "tool", "tool_call_id": _text_field(item, "call_id", where), "content": text}
        )
    elif kind not in SKIPPED_ITEMS:
        raise APIError(
            400,
            f"{where} has type {kind!r}: this server takes message, "
            "function_call and function_call_output items (it stores no items to "
            "reference and runs no built-in tools)",
            f"{where}.type",
            "unsupported",
        )


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A chat-shaped message as the chat route hands it to the template."""
    fields = MessageToolFields.model_validate(
        {k: message[k] for k in ("tool_calls", "tool_call_id") if k in message}
    )
    return template_message(message["role"], message["content"], None, fields)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise APIError(
            400,
            f"{where}.role must be user, system, developer or assistant, got {role!r}",
            f"{where}.role",
        )
    content = item.get("content")
    text = content if isinstance(content, str) else _joined_text(content, f"{where}.content")
    # Chat templates know the classic roles; "developer" is OpenAI's new name for system.
    return {"role": "system" if role == "developer" else role, "content": text}


def _joined_text(parts: Any, where: str) -> str:
    """Text parts joined; any other part (image, file, audio) is refused."""
    if not isinstance(parts, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{where}[{j}] has type {kind!r}: this server takes text "
                'only ({"type": "input_text", "text": "..."})',
                f"{where}[{j}]",
                "unsupported",
            )
        texts.append(part["text"])
    return "".join(texts)


def _text_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{name} must be a string", f"{where}.{name}")
    return value
