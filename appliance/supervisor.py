"""The supervisor: spawns the pools' workers, routes requests, moves handoffs, streams tokens.

One asyncio loop owns all state. A reader thread turns the workers' pipes (one each)
into calls on that loop. Where each prompt and handoff goes is the router's choice
(appliance/router.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch.multiprocessing as mp

from appliance.admin.schema import Event, Tuning, TuningPatch
from appliance.config import BatchSettings, Settings
from appliance.engine.sequence import SamplingParams
from appliance.kv.block_allocator import blocks_for_tokens
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


class RequestFailed(RuntimeError):
    """A request ended with an error (bad input seen by a worker, a lost worker)."""


@dataclass
class Chunk:
    """A piece of one request's stream."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    timing: dict[str, float] | None = None  # on the last chunk: the request's timestamps
    handoff_bytes: int = 0  # on the last chunk: KV bytes copied from prefill to decode pool
    cached_tokens: int = 0  # on the first chunk: prompt tokens the prefix cache supplied


@dataclass
class RequestState:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    stream: asyncio.Queue
    prefill_worker: int = -1
    decode_worker: int = -1
    output_ids: list[int] = field(default_factory=list)
    cancelled: bool = False
    # The current attempt: it prefills prompt + output_ids so far (a retry after a worker
    # was lost continues where the stream stopped) with what is left of max_tokens.
    submitted_len: int = 0
    attempt_params: SamplingParams | None = None
    awaiting_first: bool = False  # sent to prefill, its first token not back yet
    retries: int = 0
    wire_id: int = -1  # the current attempt's id in messages to and from workers
    # monotonic seconds: arrival, prefill_start (first step that ran it: queue time ends),
    # first_token, handoff_sent and handoff (the accepted handoff's round trip), finished
    timing: dict[str, float] = field(default_factory=dict)
    handoff_bytes: int = 0
    token_times: list[float] = field(default_factory=list)  # when each chunk of tokens came


