"""The link between boxes, in this process: a real ClusterHead listening on loopback, and
boxes dialling it as agents and workers do (channel.connect with a box's certificate).
Only a caller with a certificate of the cluster's CA and the shared secret gets in; what
it sends is decoded into the known messages only (a pickle, an unknown or misplaced type,
a malformed or replayed frame ends its link, and nothing in it runs); what crosses the
wire is not readable (a proxy on loopback records it)."""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from pathlib import Path

import msgspec
import pytest
from conftest import Certs
from server_process import wait_until

from appliance.bench.compare import free_port
from appliance.cluster import channel
from appliance.cluster import messages as c
from appliance.cluster.certs import CertError, make_certs
from appliance.cluster.channel import Link, connect
from appliance.cluster.head import ClusterHead
from appliance.cluster.messages import AgentHello, Refused, SpawnWorker, WorkerExited
from appliance.cluster.tls import TlsSetupError, box_context, head_context
from appliance.cluster.wire import AGENT_MESSAGES, MESSAGES, Codec
from appliance.engine.sampling.logprobs import TokenLogprobs
from appliance.engine.sequence import SamplingParams, StructuredOutput
from appliance.engine.step_timing import StepTiming
from appliance.kv.byte_ranges import PoolShape
from appliance.kv.remote_pool import RemotePool
from appliance.settings.cluster import ClusterSettings
from appliance.settings.config import load_settings
from appliance.topology.devices import Device
from appliance.workers import messages as m

SECRET = b"a-shared-secret-of-the-test-boxes"
MARKER = "plaintext-marker-the-wire-must-not-show"


@dataclass
class Head:
    """A ClusterHead and what reached its callbacks."""

    head: ClusterHead
    address: str
    joined: queue.Queue[tuple[AgentHello, Link]] = field(default_factory=queue.Queue)
    lost: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)  # why each was lost

    def on_lost(self, box: str, cause: str) -> None:
        self.lost.append(box)
        self.causes.append(cause)


@pytest.fixture
def head(certs: Certs, tmp_path: Path) -> Iterator[Head]:
    """A head whose heartbeat never fires within a test (the tests below read exactly
    what the head sends; the heartbeat's own tests start a head that beats)."""
    with listening(certs, tmp_path, heartbeat_interval_s=60, heartbeat_timeout_s=600) as running:
        yield running


@contextlib.contextmanager
def listening(certs: Certs, tmp_path: Path, **more: float) -> Iterator[Head]:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    address = f"127.0.0.1:{free_port()}"
    settings = ClusterSettings(listen=address, secret_file=secret, **certs.settings("head"), **more)
    running: Head

    def call(function: Callable[..., object], *args: object) -> None:
        function(*args)

    def joined(hello: AgentHello, link: Link) -> None:
        running.joined.put((hello, link))

    def attach(worker_id: int, link: Link) -> None:
        raise AssertionError("no worker dials in these tests")

    cluster = ClusterHead(settings, call, joined, lambda *lost: running.on_lost(*lost), attach)
    running = Head(cluster, address)
    cluster.start()
    try:
        yield running
    finally:
        cluster.stop()


def box_settings(certs: Certs, box: str) -> ClusterSettings:
    return ClusterSettings(**certs.settings(box))


def dial(head: Head, certs: Certs, box: str = "b", secret: bytes = SECRET) -> Link:
    link = connect(head.address, secret, box_context(box_settings(certs, box)), 10.0)
    link.accepts = (SpawnWorker, Refused)
    return link


def hello(box: str = "b", device: str = "cpu0") -> AgentHello:
    return AgentHello(box, (Device("cpu", 0, device, 2**30, 2**30, cores=(0,), box=""),), "decode")


def test_a_box_with_the_clusters_certificate_and_secret_joins(head: Head, certs: Certs) -> None:
    link = dial(head, certs)
    link.send(hello())
    got, their_link = head.joined.get(timeout=10)
    assert got == hello() and their_link.peer == "b"
    head.head.admit(got, their_link)
    link.send(WorkerExited(7, 0))  # what an agent reports is read (nothing waits on 7)
    head.head.refuse(their_link, "only a test")
    assert link.recv() == Refused("only a test")
    link.close()


