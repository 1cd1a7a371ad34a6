"""The head's side of other boxes: it listens on `cluster.listen` for agents and for the
workers they start, takes only callers with a certificate of the cluster's CA that hold the
shared secret (channel.py), keeps one link per agent, and stands in for remote worker
processes (RemoteProcess) and their inboxes (RemoteInbox) so the process manager handles
them as it handles its own. A caller speaks for the box its certificate names: an agent
for that box alone, a worker only if that box's agent was asked to start it.

Threads: one accepts, one per new connection runs TLS, the secret's challenge and reads
the caller's hello, all within HELLO_TIMEOUT_S (a caller that stalls holds only its own
thread until then), one per agent reads what it reports, and one beats: it pings every
agent each `cluster.heartbeat_interval_s` and drops the link of one that has said nothing
for `cluster.heartbeat_timeout_s` (a frozen box: TCP keepalive does not find it, as its
kernel still answers), which then ends as any lost link does. What the supervisor must
act on is handed to its loop.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.cluster.channel import Link, accept, read_secret
from appliance.cluster.messages import (
    AgentHello,
    KillWorker,
    Ping,
    Pong,
    Refused,
    SpawnWorker,
    ToAgent,
    WorkerExited,
    WorkerHello,
)
from appliance.cluster.tls import head_context
from appliance.cluster.wire import FROM_WORKER, HELLOS
from appliance.core.roles import Role
from appliance.settings.cluster import ClusterSettings, host_port
from appliance.settings.config import Settings
from appliance.topology.devices import Device

log = logging.getLogger("appliance.cluster")
HELLO_TIMEOUT_S = 10.0  # a caller must finish TLS, prove the secret and say hello within this
MAX_GREETINGS = 64  # callers proving the secret at once; more are turned away
ACCEPT_RETRY_S = 0.5
LOST = -1  # the exit code a remote worker gets when its box is lost


class RemoteProcess:
    """A worker process on another box, as the process manager watches it: alive until
    its agent says it exited or the agent's link is lost."""

    def __init__(self, worker_id: int, agent: AgentLink) -> None:
        self.worker_id = worker_id
        self.pid: int | None = None  # on its own box, once it has connected
        self.exitcode: int | None = None
        self._agent = agent
        self._exited = threading.Event()

    def is_alive(self) -> bool:
        return not self._exited.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._exited.wait(timeout)

    def kill(self) -> None:
        self._agent.send(KillWorker(self.worker_id))

    def exited(self, exitcode: int | None) -> None:
        self.exitcode = exitcode
        self._exited.set()


def workers_lost(processes: list[RemoteProcess]) -> None:
    """Workers of a lost box: exited, as far as the head can tell."""
    for process in processes:
        if process.is_alive():
            process.exited(LOST)


class Sender:
    """Messages to one remote end, sent by a thread of their own: a box that stops reading
    (hung, cut off) fills its socket's buffer, and a send on the supervisor's loop would
    then block the whole head (as mp.Queue's feeder thread spares local inboxes). Until
    `attach`, messages wait; after the connection fails, they are dropped (the end's loss
    is seen by its reader)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, message: object) -> None:
        self._queue.put(message)

    def attach(self, connection: Link) -> None:
        self._thread = threading.Thread(target=self._send, args=(connection,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._queue.put(_CLOSE)

    def _send(self, connection: Link) -> None:
        while (message := self._queue.get()) is not _CLOSE:
            try:
                connection.send(message)
            except (OSError, ValueError):  # gone, or closed by the reader meanwhile
                return


_CLOSE = object()  # tells a Sender's thread to end


RemoteInbox = Sender  # a remote worker's inbox: messages wait until it has connected


@dataclass
class AgentLink:
    """The head's link to one agent, and the remote workers it started for the head."""

    box: str
    devices: tuple[Device, ...]
    pool: str
    connection: Link
    processes: dict[int, RemoteProcess] = field(default_factory=dict)
    inboxes: dict[int, RemoteInbox] = field(default_factory=dict)
    lost: bool = False
    sender: Sender = field(default_factory=Sender)
    heard: float = field(default_factory=time.monotonic)  # when it last said anything
    lost_cause: str = ""  # why its link was dropped, once it was

    def __post_init__(self) -> None:
        self.sender.attach(self.connection)

    def send(self, message: ToAgent) -> None:
        if not self.lost:
            self.sender.put(message)

    def drop(self, cause: str = "") -> None:
        """Mark the link lost and end it (its reader then reports the box lost, and why:
        `cause`, or else that its link ended)."""
        if not self.lost:
            self.lost_cause = cause
        self.lost = True
        self.sender.close()
        self.connection.shutdown()


