"""systemd's notification protocol (sd_notify(3)): `KEY=VALUE` lines in one datagram to
the unix socket systemd names in NOTIFY_SOCKET (read through the settings). Without a
socket every call does nothing, so the server runs the same outside systemd."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

log = logging.getLogger("appliance.server")


class Notifier:
    """Sends READY=1 and STOPPING=1 to systemd; `heartbeat` sends WATCHDOG=1 and STATUS=."""

    def __init__(self, address: str | None) -> None:
        self._address = _socket_address(address) if address else None
        self._socket: socket.socket | None = None
        if self._address is not None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._warned = False

    def send(self, *lines: str) -> None:
        """One datagram; a failure is logged once and otherwise ignored (systemd may be
        gone, the service must not die of it)."""
        if self._socket is None or self._address is None:  # set together, in __init__
            return
        try:
            self._socket.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:
            if not self._warned:
                log.warning("cannot notify systemd at %r: %s", self._address, exc)
                self._warned = True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _socket_address(address: str) -> str | bytes:
    # "@name" is a socket in the abstract namespace: a leading NUL byte on the wire.
    return b"\0" + address[1:].encode() if address.startswith("@") else address


async def heartbeat(notifier: Notifier, interval_s: float, status: Callable[[], str]) -> None:
    """Every `interval_s` from the event loop: WATCHDOG=1 (so a stalled loop stops the
    pings and systemd restarts the service) and the pools' state as STATUS."""
    while True:
        notifier.send("WATCHDOG=1", f"STATUS={status()}")
        await asyncio.sleep(interval_s)