def test_a_box_whose_certificate_is_of_another_ca_cannot_join(
    head: Head, other_certs: Certs
) -> None:
    """Another cluster's box b: it does not trust our head, nor our head it."""
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        dial(head, other_certs)
    assert head.joined.empty()


def test_a_box_with_our_ca_but_another_clusters_certificate_is_refused(
    head: Head, certs: Certs, other_certs: Certs
) -> None:
    """It trusts the head (our CA), but its own certificate is the other cluster's b."""
    settings = ClusterSettings(
        ca_file=certs.ca,
        cert_file=other_certs.folder / "b.crt",
        key_file=other_certs.folder / "b.key",
    )
    with pytest.raises(ssl.SSLError, match="unknown ca"):
        link = connect(head.address, SECRET, box_context(settings), 10.0)
        link.send(hello())
    assert head.joined.empty()


def test_a_box_with_the_certificate_but_the_wrong_secret_cannot_join(
    head: Head, certs: Certs
) -> None:
    with pytest.raises(AuthenticationError, match="refused this box's secret"):
        dial(head, certs, secret=b"not-the-secret-of-these-boxes")
    assert head.joined.empty()


def test_a_box_cannot_speak_for_another_box(head: Head, certs: Certs) -> None:
    link = dial(head, certs, "c")
    link.send(hello("b"))  # box c's certificate, box b's name
    assert link.recv() == Refused("its certificate names box 'c', not 'b'")
    assert head.joined.empty()


def test_a_box_certificate_cannot_pose_as_the_head(certs: Certs, tmp_path: Path) -> None:
    """Box c listens with its own certificate as if it were the head: box b refuses it
    (only the head's certificate may serve)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.folder / "c.crt", certs.folder / "c.key")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def serve() -> None:
            sock, _ = server.accept()
            with contextlib.suppress(OSError), context.wrap_socket(sock, server_side=True):
                pass

        threading.Thread(target=serve, daemon=True).start()
        with pytest.raises(ssl.SSLCertVerificationError, match="unsuitable certificate purpose"):
            connect(f"127.0.0.1:{port}", SECRET, box_context(box_settings(certs, "b")), 5.0)


# ---------------------------------------------------------------- what a frame can be


class CreatesAFile:
    """A pickle whose loading creates a file: what pickled messages would let a box do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def evil_pickle(path: Path) -> bytes:
    data = pickle.dumps(CreatesAFile(path))
    assert not path.exists()
    pickle.loads(data).close()  # the payload works: loading it does create the file
    assert path.exists()
    path.unlink()
    return data


@pytest.mark.parametrize("where", ["hello", "after joining"])
def test_a_pickle_on_the_link_is_refused_and_never_loaded(
    head: Head, certs: Certs, tmp_path: Path, where: str
) -> None:
    target = tmp_path / "created-by-the-pickle"
    payload = evil_pickle(target)
    link = dial(head, certs)
    if where == "after joining":
        link.send(hello())
        got, their_link = head.joined.get(timeout=10)
        head.head.admit(got, their_link)
    link.send_bytes(payload)  # the secret proved: a pickled message as the old link sent
    with pytest.raises(EOFError):
        link.recv_bytes()  # the head ended the link
    assert not target.exists()
    if where == "after joining":
        wait_until(lambda: head.lost == ["b"], 10, "box b lost")
    else:
        assert head.joined.empty()


