"""Messages the event stream posts to the console app."""

from __future__ import annotations

from textual.message import Message

from appliance.admin.schema import Event, Snapshot


class SnapshotArrived(Message):
    """A new state snapshot."""

    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        """A newer snapshot supersedes this one: when updates pile up (a slow terminal),
        only the latest is drawn."""
        return isinstance(message, SnapshotArrived)


class EventArrived(Message):
    """One new appliance event (a move's progress, a tuning change, a worker's start/exit)."""

    def __init__(self, event: Event) -> None:
        super().__init__()
        self.event = event


class ConnectionChanged(Message):
    """The event stream opened (`connected`) or was lost; `detail` says why, for the status
    line."""

    def __init__(self, connected: bool, detail: str) -> None:
        super().__init__()
        self.connected = connected
        self.detail = detail
