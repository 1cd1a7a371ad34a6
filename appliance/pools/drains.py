"""Waiting for a worker to drain: routing skips it, and whoever moves its device waits
until no request needs it any more (running there, or parked in its KV blocks).

Event-driven: the supervisor (and the request flow, when a consumer leaves) calls
`check` after anything that can end a request's need for a worker (a worker's message, a
lost worker, a consumer leaving). The request table says which requests still need it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from appliance.core.request_table import RequestTable

Progress = Callable[[int], None]  # told how many requests still need the worker


class Drains:
    """The drains in progress: worker id -> (set once idle, its progress callback)."""

    def __init__(self, table: RequestTable) -> None:
        self._table = table
        self._waits: dict[int, tuple[asyncio.Event, Progress]] = {}

    def start(self, worker_id: int, progress: Progress) -> asyncio.Event:
        """Watch a worker that routing now skips; the event is set once it is idle."""
        idle = asyncio.Event()
        self._waits[worker_id] = (idle, progress)
        self.check()
        return idle

    async def wait(self, worker_id: int, idle: asyncio.Event, timeout: float) -> bool:
        """Whether the worker went idle within `timeout`."""
        try:
            async with asyncio.timeout(timeout):  # not wait_for: see request_flow.next_item
                await idle.wait()
        except TimeoutError:
            return False
        finally:
            self._waits.pop(worker_id, None)
        return True

    def check(self) -> None:
        """Tell each drain how many requests still need its worker; wake the idle ones."""
        for worker_id, (idle, progress) in self._waits.items():
            remaining = len(self._table.held_by(worker_id))  # running there, or parked
            progress(remaining)
            if remaining == 0:
                idle.set()
