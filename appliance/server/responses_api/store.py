"""The responses the server keeps, for `previous_response_id` and GET/DELETE
/v1/responses/{id}: OpenAI's conversation state, as its docs teach it ("pass the
previous response's id, the model sees that conversation"). In memory, the newest
`server.responses_kept` (the oldest go first), lost on restart; a response asked with
`store: false` is not kept. Each keeps its response object and the conversation it
ended: the input items it was asked with (the earlier turns included) and its output."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from appliance.server.errors import APIError


@dataclass(frozen=True)
class Kept:
    """A kept response, and the items a request that continues it starts from."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """The newest `limit` responses by id (0: none is kept)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kept: OrderedDict[str, Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep a finished response: `items`, the input items it answered (earlier turns
        first), then its output items."""
        if self.limit == 0:
            return
        conversation = [*items, *response["output"]]
        self._kept[response["id"]] = Kept(response, conversation)
        while len(self._kept) > self.limit:
            self._kept.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Kept:
        """The kept response; a 404 naming it where there is none (`param`: the field that
        named it, then a 400 as OpenAI answers an unknown previous_response_id)."""
        kept = self._kept.get(response_id)
        if kept is None:
            status = 404 if param is None else 400
            message = f"Response with id '{response_id}' not found.{self._why_none()}"
            raise APIError(status, message, param, "response_not_found")
        return kept

    def delete(self, response_id: str) -> None:
        """Forget it (a 404 where there is none)."""
        self.get(response_id)
        del self._kept[response_id]

    def _why_none(self) -> str:
        if self.limit == 0:
            return " This server keeps no responses (server.responses_kept is 0)."
        return (
            f" This server keeps the newest {self.limit} in memory, until it restarts, "
            "and none asked with store: false."
        )


def continued(body: dict[str, Any], store: ResponseStore) -> dict[str, Any]:
    """The body of a request that names a previous_response_id with that response's
    conversation before its own input (as OpenAI reads it; its `instructions` are the new
    request's alone). Unchanged without one, or where the input is no text or items (the
    validation names it)."""
    previous = body.get("previous_response_id")
    if previous is None:
        return body
    if not isinstance(previous, str):
        raise APIError(400, "previous_response_id is a response's id", "previous_response_id")
    kept = store.get(previous, "previous_response_id")
    items = input_items(body.get("input"))
    return body if items is None else body | {"input": [*kept.conversation, *items]}


def input_items(value: Any) -> list[dict[str, Any]] | None:
    """A request's input as items (a text is one user message); None for neither."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value if isinstance(value, list) else None


async def keeping(
    events: AsyncIterator[dict[str, Any]], store: ResponseStore, items: list[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    """The events as they are; a response that completed (or ended incomplete) is kept
    with `items`, the input it answered, as it closes."""
    async with aclosing(events) as each:  # type: ignore[type-var]
        async for event in each:
            if event["type"] in ("response.completed", "response.incomplete"):
                store.keep(event["response"], items)
            yield event
