"""A worker an agent starts for the head: it dials the head, says which worker it is,
and then is the same worker as on the head's own box, its inbox and outbox being that
one connection."""

from __future__ import annotations

import os
from typing import Any, cast

from appliance.cluster.channel import ConnectionInbox, connect
from appliance.cluster.messages import WorkerHello
from appliance.cluster.tls import box_context
from appliance.cluster.wire import TO_WORKER
from appliance.core.roles import Role
from appliance.settings.cluster import ClusterSettings
from appliance.settings.config import Settings
from appliance.topology.devices import Device
from appliance.workers.lifetime import ignore_ctrl_c
from appliance.workers.messages import Shutdown
from appliance.workers.outboxes import Outbox

CONNECT_TIMEOUT_S = 30.0


def run_remote_worker(
    cluster: ClusterSettings,
    secret: bytes,
    worker_id: int,
    role: Role,
    settings: Settings,
    devices: tuple[Device, ...],
) -> None:
    """Process entry point (a fork of the agent's fork server, dies with the agent);
    `cluster` is the agent's: where the head is, and the address to connect from. The
    worker (and torch with it) is imported by the fork server, never by the agent, which
    runs no model."""
    # Ctrl-C reaches the agent's whole process group: the agent decides when its workers
    # stop (they die with it), as a head's supervisor does for its own.
    ignore_ctrl_c()
    from appliance.workers.worker import run_worker

    context = box_context(cluster)  # the box's certificate: the head knows it by it
    connection = connect(cluster.head, secret, context, CONNECT_TIMEOUT_S, cluster.address)
    connection.accepts = TO_WORKER
    connection.send(WorkerHello(worker_id, os.getpid()))
    inbox = ConnectionInbox(connection, Shutdown())
    try:
        outbox = Outbox(connection)
        run_worker(worker_id, role, settings, devices, cast("Any", inbox), outbox)
    finally:
        connection.close()
