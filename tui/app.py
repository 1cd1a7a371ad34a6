"""ConsoleApp: the appliance's console. It renders the admin API's snapshots and sends
its pool moves and tuning changes; it decides nothing itself."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar, TypeVar

import httpx
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.widget import Widget
from textual.widgets import Footer

from appliance.admin.schema import DeviceInfo, Event, Move, Snapshot, Tuning
from appliance.admin.token import read_token
from tui.client import AdminClient, AdminError
from tui.components.confirm_move import (
    APPLY,
    ConfirmMove,
    apply_question,
    device_name,
    move_question,
    move_targets,
    role_choices,
)
from tui.components.event_log import EventLog
from tui.components.fault_panel import FaultPanel
from tui.components.help_screen import HelpScreen
from tui.components.kv_store_panel import KVStorePanel
from tui.components.latency_panel import LatencyPanel
from tui.components.planner_panel import NO_PLANNER, PlannerPanel, plan_to_apply
from tui.components.pools_view import PoolsView
from tui.components.requests_table import RequestsTable
from tui.components.status_line import StatusLine
from tui.components.tuning_form import TuningForm
from tui.messages import ConnectionChanged, EventArrived, SnapshotArrived

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 5.0
NOT_CONNECTED = "not connected"
T = TypeVar("T")


def describe_failure(error: Exception) -> str:
    """A short reason for the status line."""
    if isinstance(error, AdminError):
        return str(error)
    if isinstance(error, httpx.HTTPError):
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return f"bad data from the appliance: {type(error).__name__}"


class ConsoleApp(App[None]):
    """The console: pools and devices on top, latency and requests below, events and the
    planner last.

    With a client and `watch`, a worker follows /admin/events and reconnects when the
    stream drops; without, it shows whatever SnapshotArrived messages are posted to it
    (tests do that). Widget ids: `status`, `pools` (cards `device-<index>` in columns
    `pool-<role>`), `latency`, `requests`, `events`, `planner`.
    """

    # absolute, because Textual resolves a relative CSS_PATH against the module of
    # whichever subclass runs (a test's, say)
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "appliance console"
    ENABLE_COMMAND_PALETTE = False
    AUTO_FOCUS = None  # the first snapshot focuses the first device card
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("m", "move", "Move device"),
        Binding("a", "apply_plan", "Apply plan"),
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
        """Status line, pools, latency | requests, events | planner, key footer."""
        # kept as attributes: `query_one` only searches the top screen, and snapshots
        # keep coming while a dialog is open
        self._status = StatusLine(id="status")
        self._pools = PoolsView(id="pools")
        self._latency = LatencyPanel(id="latency")
        self._requests = RequestsTable(id="requests")
        self._events = EventLog(id="events")
        self._faults = FaultPanel(id="faults")  # hidden until a fault
        self._kv_store = KVStorePanel(id="kv-store")  # hidden while the store is off
        self._planner = PlannerPanel(id="planner")
        yield self._status
        yield self._pools
        with Horizontal(id="middle"):
            yield self._latency
            yield self._requests
        with Horizontal(id="bottom"):
            yield self._events
            yield self._faults
            yield self._kv_store
            yield self._planner
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
        self._faults.show(snapshot)
        self._kv_store.show(snapshot)
        self._planner.show(snapshot)
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
        panels: tuple[Widget, ...] = (self._pools, self._latency, self._requests)
        panels += (self._events, self._faults, self._kv_store, self._planner)
        for panel in panels:
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
        """Ask which pool, then move the selected device to it."""
        client = self._client
        if client is None:
            self.notify(NOT_CONNECTED, severity="warning")
            return
        device = self._selected_device_info()
        if device is None:
            self.notify("No device selected yet.", severity="warning")
            return
        if device.pool is None:
            self.notify(f"{device.name} is between pools: nothing to move.", severity="warning")
            return
        targets = move_targets(device.pool)
        question = move_question(device, targets)

        def answered(to: str | None) -> None:
            if to is not None:
                self._send(lambda: client.move(device.index, to), "Move refused", self._moving)

        self.push_screen(ConfirmMove(question, role_choices(targets)), answered)

    def action_apply_plan(self) -> None:
        """Ask, then start the move the planner recommends (not with autopilot on: it
        applies its moves itself)."""
        ready = self._ready_to_act()
        if ready is None:
            return
        client, snapshot = ready
        planner = snapshot.planner
        if planner is None:
            self.notify(NO_PLANNER, severity="warning")
            return
        plan = plan_to_apply(planner)
        if isinstance(plan, str):
            self.notify(plan)
            return
        question = apply_question(snapshot, planner, *plan)

        def answered(go: str | None) -> None:
            if go is not None:
                self._send(client.apply_plan, "Plan not applied", self._moving)

        self.push_screen(ConfirmMove(question, [APPLY]), answered)

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
        client, snapshot = ready
        admission = "open" if snapshot.tuning.admission == "paused" else "paused"
        self._send(
            lambda: client.tune(admission=admission),
            "Admission unchanged",
            lambda tuning: f"Admission {tuning.admission}.",
        )

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
    async def _send(
        self, call: Callable[[], Awaitable[T]], failed: str, done: Callable[[T], str]
    ) -> None:
        """Make an admin call; notify `done(result)`, or its error titled `failed`."""
        try:
            result = await call()
        except AdminError as error:
            self.notify(error.message, title=failed, severity="error")
        except httpx.HTTPError as error:
            self.notify(describe_failure(error), title=failed, severity="error")
        else:
            self.notify(done(result))

    def _moving(self, move: Move) -> str:
        """What the console says about a move the appliance started."""
        name = device_name(self._snapshot, move.device)
        return f"Moving {name} to {move.to_role}: {move.phase} (move #{move.move_id})."


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
