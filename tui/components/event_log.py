"""EventLog: the running move's progress above a log of the appliance's recent events."""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.markup import escape
from textual.widgets import Static

from appliance.admin.schema import Event, Move, Snapshot
from tui.format import clock

MAX_LINES = 200
"""Events kept in the log; older ones are dropped."""

_KIND_STYLE = {
    "move": "$text-accent",
    "tuning": "$text-success",
    "worker": "$text-primary",
    "admission": "$text-warning",
}
_RUNNING = ("draining", "stopping", "starting")


def move_summary(snapshot: Snapshot) -> str:
    """A line on the running move, or else on the last finished one."""
    if not snapshot.moves:
        return "No pool moves yet."
    running = [move for move in snapshot.moves if move.phase in _RUNNING]
    names = {device.index: device.name for device in snapshot.devices}
    if running:
        move = running[-1]
        return (
            f"[b]Moving[/] {_route(move, names)} · [b]{move.phase}[/] · "
            f"{move.remaining} request{'s' * (move.remaining != 1)} left · "
            f"{snapshot.at - move.started_at:.0f} s so far"
        )
    move = max(snapshot.moves, key=lambda m: m.move_id)
    ended = f" at {clock(move.finished_at)}" if move.finished_at is not None else ""
    error = f": {escape(move.error)}" if move.error else ""
    return f"Last move: {_route(move, names)} · {move.phase}{ended}{error}"


def _route(move: Move, names: dict[int, str]) -> str:
    name = escape(names.get(move.device, f"device {move.device}"))
    return f"#{move.move_id} {name} {move.from_role} → {move.to_role}"


def event_line(event: Event) -> Content:
    """An event as one log line: time, kind, message."""
    return Content.assemble(
        (clock(event.at), "$text-muted"),
        "  ",
        (f"{event.kind:<9}", _KIND_STYLE.get(event.kind, "")),
        " ",
        event.message,
    )


class EventLog(Vertical):
    """The move line (`#move-progress`) and the event log (`#event-lines`, newest last);
    id `events`.

    Events come both in snapshots (the recent ones) and one by one off the stream; each
    is logged once, by its `seq`. The log is redrawn whole (a couple of hundred short
    lines) so it wraps to the panel's current width.
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Events"
        self.last_seq = -1
        """The highest event seq logged."""
        self.lines: deque[Content] = deque(maxlen=MAX_LINES)
        self._resync = False

    def compose(self) -> ComposeResult:
        """The move line above the log."""
        yield Static("No pool moves yet.", id="move-progress")
        with VerticalScroll(id="event-lines"):
            yield Static("", id="event-text")

    def show(self, snapshot: Snapshot) -> None:
        """Show the move line and log any of `snapshot.events` not yet logged."""
        self.query_one("#move-progress", Static).update(move_summary(snapshot))
        if self._resync and snapshot.events:
            self._resync = False
            if snapshot.events[-1].seq < self.last_seq:
                # the appliance restarted while we were away and numbers events afresh
                self.last_seq = -1
        for event in snapshot.events:
            self.add(event)

    def resync(self) -> None:
        """The stream reopened: if the next snapshot's events are numbered below the
        logged ones, the appliance restarted, so take its numbering afresh."""
        self._resync = True

    def add(self, event: Event) -> None:
        """Log `event` unless it is already logged."""
        if event.seq <= self.last_seq:
            return
        self.last_seq = event.seq
        self.lines.append(event_line(event))
        self.query_one("#event-text", Static).update(Content("\n").join(self.lines))
        scroll = self.query_one("#event-lines", VerticalScroll)
        scroll.call_after_refresh(scroll.scroll_end, animate=False)
