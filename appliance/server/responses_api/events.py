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


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message; `text` None: no content part yet (just opened)."""
    content = [] if text is None else [text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


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
        self.status = "failed"
        self.error = {"code": code, "message": message}

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


class MessageEvents:
    """One assistant message item of a stream: opened, its text in deltas, closed."""

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream
        self.id = new_id("msg")
        self.index = len(stream.draft.output)
        self.text = ""
        stream.draft.output.append(message_item(self.id, "", "in_progress"))

    def opened(self) -> list[dict[str, Any]]:
        where = {"item_id": self.id, "output_index": self.index, "content_index": 0}
        return [
            self.stream.event(
                "response.output_item.added",
                output_index=self.index,
                item=message_item(self.id, None, "in_progress"),
            ),
            self.stream.event("response.content_part.added", **where, part=text_part("")),
        ]

    def delta(self, text: str) -> dict[str, Any]:
        self.text += text
        self.stream.draft.output[self.index] = message_item(self.id, self.text, "in_progress")
        where = {"item_id": self.id, "output_index": self.index, "content_index": 0}
        return self.stream.event("response.output_text.delta", **where, delta=text, logprobs=[])

    def closed(self, status: str) -> list[dict[str, Any]]:
        item = message_item(self.id, self.text, status)
        self.stream.draft.output[self.index] = item
        where = {"item_id": self.id, "output_index": self.index, "content_index": 0}
        return [
            self.stream.event("response.output_text.done", **where, text=self.text, logprobs=[]),
            self.stream.event("response.content_part.done", **where, part=text_part(self.text)),
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
    """The response's output items as the model writes them: text goes to an assistant
    message, each tool call to its own function_call item. Items come one after another,
    as OpenAI streams them: opening one closes the one before."""

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream
        self.open: MessageEvents | CallEvents | None = None
        self.calls: dict[int, CallEvents] = {}  # by the parser's call index

    def text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if not isinstance(self.open, MessageEvents):
            events += self._close("completed")
            self.open = MessageEvents(self.stream)
            events += self.open.opened()
        events.append(self.open.delta(text))
        return events

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

    def finish(self) -> list[dict[str, Any]]:
        """The generation ended (the draft holds how): the last item closes with the
        response's status; an output with nothing in it is one empty message."""
        events = []
        if not self.stream.draft.output:
            self.open = MessageEvents(self.stream)
            events += self.open.opened()
        return events + self._close(self.stream.draft.item_status())

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        events = self.open.closed(status)
        self.open = None
        return events
