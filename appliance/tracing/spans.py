"""Spans of a request, made through the OpenTelemetry API only where this process has
imported it (start_exporting does, where tracing is on): with tracing off each call here
is a dict lookup and returns at once, and nothing of OpenTelemetry is imported.

Between processes a span travels as its W3C `traceparent` string
("00-<trace id>-<span id>-<flags>"): the HTTP header a caller sends, and the `trace`
field of the worker messages; "" means the request is not traced."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

AttributeValue = str | int | float | bool
Attributes = Mapping[str, AttributeValue]
TRACER = "appliance"
FAULT_KIND = "appliance.fault.kind"  # the fault event's kind (appliance/core/events.py)


def _api() -> ModuleType | None:
    """opentelemetry.trace where this process has imported it, else None (tracing off)."""
    return sys.modules.get("opentelemetry.trace")


def _parent_context(api: ModuleType, traceparent: str) -> Any:
    """The context a span continues from `traceparent` (None: a trace of its own)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def traceparent_of(span: Any) -> str:
    """`span`'s W3C traceparent ("" for no span or an invalid one)."""
    if span is None:
        return ""
    context = span.get_span_context()
    if not context.is_valid:
        return ""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def current_traceparent() -> str:
    """The traceparent of the span current in this task (the HTTP request's), or ""."""
    api = _api()
    return "" if api is None else traceparent_of(api.get_current_span())


def start_span(name: str, parent: str, attributes: Attributes | None = None) -> Any:
    """A span under `parent` (a traceparent; "" starts a trace), not made current; None
    when tracing is off. End it with end_span."""
    api = _api()
    if api is None:
        return None
    tracer = api.get_tracer(TRACER)
    return tracer.start_span(name, context=_parent_context(api, parent), attributes=attributes)


def end_span(span: Any, error: str | None = None, attributes: Attributes | None = None) -> None:
    """End `span` (None: nothing), with an error status saying `error` where one is given."""
    api = _api()
    if span is None or api is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        span.set_status(api.Status(api.StatusCode.ERROR, error))
    span.end()


def fault_span(parent: str, kind: str, cause: str, attributes: Attributes | None = None) -> None:
    """A span of its own under `parent` for a fault that touched the request: its status
    an error saying `cause`, its `appliance.fault.kind` the fault event's kind."""
    if not parent:
        return
    span = start_span(f"fault {kind}", parent, {FAULT_KIND: kind, **(attributes or {})})
    end_span(span, error=cause)


def annotate(attributes: Attributes) -> None:
    """Set attributes on the span current in this task (the HTTP request's)."""
    api = _api()
    if api is None:
        return
    span = api.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)


def add_to(name: str, count: int) -> None:
    """Add `count` to an integer attribute of the current span (tokens over choices)."""
    api = _api()
    if api is None:
        return
    span = api.get_current_span()
    if span.is_recording():
        before = getattr(span, "attributes", None) or {}
        span.set_attribute(name, int(before.get(name, 0)) + count)


def fail_current(error: str) -> None:
    """Mark the current span (the HTTP request's) failed, saying why."""
    api = _api()
    if api is not None:
        api.get_current_span().set_status(api.Status(api.StatusCode.ERROR, error))


@contextmanager
def server_span(name: str, traceparent: str, attributes: Attributes) -> Iterator[Any]:
    """A SERVER span made current for the `with` block (the tasks it starts inherit it),
    continuing the caller's trace where `traceparent` is a valid header value."""
    api = _api()
    if api is None:
        yield None
        return
    from opentelemetry import context

    tracer = api.get_tracer(TRACER)
    span = tracer.start_span(
        name,
        context=_parent_context(api, traceparent),
        kind=api.SpanKind.SERVER,
        attributes=attributes,
    )
    token = context.attach(api.set_span_in_context(span))
    try:
        yield span
    finally:
        context.detach(token)
        span.end()
