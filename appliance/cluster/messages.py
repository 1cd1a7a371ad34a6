"""What the head and the agents (and the workers agents start) say to each other over
their authenticated connections (channel.py). Each connection's first message says who
is calling: an agent (AgentHello) or one of its workers (WorkerHello)."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.core.roles import Role
from appliance.settings.config import Settings
from appliance.topology.devices import Device


@dataclass(frozen=True)
class AgentHello:
    """An agent joins: its box, the devices it offers and the role they take."""

    box: str
    devices: tuple[Device, ...]  # numbered on its own box, from 0
    pool: Role


@dataclass(frozen=True)
class WorkerHello:
    """A worker an agent started connects: this connection is its inbox and outbox."""

    worker_id: int
    pid: int


@dataclass(frozen=True)
class SpawnWorker:
    """To an agent: start worker `worker_id` of `role` on these devices of its box."""

    worker_id: int
    role: Role
    settings: Settings
    devices: tuple[Device, ...]


@dataclass(frozen=True)
class KillWorker:
    """To an agent: kill worker `worker_id` now."""

    worker_id: int


@dataclass(frozen=True)
class WorkerExited:
    """From an agent: its worker `worker_id` exited with `exitcode`."""

    worker_id: int
    exitcode: int | None


@dataclass(frozen=True)
class Refused:
    """To an agent: the head will not take this box (why, for its log); it exits."""

    reason: str


@dataclass(frozen=True)
class Ping:
    """To an agent, every cluster.heartbeat_interval_s: answer with Pong(seq) (from the
    agent's loop, so a frozen agent, whose kernel still keeps its TCP link up, is found)."""

    seq: int


@dataclass(frozen=True)
class Pong:
    """From an agent: its answer to Ping(seq)."""

    seq: int


ToAgent = SpawnWorker | KillWorker | Refused | Ping
