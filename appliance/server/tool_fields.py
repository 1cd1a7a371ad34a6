"""The chat request's tool fields, as OpenAI defines them: `tools` (functions with a JSON
schema of their parameters), `tool_choice`, `parallel_tool_calls`; assistant messages with
`tool_calls`, `role: "tool"` results; vLLM's `chat_template_kwargs` and OpenAI's
`reasoning_effort` (a template variable too).

OpenAI's deprecated `functions` and `function_call` (still served by OpenAI, still sent by
older clients) are its tools and tool_choice with one call at most: the reply carries the
call as `function_call` and finish_reason "function_call"; an assistant turn's
`function_call` and a `role: "function"` result are a call and its result.

ChatTurn turns a validated request into the prompt (the family's template, with the tools
where it reads them) and the readers of its output (appliance/chat)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from appliance.api import SamplingParams
from appliance.chat.chat_output import ChatOutputs
from appliance.chat.formats import chat_format
from appliance.chat.function_tool import FunctionTool
from appliance.chat.tool_calls import ToolPlan, plan_tools
from appliance.engine.sequence import StructuredOutput
from appliance.engine.structured.compile import UnsupportedSpec, check
from appliance.model.tokenizer import Tokenizer, template_kwargs_clash
from appliance.server.errors import APIError

FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"  # OpenAI's: letters, digits, _ and - (64 at most)
# A deprecated function_call has no id, nor its result: the template gets this one for
# both (nine letters and digits: Mistral's template refuses any other shape).
LEGACY_CALL_ID = "call00000"


class _Strict(BaseModel):
    """As protocol.Body: strict fields, unknown ones ignored, null taken as unset."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: required and named calls are always constrained


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolFields(BaseModel):
    """The chat request's tool fields (a part of protocol.ChatCompletionRequest)."""

    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated forms of tools and tool_choice (one call at most).
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: a Jinja template of the request's own, where the server trusts them.
    chat_template: str | None = None
    # OpenAI's, passed to the template as vLLM does (gpt-oss's reads it: "Reasoning: high").
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # vLLM's: a turn for the assistant after the messages (the default), or the last
    # message, an assistant's, continued (a prefill; llama.cpp's and Anthropic's).
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def legacy_functions(self) -> bool:
        """Whether the request sent the deprecated `functions` (its reply then says
        `function_call`)."""
        return self.functions is not None

    def function_tools(self) -> list[FunctionTool]:
        functions = self.functions or [t.function for t in self.tools or []]
        return [FunctionTool(f.name, f.description, f.parameters) for f in functions]

    def choice_name(self) -> str | None:
        """tool_choice (or function_call) as plan_tools takes it: a mode, or the named
        function."""
        choice = self.tool_choice if self.function_call is None else self.function_call
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        return choice.name if isinstance(choice, FunctionName) else choice

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs with reasoning_effort among them; 400 where the two name
        different levels, or the kwargs would set what the request's own fields set."""
        kwargs = dict(self.chat_template_kwargs or {})
        clash = template_kwargs_clash(kwargs)
        if clash:  # what the request's own fields set: else the template refuses them
            message = f"chat_template_kwargs may not set {', '.join(clash)}: send them as fields"
            raise APIError(400, message, "chat_template_kwargs")
        if self.reasoning_effort is None:
            return kwargs
        said = kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        if said != self.reasoning_effort:
            message = (
                f"reasoning_effort ({self.reasoning_effort}) and chat_template_kwargs' "
                f"reasoning_effort ({said}) differ: send one"
            )
            raise APIError(400, message, "reasoning_effort")
        return kwargs

    def check_legacy(self) -> None:
        """The deprecated fields stand alone: with tools or tool_choice, or function_call
        without functions, the request is a 400 naming the field."""
        if self.functions is not None and self.tools is not None:
            raise APIError(400, "send tools or functions (deprecated), not both", "functions")
        if self.function_call is not None and self.tool_choice is not None:
            message = "send tool_choice or function_call (deprecated), not both"
            raise APIError(400, message, "function_call")
        if self.function_call is not None and self.functions is None:
            message = "function_call needs functions (or send tools and tool_choice)"
            raise APIError(400, message, "function_call")


class MessageToolFields(BaseModel):
    """The tool fields of a message (a part of protocol.ChatMessage)."""

    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    function_call: CalledFunction | None = None  # the deprecated form of one tool call


def template_message(
    role: str, content: str | None, name: str | None, fields: MessageToolFields
) -> dict[str, Any]:
    """A message as chat templates read it (transformers' documented shape): calls with
    their arguments as objects (vLLM parses them so, for templates that `tojson` them),
    a tool result with its call's id; a calling turn without content has "" (as Qwen's
    and vLLM's examples write it)."""
    calls = list(fields.tool_calls or [])
    if fields.function_call is not None:  # the deprecated form: its id is made up
        calls.append(MessageToolCall(id=LEGACY_CALL_ID, function=fields.function_call))
    if content is None and calls:
        content = ""  # templates read a calling turn's content (Qwen3's splits it)
    message: dict[str, Any] = {"role": role, "content": content}
    if name is not None:
        message["name"] = name
    if calls:
        message["tool_calls"] = [_template_call(c) for c in calls]
    if fields.tool_call_id is not None:
        message["tool_call_id"] = fields.tool_call_id
    if fields.reasoning_content is not None:
        message["reasoning_content"] = fields.reasoning_content
    return message


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments  # not JSON: the template gets the text
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def check_tool_messages(messages: Any) -> None:
    """A tool result needs the id of the call it answers, a function result (deprecated)
    the function's name (400 naming the field)."""
    if not isinstance(messages, list):
        return
    needs = {"tool": "tool_call_id", "function": "name"}
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in needs:
            continue  # not a message, or a role of another shape: validation names it
        field = needs[role]
        if not isinstance(message.get(field), str):
            where = f"messages[{i}].{field}"
            raise APIError(
                400, f"Missing required parameter: '{where}'.", where, "missing_required_parameter"
            )