@dataclass
class PendingHandoff:
    request: RequestState
    wire_id: int  # the attempt whose prompt K/V sits in `blocks`
    source: int
    blocks: list[int]


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
        self.requests: dict[int, RequestState] = {}
        self.tuning = Tuning(
            prefill_token_budget=settings.batch.max_num_batched_tokens,
            chunk_size=min(settings.batch.chunk_size, settings.batch.max_num_batched_tokens),
            decode_max_seqs=settings.batch.max_num_seqs,
            routing="least_loaded",
            admission="open",
        )
        self.events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._event_ids = itertools.count(1)
        self._ids = itertools.count()
        self._worker_ids = itertools.count()
        self.router = Router(
            settings.kv.block_size, settings.kv.prefix_caching, self.topology.bandwidth_rank
        )
        self._ctx = mp.get_context("spawn")
        self._reader = OutboxReader(self._deliver)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._all_ready: asyncio.Future | None = None
        self._peer_drops: dict[tuple[int, int], asyncio.Future] = {}  # (decode, prefill)
        self._pending: dict[int, PendingHandoff] = {}  # wire id -> handoff not yet answered
        self._wire: dict[int, RequestState] = {}  # wire id -> request, current attempts only
        self._capacity = 0
        self._watchdog: asyncio.Task | None = None
        recovery = settings.recovery
        self.restart_policy = RestartPolicy(recovery.max_crashes, recovery.crash_window_s)
        self.failed_devices: set[int] = set()
        self._restarting: dict[int, str] = {}  # device -> role of the worker coming back
        self._tasks: set[asyncio.Task] = set()  # restarts in progress
        self._stalled: deque[RequestState] = deque()  # waiting for a worker of their role

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
            self._fail_stalled(self._entry_role)

    def _stalled_for(self, worker: WorkerHandle, now: float) -> float:
        """How long a worker that has work to run has not reported a step (0 if idle)."""
        wid = worker.worker_id
        has_work = worker.running > 0
        has_work = has_work or any(
            r.prefill_worker == wid and r.awaiting_first for r in self.requests.values()
        )
        has_work = has_work or any(p.request.decode_worker == wid for p in self._pending.values())
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
        if not self._all_ready.done():  # a failed start is reported, not retried
            self._all_ready.set_exception(error)
            return
        self._forget_dead_pool(worker.worker_id)
        if worker.started is not None and not worker.started.done():
            worker.started.set_exception(error)  # whoever started it decides what next
            return
        if not worker.draining:  # a moving device's successor is started by the move
            self._schedule_restart(worker)  # first: requests may wait for it to come back
        # KV parked in a prefill pool is still there: hand it to another decode worker.
        self._reroute_handoffs_to(worker.worker_id)
        whole_requests = worker.role == "colocated"
        for request in list(self.requests.values()):
            if "finished" in request.timing:
                continue
            lost = request.decode_worker == worker.worker_id or (
                request.prefill_worker == worker.worker_id
                and (request.awaiting_first or whole_requests)
            )
            if lost:
                self._retry(request, f"worker {worker.worker_id} exited")

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
            self._fail_stalled(worker.role)
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
        for request in self.requests.values():
            request.stream.put_nowait(RequestFailed("the appliance is shutting down"))

    # ------------------------------------------------------------ requests

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        """Stream one request's chunks; leaving the loop early cancels it on both sides."""
        request = RequestState(next(self._ids), list(prompt), params, asyncio.Queue())
        request.timing["arrival"] = time.monotonic()
        request.attempt_params = params
        self.requests[request.request_id] = request
        limit = self.settings.server.request_timeout_s
        deadline = None if limit is None else request.timing["arrival"] + limit
        try:
            self._submit(request)
            while True:
                item = await self._next_item(request, deadline)
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._forget(request)

    async def _next_item(self, request: RequestState, deadline: float | None) -> Any:
        if deadline is None:
            return await request.stream.get()
        try:
            return await asyncio.wait_for(request.stream.get(), deadline - time.monotonic())
        except TimeoutError:
            limit = self.settings.server.request_timeout_s
            return RequestFailed(f"the request ran past its deadline of {limit:.0f} s")

    @property
    def _entry_role(self) -> str:
        return "colocated" if self.settings.mode == "colocated" else "prefill"

    def _submit(self, request: RequestState) -> None:
        """Send the request's current attempt to a prefill (or colocated) worker; while
        none takes work but one is coming back, it waits for it."""
        role = self._entry_role
        candidates = [w for w in self.workers.values() if w.role == role and w.routable]
        if not candidates:
            if self._may_come_back(role):
                self._stalled.append(request)
            else:
                request.stream.put_nowait(RequestFailed(f"no {role} worker is running"))
            return
        token_ids = request.prompt + request.output_ids
        worker = self.router.prefill(candidates, token_ids, self.tuning)
        request.wire_id = next(self._ids)
        self._wire[request.wire_id] = request
        request.submitted_len = len(token_ids)
        request.awaiting_first = True
        worker.queued_tokens += len(token_ids)
        worker.last_work = time.monotonic()
        request.prefill_worker = worker.worker_id
        worker.inbox.put(
            Submit(request.wire_id, token_ids, request.attempt_params, role == "prefill")
        )

    def _may_come_back(self, role: str) -> bool:
        """A worker of `role` is starting, or restarting after a crash."""
        starting = any(w.role == role and w.routable_soon for w in self.workers.values())
        return starting or role in self._restarting.values()

    def _retry(self, request: RequestState, reason: str) -> None:
        """Run the request again from where its stream stopped: its prompt plus the tokens
        it already sent, for what is left of max_tokens."""
        if request.cancelled or request.request_id not in self.requests:
            return
        if "finished" in request.timing:
            return
        self._end_attempt(request)
        if request.retries >= self.settings.recovery.max_request_retries:
            request.stream.put_nowait(RequestFailed(f"{reason}; retried too often"))
            return
        request.retries += 1
        for key in ("handoff_sent", "handoff"):  # the new attempt is handed off anew
            request.timing.pop(key, None)
        request.prefill_worker = request.decode_worker = -1
        left = request.params.max_tokens - len(request.output_ids)
        request.attempt_params = replace(request.params, max_tokens=max(1, left))
        self.note("worker", f"request {request.request_id}: {reason}; running it again")
        self._submit(request)

    def _end_attempt(self, request: RequestState) -> None:
        """Forget the current attempt: messages about it are stale from now on."""
        self._wire.pop(request.wire_id, None)
        self._pending.pop(request.wire_id, None)
        if request.awaiting_first:
            request.awaiting_first = False
            if request.prefill_worker in self.workers:
                self.workers[request.prefill_worker].queued_tokens -= request.submitted_len

    def _resubmit_stalled(self) -> None:
        waiting, self._stalled = self._stalled, deque()
        for request in waiting:
            if request.request_id in self.requests and not request.cancelled:
                self._submit(request)

    def _fail_stalled(self, role: str) -> None:
        if not self._stalled or self._may_come_back(role):
            return
        waiting, self._stalled = self._stalled, deque()
        for request in waiting:
            request.stream.put_nowait(RequestFailed(f"no {role} worker is running"))

    def _forget(self, request: RequestState) -> None:
        if self.requests.pop(request.request_id, None) is None:
            return
        wire = request.wire_id
        self._end_attempt(request)
        finished = request.timing.get("finished")
        if finished is None:  # the consumer left early: cancel wherever it runs
            request.cancelled = True
            self._tell(request.prefill_worker, Abort(wire))
            self._tell(request.decode_worker, Abort(wire))

    def _tell(self, worker_id: int, message: Any) -> None:
        if worker_id in self.workers:
            self.workers[worker_id].inbox.put(message)

    # ------------------------------------------------------------ worker messages

    def _deliver(self, message: Any) -> None:
        """From the reader thread: handle the message on the loop."""
        self._loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, Ready):
            self._on_ready(message)
        elif isinstance(message, TokenBatch):
            self._on_tokens(message)
        elif isinstance(message, HandoffResult):
            self._on_handoff_result(message)
        elif isinstance(message, PoolShared):
            self._on_pool_shared(message)
        elif isinstance(message, PeerDropped):
            dropped = self._peer_drops.pop((message.worker_id, message.peer), None)
            if dropped is not None and not dropped.done():
                dropped.set_result(None)
        elif isinstance(message, Failed):
            request = self._wire.get(message.request_id)
            if request is not None:
                request.stream.put_nowait(RequestFailed(message.error))
        elif isinstance(message, LeaseExpired):
            pending = self._pending.get(message.request_id)
            if pending is not None and pending.source == message.worker_id:
                self._retry(pending.request, "its parked KV expired before a decode worker took it")

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
        if not self._all_ready.done() and all(w.ready for w in self.workers.values()):
            self._all_ready.set_result(None)
        if self._stalled:
            self._resubmit_stalled()

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
        for wire_id in batch.started:
            request = self._wire.get(wire_id)
            if request is not None:
                request.timing.setdefault("prefill_start", batch.step_started_at)
        for out in batch.outputs:
            self._on_output(worker, out, batch.step_started_at)

    def _on_output(self, worker: WorkerHandle, out: Output, step_started_at: float) -> None:
        request = self._wire.get(out.request_id)
        if request is not None and worker.worker_id not in (
            request.prefill_worker,
            request.decode_worker,
        ):
            request = None  # not the worker running its current attempt
        cached = 0
        if request is not None and request.awaiting_first:
            cached = out.cached_tokens if request.retries == 0 else 0
            request.awaiting_first = False
            request.timing.setdefault("first_token", time.monotonic())
            request.timing.setdefault("prefill_start", step_started_at)
            worker.queued_tokens -= request.submitted_len
        if request is None:
            if out.handoff_blocks is not None:  # cancelled while prefilling: nobody pulls
                self._tell(worker.worker_id, Release(out.request_id))
            return
        request.output_ids += out.token_ids
        request.token_times.append(time.monotonic())
        timing = None
        if out.finished:
            request.timing["finished"] = time.monotonic()
            timing = dict(request.timing)
        chunk = Chunk(
            out.token_ids, out.text, out.finished, out.finish_reason, timing, cached_tokens=cached
        )
        if out.finished:
            chunk.handoff_bytes = request.handoff_bytes
        request.stream.put_nowait(chunk)
        if out.handoff_blocks is not None:
            pending = PendingHandoff(request, request.wire_id, worker.worker_id, out.handoff_blocks)
            self._hand_off(pending)

    def _hand_off(self, pending: PendingHandoff) -> None:
        request = pending.request
        if request.cancelled or pending.wire_id != request.wire_id:  # nobody wants it now
            self._tell(pending.source, Release(pending.wire_id))
            return
        source = self.workers.get(pending.source)
        if source is None or not source.alive:  # its blocks are gone: prefill again
            self._retry(request, f"prefill worker {pending.source} exited")
            return
        decodes = [w for w in self.workers.values() if w.role == "decode" and w.routable_soon]
        if not decodes and not self._may_come_back("decode"):
            self._tell(pending.source, Release(pending.wire_id))
            request.stream.put_nowait(RequestFailed("no decode worker is running"))
            return
        candidates = [w for w in decodes if w.ready and pending.source in w.peers]
        if not candidates:  # decode workers (re)starting or being wired to this prefill worker
            self._loop.call_later(HANDOFF_RETRY_S, self._hand_off, pending)
            return
        in_flight, blocks = self._blocks_in_flight(), self._handoff_blocks(request)
        decode = self.router.decode(candidates, in_flight, source, blocks)
        decode.last_work = time.monotonic()
        request.decode_worker = decode.worker_id
        request.timing["handoff_sent"] = time.monotonic()
        self._pending[pending.wire_id] = pending
        decode.inbox.put(
            Handoff(
                pending.wire_id,
                request.prompt + request.output_ids,
                request.submitted_len,
                request.attempt_params,
                pending.source,
                pending.blocks,
            )
        )

    def _blocks_in_flight(self) -> Counter[int]:
        """Decode worker id -> KV blocks its last report does not show yet: of handoffs sent
        to it and not answered, and of those it took since that report."""
        in_flight: Counter[int] = Counter()
        for pending in self._pending.values():
            in_flight[pending.request.decode_worker] += self._handoff_blocks(pending.request)
        for worker in self.workers.values():
            in_flight[worker.worker_id] += worker.taken_blocks
        return in_flight

    def _handoff_blocks(self, request: RequestState) -> int:
        """The KV blocks a decode worker holds for a handed-off request."""
        return blocks_for_tokens(request.submitted_len + 1, self.settings.kv.block_size)

    def _on_handoff_result(self, result: HandoffResult) -> None:
        pending = self._pending.get(result.request_id)
        request = pending.request if pending is not None else None
        if request is None or request.decode_worker != result.worker_id:
            if result.accepted:  # a stale answer (from a worker given up on): undo it
                self._tell(result.worker_id, Abort(result.request_id))
            return
        del self._pending[result.request_id]
        if result.accepted:
            # Its next report holds these blocks: a worker answers before it steps again.
            if (decode := self.workers.get(result.worker_id)) is not None:
                decode.taken_blocks += self._handoff_blocks(request)
            request.timing["handoff"] = time.monotonic()
            request.handoff_bytes = result.bytes_moved
            self._tell(pending.source, Release(result.request_id))
            if request.cancelled:
                self._tell(result.worker_id, Abort(result.request_id))
            return
        request.decode_worker = -1  # no worker holds it while it waits to be sent again
        self._loop.call_later(HANDOFF_RETRY_S, self._hand_off, pending)

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
        waiting = dict.fromkeys(self.workers, 0)
        for request in self.requests.values():
            if "prefill_start" not in request.timing and request.prefill_worker in waiting:
                waiting[request.prefill_worker] += 1
        for pending in self._pending.values():
            if pending.request.decode_worker in waiting:
                waiting[pending.request.decode_worker] += 1
        return [
            WorkerView(
                w.worker_id,
                w.role,
                w.device,
                w.ready,
                w.alive,
                waiting[w.worker_id],
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
        return len(self._pending)

    # ------------------------------------------------------------ pool membership and tuning

    def note(self, kind: str, message: str) -> Event:
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
        return sum(
            1
            for r in self.requests.values()
            if "finished" not in r.timing  # done, its last chunk not yet read by the client
            and (
                r.decode_worker == worker_id
                or (r.prefill_worker == worker_id and "handoff" not in r.timing)
            )
        )

    async def add_worker(
        self, role: str, devices: int | tuple[int, ...], timeout: float
    ) -> WorkerHandle:
        """Start a worker of `role` on a device (or a tensor-parallel group of them) while
        the pools serve; returns once it takes requests. Raises RuntimeError if it exits
        or is not ready within `timeout`."""
        worker = self._spawn(role, devices)
        worker.started = self._loop.create_future()
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
                        self._loop.create_future()
                    )
                    decode.inbox.put(DropPeer(prefill_id))
                    waits.append(dropped)
        if waits:
            await asyncio.wait(waits, timeout=DROP_PEER_TIMEOUT_S)

    def _reroute_handoffs_to(self, worker_id: int) -> None:
        """Handoffs sent to a worker that is gone go to another one (or are released)."""
        lost = [p for p in self._pending.values() if p.request.decode_worker == worker_id]
        for pending in lost:
            del self._pending[pending.wire_id]
            pending.request.decode_worker = -1
            self._hand_off(pending)

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
