"""The Responses API's objects: the response (whole, and as each lifecycle event repeats
it), its output items (an assistant message with output_text, function calls), and the
stream's events, numbered in order by `sequence_number`.

Pure data: the route feeds it the generated text and calls, it answers dicts in OpenAI's
shapes (openai.types.responses)."""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(
    input_tokens: int, output_tokens: int, cached_tokens: int, written_tokens: int = 0
) -> dict[str, Any]:
    """`written_tokens`: input tokens newly keyed in the prefix cache (`cache_write_tokens`)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {
            "cached_tokens": cached_tokens,
            "cache_write_tokens": written_tokens,
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def message_item(
    item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An assistant message; `text` None: no content part yet (just opened)."""
    content = [] if text is None else [text_part(text, logprobs)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The model's reasoning (Qwen3's thinking, gpt-oss's analysis channel) as its text."""
    content = [] if text is None else [reasoning_part(text)]
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status, "content": content}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`logprobs`: its tokens' entries (token, bytes, logprob, top_logprobs), if asked."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def without_bytes(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logprob entries as the stream's text events carry them: no `bytes`."""
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "top_logprobs": [
                {"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]
            ],
        }
        for e in entries
    ]


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass
class Draft:
    """The response as it stands: the request's echo (model, instructions, sampling, tools,
    text format...) and what has been generated so far."""

    echo: dict[str, Any]  # the request fields every response object repeats
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    incomplete_reason: str | None = None
    error: dict[str, str] | None = None
    completed_at: int | None = None

    def finish(self, finish_reason: str | None, used: dict[str, Any]) -> None:
        """Ended by the model (stop) or by the output budget (length: incomplete)."""
        self.usage = used
        if finish_reason == "length":
            self.status = "incomplete"
            self.incomplete_reason = "max_output_tokens"
        else:
            self.status = "completed"
            self.completed_at = int(time.time())

    def fail(self, code: str, message: str) -> None:
        """Failed mid-generation: what was generated stays, the item it was in is left
        incomplete."""
        self.status = "failed"
        self.error = {"code": code, "message": message}
        self.output = [
            {**item, "status": "incomplete"} if item["status"] == "in_progress" else item
            for item in self.output
        ]

    def body(self) -> dict[str, Any]:
        """The response object (a deep copy: events keep their own snapshot)."""
        details = None if self.incomplete_reason is None else {"reason": self.incomplete_reason}
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": details,
            **self.echo,
            "output": self.output,
            "usage": self.usage,
        }
        return copy.deepcopy(body)

    def item_status(self) -> str:
        """An item the generation ended in: cut off with the response, or complete."""
        return "incomplete" if self.status == "incomplete" else "completed"


class EventStream:
    """The stream's events in OpenAI's order, each with the next sequence number:
    response.created, response.in_progress, then per output item its added/delta/done
    events, then response.completed (or .incomplete, .failed)."""

    def __init__(self, draft: Draft) -> None:
        self.draft = draft
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self.draft.body()),
            self.event("response.in_progress", response=self.draft.body()),
        ]

    def closing(self) -> dict[str, Any]:
        """The last event: the whole response in its final state."""
        kind = {"completed": "completed", "incomplete": "incomplete"}.get(
            self.draft.status, "failed"
        )
        return self.event(f"response.{kind}", response=self.draft.body())


class TextEvents:
    """One item of text in a stream, an assistant message or the model's reasoning:
    opened, its text in deltas, closed."""

    def __init__(self, stream: EventStream, reasoning: bool = False) -> None:
        self.stream = stream
        self.reasoning = reasoning
        self.id = new_id("rs" if reasoning else "msg")
        self.index = len(stream.draft.output)
        self.text = ""
        self.kind = "reasoning_text" if reasoning else "output_text"
        self.logprobs: list[dict[str, Any]] = []  # the part's, with bytes
        stream.draft.output.append(self._item("", "in_progress"))

    def _item(self, text: str | None, status: str) -> dict[str, Any]:
        if self.reasoning:
            return reasoning_item(self.id, text, status)
        return message_item(self.id, text, status, self.logprobs)

    def _part(self, text: str) -> dict[str, Any]:
        return reasoning_part(text) if self.reasoning else text_part(text, self.logprobs)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.index, "content_index": 0}

    def _logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        # Output text's events carry logprobs (empty unless asked); reasoning's none.
        return {} if self.reasoning else {"logprobs": without_bytes(entries)}

    def opened(self) -> list[dict[str, Any]]:
        return [
            self.stream.event(
                "response.output_item.added",
                output_index=self.index,
                item=self._item(None, "in_progress"),
            ),
            self.stream.event("response.content_part.added", **self._where(), part=self._part("")),
        ]

    def delta(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """More text, with its tokens' logprob entries where the request asked for them."""
        self.text += text
        self.logprobs += logprobs or []
        self.stream.draft.output[self.index] = self._item(self.text, "in_progress")
        return self.stream.event(
            f"response.{self.kind}.delta",
            **self._where(),
            delta=text,
            **self._logprobs(logprobs or []),
        )

    def closed(self, status: str) -> list[dict[str, Any]]:
        item = self._item(self.text, status)
        self.stream.draft.output[self.index] = item
        where = self._where()
        return [
            self.stream.event(
                f"response.{self.kind}.done",
                **where,
                text=self.text,
                **self._logprobs(self.logprobs),
            ),
            self.stream.event("response.content_part.done", **where, part=self._part(self.text)),
            self.stream.event("response.output_item.done", output_index=self.index, item=item),
        ]


