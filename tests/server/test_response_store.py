"""The responses the server keeps (responses_api/store.py), on plain data: the newest
`limit` by id, none at 0; a continued request's input is the kept conversation, then its
own; a finished response is kept with the input it answered as its events close."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from appliance.server.errors import APIError
from appliance.server.responses_api.store import ResponseStore, continued, keeping

HI = [{"type": "message", "role": "user", "content": "Hi"}]


def response(n: int) -> dict[str, Any]:
    text = {"type": "output_text", "text": f"answer {n}"}
    output = [{"type": "message", "role": "assistant", "content": [text]}]
    return {"id": f"resp_{n}", "object": "response", "output": output}


def test_the_newest_are_kept_and_the_oldest_go_first() -> None:
    store = ResponseStore(2)
    for n in range(3):
        store.keep(response(n), HI)
    assert len(store) == 2
    with pytest.raises(APIError, match="resp_0' not found") as gone:
        store.get("resp_0")
    assert gone.value.status == 404 and "newest 2" in gone.value.message
    kept = store.get("resp_2")
    assert kept.response == response(2)
    assert kept.conversation == [*HI, *response(2)["output"]]
    store.delete("resp_2")
    with pytest.raises(APIError):
        store.delete("resp_2")


def test_none_is_kept_at_zero_and_a_request_naming_one_is_told_why() -> None:
    store = ResponseStore(0)
    store.keep(response(1), HI)
    assert len(store) == 0
    body = {"model": "m", "input": "More?", "previous_response_id": "resp_1"}
    with pytest.raises(APIError, match="keeps no responses") as refused:
        continued(body, store)
    assert (refused.value.status, refused.value.param) == (400, "previous_response_id")


def test_a_continued_input_is_the_kept_conversation_then_its_own() -> None:
    store = ResponseStore(4)
    store.keep(response(1), HI)
    body = {"model": "m", "input": "More?", "previous_response_id": "resp_1"}
    more = {"type": "message", "role": "user", "content": "More?"}
    assert continued(body, store)["input"] == [*HI, *response(1)["output"], more]
    assert continued({"model": "m", "input": "x"}, store) == {"model": "m", "input": "x"}
    with pytest.raises(APIError, match="a response's id"):
        continued(body | {"previous_response_id": 7}, store)


def test_a_finished_response_is_kept_as_its_events_close() -> None:
    async def events(status: str) -> AsyncIterator[dict[str, Any]]:
        yield {"type": "response.created", "response": {"id": "resp_9", "output": []}}
        yield {"type": f"response.{status}", "response": response(9)}

    async def run(status: str) -> ResponseStore:
        store = ResponseStore(4)
        async for _ in keeping(events(status), store, HI):
            pass
        return store

    assert len(asyncio.run(run("completed"))) == 1
    assert len(asyncio.run(run("incomplete"))) == 1  # cut at max_output_tokens: kept too
    assert len(asyncio.run(run("failed"))) == 0
