"""A worker process as the supervisor keeps track of it, and the view /health shows."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from appliance.core.roles import Role
from appliance.engine.speculative.acceptance import AcceptanceCounts
from appliance.workers.messages import TokenBatch, ToWorker


class Inbox(Protocol):
    """A worker's inbox as the supervisor sees it: it only puts messages in."""

    def put(self, message: ToWorker, /) -> None: ...


class WorkerProcess(Protocol):
    """A worker's process as the supervisor watches it: a local process, or a stand-in
    for one on another box (cluster/head.py's RemoteProcess)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None, /) -> None: ...

    def kill(self) -> None: ...


class WorkerPool(Protocol):
    """The workers as the request flow and the handoffs reach them (the process manager
    is this): their handles to read, their inboxes to send to, and whether one of a role
    is on its way."""

    @property
    def workers(self) -> Mapping[int, WorkerHandle]:
        """Every worker by id (read it: the process manager changes it)."""
        ...

    def send(self, worker_id: int | None, message: ToWorker, /) -> None:
        """Put a message in a worker's inbox; a worker that is gone is skipped."""
        ...

    def may_come_back(self, role: Role, /) -> bool:
        """A worker of `role` is starting, restarting, or on its way by a pool move."""
        ...


@dataclass
class WorkerHandle:
    """One worker: its process and inbox, its place in the pools, its last reported load."""

    worker_id: int
    role: Role  # "prefill", "decode" or "colocated"
    device_index: int  # the first of its devices: the one its own process runs on
    device: str
    cores: tuple[int, ...]
    inbox: Inbox
    process: WorkerProcess
    devices: tuple[int, ...] = ()  # all of them: a tensor-parallel worker has several
    box: str = ""  # the box it runs on: "" for the head's own
    shard_pids: list[int] = field(default_factory=list)  # its other shards' processes
    loaded: bool = False  # it said Ready: the model is loaded
    ready: bool = False  # loaded and wired to the other pool's KV tensors: it takes work
    alive: bool = True  # False once its process has exited: routing skips it
    draining: bool = False  # takes no new work (its device is moving to the other pool)
    stopping: bool = False  # told to shut down: its exit is expected
    started: asyncio.Future | None = None  # set when a worker joining a running pool is ready
    num_blocks: int = 0
    num_free: int = 0  # free KV blocks, as of its last report
    taken_blocks: int = 0  # KV blocks of handoffs it took since that report
    refused: bool = False  # refused a handoff since that report: no room until it says so
    running: int = 0
    queued_tokens: int = 0  # of prompts sent and not yet answered: the tokens they compute here
    tokens_out: int = 0  # tokens it has produced
    # Its process's speculative decoding totals, as of its last report (a restarted
    # process counts from 0 again).
    speculation: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    partial_tokens: int = 0  # its prompt tokens served from partial blocks, the same way
    last_report: float = 0.0  # monotonic time of its last step report
    last_work: float = 0.0  # monotonic time it was last sent a prompt or a handoff
    restarts: int = 0
    peers: set[int] = field(default_factory=set)  # decode: prefill workers whose KV it holds
    # Its KV pool can be handed off from (made by a prefill worker, or on a GPU, where any
    # pool can): it can turn prefill in place.
    shares_pool: bool = False

    def __post_init__(self) -> None:
        self.devices = self.devices or (self.device_index,)

    # Its load changes only here, each method named for what happened: the pools' other
    # parts report events, the handle keeps the counters (tests/pools/
    # test_worker_handle_ownership.py holds the rule).

    def pool_allocated(self, num_blocks: int) -> None:
        """It loaded with a KV pool of `num_blocks` blocks, all free."""
        self.num_blocks = self.num_free = num_blocks

    def reported(self, batch: TokenBatch, now: float) -> None:
        """A step report: its free blocks and running requests as of now; the handoffs it
        took and refused before are in these counts (room may have come)."""
        self.num_free, self.running = batch.num_free_blocks, batch.num_running
        self.taken_blocks, self.refused = 0, False
        self.last_report = now
        self.tokens_out += sum(len(out.token_ids) for out in batch.outputs)
        self.speculation = batch.speculation
        self.partial_tokens = batch.partial_tokens

    def sent_prompt(self, tokens: int, now: float) -> None:
        """A prompt went to it that computes `tokens` of its tokens here (the router's
        guess, its cached prefix not counted): queued until its first token comes."""
        self.queued_tokens += tokens
        self.last_work = now

    def unqueued(self, tokens: int) -> None:
        """A prompt queued as `tokens` (what `sent_prompt` counted) left its queue: its
        first token came, or its request ended before that."""
        self.queued_tokens -= tokens

    def sent_handoff(self, now: float) -> None:
        """A handoff went to it (a decode worker): it has work from now."""
        self.last_work = now

    def refused_handoff(self) -> None:
        """It had no room for a handoff: none goes to it until its next report."""
        self.refused = True

    def took_handoff(self, blocks: int) -> None:
        """It took a handoff of `blocks` KV blocks, which its next report will count."""
        self.taken_blocks += blocks

    @property
    def routable(self) -> bool:
        """Whether new requests (or handoffs) may go to it."""
        return self.alive and self.ready and not self.draining

    @property
    def routable_soon(self) -> bool:
        """Alive and not on its way out: it takes work once loaded and wired."""
        return self.alive and not self.draining and not self.stopping

    @property
    def phase(self) -> str:
        """starting, ready, draining, stopping or exited."""
        if not self.alive:
            return "exited"
        if self.stopping:
            return "stopping"
        if self.draining:
            return "draining"
        return "ready" if self.ready else "starting"

    def view(self, waiting: int) -> WorkerView:
        """What /health and the admin API show of it; `waiting`: requests sent to it whose
        first step has not run (the request table knows)."""
        return WorkerView(
            worker_id=self.worker_id,
            role=self.role,
            device=self.device,
            ready=self.ready,
            alive=self.alive,
            waiting=waiting,
            running=self.running,
            num_free_blocks=self.num_free,
            num_blocks=self.num_blocks,
            restarts=self.restarts,
            phase=self.phase,
            device_index=self.device_index,
            pid=self.process.pid,
            tokens_out=self.tokens_out,
            devices=self.devices,
            shard_pids=tuple(self.shard_pids),
            speculation=self.speculation,
            partial_tokens=self.partial_tokens,
        )


@dataclass
class WorkerView:
    """One worker as the server's /health and /metrics show it."""

    worker_id: int
    role: Role
    device: str
    ready: bool
    alive: bool
    waiting: int  # requests sent to it whose first model step has not run yet
    running: int
    num_free_blocks: int
    num_blocks: int
    restarts: int
    phase: str  # starting, ready, draining, stopping, exited
    device_index: int
    pid: int | None
    tokens_out: int
    devices: tuple[int, ...] = ()  # its tensor-parallel group, device_index first
    shard_pids: tuple[int, ...] = ()  # the processes on devices[1:], once loaded
    speculation: AcceptanceCounts = field(default_factory=AcceptanceCounts)  # its totals
    partial_tokens: int = 0  # prompt tokens its prefix cache served from partial blocks

    def pid_on(self, device: int) -> int | None:
        """The process that computes on `device` (a shard's, in a tensor-parallel group)."""
        if self.phase == "exited" or device not in self.devices:
            return None  # a pid of a process gone may name another one by now
        index = self.devices.index(device)
        if index == 0:
            return self.pid
        return self.shard_pids[index - 1] if index <= len(self.shard_pids) else None
