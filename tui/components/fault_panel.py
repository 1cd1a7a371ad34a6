"""FaultPanel: faults and recoveries by kind, and the latest of them with the worker, box
and requests each touched. Hidden until the appliance reports its first fault (a box
joining is an event of the panel's, but no fault: a first join alone leaves it hidden)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Static

from appliance.admin.schema import Event, Snapshot
from tui.format import clock

LINES_SHOWN = 8
"""Fault events listed, newest last."""
REQUESTS_SHOWN = 6
"""Request ids listed per event; more are counted."""
NOT_FAULTS = frozenset({"box_joined"})
"""Event kinds the panel lists that are no fault by themselves (a box joining)."""


def counts_line(faults: dict[str, int]) -> str:
    """'box_lost 1 · rerun 7 · worker_exit 1' (kinds that happened, by name)."""
    return " · ".join(f"{kind} {count}" for kind, count in sorted(faults.items()) if count)


def fault_line(event: Event) -> Content:
    """One fault event: time, kind, where, cause, requests."""
    where = [f"worker {event.worker}"] if event.worker is not None else []
    where += [f"box {event.box}"] if event.box else []
    ids = ", ".join(str(r) for r in event.requests[:REQUESTS_SHOWN])
    more = len(event.requests) - REQUESTS_SHOWN
    ids += f" +{more}" if more > 0 else ""
    return Content.assemble(
        (clock(event.at), "$text-muted"),
        "  ",
        (f"{event.fault or '':<14}", "$text-warning"),
        " ",
        " ".join(where) + (": " if where else ""),
        event.cause or event.message,
        (f"  [requests {ids}]" if ids else "", "$text-muted"),
    )


class FaultPanel(Vertical):
    """Fault counts (`#fault-counts`) above the latest fault events (`#fault-lines`);
    id `faults`. Shown once a snapshot reports a fault (the console knows only the admin
    API: Snapshot.faults and Snapshot.fault_events)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Faults"
        self.display = False

    def compose(self) -> ComposeResult:
        yield Static("", id="fault-counts")
        yield Static("", id="fault-lines")

    def show(self, snapshot: Snapshot) -> None:
        """Show the snapshot's fault counts and latest fault events."""
        self.display = any(n for kind, n in snapshot.faults.items() if kind not in NOT_FAULTS)
        if not self.display:
            return
        self.query_one("#fault-counts", Static).update(counts_line(snapshot.faults))
        lines = [fault_line(e) for e in snapshot.fault_events[-LINES_SHOWN:]]
        self.query_one("#fault-lines", Static).update(Content("\n").join(lines))