def test_a_pickle_without_tls_is_refused(head: Head, tmp_path: Path) -> None:
    target = tmp_path / "created-by-the-pickle"
    payload = evil_pickle(target)
    host, port = head.address.split(":")
    with socket.create_connection((host, int(port)), 10) as sock:
        sock.sendall(len(payload).to_bytes(4, "big") + payload)
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(4096):  # the head answers with an alert at most, then closes
                pass
    assert not target.exists() and head.joined.empty()


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (lambda codec: codec.encode(hello())[:-3], "not a message frame: Input data was truncated"),
        (lambda codec: b"\x93\xa3abc", "not a message frame"),
        (lambda codec: _retag(codec, "Popen"), "unknown message type 'Popen'"),
        (lambda codec: _retag(codec, "SpawnWorker"), "a SpawnWorker is not expected here"),
        (lambda codec: _with_box(codec, 12345), "Expected `str`, got `int` - at `$.box`"),
        (lambda codec: Codec(os.urandom(16)).encode(hello()), "from another connection"),
    ],
    ids=["truncated", "not a frame", "unknown type", "misplaced type", "wrong field", "foreign"],
)
def test_a_malformed_or_foreign_frame_ends_the_link(
    head: Head,
    certs: Certs,
    frame: Callable[[Codec], bytes],
    why: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    link = dial(head, certs)
    link.send_bytes(frame(link.codec))
    with pytest.raises(EOFError):
        link.recv_bytes()  # the head ended the link
    assert head.joined.empty()
    wait_until(lambda: why in caplog.text, 10, f"the head's reason: {why}")


def test_a_frame_replayed_on_a_new_connection_is_refused(head: Head, certs: Certs) -> None:
    """A box replays the hello it sent on an earlier connection (it made that frame)."""
    first = dial(head, certs)
    recorded = first.codec.encode(hello())
    first.send_bytes(recorded)
    _, their_link = head.joined.get(timeout=10)
    their_link.close()
    first.close()
    second = dial(head, certs)
    second.send_bytes(recorded)
    with pytest.raises(EOFError):
        second.recv_bytes()
    assert head.joined.empty()


def test_a_frame_replayed_within_a_connection_is_refused() -> None:
    sender, receiver = Codec(b"n" * 16), Codec(b"n" * 16)
    frame = sender.encode(hello())
    assert receiver.decode(frame, AGENT_MESSAGES) == hello()
    with pytest.raises(ConnectionError, match="out of sequence: number 0, expected 1"):
        receiver.decode(frame, AGENT_MESSAGES)


def _retag(codec: Codec, tag: str) -> bytes:
    """A hello's frame with another type's tag."""
    _, nonce, seq, fields = msgspec.msgpack.decode(codec.encode(hello()))
    codec._sent -= 1  # the frame is rewritten, not sent twice
    return msgspec.msgpack.encode([tag, nonce, seq, fields])


def _with_box(codec: Codec, box: object) -> bytes:
    """A hello's frame whose box is `box`."""
    tag, nonce, seq, fields = msgspec.msgpack.decode(codec.encode(hello()))
    codec._sent -= 1
    return msgspec.msgpack.encode([tag, nonce, seq, {**fields, "box": box}])


# ---------------------------------------------------------------- what the wire shows


class Proxy:
    """A TCP relay on loopback recording every byte either way."""

    def __init__(self, target: str) -> None:
        host, port = target.split(":")
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.seen = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.server.accept()
                upstream = socket.create_connection(self.target)
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                with self._lock:
                    self.seen += data
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.server.close()


class TamperingProxy(Proxy):
    """A relay that flips the last bit of everything a box sends once it has sent
    `after` chunks (the TLS handshake's), as a man in the middle forging bytes would."""

    def __init__(self, target: str, after: int) -> None:
        self.after, self.chunks = after, 0
        super().__init__(target)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        if source.getsockname()[1] != int(self.address.split(":")[1]):
            return super()._pump(source, sink)  # the head's side: untouched
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self.chunks += 1
                if self.chunks > self.after:
                    data = data[:-1] + bytes([data[-1] ^ 1])
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def test_the_links_bytes_on_the_wire_are_not_readable(head: Head, certs: Certs) -> None:
    proxy = Proxy(head.address)
    try:
        link = connect(proxy.address, SECRET, box_context(box_settings(certs, "b")), 10.0)
        link.accepts = (Refused,)
        link.send(hello(device=MARKER))
        got, their_link = head.joined.get(timeout=10)
        assert got.devices[0].name == MARKER  # it crossed
        head.head.refuse(their_link, MARKER + " back")
        assert link.recv() == Refused(MARKER + " back")
        link.close()
    finally:
        proxy.close()
    wire = bytes(proxy.seen)
    assert len(wire) > 1000  # the handshake, the challenge, both messages
    for plain in (MARKER.encode(), SECRET, b"AgentHello", b"Refused"):
        assert plain not in wire


@pytest.mark.parametrize("after", [0, 1, 2])
def test_bytes_forged_on_the_wire_end_the_link(head: Head, certs: Certs, after: int) -> None:
    """Tampered in the handshake or after it: the box never joins, nothing is decoded."""
    proxy = TamperingProxy(head.address, after)
    try:
        with pytest.raises((ssl.SSLError, ConnectionError, EOFError)):
            link = connect(proxy.address, SECRET, box_context(box_settings(certs, "b")), 10.0)
            link.send(hello())
            link.recv_bytes()  # the head ends the link: EOF
    finally:
        proxy.close()
    assert head.joined.empty() and proxy.chunks > after


def test_joining_a_head_that_accepts_and_stays_silent_times_out(
    monkeypatch: pytest.MonkeyPatch, certs: Certs
) -> None:
    monkeypatch.setattr(channel, "CHALLENGE_TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        with pytest.raises(TimeoutError, match="accepted but did not answer"):
            connect(f"127.0.0.1:{port}", SECRET, box_context(box_settings(certs, "b")), 5.0)


def every_message() -> list[object]:
    """One of each message type that crosses between boxes, with its nested parts filled."""

    params = SamplingParams(
        max_tokens=5,
        stop=("end",),
        logit_bias=((3, 1.5),),
        logprobs=2,
        structured=StructuredOutput("json", '{"type": "object"}'),
    )
    pool = RemotePool("agent-1", b"\x00metadata\xff", 2**40, PoolShape(2, 8, 16, 2, 4, 4))
    logprobs = [TokenLogprobs(3, -0.25, 1, ((3, -0.25), (4, -2.0)))]
    output = m.Output(1, [3], "x", True, "stop", [4, 5], 2, logprobs, logprobs)
    timing = StepTiming("decode", 1, 1, 0, 9, 0.01)
    return [
        hello(),
        c.WorkerHello(3, 1234),
        c.SpawnWorker(3, "decode", load_settings(dtype="float32"), hello().devices),
        c.KillWorker(3),
        c.WorkerExited(3, -9),
        c.Refused("why"),
        c.Ping(5),
        c.Pong(5),
        m.Submit(1, [1, 2], params, True, TRACE),  # a traced request's context crosses too
        m.Handoff(1, [1, 2, 3], 2, params, 0, [4, 5], TRACE),
        m.SharePool(3, remote=True),
        m.PeerPool(0, [pool]),
        m.DropPeer(0),
        m.Tune(chunk_size=64),
        m.Release(1),
        m.Abort(1),
        m.Shutdown(),
        m.Ready(3, 100, [7]),
        m.PoolShared(0, 3, [pool]),
        m.PeerDropped(3, 0),
        m.TokenBatch(3, [output], 90, 1, [1], 12.5, timing),
        m.HandoffResult(3, 1, True, 4096),
        m.LeaseExpired(0, 1),
        m.Failed(3, 1, "bad"),
    ]


TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # a W3C traceparent


def test_every_message_crosses_as_itself() -> None:

    sender, receiver = Codec(b"n" * 16), Codec(b"n" * 16)
    messages = every_message()
    assert {type(message) for message in messages} == set(MESSAGES.values())
    everything = tuple(MESSAGES.values())
    for message in messages:
        assert receiver.decode(sender.encode(message), everything) == message


def test_local_tensor_handles_never_leave_their_box() -> None:

    with pytest.raises(TypeError, match="local tensor handles does not leave its box"):
        Codec(b"n" * 16).encode(m.PeerPool(0, [(0, b"a pickled shared-memory tensor")]))
    with pytest.raises(TypeError, match="is not a message between boxes"):
        Codec(b"n" * 16).encode(CreatesAFile(Path("x")))


def test_the_tls_files_must_be_set_and_usable(certs: Certs) -> None:
    with pytest.raises(TlsSetupError, match=r"cluster\.ca_file, cluster\.cert_file, cluster"):
        box_context(ClusterSettings())
    wrong_key = ClusterSettings(**{**certs.settings("b"), "key_file": certs.folder / "c.key"})
    with pytest.raises(TlsSetupError, match=r"cluster\.cert_file .* cannot be used"):
        box_context(wrong_key)
    not_a_ca = ClusterSettings(**{**certs.settings("b"), "ca_file": certs.folder / "b.key"})
    with pytest.raises(TlsSetupError, match=r"cluster\.ca_file .* is not a readable CA"):
        head_context(not_a_ca)


def test_certs_adds_boxes_to_its_ca_and_never_replaces_one(tmp_path: Path) -> None:
    first = make_certs(tmp_path, ["b"])
    assert [one.name for one in first] == ["head", "b"]
    assert (tmp_path / "b.key").stat().st_mode & 0o777 == 0o600
    ca = (tmp_path / "ca.crt").read_bytes()
    [added] = make_certs(tmp_path, ["d"])  # later: the same CA signs box d
    assert added.name == "d" and (tmp_path / "ca.crt").read_bytes() == ca
    with pytest.raises(CertError, match="box 'b' has a certificate"):
        make_certs(tmp_path, ["b"])
    for bad in ("../x", "ca", "", "a b"):
        with pytest.raises(CertError, match="is not a box name"):
            make_certs(tmp_path, [bad])


def test_a_box_added_later_joins(head: Head, certs: Certs, tmp_path: Path) -> None:
    """`appliance certs` run again on the folder: box d's certificate is of the same CA."""
    folder = tmp_path / "certs"
    shutil.copytree(certs.folder, folder)
    make_certs(folder, ["d"])
    link = dial(head, Certs(folder), "d")
    link.send(hello("d"))
    got, _ = head.joined.get(timeout=10)
    assert got.box == "d"


# A silent box is found within 2.25 s; an answering one is never lost, even when this
# process is starved of the CPU for a second now and then (a loaded machine).
BEAT_S, SILENCE_S = 0.1, 0.6


def joined_box(head: Head, certs: Certs) -> Link:
    """Box b joined and admitted; its link (the agent's end) takes pings."""
    link = dial(head, certs)
    link.accepts = (SpawnWorker, Refused, c.Ping)
    link.send(hello())
    got, their_link = head.joined.get(timeout=10)
    head.head.admit(got, their_link)
    return link


def test_a_box_answering_heartbeats_stays_and_a_silent_one_is_lost_once(
    certs: Certs, tmp_path: Path
) -> None:
    """The agent's end answers each Ping with a Pong for a while, then stops answering
    while its connection stays open (as a frozen box's kernel keeps it): the head marks
    it lost once, within the timeout and a beat, naming the silence as the cause."""
    beats = {"heartbeat_interval_s": BEAT_S, "heartbeat_timeout_s": SILENCE_S}
    with listening(certs, tmp_path, **beats) as head:
        link = joined_box(head, certs)
        answered = 0
        until = time.monotonic() + 3 * SILENCE_S
        while time.monotonic() < until:  # answering: never lost
            if link.poll(0.1):
                ping = link.recv()
                assert isinstance(ping, c.Ping)
                link.send(c.Pong(ping.seq))
                answered += 1
        # a beat every 0.1 s for 1.8 s: 18, fewer on a loaded machine
        assert answered >= 6 and head.lost == [], (answered, head.causes)
        silent_since = time.monotonic()
        wait_until(lambda: head.lost == ["b"], 10, "box b lost", every_s=0.02)
        found_in = time.monotonic() - silent_since
        # within the timeout and a beat (and room for a loaded machine's scheduling)
        assert SILENCE_S - BEAT_S <= found_in <= SILENCE_S + BEAT_S + 1.5, found_in
        assert head.causes[0].startswith("no answer to heartbeats for")
        time.sleep(3 * SILENCE_S)
        assert head.lost == ["b"]  # once
        with pytest.raises((EOFError, OSError)):  # the head ended the link
            while True:
                link.recv()
        link.close()


def test_marking_a_box_lost_twice_loses_it_once(head: Head, certs: Certs) -> None:
    """The process manager's escalation (a stalled worker on box b) may come while the
    box is being lost for another reason: the box is lost once, for the first cause."""
    link = joined_box(head, certs)
    head.head.lose("b", "its worker 3 stalled")
    head.head.lose("b", "its worker 4 stalled")
    wait_until(lambda: head.lost == ["b"], 10, "box b lost")
    time.sleep(0.5)
    assert head.lost == ["b"] and head.causes == ["its worker 3 stalled"]
    assert not head.head.has_box("b")
    link.close()
