"""`appliance agent`: a box that lends its devices to a head. It joins the head (over
TLS with the box's certificate of the cluster's CA, and the shared secret), offers its
devices, starts a worker process for each SpawnWorker (the worker then talks to the head
itself), and says when one exits. When the head goes away the agent exits, and its
workers with it; systemd brings it back and it joins again."""

from __future__ import annotations

import logging
import socket
from multiprocessing.process import BaseProcess

from appliance.cluster.channel import Link, connect, read_secret
from appliance.cluster.interfaces import with_interface
from appliance.cluster.messages import (
    AgentHello,
    KillWorker,
    Ping,
    Pong,
    Refused,
    SpawnWorker,
    WorkerExited,
)
from appliance.cluster.remote_worker import run_remote_worker
from appliance.cluster.tls import box_context
from appliance.kv.remote_pool import require_nixl
from appliance.settings.config import Settings
from appliance.topology.discovery import discover_box
from appliance.workers.fork_server import worker_context
from appliance.workers.lifetime import start_holding_ctrl_c

log = logging.getLogger("appliance.agent")
REFUSED_EXIT = 78  # EX_CONFIG: joining again would be refused again (the unit does not retry)
JOIN_TIMEOUT_S = 60.0
WATCH_S = 0.2  # how often the agent looks for exited workers
SPAWN_FAILED = 1  # the exit code reported for a worker whose process could not start


class BoxRefused(Exception):
    """The head will not take this box as it is (its reason in the message)."""


class Agent:
    """One box's agent: its connection to the head and the workers it started."""

    def __init__(self, settings: Settings) -> None:
        cluster = settings.cluster
        if not cluster.head:
            raise ValueError("an agent needs cluster.head (--head host:port) to join")
        require_nixl()
        self.settings = settings
        self.secret = read_secret(cluster.secret_file)
        self.context = box_context(cluster)  # its files checked before anything starts
        self.box = cluster.box or socket.gethostname()
        self.topology = discover_box(
            settings.device, settings.cpu_devices, settings.cpu_share_cores
        )
        self.workers: dict[int, BaseProcess] = {}
        self._ctx = worker_context()  # forks of a server that imported the worker once
        self._head: Link | None = None
        self._interface = ""  # the KV transfer's interface on this box (join() finds it)

    def join(self) -> None:
        """Connect to the head and offer this box's devices."""
        cluster = self.settings.cluster
        self._head = connect(
            cluster.head, self.secret, self.context, JOIN_TIMEOUT_S, cluster.address
        )
        self._head.accepts = (SpawnWorker, KillWorker, Refused, Ping)  # all a head tells us
        # This box's own if set, else the one it reaches the head from.
        self._interface = with_interface(cluster, self._head.local_ip()).interface
        self._head.send(AgentHello(self.box, self.topology.devices, cluster.pool))
        names = ", ".join(d.name for d in self.topology.devices)
        log.info("joined %s as box %r with %s (%s)", cluster.head, self.box, names, cluster.pool)

    def serve(self) -> None:
        """Start and stop workers as the head says, until the head goes away."""
        head = self._head
        assert head is not None, "join() first"
        while True:
            try:
                if head.poll(WATCH_S):
                    self._handle(head.recv())
                self._report_exits()
            # WireError too (a frame we do not take); a send fails as well once the head
            # has dropped the link (a Pong to a Ping it sent before: this box froze). A
            # worker that cannot start is _spawn's to report, not taken for the link's end.
            except (EOFError, OSError) as error:
                log.info("the link to the head ended (%s): stopping", error or "closed")
                return

    def stop(self) -> None:
        for process in self.workers.values():
            process.kill()
        for process in self.workers.values():
            process.join(5)
        if self._head is not None:
            self._head.close()

    def _handle(self, message: object) -> None:
        match message:
            case SpawnWorker():
                self._spawn(message)
            case KillWorker():
                process = self.workers.get(message.worker_id)
                if process is not None:
                    process.kill()
            case Refused():
                raise BoxRefused(f"the head refused box {self.box!r}: {message.reason}")
            case Ping():  # answered from this loop: a frozen agent answers nothing
                assert self._head is not None
                self._head.send(Pong(message.seq))

    def _spawn(self, message: SpawnWorker) -> None:
        # The head's settings (transports, ports, timeout hold for the whole cluster), but
        # this box's interface for the KV transfer: the head's names an interface there.
        cluster = message.settings.cluster.model_copy(update={"interface": self._interface})
        # And no KV store: the head's is its own box's (a host tier in its shared memory,
        # owned by its supervisor), which a worker here can neither map nor reach over the
        # link (its messages are not box-link messages: the worker died at StoreReady).
        kv_store = message.settings.kv_store.model_copy(update={"enabled": False})
        settings = message.settings.model_copy(update={"cluster": cluster, "kv_store": kv_store})
        args = (
            self.settings.cluster,
            self.secret,
            message.worker_id,
            message.role,
            settings,
            message.devices,
        )
        process = self._ctx.Process(target=run_remote_worker, args=args, daemon=True)
        try:
            start_holding_ctrl_c(process)
        except OSError as error:  # no fork, no memory, no fds: the worker exits, not the box
            log.error("could not start worker %d (%s): %s", message.worker_id, message.role, error)
            assert self._head is not None
            self._head.send(WorkerExited(message.worker_id, SPAWN_FAILED))
            return
        self.workers[message.worker_id] = process
        log.info("started worker %d (%s) as pid %s", message.worker_id, message.role, process.pid)

    def _report_exits(self) -> None:
        assert self._head is not None
        for worker_id, process in list(self.workers.items()):
            if not process.is_alive():
                del self.workers[worker_id]
                self._head.send(WorkerExited(worker_id, process.exitcode))


def run_agent(settings: Settings) -> int:
    """The `appliance agent` command: join, serve, and exit when the head goes away."""
    agent = Agent(settings)
    agent.join()
    try:
        agent.serve()
    finally:
        agent.stop()
    return 0
