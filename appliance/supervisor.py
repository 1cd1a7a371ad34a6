"""The supervisor: spawns the pools' workers, routes requests, moves handoffs, streams tokens.

One asyncio loop owns all state. A reader thread turns the workers' pipes (one each)
into calls on that loop. Where each prompt and handoff goes is the router's choice
(appliance/router.py); each request's phase, timing and workers are the request table's
(appliance/request_table.py), and what a lost worker means for them is recovery's
(appliance/recovery.py): this class carries out what they decide.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import torch.multiprocessing as mp

from appliance.admin.schema import Event, Tuning, TuningPatch
from appliance.config import BatchSettings, Settings
from appliance.engine.sequence import SamplingParams
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.recovery import Action, after_worker_lost, retry_action
from appliance.request_table import ParkedKV, Phase, Request, RequestTable
from appliance.restart_policy import RestartPolicy
from appliance.router import Router
from appliance.topology.devices import Topology
from appliance.topology.discovery import discover
from appliance.topology.partition import Partition, partition, tp_groups
from appliance.worker_handle import WorkerHandle, WorkerView
from appliance.workers.messages import (
    Abort,
    DropPeer,
    Failed,
    Handoff,
    HandoffResult,
    LeaseExpired,
    Output,
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
from appliance.workers.outboxes import Outbox, OutboxReader
from appliance.workers.worker import run_worker

log = logging.getLogger("appliance.supervisor")

HANDOFF_RETRY_S = 0.01  # a decode pool without room is asked again this much later
WATCH_INTERVAL_S = 0.2  # how often worker processes are checked for being alive
DROP_PEER_TIMEOUT_S = 10.0  # how long decode workers get to let go of a retiring pool
MAX_EVENTS = 200  # events kept for the admin API

EventKind = Literal["move", "tuning", "worker", "admission"]  # as Event.kind allows


class RequestFailed(RuntimeError):
    """A request ended with an error (bad input seen by a worker, a lost worker)."""


@dataclass
class Chunk:
    """A piece of one request's stream."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    timing: dict[str, float] | None = None  # on the last chunk: Timing.as_dict()
    handoff_bytes: int = 0  # on the last chunk: KV bytes copied from prefill to decode pool
    cached_tokens: int = 0  # on the first chunk: prompt tokens the prefix cache supplied


