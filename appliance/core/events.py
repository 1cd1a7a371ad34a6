"""What the appliance did that an operator wants to see: moves, tuning, workers, admission.

Kept for the admin API (`/admin/events`, the console) and written to the log.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Literal

from pydantic import BaseModel

EventKind = Literal["move", "tuning", "worker", "admission", "planner", "box"]

MAX_EVENTS = 200  # events kept for the admin API

log = logging.getLogger("appliance.supervisor")


class Event(BaseModel):
    """Something the appliance did or saw, in the order it happened."""

    seq: int
    at: float
    kind: EventKind
    message: str


class EventLog:
    """The last MAX_EVENTS events, numbered from 1."""

    def __init__(self, kept: int = MAX_EVENTS) -> None:
        self.events: deque[Event] = deque(maxlen=kept)  # oldest first
        self._ids = itertools.count(1)

    def note(self, kind: EventKind, message: str) -> Event:
        """Record an event (and log it)."""
        event = Event(seq=next(self._ids), at=time.time(), kind=kind, message=message)
        self.events.append(event)
        log.info("%s", message)
        return event
