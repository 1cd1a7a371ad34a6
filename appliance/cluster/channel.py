"""Authenticated connections between boxes: the standard library's multiprocessing
connections, whose HMAC challenge proves both ends hold the shared secret before anything
is unpickled, bound to the one address the settings name."""

from __future__ import annotations

import os
import queue
import socket
import struct
import time
from multiprocessing.connection import (
    Connection,
    answer_challenge,
    deliver_challenge,
)
from pathlib import Path

from appliance.settings.cluster import host_port

CONNECT_RETRY_S = 0.5
CHALLENGE_TIMEOUT_S = 10.0  # the other end must answer the secret's challenge within this
# A peer that vanishes without closing its connection (power lost, cable cut) is seen
# within KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S (about 11 s).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 5, 2, 3


class SecretError(ValueError):
    """The shared secret is missing or unusable."""


def read_secret(path: Path | None) -> bytes:
    """The shared secret from its file (at least 16 bytes, surrounding whitespace ignored)."""
    if path is None:
        raise SecretError(
            "cluster.secret_file is not set: every box needs the same secret file "
            "(make one with `head -c 32 /dev/urandom | base64 > secret`)"
        )
    try:
        secret = path.read_bytes().strip()
    except OSError as error:
        raise SecretError(f"cannot read the cluster secret {path}: {error.strerror}") from None
    if len(secret) < 16:
        raise SecretError(f"the cluster secret in {path} is shorter than 16 bytes")
    return secret


def connect(address: str, secret: bytes, timeout: float, source: str = "") -> Connection:
    """A connection to host:port, from the local address `source` if given (a box's own),
    retried until `timeout` (the head may be starting); ConnectionError when it cannot be
    made, AuthenticationError for a wrong secret, TimeoutError when the other end accepts
    but does not answer the challenge within CHALLENGE_TIMEOUT_S."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _dial(host_port(address), secret, source)
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise ConnectionError(f"nothing answers at {address}") from None
            time.sleep(CONNECT_RETRY_S)


def _dial(address: tuple[str, int], secret: bytes, source: str) -> Connection:
    """The connection and the secret's challenge both ways, as Client makes them, but from
    `source` (Client cannot bind its end) and with a deadline on each read (Client has
    none: a head that accepts and stays silent would hold a joining box for ever)."""
    bind = (source, 0) if source else None
    with socket.create_connection(address, CHALLENGE_TIMEOUT_S, bind) as sock:
        sock.setblocking(True)  # Connection reads a blocking descriptor
        set_read_timeout(sock, CHALLENGE_TIMEOUT_S)
        connection = Connection(sock.detach())
    try:
        answer_challenge(connection, secret)
        deliver_challenge(connection, secret)
    except BlockingIOError:  # SO_RCVTIMEO ran out
        connection.close()
        raise TimeoutError(f"{address[0]}:{address[1]} accepted but did not answer") from None
    except BaseException:
        connection.close()
        raise
    with socket_of(connection) as open_socket:  # from now on it may idle
        set_read_timeout(open_socket, 0)
        keep_alive(open_socket)
    return connection


class ConnectionInbox:
    """A worker's inbox on its connection to the head: a queue's get / get_nowait, as the
    worker reads its local inbox. The head closing the connection reads as Shutdown."""

    def __init__(self, connection: Connection, shutdown: object) -> None:
        self._connection = connection
        self._shutdown = shutdown

    def get(self, timeout: float | None = None) -> object:
        if not self._connection.poll(timeout):
            raise queue.Empty
        return self._receive()

    def get_nowait(self) -> object:
        return self.get(0)

    def _receive(self) -> object:
        try:
            return self._connection.recv()
        except (EOFError, OSError):
            return self._shutdown


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive probes on `sock`: a peer gone silently fails its reads."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)


def set_read_timeout(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO: a blocking read past it fails (0: never). A socket timeout would
    make the descriptor non-blocking, which Connection does not expect."""
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)


def socket_of(connection: Connection) -> socket.socket:
    """A socket object on a copy of the connection's descriptor (the same socket; close
    the object, the connection keeps its own)."""
    return socket.socket(fileno=os.dup(connection.fileno()))
