"""The link between boxes: TLS with the cluster's own certificates (tls.py), then the
shared secret's challenge both ways, then messages as data (wire.py), bound to the one
address the settings name.

A Link reads and writes the TLS stream through memory buffers and moves the bytes on the
socket itself: one thread may then read while another writes (an OpenSSL connection must
not be used by two threads at once, so each TLS step holds a lock, but no socket wait
does). It reads the socket one TLS record at a time, and each frame is written as one TLS
write, so a frame read leaves the next one's records in the socket: a `select` on the
link's descriptor (as multiprocessing.connection.wait does) sees every frame still unread.

The secret's challenge: the head sends a random nonce, the box answers with its own and
HMAC-SHA256(secret, "box" + both), the head checks it and answers HMAC(secret, "head" +
both), which the box checks. The two nonces also make the connection's nonce that each
frame carries (wire.py): no frame of another connection is taken on this one.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import queue
import select
import socket
import ssl
import struct
import threading
import time
from multiprocessing import AuthenticationError
from pathlib import Path

from appliance.cluster.tls import peer_name
from appliance.cluster.wire import NONCE_BYTES, Codec, WireError
from appliance.settings.cluster import host_port

log = logging.getLogger("appliance.cluster")
CONNECT_RETRY_S = 0.5
CHALLENGE_TIMEOUT_S = 10.0  # the other end must finish TLS and the challenge within this
# A peer that vanishes without closing its connection (power lost, cable cut) is seen
# within KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S (about 11 s).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 5, 2, 3
MAX_FRAME = 64 * 2**20  # bytes; the largest message (a SpawnWorker's settings) is far less
CHALLENGE_BYTES = 32
FRAME_LENGTH = struct.Struct("!I")
RECORD_HEADER = 5  # a TLS record: type, version (2 bytes), length (2 bytes), then its body
MAX_RECORD = 2**14 + 2048  # TLS 1.3's largest record body, with room for its expansion
REFUSED = b"refused".ljust(CHALLENGE_BYTES, b"\0")  # the head's answer to a wrong secret


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


class Link:
    """One connection between boxes after TLS and the secret's challenge: `send` a message,
    `recv` the next one (only of the types in `accepts`), `poll`, `fileno` for a select.
    A frame that is not such a message raises WireError and ends the link. `peer` is the
    box the other end's certificate names."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server: bool) -> None:
        """TLS over `sock`; `handshake` and a `prove_as_*` next."""
        self._sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server)
        self._tls_lock = threading.Lock()  # the TLS object: one step at a time
        self._send_lock = threading.Lock()  # whole frames, in order, on the socket
        self._recv_lock = threading.Lock()
        self._plain = bytearray()  # decrypted bytes not yet taken as frames
        self.peer = ""
        self.codec = Codec(b"")  # replaced by the challenge's, with the connection's nonce
        self.accepts: tuple[type, ...] = ()

    # ------------------------------------------------------------ messages

    def send(self, message: object) -> None:
        """Send one message (TypeError for one that does not cross between boxes)."""
        with self._send_lock:
            self._write_frame(self.codec.encode(message))

    def recv(self) -> object:
        """The next message; EOFError when the other end closed, WireError (and the link
        ended) for a frame that is not a message this link takes."""
        payload = self.recv_bytes()
        try:
            return self.codec.decode(payload, self.accepts)
        except WireError as error:
            log.warning("ending the link with %s: %s", self.peer or "a caller", error)
            self.shutdown()
            raise

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether something is there to read, waiting up to `timeout` (None: for ever)."""
        if self._plain:
            return True
        readable, _, _ = select.select([self._sock], [], [], timeout)
        return bool(readable)

    def fileno(self) -> int:
        return self._sock.fileno()

    def local_ip(self) -> str:
        """The address this end talks from."""
        return str(self._sock.getsockname()[0])

    def peer_ip(self) -> str:
        return str(self._sock.getpeername()[0])

    def shutdown(self) -> None:
        """End the connection both ways (a thread reading it wakes with EOF)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        self._sock.close()

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0

    # ------------------------------------------------------------ frames

    def send_bytes(self, payload: bytes) -> None:
        with self._send_lock:
            self._write_frame(payload)

    def recv_bytes(self, limit: int = MAX_FRAME) -> bytes:
        """The next frame's payload; WireError for one longer than `limit`."""
        with self._recv_lock:
            while len(self._plain) < FRAME_LENGTH.size:
                self._read_record()
            (length,) = FRAME_LENGTH.unpack_from(self._plain)
            if length > limit:
                self.shutdown()
                raise WireError(f"a frame of {length} bytes (at most {limit} here)")
            end = FRAME_LENGTH.size + length
            while len(self._plain) < end:
                self._read_record()
            payload = bytes(self._plain[FRAME_LENGTH.size : end])
            del self._plain[:end]
            return payload

    def _write_frame(self, payload: bytes) -> None:
        """One TLS write of the frame (its records hold this frame alone); _send_lock held."""
        if len(payload) > MAX_FRAME:
            raise ValueError(f"a message of {len(payload)} bytes (at most {MAX_FRAME})")
        with self._tls_lock:
            self._tls.write(FRAME_LENGTH.pack(len(payload)) + payload)
            data = self._outgoing.read()
        self._sock.sendall(data)

    def _read_record(self) -> None:
        """Read one TLS record from the socket and keep what it decrypts to."""
        self._feed_record()
        with self._tls_lock:
            while True:
                try:
                    chunk = self._tls.read(MAX_RECORD)
                except ssl.SSLWantReadError:
                    break
                except ssl.SSLZeroReturnError:
                    raise EOFError("the other end closed the link") from None
                if not chunk:
                    raise EOFError("the other end closed the link")
                self._plain += chunk
            answer = self._outgoing.pending > 0
        if answer:  # TLS had something to say back (a key update)
            self._flush()

    def _feed_record(self) -> None:
        header = self._read_exact(RECORD_HEADER)
        length = int.from_bytes(header[3:5], "big")
        if length > MAX_RECORD:
            self.shutdown()
            raise WireError(f"not TLS: a record of {length} bytes")
        body = self._read_exact(length)
        with self._tls_lock:
            self._incoming.write(header + body)

    def _read_exact(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = self._sock.recv(size - len(data))
            if not chunk:
                raise EOFError("the other end closed the link")
            data += chunk
        return bytes(data)

    def _flush(self) -> None:
        with self._send_lock:
            with self._tls_lock:
                data = self._outgoing.read()
            if data:
                self._sock.sendall(data)

    # ------------------------------------------------------------ the handshake

    def handshake(self) -> None:
        """TLS's handshake; ssl.SSLError (certificate refused) or TimeoutError."""
        while True:
            try:
                with self._tls_lock:
                    self._tls.do_handshake()
                self._flush()
                break
            except ssl.SSLWantReadError:
                self._flush()
                self._feed_record()
            except ssl.SSLError:
                with contextlib.suppress(OSError):
                    self._flush()  # the alert: the other end learns why
                raise
        self.peer = peer_name(self._tls.getpeercert(binary_form=True))

    def prove_as_head(self, secret: bytes) -> None:
        """The head's half of the challenge; AuthenticationError for a wrong secret."""
        ours = os.urandom(CHALLENGE_BYTES)
        self.send_bytes(ours)
        reply = self.recv_bytes(2 * CHALLENGE_BYTES)
        theirs, proof = reply[:CHALLENGE_BYTES], reply[CHALLENGE_BYTES:]
        if len(theirs) != CHALLENGE_BYTES or not hmac.compare_digest(
            proof, _proof(secret, b"box", ours, theirs)
        ):
            self.send_bytes(REFUSED)
            raise AuthenticationError(f"{self.peer or 'a caller'} does not hold the secret")
        self.send_bytes(_proof(secret, b"head", ours, theirs))
        self.codec = Codec(_nonce(ours, theirs))

    def prove_as_box(self, secret: bytes) -> None:
        """A box's half of the challenge; AuthenticationError when the head refuses this
        secret or does not hold it."""
        theirs = self.recv_bytes(CHALLENGE_BYTES)
        ours = os.urandom(CHALLENGE_BYTES)
        self.send_bytes(ours + _proof(secret, b"box", theirs, ours))
        answer = self.recv_bytes(CHALLENGE_BYTES)
        if answer == REFUSED:
            raise AuthenticationError("the head refused this box's secret")
        if not hmac.compare_digest(answer, _proof(secret, b"head", theirs, ours)):
            raise AuthenticationError("the head does not hold the cluster's secret")
        self.codec = Codec(_nonce(theirs, ours))


def _proof(secret: bytes, role: bytes, head_nonce: bytes, box_nonce: bytes) -> bytes:
    text = b"appliance box link\0" + role + b"\0" + head_nonce + box_nonce
    return hmac.new(secret, text, hashlib.sha256).digest()


def _nonce(head_nonce: bytes, box_nonce: bytes) -> bytes:
    return hashlib.sha256(b"connection\0" + head_nonce + box_nonce).digest()[:NONCE_BYTES]


def connect(
    address: str, secret: bytes, context: ssl.SSLContext, timeout: float, source: str = ""
) -> Link:
    """A link to the head at host:port, from the local address `source` if given (a box's
    own), retried until `timeout` (the head may be starting); ConnectionError when it
    cannot be made, ssl.SSLError when a certificate is refused, AuthenticationError for a
    wrong secret, TimeoutError when the other end accepts but does not finish TLS and the
    challenge within CHALLENGE_TIMEOUT_S."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _dial(host_port(address), secret, context, source)
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise ConnectionError(f"nothing answers at {address}") from None
            time.sleep(CONNECT_RETRY_S)


def _dial(address: tuple[str, int], secret: bytes, context: ssl.SSLContext, source: str) -> Link:
    bind = (source, 0) if source else None
    sock = socket.create_connection(address, CHALLENGE_TIMEOUT_S, bind)
    link = Link(sock, context, server=False)
    try:
        link.handshake()
        link.prove_as_box(secret)
    except (TimeoutError, EOFError) as error:
        link.close()
        if isinstance(error, EOFError):
            raise ConnectionError(f"{address[0]}:{address[1]} closed the connection") from None
        raise TimeoutError(f"{address[0]}:{address[1]} accepted but did not answer") from None
    except BaseException:
        link.close()
        raise
    sock.settimeout(None)  # from now on it may idle
    keep_alive(sock)
    return link


def accept(sock: socket.socket, secret: bytes, context: ssl.SSLContext, timeout: float) -> Link:
    """The head's side of a new connection: TLS, then the challenge, within `timeout`
    (the socket keeps that timeout: reading the caller's hello is within it too)."""
    keep_alive(sock)
    sock.settimeout(timeout)
    link = Link(sock, context, server=True)
    try:
        link.handshake()
        link.prove_as_head(secret)
    except BaseException:
        link.close()
        raise
    return link


class ConnectionInbox:
    """A worker's inbox on its link to the head: a queue's get / get_nowait, as the
    worker reads its local inbox. The head closing the link reads as Shutdown."""

    def __init__(self, link: Link, shutdown: object) -> None:
        self._link = link
        self._shutdown = shutdown

    def get(self, timeout: float | None = None) -> object:
        if not self._link.poll(timeout):
            raise queue.Empty
        return self._receive()

    def get_nowait(self) -> object:
        return self.get(0)

    def _receive(self) -> object:
        try:
            return self._link.recv()
        except (EOFError, OSError):  # ended, or a frame that is no message (WireError)
            return self._shutdown


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive probes on `sock`: a peer gone silently fails its reads."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
