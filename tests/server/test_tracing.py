"""One request traced across processes: a real split appliance (`appliance serve`, a
prefill and a decode CPU worker) exporting its spans over OTLP/HTTP to a tiny collector in
this test on loopback (each process exports its own: the SDK's in-memory exporter would
see only the process it runs in). A completion sent with a caller's `traceparent` makes
one trace: the server's root span under the caller's, the supervisor's span under it, and
under that the prefill worker's "prefill", the decode worker's "handoff" and "decode",
each exported by the process that ran it. Then a decode worker killed while it holds
requests: each request it held shows a "fault rerun" span with an error status, under the
supervisor span of a request the `rerun` fault event names."""

from __future__ import annotations

import asyncio
import gzip
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from server_process import ServerProcess, admin_split_server, wait_until
from worker_faults import json_events, settled_requests, stop_holding_requests, stream

from appliance.model.model_source import model_name

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
MAX_TOKENS = 8
STREAMS = 6
STREAM_TOKENS = 48
BOUND_S = 300.0
OUT = "gen_ai.usage.output_tokens"


@dataclass
class Span:
    """One exported span, as the collector received it."""

    name: str
    instance: str  # the exporting process's service.instance.id ("server", "worker 1")
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object]
    error: str | None  # the status's description when its code is ERROR


class Collector:
    """An OTLP/HTTP traces receiver on loopback: POST /v1/traces, protobuf bodies."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                collector.receive(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def receive(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    attributes = {a.key: value_of(a.value) for a in s.attributes}
                    error = s.status.message if s.status.code == 2 else None  # STATUS_CODE_ERROR
                    span = Span(
                        s.name,
                        resource.get("service.instance.id", ""),
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        attributes,
                        error,
                    )
                    with self.lock:
                        self.spans.append(span)

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def named(self, name: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.name == name]


def value_of(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    running = Collector()
    yield running
    running.server.shutdown()


@pytest.fixture(scope="module")
def traced_server(
    tmp_path_factory: pytest.TempPathFactory, collector: Collector
) -> Iterator[ServerProcess]:
    """Its own split server, tracing to the collector (its batches sent every 0.2 s); the
    second test kills its decode worker."""
    folder = tmp_path_factory.mktemp("tracing")
    process = admin_split_server(
        folder,
        2,
        APPLIANCE_TRACING__OTLP_TRACES_ENDPOINT=collector.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="200",
    )
    process.start(timeout=BOUND_S)  # three processes load the model: slow on a busy box
    yield process
    process.stop()


def completion(url: str, prompt: str, max_tokens: int, headers: dict[str, str]) -> dict:
    body = {"model": model_name(None), "prompt": prompt, "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True}
    reply = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=BOUND_S)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_requests_spans_form_one_trace_across_the_server_and_both_workers(
    traced_server: ServerProcess, collector: Collector
) -> None:
    header = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
    reply = completion(traced_server.url, "The lighthouse keeper wrote", MAX_TOKENS, header)

    def whole_trace() -> dict[str, Span] | None:
        spans = {s.name: s for s in collector.trace(CALLER_TRACE)}
        wanted = {"POST /v1/completions", "supervisor", "prefill", "handoff", "decode"}
        return spans if wanted <= spans.keys() else None

    spans = wait_until(whole_trace, 60, "the request's five spans at the collector")
    root, supervisor = spans["POST /v1/completions"], spans["supervisor"]
    assert root.parent_id == CALLER_SPAN and root.instance == "server"
    assert root.attributes["gen_ai.response.id"] == reply["id"]
    assert root.attributes["gen_ai.request.model"] == model_name(None)
    assert root.attributes["gen_ai.usage.input_tokens"] == reply["usage"]["prompt_tokens"]
    assert root.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert root.attributes["http.response.status_code"] == 200
    assert supervisor.parent_id == root.span_id and supervisor.instance == "server"
    prefill, handoff, decode = spans["prefill"], spans["handoff"], spans["decode"]
    for child in (prefill, handoff, decode):
        assert child.parent_id == supervisor.span_id, child
        assert child.error is None, child
    # Each worker's spans come from its own process.
    assert prefill.instance.startswith("worker ") and decode.instance.startswith("worker ")
    assert prefill.instance != decode.instance and handoff.instance == decode.instance
    assert prefill.attributes["gen_ai.usage.input_tokens"] == reply["usage"]["prompt_tokens"]
    assert int(str(handoff.attributes["appliance.handoff.bytes"])) > 0
    # The decode worker's steps: one span for all of them, counted (the prefill made the
    # first token, the decode worker the rest; a step may make several where it speculates).
    made = [prefill.attributes["gen_ai.usage.output_tokens"], decode.attributes[OUT]]
    assert made == [1, MAX_TOKENS - 1], made
    assert 1 <= int(str(decode.attributes["appliance.steps"])) <= MAX_TOKENS - 1
    assert decode.attributes["gen_ai.response.finish_reasons"] == "length"


def test_a_killed_worker_shows_as_an_error_span_and_an_event(
    traced_server: ServerProcess, collector: Collector
) -> None:
    async def scenario() -> set[int]:
        async with httpx.AsyncClient(base_url=traced_server.url, timeout=BOUND_S) as client:
            traffic = asyncio.gather(*(stream(client, n, STREAM_TOKENS) for n in range(STREAMS)))
            worker = await stop_holding_requests(traced_server, 1)  # SIGSTOPped, holding
            held = await settled_requests(traced_server, worker.worker_id)
            os.kill(worker.pid, signal.SIGKILL)
            assert await asyncio.wait_for(traffic, BOUND_S) == [STREAM_TOKENS] * STREAMS
            return held

    held = asyncio.run(scenario())
    assert held
    reruns = {r for e in json_events(traced_server) if e["kind"] == "rerun" for r in e["requests"]}
    assert held <= reruns

    def faults_of_held() -> dict[int, Span] | None:
        found = {}
        for fault in collector.named("fault rerun"):
            for parent in collector.trace(fault.trace_id):  # the supervisor's, once exported
                if parent.span_id == fault.parent_id:
                    found[int(str(parent.attributes["appliance.request_id"]))] = fault
        return found if held <= found.keys() else None

    faults = wait_until(faults_of_held, 60, "an error span for each request run again")
    for request_id in held:
        fault = faults[request_id]
        assert fault.attributes["appliance.fault.kind"] == "rerun"
        assert fault.error is not None and "exited" in fault.error, fault
