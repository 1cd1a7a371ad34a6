"""The supervisor: the pools' parts put together, and what happens when.

One asyncio loop owns all state. A reader thread turns the workers' pipes (one each)
into messages on that loop, each handled by `_dispatch`. The parts, one file each:
- appliance/pools/process_manager.py: the worker processes (spawn, inboxes, watch, restart, stop)
- appliance/pools/boxes.py: other boxes' agents joining and leaving (cluster.listen)
- appliance/pools/wiring.py: which decode worker holds which prefill worker's KV tensor
- appliance/pools/request_flow.py: each request's attempts and its stream of chunks
- appliance/pools/handoffs.py: prefilled prompts on their way to a decode worker (the
  request flow's: it hands them what it prefilled)
- appliance/core/request_table.py: each request's phase, timing and workers (pure)
- appliance/core/recovery.py: what a lost worker means for each request it held (pure)
- appliance/core/router.py: which worker takes a prompt or a handoff (pure)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from collections.abc import Set as AbstractSet
from typing import Any

from appliance.core.events import Event, EventKind, EventLog
from appliance.core.recovery import Action, after_worker_lost
from appliance.core.request_table import Phase, Request, RequestTable
from appliance.core.roles import Role
from appliance.core.router import Router
from appliance.core.tuning import Tuning, TuningPatch, batch_limits, check_for_mode, initial_tuning
from appliance.engine.sequence import SamplingParams
from appliance.planner.online_profile import box_facts, kv_sizes
from appliance.planner.profile import Profile
from appliance.planner.traffic_log import TrafficLog
from appliance.pools.boxes import Boxes
from appliance.pools.drains import Drains, Progress
from appliance.pools.kv_store_owner import StoreFigures, StoreOwner
from appliance.pools.process_manager import ProcessManager
from appliance.pools.request_flow import Chunk, RequestFailed, RequestFlow
from appliance.pools.wiring import Wiring
from appliance.pools.worker_handle import WorkerHandle, WorkerView
from appliance.settings.config import BatchSettings, Settings
from appliance.topology.devices import Topology
from appliance.topology.discovery import discover_box
from appliance.topology.partition import Partition, partition, tp_groups
from appliance.workers.messages import (
    Failed,
    FromWorker,
    HandoffResult,
    LeaseExpired,
    PeerDropped,
    PoolShared,
    Ready,
    StorePut,
    StoreReady,
    StoreRelease,
    StoreWritten,
    TokenBatch,
    Tune,
)
from appliance.workers.outboxes import OutboxReader

__all__ = ["Chunk", "RequestFailed", "Supervisor"]


class Supervisor:
    """Owns the workers of both pools and every request in flight."""

    def __init__(self, settings: Settings, topology: Topology | None = None) -> None:
        self.settings = settings
        topology = topology or discover_box(
            settings.device, settings.cpu_devices, settings.cpu_share_cores
        )
        devices = settings.prefill_devices, settings.decode_devices, settings.colocated_devices
        boxes = bool(settings.cluster.listen)  # decode may come from other boxes only
        self.partition: Partition = partition(topology, settings.mode, *devices, boxes=boxes)
        # Checked here, so a bad tensor-parallel degree fails before any process starts.
        self.layout = worker_layout(topology, self.partition, settings)
        self.tuning = initial_tuning(settings.batch)
        self.log = EventLog()
        self.table = RequestTable()  # every request in flight: its phase, timing, workers
        self.traffic = TrafficLog(settings.planner.window_s)  # what the rebalancer reads
        self.processes = ProcessManager(settings, topology, OutboxReader(self._deliver))
        rank = lambda a, b: self.topology.bandwidth_rank(a, b)  # noqa: E731 (boxes join: it grows)
        self.router = Router(settings.kv.block_size, settings.kv.prefix_caching, rank)
        self.boxes = Boxes(settings, self.processes, self.log)
        self.drains = Drains(self.table)
        self.wiring = Wiring(self.processes.workers, self.processes.send)
        self.flow = RequestFlow(
            settings,
            self.table,
            self.router,
            pool=self.processes,  # the workers' handles and inboxes
            tuning=lambda: self.tuning,  # tune() replaces the knobs
            log=self.log,
            drains=self.drains,
            traffic=self.traffic,
        )
        self.handoffs = self.flow.handoffs  # what workers answer and lost workers leave
        # The box's KV store (kv_store.enabled): opened when the first worker loads.
        self.kv_store = self.flow.store = StoreOwner(
            settings.kv_store, settings.kv.block_size, send=self.processes.send
        )
        self._capacity = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self, timeout: float = 300.0) -> None:
        """Spawn every worker and wait until each has loaded its model and is wired."""
        self.processes.start(self.layout, self)
        assert self.processes.all_ready is not None  # start() made it
        try:
            async with asyncio.timeout(timeout):  # not wait_for: see request_flow.next_item
                await self.processes.all_ready
        except TimeoutError:
            await self.stop()
            raise RuntimeError(f"workers not ready within {timeout:.0f} s") from None
        self.boxes.start()

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop every worker; requests still in flight end with an error."""
        await self.processes.stop(timeout)
        self.flow.fail_all("the appliance is shutting down")
        await asyncio.sleep(0)  # the blocks the workers sent as they stopped, into the store
        self.kv_store.close()

    def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        """Stream one request's chunks; leaving the loop early cancels it on both sides."""
        return self.flow.generate(prompt, params)

    # ------------------------------------------------------------ worker messages

    def _deliver(self, message: FromWorker) -> None:
        """From the reader thread: handle the message on the loop."""
        self.processes.loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, message: FromWorker) -> None:
        match message:
            case Ready():
                self._on_ready(message)
            case TokenBatch():
                self._on_tokens(message)
            case HandoffResult():
                self.handoffs.on_result(message)
            case PoolShared():
                self.wiring.on_pool_shared(message)
                self._mark_wired()
            case PeerDropped():
                self.wiring.on_peer_dropped(message)
            case Failed():
                if (request := self.table.by_wire(message.request_id)) is not None:
                    self.flow.fail(request, message.error)
            case StoreReady():
                self.kv_store.on_ready(message)
            case StorePut():
                self.kv_store.on_put(message)
            case StoreWritten():
                self.kv_store.on_written(message)
            case StoreRelease():
                self.kv_store.on_release(message)
            case LeaseExpired():
                if (request := self.table.on_lease_expired(message)) is not None:
                    reason = "its parked KV expired before a decode worker took it"
                    self.flow.retry(request, reason)
        self.drains.check()

    def _on_ready(self, message: Ready) -> None:
        worker = self.processes.workers.get(message.worker_id)
        if worker is None:
            return
        self.processes.mark_loaded(worker, message.num_blocks, message.shard_pids)
        block_size = self.settings.kv.block_size
        self.note(
            "worker",
            f"worker {worker.worker_id} ({worker.role}) loaded on {worker.device}: its "
            f"{message.num_blocks} KV blocks of {block_size} tokens hold "
            f"{message.num_blocks * block_size} tokens of context",
        )
        self.wiring.on_loaded(worker)
        self._mark_wired()

    def _mark_wired(self) -> None:
        """Wired workers take work; handoffs retry (a pool came: maybe one they wait for)."""
        wired = self.wiring.newly_wired()
        for worker in wired:
            self.processes.mark_ready(worker)
        if wired:
            self.flow.submit_waiting()
        self.handoffs.retry_waiting()

    def _on_tokens(self, batch: TokenBatch) -> None:
        worker = self.processes.workers.get(batch.worker_id)
        if worker is None or not worker.alive:  # retired or dead since it sent this
            return
        worker.reported(batch, time.monotonic())
        self.flow.on_tokens(worker, batch)  # streams it, hands off what it prefilled

    # ------------------------------------------------------------ lost workers (ProcessHooks)

    def settings_for(self, role: Role) -> Settings:
        """The settings with the live tuning a worker of `role` starts with."""
        limits = batch_limits(self.settings.batch, role, self.tuning)
        batch = BatchSettings(**{**self.settings.batch.model_dump(), **limits})
        return self.settings.model_copy(update={"batch": batch})

    def has_work(self, worker: WorkerHandle) -> bool:
        return self.table.owes_answer(worker.worker_id)

    def holding(self, worker_id: int) -> list[int]:
        return [r.request_id for r in self.table.held_by(worker_id)]

    def on_exit(self, worker: WorkerHandle) -> None:
        """A worker died: decode workers drop its pool, its requests go on elsewhere."""
        self.wiring.forget(worker.worker_id)
        self.router.forget(worker.worker_id)
        self.kv_store.forget_worker(worker.worker_id)
        reason = f"worker {worker.worker_id} exited"
        held = self.table.held_by(worker.worker_id)
        for step in after_worker_lost(held, worker.worker_id, self.max_retries):
            self._act(self.table.requests[step.request_id], step.action, reason)
        self.handoffs.retry_waiting()  # those waiting for it may go elsewhere, or fail
        self.drains.check()

    def on_gone(self, role: Role) -> None:
        self.flow.fail_waiting(role)
        self.handoffs.retry_waiting()

    @property
    def arriving(self) -> Counter[str]:
        """Roles a pool move is bringing to a device: requests wait for them, not fail
        (the process manager's count; the move adds and takes away)."""
        return self.processes.arriving

    async def release(self, worker: WorkerHandle) -> None:
        await self.wiring.release(worker.worker_id)

    @property
    def max_retries(self) -> int:
        return self.settings.recovery.max_request_retries

    def _act(self, request: Request, action: Action, reason: str, fault: bool = True) -> None:
        match action:
            case Action.REROUTE:  # KV parked in a prefill pool is still there
                if fault:  # a recovery (not a retired worker's handoffs): its event
                    self.note(
                        "worker",
                        f"request {request.request_id}: {reason}; its handoff goes to "
                        "another decode worker",
                        fault="rerun",
                        cause=reason,
                        requests=[request.request_id],
                    )
                self.handoffs.take_back(request)
            case Action.RERUN:
                self.flow.rerun(request, reason)
            case Action.FAIL:
                self.flow.fail_by_fault(request, f"{reason}; retried too often")

    # ------------------------------------------------------------ state (PoolState)

    @property
    def topology(self) -> Topology:
        """Every device: this box's, then those of each box that joined."""
        return self.processes.topology

    @property
    def workers(self) -> dict[int, WorkerHandle]:
        """Every worker by id (read it; the process manager changes it)."""
        return self.processes.workers

    @property
    def requests(self) -> dict[int, Request]:
        """Every request in flight by id, oldest first (read it, do not change it)."""
        return self.table.requests

    @property
    def events(self) -> list[Event]:
        """The latest events, oldest first."""
        return list(self.log.events)

    @property
    def failed_devices(self) -> AbstractSet[int]:
        return self.processes.failed_devices

    @property
    def ready(self) -> bool:
        """Every worker has loaded its model and the pools are wired together."""
        started = self.processes.all_ready
        if started is None or not started.done() or started.cancelled():
            return False
        return started.exception() is None

    def block_counts(self) -> dict[int, tuple[int, int]]:
        """Each worker's last reported (free, total) KV blocks."""
        return {w.worker_id: (w.num_free, w.num_blocks) for w in self.workers.values()}

    def capacity_tokens(self) -> int:
        """The longest sequence every worker's KV pool can hold (0 before they are ready)."""
        sizes = [w.num_blocks for w in self.workers.values() if w.alive and w.ready]
        if sizes:
            self._capacity = min(sizes) * self.settings.kv.block_size
        return self._capacity  # while every worker restarts: what they held before

    def views(self) -> list[WorkerView]:
        """A snapshot of every worker's state and load."""
        return [w.view(waiting=self.table.waiting_at(w.worker_id)) for w in self.workers.values()]

    def pending_handoffs(self) -> int:
        """Handoffs sent to a decode worker and not yet answered."""
        return len(self.table.in_phase(Phase.HANDING_OFF))

    def busy_with(self, worker_id: int) -> int:
        """Requests that still need this worker: running on it, or parked in its blocks
        until a decode worker has copied them."""
        return len(self.table.held_by(worker_id))

    # ------------------------------------------------------------ admin: events, tuning, moves

    def note(self, kind: EventKind, message: str, **fault: Any) -> Event:
        """Record an event for the admin API (and the log); `fault`: EventLog.note's
        fault fields."""
        return self.log.note(kind, message, **fault)

    @property
    def fault_events(self) -> list[Event]:
        """The latest fault events, oldest first (kept apart from the other events)."""
        return list(self.log.faults)

    @property
    def kv_store_figures(self) -> StoreFigures | None:
        """The box's KV store: what it holds and served; None while it is off or not open."""
        return self.kv_store.figures()

    @property
    def fault_counts(self) -> dict[str, int]:
        """Fault events since the start, by kind (core/events.py's FaultKind)."""
        return dict(self.log.fault_counts)

    def tune(self, patch: TuningPatch) -> Tuning:
        """Apply new knobs now: routing and admission here, batching limits in each worker's
        scheduler from its next step. Raises ValueError for a bad combination."""
        tuning = check_for_mode(patch.applied_to(self.tuning), tuning_mode(self))
        changed = {k: v for k, v in tuning.model_dump().items() if getattr(self.tuning, k) != v}
        self.tuning = tuning
        for worker in self.workers.values():
            limits = batch_limits(self.settings.batch, worker.role, tuning)
            if worker.alive and limits:
                worker.inbox.put(Tune(**limits))
        if changed:
            described = ", ".join(f"{k}={v}" for k, v in changed.items())
            self.note("admission" if set(changed) == {"admission"} else "tuning", described)
        return tuning

    def drain(
        self, worker_id: int, timeout: float, progress: Progress = lambda n: None
    ) -> Awaitable[bool]:
        """Route nothing new to the worker from now on; the awaitable returned waits until
        no request needs it, telling `progress` how many still do at each change, and is
        False if `timeout` passes first (the worker then takes work again)."""
        self.processes.start_draining(worker_id)
        idle = self.drains.start(worker_id, progress)
        return self._drained(worker_id, idle, timeout)

    async def _drained(self, worker_id: int, idle: asyncio.Event, timeout: float) -> bool:
        if await self.drains.wait(worker_id, idle, timeout):
            return True
        self.processes.stop_draining(worker_id)
        return False

    async def add_worker(
        self, role: Role, devices: int | tuple[int, ...], timeout: float
    ) -> WorkerHandle:
        """Start a worker of `role` on a device (or a tensor-parallel group of them) while
        the pools serve; returns once it takes requests. Raises RuntimeError if it exits
        or is not ready within `timeout`."""
        return await self.processes.add_worker(role, devices, timeout)

    async def retire(self, worker_id: int, timeout: float = 10.0) -> None:
        """Stop a worker that has nothing left to do and forget it; handoffs sent to it
        and not answered go to another decode worker."""
        await self.processes.retire(worker_id, timeout)
        self.router.forget(worker_id)
        for request in self.handoffs.sent_to(worker_id):
            self._act(request, Action.REROUTE, f"worker {worker_id} retired", fault=False)