class CallEvents:
    """One function_call item of a stream: opened with its name, arguments in deltas,
    closed."""

    def __init__(self, stream: EventStream, name: str, call_id: str | None = None) -> None:
        self.stream = stream
        self.id = new_id("fc")
        self.call_id = call_id or new_id("call")
        self.name = name
        self.index = len(stream.draft.output)
        self.arguments = ""
        stream.draft.output.append(self._item("in_progress"))

    def _item(self, status: str) -> dict[str, Any]:
        return call_item(self.id, self.call_id, self.name, self.arguments, status)

    def opened(self) -> list[dict[str, Any]]:
        item = self._item("in_progress")
        return [self.stream.event("response.output_item.added", output_index=self.index, item=item)]

    def delta(self, fragment: str) -> dict[str, Any]:
        self.arguments += fragment
        self.stream.draft.output[self.index] = self._item("in_progress")
        return self.stream.event(
            "response.function_call_arguments.delta",
            item_id=self.id,
            output_index=self.index,
            delta=fragment,
        )

    def closed(self, status: str) -> list[dict[str, Any]]:
        item = self._item(status)
        self.stream.draft.output[self.index] = item
        return [
            self.stream.event(
                "response.function_call_arguments.done",
                item_id=self.id,
                output_index=self.index,
                name=self.name,
                arguments=self.arguments,
            ),
            self.stream.event("response.output_item.done", output_index=self.index, item=item),
        ]


class OutputItems:
    """The response's output items as the model writes them: reasoning to a reasoning
    item, the reply to an assistant message, each tool call to its own function_call item.
    Items come one after another, as OpenAI streams them: opening one closes the one
    before."""

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream
        self.open: TextEvents | CallEvents | None = None
        self.calls: dict[int, CallEvents] = {}  # by the parser's call index

    def text(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        return self._write(text, False, logprobs)

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        return self._write(text, True)

    def call(
        self, index: int, name: str | None, arguments: str, call_id: str
    ) -> list[dict[str, Any]]:
        """Call `index`: its name opens its item, arguments come as deltas."""
        events = []
        call = self.calls.get(index)
        if call is None:
            events += self._close("completed")
            call = self.calls[index] = CallEvents(self.stream, name or "", call_id)
            self.open = call
            events += call.opened()
        if arguments:
            events.append(call.delta(arguments))
        return events

    def finish(self, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The generation ended (the draft holds how): the last item closes with the
        response's status; an output with no message and no call gets an empty message.
        `logprobs`: those of the last tokens, which added no text (an end token)."""
        events = []
        if all(item["type"] == "reasoning" for item in self.stream.draft.output):
            events += self._close("completed")
            self.open = TextEvents(self.stream)
            events += self.open.opened()
        if logprobs and isinstance(self.open, TextEvents) and not self.open.reasoning:
            self.open.logprobs += logprobs
        return events + self._close(self.stream.draft.item_status())

    def _write(
        self, text: str, reasoning: bool, logprobs: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """More reply or reasoning text: into the open item of that kind, else a new one."""
        if not text:
            return []
        events = []
        if not (isinstance(self.open, TextEvents) and self.open.reasoning == reasoning):
            events += self._close("completed")
            self.open = TextEvents(self.stream, reasoning)
            events += self.open.opened()
        events.append(self.open.delta(text, logprobs))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        events = self.open.closed(status)
        self.open = None
        return events