class Supervisor:
    """Owns the workers of both pools and every request in flight."""

    def __init__(self, settings: Settings, topology: Topology | None = None) -> None:
        self.settings = settings
        # Without accelerators, one CPU "device" per usable core unless told otherwise.
        cpu_devices = settings.cpu_devices or len(os.sched_getaffinity(0))
        self.topology = topology or discover(
            settings.device, num_cpu_devices=cpu_devices, share_cores=settings.cpu_share_cores
        )
        self.partition: Partition = partition(
            self.topology, settings.mode, settings.prefill_devices, settings.decode_devices
        )
        self.layout = self._roles()  # checked here, so a bad tensor-parallel degree fails early
        self.workers: dict[int, WorkerHandle] = {}
        self.table = RequestTable()  # every request in flight: its phase, timing, workers
        self._streams: dict[int, asyncio.Queue] = {}  # request id -> its consumer's chunks
        self.tuning = Tuning(
            prefill_token_budget=settings.batch.max_num_batched_tokens,
            chunk_size=min(settings.batch.chunk_size, settings.batch.max_num_batched_tokens),
            decode_max_seqs=settings.batch.max_num_seqs,
            routing="least_loaded",
            admission="open",
        )
        self.events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._event_ids = itertools.count(1)
        self._worker_ids = itertools.count()
        self.router = Router(
            settings.kv.block_size, settings.kv.prefix_caching, self.topology.bandwidth_rank
        )
        self._ctx = mp.get_context("spawn")
        self._reader = OutboxReader(self._deliver)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._all_ready: asyncio.Future | None = None
        self._peer_drops: dict[tuple[int, int], asyncio.Future] = {}  # (decode, prefill)
        self._capacity = 0
        self._watchdog: asyncio.Task | None = None
        recovery = settings.recovery
        self.restart_policy = RestartPolicy(recovery.max_crashes, recovery.crash_window_s)
        self.failed_devices: set[int] = set()
        self._restarting: dict[int, str] = {}  # device -> role of the worker coming back
        self._tasks: set[asyncio.Task] = set()  # restarts in progress

    @property
    def _started_loop(self) -> asyncio.AbstractEventLoop:
        """The loop start() runs on: every worker, reader and timer lives on it."""
        if self._loop is None:
            raise RuntimeError("the supervisor is not started: call start() first")
        return self._loop

    @property
    def requests(self) -> dict[int, Request]:
        """Every request in flight by id, oldest first (read it, do not change it)."""
        return self.table.requests

    # ------------------------------------------------------------ lifecycle

    async def start(self, timeout: float = 300.0) -> None:
        """Spawn every worker and wait until each has loaded its model."""
        self._loop = asyncio.get_running_loop()
        self._all_ready = self._loop.create_future()
        for role, group in self.layout:
            self._spawn(role, group)
        self._reader.start()
        self._watchdog = asyncio.create_task(self._watch_workers())
        try:
            await asyncio.wait_for(self._all_ready, timeout)
        except TimeoutError:
            await self.stop()
            raise RuntimeError(f"workers not ready within {timeout:.0f} s") from None

    def _roles(self) -> list[tuple[str, tuple[int, ...]]]:
        """Each worker to start: its role and its devices (several for tensor parallelism)."""
        part, settings = self.partition, self.settings
        if settings.mode == "colocated":
            groups = tp_groups(self.topology, part.prefill, settings.prefill_tp, "prefill_tp")
            return [("colocated", g) for g in groups]
        prefill = tp_groups(self.topology, part.prefill, settings.prefill_tp, "prefill_tp")
        decode = tp_groups(self.topology, part.decode, settings.decode_tp, "decode_tp")
        return [("prefill", g) for g in prefill] + [("decode", g) for g in decode]

    def _spawn(self, role: str, group: int | tuple[int, ...]) -> WorkerHandle:
        group = (group,) if isinstance(group, int) else group
        device_index = group[0]
        worker_id = next(self._worker_ids)
        device = self.topology.devices[device_index]
        devices = tuple(self.topology.devices[i] for i in group)
        inbox = self._ctx.Queue()
        receiving, sending = self._ctx.Pipe(duplex=False)
        settings = self._worker_settings(role)
        process = self._ctx.Process(
            target=run_worker,
            args=(worker_id, role, settings, devices, inbox, Outbox(sending)),
            daemon=True,
        )
        process.start()
        sending.close()  # the worker holds it now: its exit closes the pipe
        self._reader.add(worker_id, receiving)
        name = "+".join(d.name for d in devices)  # a tensor-parallel group names them all
        worker = WorkerHandle(
            worker_id, role, device_index, name, device.cores, inbox, process, group
        )
        self.workers[worker_id] = worker
        return worker

    def _worker_settings(self, role: str) -> Settings:
        """The settings with the live tuning a worker of `role` starts with."""
        limits = self.batch_limits(role, self.tuning)
        batch = BatchSettings(**{**self.settings.batch.model_dump(), **limits})
        return self.settings.model_copy(update={"batch": batch})

    async def _watch_workers(self) -> None:
        """Every WATCH_INTERVAL_S: a worker whose process exited is handled within that
        time; one that has work but has reported no step for too long is killed."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            for worker in list(self.workers.values()):
                if not worker.alive or worker.stopping:
                    continue
                if not worker.process.is_alive():
                    self._on_exit(worker)
                elif self._stalled_for(worker, now) > self.settings.recovery.stall_timeout_s:
                    self.note("worker", f"worker {worker.worker_id} stalled: killing it")
                    worker.process.kill()
            self._fail_waiting(self._entry_role)

    def _stalled_for(self, worker: WorkerHandle, now: float) -> float:
        """How long a worker that has work to run has not reported a step (0 if idle)."""
        has_work = worker.running > 0 or self.table.owes_answer(worker.worker_id)
        if not (worker.ready and has_work):
            return 0.0
        return now - max(worker.last_report, worker.last_work)

    def _on_exit(self, worker: WorkerHandle) -> None:
        worker.alive = False
        self.note(
            "worker",
            f"worker {worker.worker_id} ({worker.role}, {worker.device}) exited with "
            f"code {worker.process.exitcode}",
        )
        error = RuntimeError(f"worker {worker.worker_id} exited while starting")
        assert self._all_ready is not None  # start() set it before spawning any worker
        if not self._all_ready.done():  # a failed start is reported, not retried
            self._all_ready.set_exception(error)
            return
        self._forget_dead_pool(worker.worker_id)
        if worker.started is not None and not worker.started.done():
            worker.started.set_exception(error)  # whoever started it decides what next
            return
        if not worker.draining:  # a moving device's successor is started by the move
            self._schedule_restart(worker)  # first: requests may wait for it to come back
        self._recover(worker.worker_id, f"worker {worker.worker_id} exited")

    def _recover(self, worker_id: int, reason: str) -> None:
        """Carry out what losing this worker means for each request it held."""
        held = self.table.held_by(worker_id)
        for step in after_worker_lost(held, worker_id, self.settings.recovery.max_request_retries):
            self._act(self.table.requests[step.request_id], step.action, reason)

    def _act(self, request: Request, action: Action, reason: str) -> None:
        match action:
            case Action.REROUTE:  # KV parked in a prefill pool is still there
                self._hand_off(self.table.take_back_handoff(request.request_id))
            case Action.RERUN:
                self._rerun(request, reason)
            case Action.FAIL:
                self._fail(request, f"{reason}; retried too often")

    def _forget_dead_pool(self, worker_id: int) -> None:
        for decode in self.workers.values():
            if worker_id in decode.peers:
                decode.peers.discard(worker_id)
                decode.inbox.put(DropPeer(worker_id))

    def _schedule_restart(self, worker: WorkerHandle, failed_starts: int = 0) -> None:
        device = worker.device_index
        delay = self.restart_policy.on_crash(device, time.monotonic())
        if failed_starts >= self.settings.recovery.max_crashes:  # however slowly it fails
            delay = None
        if delay is None:
            self.failed_devices.update(worker.devices)  # a group fails as one
            self.note("worker", f"{worker.device} crashed too often: no more restarts")
            self._fail_waiting(worker.role)
            return
        self._restarting[device] = worker.role
        task = asyncio.create_task(self._restart(worker, delay, failed_starts))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, dead: WorkerHandle, delay: float, failed_starts: int) -> None:
        """Start a worker of the dead one's role on its device, after `delay`."""
        await asyncio.sleep(delay)
        device = dead.device_index
        taken = any(w.device_index == device and w.alive for w in self.workers.values())
        if dead.worker_id not in self.workers or taken:  # a pool move took the device over
            self._restarting.pop(device, None)
            return
        del self.workers[dead.worker_id]
        try:
            worker = await self.add_worker(
                dead.role, dead.devices, self.settings.recovery.start_timeout_s
            )
        except Exception as exc:  # it died loading, or could not even be spawned
            self._restarting.pop(device, None)
            self.note("worker", f"restarting {dead.device} failed: {exc}")
            self._schedule_restart(dead, failed_starts + 1)
            return
        self._restarting.pop(device, None)
        worker.restarts = dead.restarts + 1

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask every worker to stop, then make sure each has."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        for task in list(self._tasks):
            task.cancel()
        for worker in self.workers.values():
            worker.inbox.put(Shutdown())
        deadline = time.monotonic() + timeout
        for worker in self.workers.values():
            await asyncio.to_thread(worker.process.join, max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
        await asyncio.to_thread(self._reader.stop)
        for request in list(self.table.requests.values()):
            if not request.phase.terminal:
                self.table.fail(request.request_id)
            self._put(request, RequestFailed("the appliance is shutting down"))

    # ------------------------------------------------------------ requests

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        """Stream one request's chunks; leaving the loop early cancels it on both sides."""
        arrival = time.monotonic()
        request = self.table.add(prompt, params, arrival)
        stream = self._streams[request.request_id] = asyncio.Queue()
        limit = self.settings.server.request_timeout_s
        deadline = None if limit is None else arrival + limit
        try:
            self._submit(request)
            while True:
                item = await self._next_item(stream, deadline)
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._forget(request)

    async def _next_item(self, stream: asyncio.Queue, deadline: float | None) -> Any:
        if deadline is None:
            return await stream.get()
        try:
            return await asyncio.wait_for(stream.get(), deadline - time.monotonic())
        except TimeoutError:
            limit = self.settings.server.request_timeout_s
            return RequestFailed(f"the request ran past its deadline of {limit:.0f} s")

    def _put(self, request: Request, item: Chunk | Exception) -> None:
        """Pass a chunk (or the error that ends it) to the request's consumer."""
        stream = self._streams.get(request.request_id)
        if stream is not None:
            stream.put_nowait(item)

    @property
    def _entry_role(self) -> str:
        return "colocated" if self.settings.mode == "colocated" else "prefill"

    def _submit(self, request: Request) -> None:
        """Send a WAITING request's next attempt to a prefill (or colocated) worker; while
        none takes work but one is coming back, it stays WAITING for it."""
        role = self._entry_role
        candidates = [w for w in self.workers.values() if w.role == role and w.routable]
        if not candidates:
            if not self._may_come_back(role):
                self._fail(request, f"no {role} worker is running")
            return
        token_ids = request.tokens
        worker = self.router.prefill(candidates, token_ids, self.tuning)
        wire_id = self.table.submit(request.request_id, worker.worker_id)
        worker.queued_tokens += len(token_ids)
        worker.last_work = time.monotonic()
        worker.inbox.put(Submit(wire_id, token_ids, request.attempt_params, role == "prefill"))

    def _may_come_back(self, role: str) -> bool:
        """A worker of `role` is starting, or restarting after a crash."""
        starting = any(w.role == role and w.routable_soon for w in self.workers.values())
        return starting or role in self._restarting.values()

    def _retry(self, request: Request, reason: str) -> None:
        """The current attempt is lost: run it again, or fail it after too many tries."""
        max_retries = self.settings.recovery.max_request_retries
        self._act(request, retry_action(request, max_retries), reason)

    def _rerun(self, request: Request, reason: str) -> None:
        """Run the request again from where its stream stopped: its prompt plus the tokens
        it already sent, for what is left of max_tokens."""
        self._unqueue(request)
        self.table.rerun(request.request_id)
        self.note("worker", f"request {request.request_id}: {reason}; running it again")
        self._submit(request)

    def _fail(self, request: Request, message: str) -> None:
        """End the request with an error its consumer raises."""
        self._unqueue(request)
        self.table.fail(request.request_id)
        self._put(request, RequestFailed(message))

    def _unqueue(self, request: Request) -> None:
        """Its prompt leaves its prefill worker's queue (the router weighs queued tokens)."""
        if not request.phase.awaiting_first or request.prefill_worker is None:
            return
        if (worker := self.workers.get(request.prefill_worker)) is not None:
            worker.queued_tokens -= request.submitted_len

    def _submit_waiting(self) -> None:
        """Requests WAITING for a worker of their role try again (one may be ready now)."""
        for request in self.table.in_phase(Phase.WAITING):
            self._submit(request)

    def _fail_waiting(self, role: str) -> None:
        """WAITING requests fail once no worker of `role` can come back for them."""
        waiting = self.table.in_phase(Phase.WAITING)
        if not waiting or self._may_come_back(role):
            return
        for request in waiting:
            self._fail(request, f"no {role} worker is running")

    def _forget(self, request: Request) -> None:
        if request.request_id not in self.table.requests:
            return
        self._unqueue(request)
        self._streams.pop(request.request_id, None)
        wire_id = request.wire_id  # None: never sent to a worker
        if self.table.forget(request.request_id) and wire_id is not None:
            # The consumer left early: cancel it wherever it runs.
            self._tell(request.prefill_worker, Abort(wire_id))
            self._tell(request.decode_worker, Abort(wire_id))

    def _tell(self, worker_id: int | None, message: Any) -> None:
        if worker_id in self.workers:
            self.workers[worker_id].inbox.put(message)

    # ------------------------------------------------------------ worker messages

    def _deliver(self, message: Any) -> None:
        """From the reader thread: handle the message on the loop."""
        self._started_loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, message: Any) -> None:
        match message:
            case Ready():
                self._on_ready(message)
            case TokenBatch():
                self._on_tokens(message)
            case HandoffResult():
                self._on_handoff_result(message)
            case PoolShared():
                self._on_pool_shared(message)
            case PeerDropped():
                dropped = self._peer_drops.pop((message.worker_id, message.peer), None)
                if dropped is not None and not dropped.done():
                    dropped.set_result(None)
            case Failed():
                if (request := self.table.by_wire(message.request_id)) is not None:
                    self._fail(request, message.error)
            case LeaseExpired():
                if (request := self.table.on_lease_expired(message)) is not None:
                    self._retry(request, "its parked KV expired before a decode worker took it")

    def _on_ready(self, message: Ready) -> None:
        worker = self.workers.get(message.worker_id)
        if worker is None:
            return
        worker.num_blocks = worker.num_free = message.num_blocks
        worker.shard_pids = message.shard_pids
        worker.loaded = True
        block_size = self.settings.kv.block_size
        self.note(
            "worker",
            f"worker {worker.worker_id} ({worker.role}) loaded on {worker.device}: its "
            f"{message.num_blocks} KV blocks of {block_size} tokens hold "
            f"{message.num_blocks * block_size} tokens of context",
        )
        # Each (prefill, decode) pair is wired once, when the second of the two has loaded.
        if worker.role == "decode":
            for prefill in self._wiring_peers("prefill"):
                prefill.inbox.put(SharePool(worker.worker_id))
        elif worker.role == "prefill":
            for decode in self._wiring_peers("decode"):
                worker.inbox.put(SharePool(decode.worker_id))
        self._mark_wired()

    def _wiring_peers(self, role: str) -> list[WorkerHandle]:
        """Loaded workers of `role` that take part in handoffs."""
        return [w for w in self.workers.values() if w.role == role and w.loaded and w.routable_soon]

    def _on_pool_shared(self, message: PoolShared) -> None:
        decode = self.workers.get(message.consumer)
        if decode is None or not decode.alive or message.worker_id not in self.workers:
            return
        decode.inbox.put(PeerPool(message.worker_id, message.data))
        decode.peers.add(message.worker_id)  # its inbox has the pool before any handoff
        self._mark_wired()

    def _mark_wired(self) -> None:
        """Loaded workers that hold (or have given) every KV pool they need take work."""
        for worker in self.workers.values():
            if worker.loaded and not worker.ready and self._wired(worker):
                worker.ready = True
                if worker.started is not None and not worker.started.done():
                    worker.started.set_result(None)
        assert self._all_ready is not None  # start() set it before spawning any worker
        if not self._all_ready.done() and all(w.ready for w in self.workers.values()):
            self._all_ready.set_result(None)
        self._submit_waiting()

    def _wired(self, worker: WorkerHandle) -> bool:
        if worker.role == "decode":
            return {p.worker_id for p in self._wiring_peers("prefill")} <= worker.peers
        if worker.role == "prefill":
            return all(worker.worker_id in d.peers for d in self._wiring_peers("decode"))
        return True

    def _on_tokens(self, batch: TokenBatch) -> None:
        worker = self.workers.get(batch.worker_id)
        if worker is None or not worker.alive:  # retired or dead since it sent this
            return
        worker.num_free, worker.running = batch.num_free_blocks, batch.num_running
        worker.taken_blocks = 0
        worker.last_report = time.monotonic()
        worker.tokens_out += sum(len(out.token_ids) for out in batch.outputs)
        self.table.on_started(batch.started, batch.step_started_at)
        for out in batch.outputs:
            self._on_output(worker, out, batch.step_started_at)

    def _on_output(self, worker: WorkerHandle, out: Output, step_started_at: float) -> None:
        current = self.table.by_wire(out.request_id)
        first = current is not None and current.phase.awaiting_first  # before it moves on
        request = self.table.on_output(worker.worker_id, out, time.monotonic(), step_started_at)
        if request is None:  # not the worker running its current attempt
            if out.handoff_blocks is not None:  # cancelled while prefilling: nobody pulls
                self._tell(worker.worker_id, Release(out.request_id))
            return
        if first:
            worker.queued_tokens -= request.submitted_len
        cached = out.cached_tokens if first and request.retries == 0 else 0
        self._put(request, _chunk(request, out, cached))
        if request.phase is Phase.PARKED:
            self._hand_off(request.kv)

    def _hand_off(self, parked: ParkedKV) -> None:
        """Ask the decode worker the router picks to pull a parked prompt's KV; without
        one that can yet, ask again HANDOFF_RETRY_S later."""
        request = self.table.by_wire(parked.wire_id)
        if request is None:  # cancelled, failed or running again: nobody wants it now
            self._tell(parked.source, Release(parked.wire_id))
            return
        source = self.workers.get(parked.source)
        if source is None or not source.alive:  # its blocks are gone: prefill again
            self._retry(request, f"prefill worker {parked.source} exited")
            return
        decodes = [w for w in self.workers.values() if w.role == "decode" and w.routable_soon]
        if not decodes and not self._may_come_back("decode"):
            self._tell(parked.source, Release(parked.wire_id))
            self._fail(request, "no decode worker is running")
            return
        candidates = [w for w in decodes if w.ready and parked.source in w.peers]
        if not candidates:  # decode workers (re)starting or being wired to this prefill worker
            self._started_loop.call_later(HANDOFF_RETRY_S, self._hand_off, parked)
            return
        in_flight, blocks = self._blocks_in_flight(), self._handoff_blocks(request)
        decode = self.router.decode(candidates, in_flight, source, blocks)
        decode.last_work = time.monotonic()
        self.table.send_handoff(request.request_id, decode.worker_id, time.monotonic())
        decode.inbox.put(
            Handoff(
                parked.wire_id,
                request.tokens,
                request.submitted_len,
                request.attempt_params,
                parked.source,
                parked.blocks,
            )
        )

    def _blocks_in_flight(self) -> Counter[int]:
        """Decode worker id -> KV blocks its last report does not show yet: of handoffs sent
        to it and not answered, and of those it took since that report."""
        in_flight: Counter[int] = Counter()
        for worker in self.workers.values():
            sent = self.table.handoffs_to(worker.worker_id)
            in_flight[worker.worker_id] += sum(self._handoff_blocks(r) for r in sent)
            in_flight[worker.worker_id] += worker.taken_blocks
        return in_flight

    def _handoff_blocks(self, request: Request) -> int:
        """The KV blocks a decode worker holds for a handed-off request."""
        return blocks_for_tokens(request.submitted_len + 1, self.settings.kv.block_size)

    def _on_handoff_result(self, result: HandoffResult) -> None:
        request = self.table.on_handoff_result(result, time.monotonic())
        if request is None:
            if result.accepted:  # a stale answer (from a worker given up on): undo it
                self._tell(result.worker_id, Abort(result.request_id))
            return
        if not result.accepted:  # no room there now: ask again a little later
            self._started_loop.call_later(HANDOFF_RETRY_S, self._hand_off, request.kv)
            return
        # Its next report holds these blocks: a worker answers before it steps again.
        if (decode := self.workers.get(result.worker_id)) is not None:
            decode.taken_blocks += self._handoff_blocks(request)
        self._tell(request.prefill_worker, Release(result.request_id))

    # ------------------------------------------------------------ state

    @property
    def ready(self) -> bool:
        """Every worker has loaded its model and the pools are wired together."""
        started = self._all_ready
        return (
            started is not None
            and started.done()
            and not started.cancelled()
            and started.exception() is None
        )

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
        return [
            WorkerView(
                w.worker_id,
                w.role,
                w.device,
                w.ready,
                w.alive,
                self.table.waiting_at(w.worker_id),
                w.running,
                w.num_free,
                w.num_blocks,
                w.restarts,
                w.phase,
                w.device_index,
                w.process.pid,
                w.tokens_out,
                w.devices,
                tuple(w.shard_pids),
            )
            for w in self.workers.values()
        ]

    def pending_handoffs(self) -> int:
        """Handoffs sent to a decode worker and not yet answered."""
        return len(self.table.in_phase(Phase.HANDING_OFF))

    # ------------------------------------------------------------ pool membership and tuning

    def note(self, kind: EventKind, message: str) -> Event:
        """Record an event for the admin API (and the log)."""
        event = Event(seq=next(self._event_ids), at=time.time(), kind=kind, message=message)
        self.events.append(event)
        log.info("%s", message)
        return event

    def tune(self, patch: TuningPatch) -> Tuning:
        """Apply new knobs now: routing and admission here, batching limits in each worker's
        scheduler from its next step. Raises ValueError for a bad combination."""
        tuning = patch.applied_to(self.tuning)
        if (
            self.settings.mode == "colocated"
            and tuning.decode_max_seqs > tuning.prefill_token_budget
        ):
            # A step's budget covers one token per running sequence first: fewer tokens
            # than sequences would leave the newest ones waiting every step.
            raise ValueError(
                f"in colocated mode decode_max_seqs ({tuning.decode_max_seqs}) must not "
                f"exceed prefill_token_budget ({tuning.prefill_token_budget})"
            )
        changed = {k: v for k, v in tuning.model_dump().items() if getattr(self.tuning, k) != v}
        self.tuning = tuning
        for worker in self.workers.values():
            limits = self.batch_limits(worker.role, tuning)
            if worker.alive and limits:
                worker.inbox.put(Tune(**limits))
        if changed:
            described = ", ".join(f"{k}={v}" for k, v in changed.items())
            self.note("admission" if set(changed) == {"admission"} else "tuning", described)
        return tuning

    def busy_with(self, worker_id: int) -> int:
        """Requests that still need this worker: running on it, or parked in its blocks
        until a decode worker has copied them."""
        return len(self.table.held_by(worker_id))

    async def add_worker(
        self, role: str, devices: int | tuple[int, ...], timeout: float
    ) -> WorkerHandle:
        """Start a worker of `role` on a device (or a tensor-parallel group of them) while
        the pools serve; returns once it takes requests. Raises RuntimeError if it exits
        or is not ready within `timeout`."""
        worker = self._spawn(role, devices)
        worker.started = self._started_loop.create_future()
        try:
            await asyncio.wait_for(asyncio.shield(worker.started), timeout)
        except TimeoutError:
            await self.retire(worker.worker_id)
            message = f"worker {worker.worker_id} not ready within {timeout:.0f} s"
            raise RuntimeError(message) from None
        except RuntimeError:
            self.workers.pop(worker.worker_id, None)
            raise
        self.note("worker", f"worker {worker.worker_id} ({role}) serves on {worker.device}")
        return worker

    async def retire(self, worker_id: int, timeout: float = 10.0) -> None:
        """Stop a worker that has nothing left to do and forget it. A prefill worker stops
        only after the decode workers have let go of its KV tensor: a CUDA tensor's owner
        must outlive the processes that mapped it."""
        worker = self.workers[worker_id]
        worker.draining = worker.stopping = True
        await self._drop_peer(worker_id)
        worker.inbox.put(Shutdown())
        await asyncio.to_thread(worker.process.join, timeout)
        if worker.process.is_alive():
            worker.process.kill()
            await asyncio.to_thread(worker.process.join, timeout)
        del self.workers[worker_id]
        self._reroute_handoffs_to(worker_id)

    async def _drop_peer(self, prefill_id: int) -> None:
        waits = []
        for decode in self.workers.values():
            if prefill_id in decode.peers:
                decode.peers.discard(prefill_id)
                if decode.alive:
                    dropped = self._peer_drops[(decode.worker_id, prefill_id)] = (
                        self._started_loop.create_future()
                    )
                    decode.inbox.put(DropPeer(prefill_id))
                    waits.append(dropped)
        if waits:
            await asyncio.wait(waits, timeout=DROP_PEER_TIMEOUT_S)

    def _reroute_handoffs_to(self, worker_id: int) -> None:
        """Handoffs sent to a worker that is gone go to another one (or are released)."""
        for request in self.table.handoffs_to(worker_id):
            self._act(request, Action.REROUTE, f"worker {worker_id} retired")

    def batch_limits(self, role: str, tuning: Tuning) -> dict[str, int]:
        """The scheduler limits the live tuning sets for a worker of `role`."""
        prefill = {
            "max_num_batched_tokens": tuning.prefill_token_budget,
            "chunk_size": tuning.chunk_size,
        }
        if role == "prefill":
            return prefill
        # A decode step needs a token of budget per running sequence.
        budget = max(self.settings.batch.max_num_batched_tokens, tuning.decode_max_seqs)
        decode = {"max_num_seqs": tuning.decode_max_seqs, "max_num_batched_tokens": budget}
        return decode if role == "decode" else prefill | {"max_num_seqs": tuning.decode_max_seqs}


def _chunk(request: Request, out: Output, cached_tokens: int) -> Chunk:
    """A request's next chunk; the last one carries its timing and handoff bytes."""
    finished = request.phase is Phase.FINISHED
    return Chunk(
        out.token_ids,
        out.text,
        out.finished,
        out.finish_reason,
        request.timing.as_dict() if finished else None,
        request.handoff_bytes if finished else 0,
        cached_tokens,
    )
