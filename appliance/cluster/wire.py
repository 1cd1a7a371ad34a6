"""The messages between boxes as data: msgpack (msgspec) of the known message types, never
pickle. A frame is [tag, connection nonce, sequence number, body]: the tag names one of
the types below and the body is decoded into that type alone, its fields checked against
their annotations (and each type's own __post_init__ checks), so a frame can only ever
become one of these messages. Settings travel as the settings model's JSON form and are
validated by it; tensors never travel (a KV pool crosses as its NIXL address, RemotePool,
whose metadata is raw bytes).

The nonce and the sequence number tie a frame to its connection and place: a frame
recorded on one connection and replayed on another, or replayed or dropped within one, is
refused (TLS already stops an outsider doing either; this stops a peer replaying its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel

from appliance.cluster.messages import (
    AgentHello,
    KillWorker,
    Ping,
    Pong,
    Refused,
    SpawnWorker,
    WorkerExited,
    WorkerHello,
)
from appliance.kv.remote_pool import RemotePool
from appliance.workers.messages import (
    Abort,
    DropPeer,
    Failed,
    Handoff,
    HandoffResult,
    LeaseExpired,
    PeerDropped,
    PeerPool,
    PoolShared,
    Ready,
    Release,
    SharePool,
    Shutdown,
    Submit,
    TokenBatch,
    Tune,
)


class WireError(ConnectionError):
    """A frame that is not a message this link takes (the message says what is wrong); the
    link that read it ends. A ConnectionError, so a reader ending on a lost connection ends
    on this too."""


@dataclass(frozen=True)
class _RemotePools:
    """PeerPool on the wire: between boxes its pools are only ever RemotePools (the other
    form, pickled shared-memory and CUDA IPC handles, never leaves its box)."""

    worker_id: int
    data: list[RemotePool]


@dataclass(frozen=True)
class _SharedRemotePools:
    """PoolShared on the wire (see _RemotePools)."""

    worker_id: int
    consumer: int
    data: list[RemotePool]


AGENT_MESSAGES: tuple[type, ...] = (AgentHello, WorkerHello, SpawnWorker, KillWorker)
AGENT_MESSAGES += (WorkerExited, Refused, Ping, Pong)
TO_WORKER: tuple[type, ...] = (Submit, Handoff, SharePool, PeerPool, DropPeer, Tune, Release)
TO_WORKER += (Abort, Shutdown)
FROM_WORKER: tuple[type, ...] = (Ready, PoolShared, PeerDropped, TokenBatch, HandoffResult)
FROM_WORKER += (LeaseExpired, Failed)
MESSAGES = {kind.__name__: kind for kind in AGENT_MESSAGES + TO_WORKER + FROM_WORKER}
# The form each type has on the wire, where it is not the type itself.
WIRE_FORM: dict[type, type] = {PeerPool: _RemotePools, PoolShared: _SharedRemotePools}
HELLOS = (AgentHello, WorkerHello)  # what a new connection to the head may say first

NONCE_BYTES = 16


class _Frame(msgspec.Struct, array_like=True):
    tag: str
    nonce: bytes
    seq: int
    body: msgspec.Raw


def _encode_hook(value: object) -> object:
    if isinstance(value, BaseModel):  # the settings: checked again by the model on arrival
        return value.model_dump(mode="json")
    raise TypeError(f"{type(value).__name__} does not cross between boxes")


def _decode_hook(kind: type, value: Any) -> object:
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return kind.model_validate(value)
    raise TypeError(f"{kind} does not cross between boxes")


class Codec:
    """Messages to frames and back for one connection: its nonce, and each direction's
    next sequence number."""

    def __init__(self, nonce: bytes) -> None:
        self.nonce = nonce
        self._sent = 0
        self._received = 0
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_hook)
        self._frames = msgspec.msgpack.Decoder(_Frame)

    def encode(self, message: object) -> bytes:
        """The frame of the next message sent; TypeError for what is not a message here."""
        kind = type(message)
        if kind.__name__ not in MESSAGES or MESSAGES[kind.__name__] is not kind:
            raise TypeError(f"{kind.__name__} is not a message between boxes")
        body = self._encoder.encode(_to_wire(message))
        envelope = _Frame(kind.__name__, self.nonce, self._sent, msgspec.Raw(body))
        frame = self._encoder.encode(envelope)
        self._sent += 1
        return frame

    def decode(self, frame: bytes, accepts: tuple[type, ...]) -> object:
        """The message in the next frame received, if it is one of `accepts`; WireError
        naming what is wrong otherwise (nothing in the frame is run or imported)."""
        try:
            envelope = self._frames.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise WireError(f"not a message frame: {error}") from None
        kind = MESSAGES.get(envelope.tag)
        if kind is None:
            raise WireError(f"unknown message type {envelope.tag[:64]!r}")
        if kind not in accepts:
            raise WireError(f"a {envelope.tag} is not expected here")
        if envelope.nonce != self.nonce:
            raise WireError(f"a {envelope.tag} from another connection (replayed)")
        if envelope.seq != self._received:
            raise WireError(
                f"a {envelope.tag} out of sequence: number {envelope.seq}, expected "
                f"{self._received} (replayed or dropped)"
            )
        try:
            wire: object = msgspec.msgpack.decode(
                envelope.body, type=WIRE_FORM.get(kind, kind), dec_hook=_decode_hook
            )
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise WireError(f"a malformed {envelope.tag}: {error}") from None
        self._received += 1
        return _from_wire(kind, wire)


def _to_wire(message: object) -> object:
    if isinstance(message, PeerPool | PoolShared):
        if not all(isinstance(pool, RemotePool) for pool in message.data):
            raise TypeError(
                f"a {type(message).__name__} of local tensor handles does not leave its box"
            )
        pools = list(message.data)  # every one a RemotePool (checked above)
        if isinstance(message, PeerPool):
            return _RemotePools(message.worker_id, pools)  # type: ignore[arg-type]
        return _SharedRemotePools(message.worker_id, message.consumer, pools)  # type: ignore[arg-type]
    return message


def _from_wire(kind: type, wire: object) -> object:
    if isinstance(wire, _RemotePools):
        return PeerPool(wire.worker_id, wire.data)
    if isinstance(wire, _SharedRemotePools):
        return PoolShared(wire.worker_id, wire.consumer, wire.data)
    return wire
