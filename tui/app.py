"""ConsoleApp: the appliance's console. It renders the admin API's snapshots and sends
its pool moves and tuning changes; it decides nothing itself."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

import httpx
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.widgets import Footer

from appliance.admin.schema import DeviceInfo, Event, Snapshot, Tuning
from appliance.admin.token import read_token
from tui.client import AdminClient, AdminError
from tui.components.confirm_move import ConfirmMove
from tui.components.event_log import EventLog
from tui.components.help_screen import HelpScreen
from tui.components.latency_panel import LatencyPanel
from tui.components.pools_view import PoolsView
from tui.components.requests_table import RequestsTable
from tui.components.status_line import StatusLine
from tui.components.tuning_form import TuningForm
from tui.messages import ConnectionChanged, EventArrived, SnapshotArrived

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 5.0
NOT_CONNECTED = "not connected"


def describe_failure(error: Exception) -> str:
    """A short reason for the status line."""
    if isinstance(error, AdminError):
        return str(error)
    if isinstance(error, httpx.HTTPError):
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return f"bad data from the appliance: {type(error).__name__}"


class ConsoleApp(App[None]):
    """The console: pools and devices on top, latency and requests below, events last.

    With a client and `watch`, a worker follows /admin/events and reconnects when the
    stream drops; without, it shows whatever SnapshotArrived messages are posted to it
    (tests do that). Widget ids: `status`, `pools` (cards `device-<index>` in columns
    `pool-<role>`), `latency`, `requests`, `events`.
    """

    # absolute, because Textual resolves a relative CSS_PATH against the module of
    # whichever subclass runs (a test's, say)
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "appliance console"
    ENABLE_COMMAND_PALETTE = False
    AUTO_FOCUS = None  # the first snapshot focuses the first device card
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("m", "move", "Move device"),
        Binding("t", "tune", "Tuning"),
        Binding("p", "toggle_admission", "Pause/resume"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, client: AdminClient | None, *, watch: bool = True) -> None:
        super().__init__()
        self._client = client
        self._watch = watch and client is not None
        self._snapshot: Snapshot | None = None
        self._connected = False
        self._detail = "connecting…" if self._watch else NOT_CONNECTED

    # --- what tests and callers read ------------------------------------------------

    @property
    def client(self) -> AdminClient | None:
        """The admin API client, None when the console runs without one."""
        return self._client

    @property
    def snapshot(self) -> Snapshot | None:
        """The last snapshot shown, None before the first."""
        return self._snapshot

    @property
    def connected(self) -> bool:
        """Whether the event stream is open."""
        return self._connected

    @property
    def connection_detail(self) -> str:
        """Why the console is not connected (or what it is doing), as the status line says."""
        return self._detail

    @property
    def selected_device(self) -> int | None:
        """The index of the selected device (its card has or last had the focus)."""
        return self._pools.selected

    # --- layout ---------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        """Status line, pools, latency | requests, events, key footer."""
        # kept as attributes: `query_one` only searches the top screen, and snapshots
        # keep coming while a dialog is open
        self._status = StatusLine(id="status")
        self._pools = PoolsView(id="pools")
        self._latency = LatencyPanel(id="latency")
        self._requests = RequestsTable(id="requests")
        self._events = EventLog(id="events")
        yield self._status
        yield self._pools
        with Horizontal(id="middle"):
            yield self._latency
            yield self._requests
        yield self._events
        yield Footer()

    def on_mount(self) -> None:
        """Draw the status line and start following the appliance."""
        self._show_status()
        if self._watch:
            self._follow_events()

    async def on_unmount(self) -> None:
        """Close the client's connections on the way out."""
        if self._client is not None:
            await self._client.aclose()

    # --- incoming -------------------------------------------------------------------

    async def on_snapshot_arrived(self, message: SnapshotArrived) -> None:
        """Show a new snapshot in every panel."""
        if not self.is_running:  # shutting down: the panels' children are being removed
            return
        snapshot = message.snapshot
        self._snapshot = snapshot
        await self._pools.show(snapshot)
        self._latency.show(snapshot)
        self._requests.show(snapshot)
        self._events.show(snapshot)
        self._show_status()

    def on_event_arrived(self, message: EventArrived) -> None:
        """Log a new event."""
        if not self.is_running:
            return
        self._events.add(message.event)

    def on_connection_changed(self, message: ConnectionChanged) -> None:
        """Show the connection's state; dim the (last known) data while it is down."""
        if message.connected and not self._connected:
            self._events.resync()
        self._connected = message.connected
        self._detail = message.detail
        for panel in (self._pools, self._latency, self._requests, self._events):
            panel.set_class(not message.connected, "-stale")
        self._show_status()

    def _show_status(self) -> None:
        self._status.show(self._snapshot, self._connected, self._detail)

    @work(exclusive=True, group="events")
    async def _follow_events(self) -> None:
        """Follow /admin/events for good, reconnecting after any failure."""
        assert self._client is not None
        delay = RETRY_FIRST_S
        while True:
            try:
                reason = "the appliance closed the event stream"
                opened = False
                async for item in self._client.events():
                    if not opened:
                        opened, delay = True, RETRY_FIRST_S
                        self.post_message(ConnectionChanged(True, "connected"))
                    self.post_message(_arrival(item))
            # a lost connection, an error status or unreadable data: all mean "retry",
            # and none may take the console down
            except (httpx.HTTPError, AdminError, ValueError) as error:
                reason = describe_failure(error)
            self.post_message(
                ConnectionChanged(False, f"disconnected — retrying in {delay:g} s ({reason})")
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    # --- actions --------------------------------------------------------------------

    def action_help(self) -> None:
        """Show the keys and what the panels show."""
        self.push_screen(HelpScreen())

    def action_move(self) -> None:
        """Ask, then move the selected device to the other pool."""
        if self._client is None:
            self.notify(NOT_CONNECTED, severity="warning")
            return
        device = self._selected_device_info()
        if device is None:
            self.notify("No device selected yet.", severity="warning")
            return
        if device.pool not in ("prefill", "decode"):
            where = "is between pools" if device.pool is None else "is colocated"
            self.notify(f"{device.name} {where}: nothing to move.", severity="warning")
            return
        to = "decode" if device.pool == "prefill" else "prefill"
        worker = device.worker
        requests = worker.waiting + worker.running if worker is not None else 0
        confirm = ConfirmMove(device.name, device.pool, to, requests)

        def answered(go: bool | None) -> None:
            if go:
                self._send_move(device.index, device.name, to)

        self.push_screen(confirm, answered)

    def action_tune(self) -> None:
        """Open the tuning form on the current values."""
        ready = self._ready_to_act()
        if ready is None:
            return
        client, snapshot = ready

        def applied(tuning: Tuning | None) -> None:
            if tuning is not None:
                self.notify(f"Tuning applied: {_tuning_line(tuning)}")

        self.push_screen(TuningForm(snapshot.tuning, client.tune), applied)

    def action_toggle_admission(self) -> None:
        """Pause admission if open, resume it if paused."""
        ready = self._ready_to_act()
        if ready is None:
            return
        _, snapshot = ready
        paused = snapshot.tuning.admission == "paused"
        self._send_admission("open" if paused else "paused")

    def _ready_to_act(self) -> tuple[AdminClient, Snapshot] | None:
        """The client and the state to act on; otherwise say why not (and None)."""
        if self._client is None:
            self.notify(NOT_CONNECTED, severity="warning")
            return None
        if self._snapshot is None:
            self.notify("No state from the appliance yet.", severity="warning")
            return None
        return self._client, self._snapshot

    def _selected_device_info(self) -> DeviceInfo | None:
        index = self.selected_device
        if self._snapshot is None or index is None:
            return None
        return next((d for d in self._snapshot.devices if d.index == index), None)

    @work(group="admin")
    async def _send_move(self, device: int, name: str, to: str) -> None:
        assert self._client is not None
        try:
            move = await self._client.move(device, to)
        except AdminError as error:
            self.notify(error.message, title="Move refused", severity="error")
        except httpx.HTTPError as error:
            self.notify(describe_failure(error), title="Move not sent", severity="error")
        else:
            self.notify(f"Moving {name} to {move.to_role}: {move.phase} (move #{move.move_id}).")

    @work(group="admin")
    async def _send_admission(self, admission: str) -> None:
        assert self._client is not None
        try:
            tuning = await self._client.tune(admission=admission)
        except AdminError as error:
            self.notify(error.message, title="Admission unchanged", severity="error")
        except httpx.HTTPError as error:
            self.notify(describe_failure(error), title="Admission unchanged", severity="error")
        else:
            self.notify(f"Admission {tuning.admission}.")


def _arrival(item: Snapshot | Event) -> SnapshotArrived | EventArrived:
    return SnapshotArrived(item) if isinstance(item, Snapshot) else EventArrived(item)


def _tuning_line(tuning: Tuning) -> str:
    return (
        f"budget {tuning.prefill_token_budget}, chunk {tuning.chunk_size}, "
        f"decode seqs {tuning.decode_max_seqs}, {tuning.routing.replace('_', ' ')}"
    )


def run_console(url: str, token_file: Path) -> None:
    """Run the console against the appliance at `url`, with the admin token it wrote to
    `token_file` (read again whenever the appliance restarts with a new one)."""
    ConsoleApp(AdminClient(url, read_token(token_file), token_file=token_file)).run()