def tuning_mode(supervisor: Supervisor) -> str:
    """ "colocated" while any worker prefills and decodes (its limits then bind)."""
    workers = supervisor.workers.values()
    colocated = any(w.role == "colocated" and w.alive for w in workers)
    return "colocated" if colocated else supervisor.settings.mode


def online_profile(supervisor: Supervisor, base: Profile | None = None) -> Profile | None:
    """`base` refined by the steps the workers ran (planner/online_profile.py); with no
    base, a profile of those steps alone (None until a worker size fits)."""
    online, sizes = supervisor.flow.online, kv_sizes(supervisor.workers.values())
    if base is not None:
        return online.profile(base, sizes)
    return online.standalone(box_facts(supervisor.settings, supervisor.topology), sizes)


def worker_layout(
    topology: Topology, part: Partition, settings: Settings
) -> list[tuple[Role, tuple[int, ...]]]:
    """Each worker to start: its role and its devices (several for tensor parallelism)."""
    if settings.mode == "colocated":
        groups = tp_groups(topology, part.prefill, settings.prefill_tp, "prefill_tp")
        return [("colocated", g) for g in groups]
    prefill = tp_groups(topology, part.prefill, settings.prefill_tp, "prefill_tp")
    decode = tp_groups(topology, part.decode, settings.decode_tp, "decode_tp")
    workers: list[tuple[Role, tuple[int, ...]]] = [("prefill", g) for g in prefill]
    workers += [("decode", g) for g in decode]
    return workers + [("colocated", (d,)) for d in part.colocated]  # one device each
