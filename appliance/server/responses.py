"""The JSON shapes of OpenAI's chat and text completion responses, whole and streamed."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from appliance.api import TokenLogprobs
from appliance.chat.chat_output import ChatOutputs, GeneratedPiece


class Piece(Protocol):
    """A token id's text, as the tokenizer decodes it alone (replies.token_pieces)."""

    def __call__(self, token_id: int, /) -> str: ...

    def bytes_of(self, token_id: int, /) -> bytes:
        """The bytes it stands for: a character split over tokens is split bytes."""
        ...


Logprobs = dict[str, Any] | None  # a choice's "logprobs" value
LOWEST_LOGPROB = -9999.0  # what vLLM reports for -inf (JSON has no infinity)


def _logprob(value: float) -> float:
    return max(value, LOWEST_LOGPROB)


def vllm_prompt_logprobs(
    prompt_ids: list[int], tokens: list[TokenLogprobs], piece: Piece, k: int
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a
    {token id: {logprob, rank, decoded_token}} of its top k and the prompt token itself."""
    found: list[dict[str, Any] | None] = [None] if prompt_ids else []
    for token in tokens:
        entry = {
            str(i): {"logprob": _logprob(lp), "rank": rank, "decoded_token": piece(i)}
            for rank, (i, lp) in enumerate(token.top[:k], start=1)
        }
        entry.setdefault(
            str(token.token_id),
            {
                "logprob": _logprob(token.logprob),
                "rank": token.rank,
                "decoded_token": piece(token.token_id),
            },
        )
        found.append(entry)
    return found


def _token(piece: Piece, token_id: int, logprob: float) -> dict[str, Any]:
    """OpenAI's chat token entry: its text, logprob and bytes (a token holding part of a
    character has text U+FFFD, and the bytes that joined to the next give the character)."""
    return {
        "token": piece(token_id),
        "logprob": _logprob(logprob),
        "bytes": list(piece.bytes_of(token_id)),
    }


class ChatShape:
    """/v1/chat/completions: choices carry a message, stream chunks a delta."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    echo = False  # chat never repeats the prompt

    def __init__(self, outputs: ChatOutputs | None = None) -> None:
        # The readers of tool calls and reasoning (tool_fields.ChatTurn); None: plain text.
        self.outputs = outputs

    def text_of(self, index: int, piece: GeneratedPiece) -> str:
        """The text of choice `index`'s next piece that the reply is made of."""
        return piece.text if self.outputs is None else self.outputs.text_of(index, piece)

    def choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: Logprobs = None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.outputs is not None:
            message, finish_reason = self.outputs.message(text, finish_reason)
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def delta(
        self, index: int, text: str, finish_reason: str | None, logprobs: Logprobs = None
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text else {}
        if self.outputs is not None:
            delta, finish_reason = self.outputs.delta(index, text, finish_reason)
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def logprobs(self, tokens: list[TokenLogprobs], piece: Piece, offset: int) -> dict[str, Any]:
        """OpenAI's chat logprobs: per token its entry and its top alternatives."""
        content = []
        for token in tokens:
            entry = _token(piece, token.token_id, token.logprob)
            entry["top_logprobs"] = [_token(piece, i, lp) for i, lp in token.top]
            content.append(entry)
        return {"content": content}

    def opening(self, index: int) -> dict[str, Any] | None:
        """The first chunk of each choice names the role, as OpenAI's stream does."""
        delta = {"role": "assistant", "content": ""}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


class CompletionShape:
    """/v1/completions: choices and stream chunks carry text."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, echo: bool = False) -> None:
        self.echo = echo  # the text (and logprobs) start with the prompt's

    def prompt_logprobs(
        self, prompt_ids: list[int], tokens: list[TokenLogprobs], piece: Piece, asked: int
    ) -> dict[str, Any]:
        """`logprobs`' prompt part under echo, as vLLM gives it: the first prompt token has
        no logprob (null), the others `tokens` (prompt logprobs from the second token)."""
        if not prompt_ids:
            return self.logprobs([], piece, 0)
        first = piece(prompt_ids[0])
        rest = self.logprobs(tokens, piece, len(first), keep=asked)
        return {
            "tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]],
        }

    def text_of(self, index: int, piece: GeneratedPiece) -> str:
        return piece.text

    def choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: Logprobs = None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def delta(
        self, index: int, text: str, finish_reason: str | None, logprobs: Logprobs = None
    ) -> dict[str, Any]:
        return self.choice(index, text, finish_reason, logprobs)

    def logprobs(
        self, tokens: list[TokenLogprobs], piece: Piece, offset: int, keep: int | None = None
    ) -> dict[str, Any]:
        """OpenAI's legacy logprobs: parallel lists, each token's top alternatives (the
        first `keep` of them; None: all) as a {text: logprob} dict that always holds the
        sampled token (so up to k + 1), and each token's character offset in the text,
        counting from `offset`."""
        texts = [piece(token.token_id) for token in tokens]
        top: list[dict[str, float]] = []
        offsets: list[int] = []
        for token, text in zip(tokens, texts, strict=True):
            alternatives = {piece(i): _logprob(lp) for i, lp in token.top[:keep]}
            alternatives.setdefault(text, _logprob(token.logprob))
            top.append(alternatives)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [_logprob(token.logprob) for token in tokens],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def opening(self, index: int) -> dict[str, Any] | None:
        return None


Shape = ChatShape | CompletionShape


@dataclass
class Envelope:
    """What every response and chunk of one request shares."""

    shape: Shape
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, where asked (whole only)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" in logprobs

    def __post_init__(self) -> None:
        self.id = self.id or self.shape.id_prefix + uuid.uuid4().hex

    def whole(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        return self._wrap(self.shape.object, choices) | {"usage": usage}

    def chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, int] | None, with_usage: bool
    ) -> dict[str, Any]:
        body = self._wrap(self.shape.chunk_object, choices)
        return body | {"usage": usage} if with_usage else body

    def _wrap(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
