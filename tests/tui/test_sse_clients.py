"""The console (/admin/events) and the bench (/v1 streams) read Server-Sent Events through
one parser, httpx-sse's: comments, event names, `id` and `retry` fields, data over several
lines, CRLF line ends, a stream cut into chunks anywhere (inside a line, between CR and
LF, inside a UTF-8 character), and a reply that is no event stream."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from tests_root import DATA

from appliance.admin.schema import Event, Snapshot
from appliance.bench.client import send
from appliance.bench.workloads import RequestSpec
from appliance.core.goodput import RequestResult
from tui.client import AdminClient

STATE = DATA / "console_state.json"
CHUNKS = [1, 2, 3, 7, 64, 1 << 20]


def answering(body: bytes, size: int, seen: list[httpx.Request], kind: str) -> httpx.MockTransport:
    """A server that answers with `body` in chunks of `size` bytes, as `kind`."""

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), size):
            yield body[start : start + size]

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"content-type": kind}, content=chunks())

    return httpx.MockTransport(answer)


# --- the bench ---------------------------------------------------------------------------

COMPLETION = (
    ": a comment, then a named message whose JSON spans two data lines\r\n"
    "event: completion\r\n"
    'data: {"choices": [{"text": " é"}],\r\n'
    'data:  "usage": null}\r\n'
    "\r\n"
    "id: 7\n"
    'data: {"choices": [{"text": " b"}]}\n'
    "\n"
    "\n"  # an empty message (httpx-sse yields one after an `id`): skipped
    "retry: 1000\n"
    'data:{"choices": [], "usage": {"completion_tokens": 2}}\n'
    "\n"
    "data: [DONE]\n"
    "\n"
).encode()


def bench_send(transport: httpx.MockTransport) -> RequestResult:
    async def main() -> RequestResult:
        async with httpx.AsyncClient(transport=transport, base_url="http://peer") as client:
            spec = RequestSpec("hi", 1, 4)
            return await send(client, "m", spec, {}, 0.0, lambda text: 99)

    return asyncio.run(main())


@pytest.mark.parametrize("size", CHUNKS)
def test_the_bench_reads_a_stream_cut_anywhere(size: int) -> None:
    seen: list[httpx.Request] = []
    result = bench_send(answering(COMPLETION, size, seen, "text/event-stream; charset=utf-8"))
    assert result.ok, result.error
    assert result.output_tokens == 2  # the stream's usage, not the text counted
    assert len(result.itl) == 1  # two pieces of text: " é" and " b"
    assert seen[0].headers["accept"] == "text/event-stream"


def test_a_stream_cut_before_its_last_blank_line_has_no_done() -> None:
    """A message the stream ends inside is not one (the spec drops it)."""
    body = b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]'
    result = bench_send(answering(body, 5, [], "text/event-stream"))
    assert not result.ok and result.error == "the stream ended without [DONE]"


def test_a_reply_that_is_no_event_stream_is_a_failed_request() -> None:
    body = json.dumps({"choices": [{"text": "x"}]}).encode()
    result = bench_send(answering(body, 1 << 20, [], "application/json"))
    assert not result.ok
    assert result.error is not None and "text/event-stream" in result.error


# --- the console -------------------------------------------------------------------------


def admin_stream() -> bytes:
    first, second = (
        {"seq": seq, "at": 1733140620.0 + seq, "kind": "worker", "message": f"worker {seq} up"}
        for seq in (1, 2)
    )
    # the snapshot as the file holds it, over many lines: one data line each
    state = "".join(f"data: {line}\r\n" for line in STATE.read_text().splitlines())
    return (
        ": ping\r\n"
        "\r\n"
        "event: state\r\n" + state + "\r\n"
        "event: unknown\n"
        "data: {}\n"
        "\n"
        "id: 3\n"
        "event: event\n"
        f"data: {json.dumps(first)}\n"
        "\n"
        "\n"
        "retry: 1000\n"
        "event: event\n"
        f"data:{json.dumps(second)}\n"
        "\n"
        "event: state\n"  # a message without data: none
        "\n"
    ).encode()


def follow(monkeypatch: pytest.MonkeyPatch, transport: httpx.MockTransport) -> list[object]:
    """What AdminClient.events() yields from `transport`, until the stream ends."""
    monkeypatch.setattr(
        "tui.client.httpx.AsyncClient", functools.partial(httpx.AsyncClient, transport=transport)
    )

    async def main() -> list[object]:
        client = AdminClient("http://appliance", "token")
        try:
            return [item async for item in client.events()]
        finally:
            await client.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize("size", CHUNKS)
def test_the_console_reads_a_stream_cut_anywhere(
    monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    seen: list[httpx.Request] = []
    items = follow(monkeypatch, answering(admin_stream(), size, seen, "text/event-stream"))
    assert items == [
        Snapshot.model_validate_json(STATE.read_text()),
        Event(seq=1, at=1733140621.0, kind="worker", message="worker 1 up"),
        Event(seq=2, at=1733140622.0, kind="worker", message="worker 2 up"),
    ]
    assert seen[0].url.path == "/admin/events"
    assert seen[0].headers["authorization"] == "Bearer token"
    assert seen[0].headers["accept"] == "text/event-stream"


def test_the_console_takes_a_reply_that_is_no_event_stream_for_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An httpx.HTTPError, which the console's follower answers by reconnecting."""
    with pytest.raises(httpx.HTTPError, match="text/event-stream"):
        follow(monkeypatch, answering(b"<html>a proxy</html>", 8, [], "text/html"))
