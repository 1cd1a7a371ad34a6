"""The head's side of other boxes: it listens on `cluster.listen` for agents and for the
workers they start, checks each caller holds the shared secret, keeps one link per agent,
and stands in for remote worker processes (RemoteProcess) and their inboxes (RemoteInbox)
so the process manager handles them as it handles its own.

Threads: one accepts, one per new connection runs the secret's challenge and reads the
caller's hello (a caller that never answers the challenge holds only its own thread, and
one that answers but says nothing is dropped after HELLO_TIMEOUT_S), one per agent reads
what it reports. What the supervisor must act on is handed to its loop.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from appliance.cluster.channel import read_secret
from appliance.cluster.messages import (
    AgentHello,
    KillWorker,
    SpawnWorker,
    ToAgent,
    WorkerExited,
    WorkerHello,
)
from appliance.cluster_settings import ClusterSettings, host_port
from appliance.config import Settings
from appliance.topology.devices import Device
from appliance.workers.messages import ToWorker

log = logging.getLogger("appliance.cluster")
HELLO_TIMEOUT_S = 10.0  # a caller must prove the secret and say hello within this
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


class RemoteInbox:
    """A remote worker's inbox: messages wait here until the worker has connected."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[ToWorker] = []
        self._connection: Connection | None = None

    def put(self, message: ToWorker) -> None:
        with self._lock:
            if self._connection is None:
                self._waiting.append(message)
                return
            try:
                self._connection.send(message)
            except OSError:  # it is gone: its exit is handled when its agent says so
                pass

    def attach(self, connection: Connection) -> None:
        with self._lock:
            self._connection = connection
            for message in self._waiting:
                connection.send(message)
            self._waiting.clear()


@dataclass
class AgentLink:
    """The head's link to one agent, and the remote workers it started for the head."""

    box: str
    devices: tuple[Device, ...]
    pool: str
    connection: Connection
    processes: dict[int, RemoteProcess] = field(default_factory=dict)
    inboxes: dict[int, RemoteInbox] = field(default_factory=dict)
    lost: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: ToAgent) -> None:
        with self._lock:
            if self.lost:
                return
            try:
                self.connection.send(message)
            except OSError:
                pass  # the reader thread sees the link end and reports the box lost


class ClusterHead:
    """Listens for agents and their workers; see the module docstring.

    `joined(hello)` and `lost(box)` run on the supervisor's loop (`call`); `attach(worker
    id, connection)` runs on a connection's thread (the outbox reader takes the connection)."""

    def __init__(
        self,
        settings: ClusterSettings,
        call: Callable[..., object],
        joined: Callable[[AgentHello], None],
        lost: Callable[[str], None],
        attach: Callable[[int, Connection], None],
    ) -> None:
        self.secret = read_secret(settings.secret_file)
        self.address = host_port(settings.listen)
        self.agents: dict[str, AgentLink] = {}
        self._call, self._joined, self._lost, self._attach = call, joined, lost, attach
        self._lock = threading.Lock()
        self._server = socket.create_server(self.address, reuse_port=False)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="cluster")

    def start(self) -> None:
        self._thread.start()
        log.info("listening for boxes on %s:%d", *self.address)

    def stop(self) -> None:
        self._stopping.set()
        self._server.close()
        with self._lock:
            agents = list(self.agents.values())
        for agent in agents:
            agent.lost = True
            agent.connection.close()

    def has_box(self, box: str) -> bool:
        with self._lock:
            agent = self.agents.get(box)
            return agent is not None and not agent.lost

    def spawn(
        self, worker_id: int, role: str, settings: Settings, devices: tuple[Device, ...]
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
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._greet, args=(sock,), daemon=True).start()

    def _greet(self, sock: socket.socket) -> None:
        """The secret's challenge both ways, then the caller's hello."""
        connection = Connection(sock.detach())
        try:
            deliver_challenge(connection, self.secret)
            answer_challenge(connection, self.secret)
            if not connection.poll(HELLO_TIMEOUT_S):
                raise TimeoutError("no hello")
            hello = connection.recv()
        except (AuthenticationError, EOFError, OSError, TimeoutError) as error:
            log.warning("refused a connection to the cluster port: %s", error or "no secret")
            connection.close()
            return
        match hello:
            case AgentHello():
                self._agent_joined(hello, connection)
            case WorkerHello():
                self._worker_connected(hello, connection)
            case _:
                connection.close()

    def _agent_joined(self, hello: AgentHello, connection: Connection) -> None:
        agent = AgentLink(hello.box, hello.devices, hello.pool, connection)
        with self._lock:
            old = self.agents.get(hello.box)
            if old is not None and not old.lost:
                log.warning("box %r joined twice: refusing the second", hello.box)
                connection.close()
                return
            self.agents[hello.box] = agent
        threading.Thread(target=self._read_agent, args=(agent,), daemon=True).start()
        self._call(self._joined, hello)

    def _worker_connected(self, hello: WorkerHello, connection: Connection) -> None:
        with self._lock:
            found = [a for a in self.agents.values() if hello.worker_id in a.inboxes]
        if not found:
            connection.close()  # a worker the head did not ask for (or forgot)
            return
        agent = found[0]
        agent.processes[hello.worker_id].pid = hello.pid
        self._attach(hello.worker_id, connection)
        agent.inboxes[hello.worker_id].attach(connection)

    def _read_agent(self, agent: AgentLink) -> None:
        """What one agent reports, until its link ends: then every worker it ran exited."""
        while True:
            try:
                message = agent.connection.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, WorkerExited):
                process = agent.processes.get(message.worker_id)
                if process is not None:
                    process.exited(message.exitcode)
        with agent._lock:
            agent.lost = True
        for process in agent.processes.values():
            if process.is_alive():
                process.exited(LOST)
        if not self._stopping.is_set():
            log.warning("lost box %r", agent.box)
            self._call(self._lost, agent.box)