class ClusterHead:
    """Listens for agents and their workers; see the module docstring.

    `joined(hello, connection)` and `lost(box, cause)` run on the supervisor's loop (`call`);
    joined answers with `admit` or `refuse`. `attach(worker id, connection)` runs on a
    connection's thread (the outbox reader takes the connection)."""

    def __init__(
        self,
        settings: ClusterSettings,
        call: Callable[..., object],
        joined: Callable[[AgentHello, Link], None],
        lost: Callable[[str, str], None],
        attach: Callable[[int, Link], None],
    ) -> None:
        self.secret = read_secret(settings.secret_file)
        self.context = head_context(settings)  # before anything listens: a bad file fails here
        self.address = host_port(settings.listen)
        self.beat_s, self.silence_s = settings.heartbeat_interval_s, settings.heartbeat_timeout_s
        self.agents: dict[str, AgentLink] = {}
        self._call, self._joined, self._lost, self._attach = call, joined, lost, attach
        self._lock = threading.Lock()
        self._server = socket.create_server(self.address, reuse_port=False)
        self._stopping = threading.Event()
        self._greeting = threading.BoundedSemaphore(MAX_GREETINGS)
        self._thread = threading.Thread(target=self._accept, daemon=True, name="cluster")
        self._beating = threading.Thread(target=self._beat, daemon=True, name="heartbeat")

    def start(self) -> None:
        self._thread.start()
        self._beating.start()
        log.info("listening for boxes on %s:%d", *self.address)

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):  # wakes the accepting thread
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        with self._lock:
            agents = list(self.agents.values())
        for agent in agents:
            agent.drop()

    def has_box(self, box: str) -> bool:
        with self._lock:
            agent = self.agents.get(box)
            return agent is not None and not agent.lost

    def lose(self, box: str, cause: str) -> None:
        """Mark a box lost now (`cause`: why, for the event): its link is dropped, and its
        reader reports it as any lost box. A box already lost is left as it is."""
        with self._lock:
            agent = self.agents.get(box)
        if agent is not None and not agent.lost:
            agent.drop(cause)

    def admit(self, hello: AgentHello, connection: Link) -> None:
        """Take a box that joined: its link replaces any old one, and is read from now."""
        connection.accepts = (WorkerExited, Pong)  # all an agent reports
        agent = AgentLink(hello.box, hello.devices, hello.pool, connection)
        with self._lock:
            old = self.agents.get(hello.box)
            self.agents[hello.box] = agent
        if old is not None and not old.lost:
            # Its agent came back (a reboot, a cut the head had not seen yet): the old
            # link is stale, and ending it loses that box's workers as any loss does.
            log.warning("box %r joined again: dropping its old link", hello.box)
            old.drop("it joined again on a new link")
        threading.Thread(target=self._read_agent, args=(agent,), daemon=True).start()

    def refuse(self, connection: Link, reason: str) -> None:
        """Turn a box that joined away (its agent exits); a link it had stays as it is."""
        threading.Thread(target=_say_and_close, args=(connection, Refused(reason))).start()

    def spawn(
        self, worker_id: int, role: Role, settings: Settings, devices: tuple[Device, ...]
    ) -> tuple[RemoteInbox, RemoteProcess]:
        """Ask the devices' agent to start a worker; its stand-ins here. On a box that is
        gone the process has exited already."""
        with self._lock:
            agent = self.agents.get(devices[0].box)
        if agent is None:
            raise RuntimeError(f"box {devices[0].box!r} never joined")
        process, inbox = RemoteProcess(worker_id, agent), RemoteInbox()
        with self._lock:
            agent.processes[worker_id], agent.inboxes[worker_id] = process, inbox
        if agent.lost:
            process.exited(LOST)
        else:
            agent.send(SpawnWorker(worker_id, role, settings, devices))
        return inbox, process

    # ------------------------------------------------------------ threads

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._server.accept()
            except OSError as error:
                if self._stopping.is_set():
                    return  # closed by stop()
                log.warning("accepting on the cluster port failed: %s", error)
                time.sleep(ACCEPT_RETRY_S)  # out of descriptors, an aborted caller: go on
                continue
            if not self._greeting.acquire(blocking=False):
                sock.close()  # too many callers still proving the secret
                continue
            threading.Thread(target=self._greet, args=(sock,), daemon=True).start()

    def _greet(self, sock: socket.socket) -> None:
        """TLS, the secret's challenge both ways, then the caller's hello, all within
        HELLO_TIMEOUT_S (a read past it fails)."""
        peer = sock.getpeername()[0]
        try:
            connection = accept(sock, self.secret, self.context, HELLO_TIMEOUT_S)
            connection.accepts = HELLOS
            hello = connection.recv()
            sock.settimeout(None)  # from now on it may idle
        except Exception as error:  # no certificate of ours, a wrong secret, a garbled caller
            log.warning("refused a connection to the cluster port from %s: %s", peer, error)
            sock.close()
            return
        finally:
            self._greeting.release()
        match hello:
            case AgentHello() if hello.box != connection.peer:
                log.warning(
                    "refused box %r from %s: its certificate is %r's",
                    hello.box,
                    peer,
                    connection.peer,
                )
                reason = f"its certificate names box {connection.peer!r}, not {hello.box!r}"
                self.refuse(connection, reason)
            case AgentHello():
                log.info("box %r joins from %s", hello.box, peer)
                self._call(self._joined, hello, connection)  # which admits or refuses it
            case WorkerHello():
                self._worker_connected(hello, connection)

    def _worker_connected(self, hello: WorkerHello, connection: Link) -> None:
        with self._lock:
            found = [
                (a.processes[hello.worker_id], a.inboxes[hello.worker_id])
                for a in self.agents.values()
                if hello.worker_id in a.inboxes and a.box == connection.peer
            ]
        if not found:
            # A worker the head did not ask this box for (or forgot: it exited).
            log.warning("refused worker %d from box %r", hello.worker_id, connection.peer)
            connection.close()
            return
        [(process, inbox)] = found
        process.pid = hello.pid
        connection.accepts = FROM_WORKER
        self._attach(hello.worker_id, connection)
        inbox.attach(connection)

    def _read_agent(self, agent: AgentLink) -> None:
        """What one agent reports, until its link ends: then every worker it ran exited."""
        while True:
            try:
                message = agent.connection.recv()
            except Exception:  # ended, timed out (keepalive), or a message we cannot read
                break
            agent.heard = time.monotonic()  # any message shows its loop runs, a Pong too
            if isinstance(message, WorkerExited):
                with self._lock:  # a worker id is never reused: forget it here
                    process = agent.processes.pop(message.worker_id, None)
                    inbox = agent.inboxes.pop(message.worker_id, None)
                if inbox is not None:
                    inbox.close()
                if process is not None:
                    process.exited(message.exitcode)
        agent.drop("its link ended")
        with self._lock:
            processes = [p for p in agent.processes.values() if p.is_alive()]
        if self._stopping.is_set():
            workers_lost(processes)
            return
        # On the supervisor's loop, the loss first (one line, one event naming the requests
        # the box's workers held), then their exits: marked exited here, the watchdog could
        # re-run those requests first and the event would name none.
        self._call(self._lose_box, agent.box, agent.lost_cause, processes)

    def _lose_box(self, box: str, cause: str, processes: list[RemoteProcess]) -> None:
        self._lost(box, cause)
        workers_lost(processes)

    def _beat(self) -> None:
        """Ping every agent each beat_s; drop the link of one silent for over silence_s."""
        sequence = 0
        while not self._stopping.wait(self.beat_s):
            now = time.monotonic()
            with self._lock:
                agents = [a for a in self.agents.values() if not a.lost]
            for agent in agents:
                silent = now - agent.heard
                if silent > self.silence_s:
                    agent.drop(f"no answer to heartbeats for {silent:.1f} s")
                else:
                    agent.send(Ping(sequence))
            sequence += 1


def _say_and_close(connection: Link, message: object) -> None:
    with contextlib.suppress(OSError, ValueError):
        connection.send(message)
    connection.close()