def _check_continuable(messages: list[dict[str, Any]], generation_prompt: bool) -> None:
    """continue_final_message's conditions (vLLM's): no new turn asked, an assistant's
    text last."""
    if generation_prompt:
        message = (
            "continue_final_message continues the last message: send add_generation_prompt "
            "false with it"
        )
        raise APIError(400, message, "add_generation_prompt")
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or not isinstance(last.get("content"), str):
        where = f"messages[{len(messages) - 1}]"
        raise APIError(400, "continue_final_message needs an assistant's text last", where)


@dataclass
class ChatTurn:
    """A chat request's prompt and the reading of its output, from the model's template."""

    tokenizer: Tokenizer
    messages: list[dict[str, Any]]
    plan: ToolPlan
    template_kwargs: dict[str, Any]
    generation_prompt: bool = True
    continue_final: bool = False
    legacy: bool = False  # the request sent `functions`: its calls read as `function_call`

    @classmethod
    def of(
        cls,
        tokenizer: Tokenizer,
        messages: list[dict[str, Any]],
        fields: ToolFields,
        trust_template: bool = False,
    ) -> ChatTurn:
        """The turn of validated fields; APIError 400 for a tool_choice the tools cannot
        meet, or a chat_template of the request's own unless `trust_template`
        (server.trust_request_chat_template) or it does not compile."""
        fields.check_legacy()
        if fields.chat_template is not None:
            tokenizer = _request_template(tokenizer, fields.chat_template, trust_template)
        fmt = chat_format(tokenizer.chat_template, tokenizer.takes_tools)
        parallel = fields.parallel_tool_calls and not fields.legacy_functions
        try:
            plan = plan_tools(fmt, fields.function_tools(), fields.choice_name(), parallel)
        except ValueError as exc:
            param = "tools" if str(exc).startswith("tools") else "tool_choice"
            if fields.legacy_functions:
                param = {"tools": "functions", "tool_choice": "function_call"}[param]
            raise APIError(400, str(exc), param) from None
        if plan.structured is not None:
            try:  # as the workers will build it: what the grammar engine refuses is a 400
                check(plan.structured)
            except UnsupportedSpec as exc:
                raise APIError(
                    400, f"a tool's parameters cannot constrain the calls: {exc}", "tools"
                ) from None
        if fields.continue_final_message:
            _check_continuable(messages, fields.add_generation_prompt)
        return cls(
            tokenizer,
            messages,
            plan,
            fields.template_kwargs(),
            fields.add_generation_prompt,
            fields.continue_final_message,
            fields.legacy_functions,
        )

    def token_ids(self) -> list[int]:
        """The prompt: the messages (and tools) through the model's template. ValueError
        where the template refuses them."""
        # The template already holds any BOS; adding special tokens again would double it.
        return self.tokenizer.encode(self.prompt_text(), add_special_tokens=False)

    def prompt_text(self) -> str:
        """The prompt token_ids reads, as text (llama.cpp's /apply-template)."""
        messages = self.plan.messages(self.messages)
        return self.tokenizer.render_chat(
            messages,
            self.plan.prompt_tools(),
            self.template_kwargs,
            self.generation_prompt,
            self.continue_final,
        )

    def outputs(self, stop: tuple[str, ...] = (), include_stop: bool = False) -> ChatOutputs | None:
        """The readers of the choices' output (`stop`: the request's stop strings, kept in
        the text if `include_stop`); None where the output is plain content (no tools, no
        reasoning, no markers to read), so the reply is the text as it was."""
        if self.plan.mode == "none" and not self.plan.format.reasoning:
            return None
        return ChatOutputs(self.plan, self.tokenizer, stop, include_stop, self.legacy)

    @property
    def structured(self) -> StructuredOutput | None:
        return self.plan.structured


def _request_template(tokenizer: Tokenizer, source: str, trusted: bool) -> Tokenizer:
    """The tokenizer rendering with a request's own chat template, where trusted."""
    if not trusted:
        message = (
            "a chat_template of the request's own is rendered only where the server trusts "
            "them (server.trust_request_chat_template, vLLM's --trust-request-chat-template)"
        )
        raise APIError(400, message, "chat_template", "unsupported")
    try:
        return tokenizer.with_template(source)
    except ValueError as exc:
        raise APIError(400, f"chat_template does not compile: {exc}", "chat_template") from None


def constrained(params: SamplingParams, structured: StructuredOutput | None) -> SamplingParams:
    """`params` with the tool calls' constraint; a request constrained another way too
    (response_format) is refused: one output cannot follow two grammars."""
    if structured is None:
        return params
    if params.structured is not None:
        raise APIError(
            400,
            "tool_choice constrains the output to tool calls; it cannot be combined with "
            "response_format or another structured output",
            "tool_choice",
        )
    return replace(params, structured=structured)
