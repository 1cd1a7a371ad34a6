"""The tracing parts in one process (appliance/tracing/): the spans a worker makes for a
request, the fault span, the root span of an HTTP request continuing a caller's
`traceparent`, all read from the OpenTelemetry SDK's in-memory exporter; and that with
tracing off nothing of OpenTelemetry is imported. The spans across real processes are
tests/server/test_tracing.py's."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from appliance.settings.tracing import TracingSettings
from appliance.tracing.http_spans import RequestSpans
from appliance.tracing.spans import (
    FAULT_KIND,
    add_to,
    annotate,
    current_traceparent,
    end_span,
    fault_span,
    start_span,
    traceparent_of,
)
from appliance.tracing.worker_spans import WorkerSpans

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def provider() -> TracerProvider:
    """This test process's global tracer provider (settable once per process)."""
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    made = TracerProvider()
    trace.set_tracer_provider(made)
    return made


@pytest.fixture
def exported(provider: TracerProvider) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    yield exporter
    processor.shutdown()  # exports nothing more


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    spans = exporter.get_finished_spans()
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def test_a_handed_off_request_has_prefill_handoff_and_decode_spans_under_one_parent(
    exported: InMemorySpanExporter,
) -> None:
    root = start_span("supervisor", "")
    parent = traceparent_of(root)
    prefill, decode = WorkerSpans(0), WorkerSpans(1)
    prefill.begin(7, "prefill", parent, {"gen_ai.usage.input_tokens": 12})
    prefill.stepped(7, 1)
    prefill.end(7)
    decode.begin(7, "handoff", parent)
    decode.landed(7, 4096)
    for _ in range(5):
        decode.stepped(7, 1)
    decode.end(7)
    end_span(root)
    spans = by_name(exported)
    assert set(spans) == {"supervisor", "prefill", "handoff", "decode"}
    supervisor = spans["supervisor"].context
    for name in ("prefill", "handoff", "decode"):
        span = spans[name]
        assert span.context.trace_id == supervisor.trace_id, name
        assert span.parent is not None and span.parent.span_id == supervisor.span_id, name
        assert span.attributes["appliance.request.wire_id"] == 7
    assert spans["prefill"].attributes["appliance.worker"] == 0
    assert spans["handoff"].attributes["appliance.handoff.bytes"] == 4096
    assert spans["decode"].attributes["appliance.steps"] == 5
    assert spans["decode"].attributes["gen_ai.usage.output_tokens"] == 5
    assert spans["decode"].attributes["appliance.worker"] == 1


def test_an_untraced_request_makes_no_worker_span(exported: InMemorySpanExporter) -> None:
    spans = WorkerSpans(0)
    spans.begin(3, "prefill", "")
    spans.stepped(3, 1)
    assert spans.end(3) == ""
    assert exported.get_finished_spans() == ()


def test_a_fault_is_an_error_span_naming_its_kind(exported: InMemorySpanExporter) -> None:
    root = start_span("supervisor", "")
    fault_span(traceparent_of(root), "rerun", "worker 3 exited (exit code -9)")
    end_span(root)
    fault = by_name(exported)["fault rerun"]
    assert fault.status.status_code is StatusCode.ERROR
    assert fault.status.description == "worker 3 exited (exit code -9)"
    assert fault.attributes[FAULT_KIND] == "rerun"
    assert fault.parent is not None
    assert fault.parent.span_id == by_name(exported)["supervisor"].context.span_id


def test_a_stopping_worker_ends_its_open_spans_as_errors(exported: InMemorySpanExporter) -> None:
    root = start_span("supervisor", "")
    spans = WorkerSpans(2)
    spans.begin(1, "decode", traceparent_of(root))
    spans.close()
    [decode] = exported.get_finished_spans()
    assert decode.status.status_code is StatusCode.ERROR


def test_the_http_root_span_continues_the_callers_trace(exported: InMemorySpanExporter) -> None:
    seen: list[str] = []

    async def completions(request: Request) -> JSONResponse:
        seen.append(current_traceparent())  # what the supervisor's span hangs under
        annotate({"gen_ai.request.model": "m"})
        add_to("gen_ai.usage.output_tokens", 3)
        add_to("gen_ai.usage.output_tokens", 4)  # a second choice
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    with TestClient(RequestSpans(app)) as client:
        header = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
        assert client.post("/v1/completions", headers={"traceparent": header}).status_code == 201
        assert client.post("/v1/completions").status_code == 201  # a trace of its own
    first, second = exported.get_finished_spans()
    assert first.name == "POST /v1/completions" and first.kind is trace.SpanKind.SERVER
    assert f"{first.context.trace_id:032x}" == CALLER_TRACE
    assert first.parent is not None and f"{first.parent.span_id:016x}" == CALLER_SPAN
    assert seen[0] == traceparent_of(first)
    assert first.attributes["http.response.status_code"] == 201
    assert first.attributes["gen_ai.request.model"] == "m"
    assert first.attributes["gen_ai.usage.output_tokens"] == 7
    assert f"{second.context.trace_id:032x}" != CALLER_TRACE and second.parent is None


def test_the_endpoint_setting_must_be_an_http_url() -> None:
    assert not TracingSettings().enabled
    assert TracingSettings(otlp_traces_endpoint="").otlp_traces_endpoint is None
    with pytest.raises(ValidationError, match="otlp_traces_endpoint"):
        TracingSettings(otlp_traces_endpoint="collector:4317")


@pytest.mark.process  # a fresh interpreter, importing the server, supervisor and worker
def test_with_tracing_off_nothing_of_opentelemetry_is_imported() -> None:
    code = (
        "import sys\n"
        "import appliance.server.app, appliance.pools.request_flow, appliance.workers.worker\n"
        "from appliance.tracing.exporting import start_exporting\n"
        "from appliance.tracing.spans import start_span, current_traceparent\n"
        "from appliance.settings.tracing import TracingSettings\n"
        "assert start_exporting(TracingSettings(), 'server') is None\n"
        "assert start_span('x', '') is None and current_traceparent() == ''\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
