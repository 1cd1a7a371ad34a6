"""Other boxes joining and leaving a running appliance (when `cluster.listen` is set).

An agent that joins adds its box's devices to the topology (linked to the head's over the
network, so handoffs stay in a box where they can) and gets a worker on each, of the role
it offered. A box whose agent is lost loses its workers like any crash, but they are not
restarted until the box joins again: then each of its devices gets a worker again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from appliance.cluster.channel import Link, read_secret
from appliance.cluster.head import ClusterHead
from appliance.cluster.interfaces import with_interface
from appliance.cluster.messages import AgentHello
from appliance.cluster.tls import head_context
from appliance.core.events import EventLog
from appliance.core.roles import Role
from appliance.kv.remote_pool import require_nixl
from appliance.pools.process_manager import ProcessManager
from appliance.settings.cluster import ClusterSettings, host_port
from appliance.settings.config import Settings
from appliance.topology.devices import Device


class Boxes:
    """The head's listener for agents and what a box joining or leaving changes."""

    def __init__(
        self,
        settings: Settings,
        processes: ProcessManager,
        log: EventLog,
    ) -> None:
        self.settings = settings
        self.processes = processes
        self._note = log.note
        self.head: ClusterHead | None = None
        if settings.cluster.listen:  # before any worker starts: they take it with them
            require_nixl()
            read_secret(settings.cluster.secret_file)  # a missing secret or TLS file fails
            head_context(settings.cluster)  # here, not once the head's workers are up
            settings.cluster.interface = transfer_interface(settings.cluster)

    def start(self) -> None:
        """Listen for agents, if the settings say where (on the running loop; once the
        head's own workers are ready, so a box's worker cannot fail the head's start)."""
        if not self.settings.cluster.listen:
            return
        loop = asyncio.get_running_loop()
        self.head = ClusterHead(
            self.settings.cluster,
            loop.call_soon_threadsafe,
            self.joined,
            self.lost,
            self.processes.attach,  # a remote worker dialled in: that connection its outbox
        )
        self.processes.cluster = self.head
        self.head.start()

    def joined(self, hello: AgentHello, connection: Link) -> None:
        """A box joined (or rejoined): a worker of its role on each of its devices, or,
        if it offers other devices than before, turned away."""
        assert self.head is not None
        topology = self.processes.topology
        known = [d for d in topology.devices if d.box == hello.box]
        if known and identities(known) != identities(hello.devices):
            self._refuse(hello, known, connection)
            return
        self.head.admit(hello, connection)
        indices = [d.index for d in known]
        if not indices:
            topology = self.processes.topology = topology.with_box(hello.box, hello.devices)
            indices = [d.index for d in topology.devices if d.box == hello.box]
        self._note(
            "box",
            f"box {hello.box!r} joined with {len(hello.devices)} device(s) for {hello.pool}",
            fault="box_joined",
            box=hello.box,
            cause="its agent joined" if not known else "its agent joined again",
        )
        self.processes.forget_exited(indices)
        busy = {i for w in self.processes.workers.values() if w.alive for i in w.devices}
        for index in indices:
            if index not in busy:
                self._start(hello.pool, index)

    def _refuse(self, hello: AgentHello, known: Sequence[Device], connection: Link) -> None:
        """A known box offers other devices than when it first joined: its devices' numbers
        are taken here (workers, moves, the console refer to them), so it is turned away
        (a link it still has stays: this may be another machine claiming its name)."""
        reason = (
            f"it joined before with {names(known)} and now offers {names(hello.devices)}: "
            "restart the head to take the new devices, or join under another --box name"
        )
        assert self.head is not None
        self.head.refuse(connection, reason)
        self._note("box", f"refused box {hello.box!r}: {reason}")

    def lost(self, box: str, cause: str) -> None:
        """A box's link ended (`cause`: why): its workers have exited or soon will (the
        process manager re-runs their requests); one event says so."""
        workers = [w.worker_id for w in self.processes.workers.values() if w.box == box]
        held = {r for w in workers for r in self.processes.hooks.holding(w)}
        self._note(
            "box",
            f"lost box {box!r} ({cause}): its workers' requests go on elsewhere",
            fault="box_lost",
            box=box,
            cause=cause,
            requests=held,
        )

    def _start(self, role: Role, index: int) -> None:
        """Start a worker on a box's device; a start that fails while the box stays joined
        is tried again as a crashed worker's restart is (given up once, the box would stay
        joined with no worker until its agent joined again)."""
        self.processes.track(asyncio.create_task(self.processes.start_retrying(role, index)))


def transfer_interface(cluster: ClusterSettings) -> str:
    """The interface the head's KV transfer uses: the settings', else the one agents dial
    in on; ValueError when neither is known (UCX would listen on every interface)."""
    interface = with_interface(cluster, host_port(cluster.listen)[0]).interface
    if not interface:
        raise ValueError(
            f"cluster.listen={cluster.listen!r} is on no interface of this machine (a "
            "wildcard or a host name): set cluster.interface to the one the boxes share"
        )
    return interface


def identities(devices: Sequence[Device]) -> list[tuple[object, ...]]:
    """What makes a box's devices the same ones again (not their free memory)."""
    return [(d.kind, d.cores, d.ordinal, d.uuid) for d in devices]


def names(devices: Sequence[Device]) -> str:
    return ", ".join(f"{d.name} (cores {list(d.cores)})" if d.cores else d.name for d in devices)
