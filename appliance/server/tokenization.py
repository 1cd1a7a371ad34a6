"""POST /tokenize, /detokenize and /apply-template: the served model's tokenizer and
template, as vLLM's and llama.cpp's servers offer them, so an application counts a
prompt's tokens (or reads ids back, or renders messages) before it sends it. Both
dialects, told apart by their fields:

- vLLM: `prompt` (text) or `messages` (with `tools` and `chat_template_kwargs`, rendered
  as a chat completion renders them: the ids its prefill would read), `add_special_tokens`
  and `return_token_strs`; answers `count`, `max_model_len`, `tokens`, `token_strs`.
- llama.cpp: `content`, `add_special` and `with_pieces`; answers `tokens` (ids, or with
  pieces `{"id", "piece"}` objects).

/detokenize takes `tokens` in either and answers the text under both names (`prompt`,
vLLM's, and `content`, llama.cpp's). llama.cpp's /apply-template takes `messages` (and
`tools`) and answers the chat template's text as `prompt`. The tokenizer is loaded before
the workers, so all three answer while the server is starting."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.model.tokenizer import Tokenizer
from appliance.server.body import read_json_object, validated
from appliance.server.errors import APIError
from appliance.server.protocol import (
    Body,
    ChatCompletionRequest,
    unsupported_field,
    unsupported_message,
    valid_unicode,
)
from appliance.server.routes import tokenized
from appliance.server.state import ServerState
from appliance.server.tool_fields import ChatTurn


class PromptTokenize(Body):
    """vLLM's /tokenize of a raw prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    _unicode = field_validator("prompt")(valid_unicode)


class ContentTokenize(Body):
    """llama.cpp's /tokenize."""

    content: str
    add_special: bool = False
    with_pieces: bool = False

    _unicode = field_validator("content")(valid_unicode)


class ChatTokenize(Body):
    """vLLM's /tokenize of messages: its own flags (the rest is a chat completion's)."""

    return_token_strs: bool = False
    # vLLM adds the tokenizer's special tokens on top of the template's when True; the
    # template holds them already, and a chat completion never adds them.
    add_special_tokens: bool = False


class Detokenize(Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


async def tokenize(request: Request) -> Response:
    """POST /tokenize (see the module's docstring)."""
    state, tokenizer, body = await _accept(request)
    if body.get("content") is not None:
        llama = validated(ContentTokenize, body)
        ids = await tokenized(lambda: tokenizer.encode(llama.content, llama.add_special), "content")
        if not llama.with_pieces:
            return JSONResponse({"tokens": ids})
        return JSONResponse({"tokens": [{"id": i, "piece": _piece(tokenizer, i)} for i in ids]})
    if body.get("messages") is not None:
        flags = validated(ChatTokenize, body)
        if flags.add_special_tokens:
            raise APIError(
                400,
                "add_special_tokens with messages is not supported: the chat template holds "
                "the special tokens a chat completion reads; send false or leave it out",
                "add_special_tokens",
                "unsupported",
            )
        ids = await _chat_ids(state, tokenizer, body)
        strings = flags.return_token_strs
    else:
        if body.get("prompt") is None:
            raise APIError(400, "send a prompt, messages, or (llama.cpp's) content", "prompt")
        req = validated(PromptTokenize, body)
        _check_model(state, req.model)
        ids = await tokenized(
            lambda: tokenizer.encode(req.prompt, req.add_special_tokens), "prompt"
        )
        strings = req.return_token_strs
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": state.appliance.max_model_len if state.appliance.ready else None,
            "tokens": ids,
            "token_strs": tokenizer.token_strings(ids) if strings else None,
        }
    )


async def detokenize(request: Request) -> Response:
    """POST /detokenize: ids to text, under vLLM's name and llama.cpp's."""
    state, tokenizer, body = await _accept(request)
    req = validated(Detokenize, body)
    _check_model(state, req.model)
    vocab = state.appliance.model_config.vocab_size
    bad = next((i for i in req.tokens if not 0 <= i < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary ({vocab})", "tokens")
    text = await tokenized(lambda: tokenizer.decode(req.tokens), "tokens")
    return JSONResponse({"prompt": text, "content": text})


async def apply_template(request: Request) -> Response:
    """POST /apply-template (llama.cpp's): messages (and tools) through the chat template,
    as the text a chat completion would prefill, for a client to edit and send to
    /completion."""
    state, tokenizer, body = await _accept(request)
    turn = await chat_turn(state, tokenizer, {k: v for k, v in body.items() if k != "model"})
    prompt = await tokenized(turn.prompt_text, "messages")
    # A text prompt gets the tokenizer's BOS again when /completion encodes it: the
    # template's own goes (llama.cpp's common_chat_template_direct_apply does the same).
    bos = tokenizer.special_tokens.get("bos_token")
    if bos and prompt.startswith(bos) and tokenizer.encode("")[:1] == [tokenizer.token_id(bos)]:
        prompt = prompt[len(bos) :]
    return JSONResponse({"prompt": prompt})


async def _accept(request: Request) -> tuple[ServerState, Tokenizer, dict[str, Any]]:
    state: ServerState = request.app.state.server
    state.authorize(request)
    body = await read_json_object(request, state.settings.server.max_body_bytes)
    tokenizer = state.appliance.tokenizer
    if tokenizer is None:  # the server answers before the tokenizer is loaded only if it failed
        state.check_ready()
        raise APIError(503, "the tokenizer is not loaded yet", code="starting")
    return state, tokenizer, body


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None:
        state.check_model(model)


async def _chat_ids(state: ServerState, tokenizer: Tokenizer, body: dict[str, Any]) -> list[int]:
    """The prompt a chat completion of these messages (and tools) would prefill."""
    turn = await chat_turn(state, tokenizer, body)
    return await tokenized(turn.token_ids, "messages")


async def chat_turn(state: ServerState, tokenizer: Tokenizer, body: dict[str, Any]) -> ChatTurn:
    """These messages (and tools) as a chat completion takes them (a chat_template of the
    request's own where the server trusts them, as there)."""
    field = unsupported_field(body)
    if field is not None:
        raise APIError(400, unsupported_message(field), field, "unsupported")
    if body.get("messages") is None:
        raise APIError(400, "send messages", "messages")
    req = validated(ChatCompletionRequest, {"model": state.appliance.model_name, **body})
    state.check_model(req.model)
    trusted = state.settings.server.trust_request_chat_template
    return ChatTurn.of(tokenizer, [m.for_template() for m in req.messages], req, trusted)


def _piece(tokenizer: Tokenizer, token_id: int) -> str | list[int]:
    """llama.cpp's piece of a token: its text, or where it holds part of a character (not
    valid UTF-8 alone) its bytes as a list of numbers."""
    piece = tokenizer.token_bytes(token_id)
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)
