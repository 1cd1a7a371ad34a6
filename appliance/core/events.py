"""What the appliance did that an operator wants to see: moves, tuning, workers, admission,
and each fault and recovery.

Kept for the admin API (`/admin/events`, the console) and written to the log. An event that
records a fault or a recovery (a worker that exited, stalled, was killed or restarted, a box
lost or joined, a request run again or failed by a fault) carries `fault` and the worker,
box, cause and request ids it touched; it is also written as one JSON object per line to the
`appliance.events` logger, for an operator's tools, and counted by fault kind (`/metrics`).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import Literal, get_args

from pydantic import BaseModel, Field

EventKind = Literal["move", "tuning", "worker", "admission", "planner", "box"]
FaultKind = Literal[
    "worker_exit",  # a worker's process exited while serving (a crash, a kill, a lost box)
    "stall",  # a worker with work reported no step for too long
    "kill",  # the supervisor killed a stalled worker
    "restart",  # a worker came back after an exit
    "box_lost",  # another box's agent is gone (its link ended or its heartbeat stopped)
    "box_joined",  # another box's agent joined (or joined again)
    "rerun",  # a request's attempt was lost and it runs again
    "request_failed",  # a request ended with an error because of a fault
]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)

MAX_EVENTS = 200  # events kept for the admin API
MAX_FAULT_EVENTS = 50  # fault events kept besides, so a busy log of moves cannot push them out

log = logging.getLogger("appliance.supervisor")
json_log = logging.getLogger("appliance.events")  # one JSON object per fault event


class Event(BaseModel):
    """Something the appliance did or saw, in the order it happened."""

    seq: int
    at: float
    kind: EventKind
    message: str
    fault: FaultKind | None = Field(
        None, description="For a fault or a recovery, which one; None for other events."
    )
    worker: int | None = Field(None, description="The worker it concerns, if one.")
    box: str | None = Field(None, description="The box it concerns, if another box's.")
    cause: str | None = Field(None, description="Why it happened, as far as it is known.")
    requests: list[int] = Field(
        default_factory=list, description="The ids of the requests it touched."
    )

    def json_line(self) -> str:
        """The event as one JSON object on one line (what `appliance.events` logs)."""
        record: dict[str, object] = {
            "time": self.at,
            "seq": self.seq,
            "kind": self.fault,
            "event": self.kind,
            "worker": self.worker,
            "box": self.box,
            "cause": self.cause,
            "requests": self.requests,
            "message": self.message,
        }
        return json.dumps(record, separators=(",", ":"))


class EventLog:
    """The last MAX_EVENTS events, numbered from 1; the last MAX_FAULT_EVENTS fault
    events apart from them; and every fault counted by kind."""

    def __init__(self, kept: int = MAX_EVENTS, faults_kept: int = MAX_FAULT_EVENTS) -> None:
        self.events: deque[Event] = deque(maxlen=kept)  # oldest first
        self.faults: deque[Event] = deque(maxlen=faults_kept)  # oldest first
        self.fault_counts: Counter[str] = Counter()  # fault kind -> events since the start
        self._ids = itertools.count(1)

    def note(
        self,
        kind: EventKind,
        message: str,
        *,
        fault: FaultKind | None = None,
        worker: int | None = None,
        box: str | None = None,
        cause: str | None = None,
        requests: Iterable[int] = (),
    ) -> Event:
        """Record an event (and log it); with `fault`, also its JSON line and its count."""
        event = Event(
            seq=next(self._ids),
            at=time.time(),
            kind=kind,
            message=message,
            fault=fault,
            worker=worker,
            box=box or None,
            cause=cause,
            requests=sorted(requests),
        )
        self.events.append(event)
        log.info("%s", message)
        if fault is not None:
            self.faults.append(event)
            self.fault_counts[fault] += 1
            json_log.info("%s", event.json_line())
        return event
