"""The spans one worker makes for its requests: "prefill" (a prefill worker: the prompt to
its first token, its KV parked), "generate" (a colocated worker: prompt and decoding),
"handoff" (a decode worker: the parked KV copied in) and "decode" (a decode worker: every
decode step of the request, one span with the step and token counts as attributes, not a
span per step). Each is a child of the supervisor's span for the request, whose
traceparent the worker message carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance.tracing.spans import Attributes, end_span, start_span


@dataclass
class OpenSpan:
    """A request's span on this worker, and what it has counted."""

    span: Any
    parent: str  # the supervisor's span (a traceparent), for the span after this one
    steps: int = 0  # model steps that gave the request tokens
    tokens: int = 0


class WorkerSpans:
    """The open span of each traced request on one worker (request ids: the supervisor's
    wire ids)."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.open: dict[int, OpenSpan] = {}

    def begin(
        self, request_id: int, name: str, parent: str, attributes: Attributes | None = None
    ) -> None:
        """Open `name` under `parent` ("": the request is not traced, nothing is made),
        ending the request's span before it here, if any."""
        self.end(request_id)
        if not parent:
            return
        base = {"appliance.request.wire_id": request_id, "appliance.worker": self.worker_id}
        span = start_span(name, parent, {**base, **(attributes or {})})
        if span is not None:
            self.open[request_id] = OpenSpan(span, parent)

    def stepped(self, request_id: int, tokens: int) -> None:
        """A step gave the request `tokens` tokens."""
        if (opened := self.open.get(request_id)) is not None:
            opened.steps += 1
            opened.tokens += tokens

    def end(
        self, request_id: int, error: str | None = None, attributes: Attributes | None = None
    ) -> str:
        """End the request's span here (an error status where `error` says one); its parent
        ("" where none was open)."""
        opened = self.open.pop(request_id, None)
        if opened is None:
            return ""
        counts = {"appliance.steps": opened.steps, "gen_ai.usage.output_tokens": opened.tokens}
        end_span(opened.span, error, {**counts, **(attributes or {})})
        return opened.parent

    def landed(self, request_id: int, bytes_moved: int) -> None:
        """A handoff's blocks landed: its "handoff" span ends, its "decode" span starts."""
        parent = self.end(request_id, attributes={"appliance.handoff.bytes": bytes_moved})
        self.begin(request_id, "decode", parent)

    def close(self) -> None:
        """End every open span (the worker stops): they say so."""
        for request_id in list(self.open):
            self.end(request_id, error="the worker stopped")
