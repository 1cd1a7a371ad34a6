"""StatusLine: the top line: model, mode, readiness, admission; the connection on the right."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.markup import escape
from textual.widgets import Static

from appliance.admin.schema import Snapshot
from tui.format import clock


def appliance_markup(snapshot: Snapshot | None) -> str:
    """Model, mode, ready, admission, requests in flight and the snapshot's time."""
    if snapshot is None:
        return "[$text-muted]no state yet[/]"
    admission = (
        "[$success]open[/]" if snapshot.tuning.admission == "open" else "[$warning]paused[/]"
    )
    return " · ".join(
        [
            f"[b]{escape(snapshot.model)}[/]",
            snapshot.mode,
            "[$success]ready[/]" if snapshot.ready else "[$warning]not ready[/]",
            f"admission {admission}",
            f"{snapshot.requests_in_flight} in flight",
            f"as of {clock(snapshot.at)}",
        ]
    )


def connection_markup(connected: bool, detail: str) -> str:
    """● connected, or the reason it is not."""
    if connected:
        return "[$success]● connected[/]"
    return f"[$error]● {escape(detail)}[/]"


class StatusLine(Horizontal):
    """The appliance's state (`#status-appliance`) and, right-aligned so it never gets
    cut off, the connection's (`#status-connection`); id `status`."""

    def compose(self) -> ComposeResult:
        """The two halves."""
        yield Static(appliance_markup(None), id="status-appliance")
        yield Static("", id="status-connection")

    def show(self, snapshot: Snapshot | None, connected: bool, detail: str) -> None:
        """Redraw for the last snapshot and the connection's state."""
        self.query_one("#status-appliance", Static).update(appliance_markup(snapshot))
        self.query_one("#status-connection", Static).update(connection_markup(connected, detail))
