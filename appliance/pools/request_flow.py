"""A request from its arrival to its last chunk: sent to a prefill (or colocated) worker,
each step's tokens streamed to its consumer, run again or failed when its worker is lost,
cancelled on both sides when its consumer leaves.

Its phase, timing and workers are the request table's (appliance/core/request_table.py);
where it goes is the router's; this module sends the messages and streams the chunks. A
prompt prefilled in the prefill pool goes on through the flow's handoffs
(appliance/pools/handoffs.py), which come back to the flow when one cannot go.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from appliance.core.admission import DecodeLoad, StepModel, admission_limits, pool_load
from appliance.core.admission_queue import AdmissionQueue, ModelCache, StepPace, load_of
from appliance.core.events import EventLog
from appliance.core.recovery import Action, retry_action
from appliance.core.request_table import Phase, Request, RequestTable
from appliance.core.roles import ENTRY_ROLES, Role
from appliance.core.router import Router
from appliance.core.tuning import Tuning
from appliance.engine.sampling.logprobs import TokenLogprobs
from appliance.engine.sequence import SamplingParams
from appliance.planner.decode_fit import RecentDecodeFits
from appliance.planner.online_profile import OnlineProfile, worker_size
from appliance.planner.traffic_log import TrafficLog
from appliance.pools.drains import Drains
from appliance.pools.handoffs import Handoffs
from appliance.pools.kv_store_owner import StoreOwner
from appliance.pools.worker_handle import WorkerHandle, WorkerPool
from appliance.settings.config import Settings
from appliance.tracing.spans import (
    current_traceparent,
    end_span,
    fault_span,
    start_span,
    traceparent_of,
)
from appliance.workers.messages import Abort, Output, Release, Submit, TokenBatch

# Prompts go to prefill workers (which hand their KV off) and colocated ones (which keep it).
NO_ENTRY_WORKER = "no prefill or colocated worker is running"


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
    logprobs: list[TokenLogprobs] | None = None  # one per token id, where the request asked
    # On the first chunk, where asked: the prompt's tokens from the second on.
    prompt_logprobs: list[TokenLogprobs] | None = None
    embedding: list[float] | None = None  # an embedding request's, on its first chunk


class RequestFlow:
    """Every request's stream, and the sending of its attempts; its handoffs take the
    prefilled ones on to a decode worker."""

    def __init__(
        self,
        settings: Settings,
        table: RequestTable,
        router: Router,
        pool: WorkerPool,
        tuning: Callable[[], Tuning],
        log: EventLog,
        drains: Drains,
        traffic: TrafficLog,
    ) -> None:
        """`tuning` is a callable, not a value: Supervisor.tune replaces the knobs in force
        and each prompt is routed by those. `drains` are told when a request leaves (a
        drain may be done); `traffic` records each request its consumer is done with."""
        self.settings = settings
        self.table = table
        self.router = router
        self.pool = pool
        self.tuning = tuning
        self.log = log
        self.drains = drains
        self.traffic = traffic
        # The handoffs are the flow's: it hands them what its workers prefilled, and a
        # handoff that cannot go comes back to it (run again, or failed).
        self._traces: dict[int, str] = {}  # request id -> its span, where traced
        self.handoffs = Handoffs(
            settings.kv.block_size, table, router, pool, self, traces=self._traces
        )
        self._streams: dict[int, asyncio.Queue[Chunk | Exception]] = {}  # request id -> chunks
        self.online = OnlineProfile()  # every worker size's recent steps, timed
        # Prompts held while their decode step would miss the SLO (planner.scheduling_policy)
        self.admission = AdmissionQueue(admission_limits(settings.planner))
        # Read once a second at most, refitted only after new decode steps came.
        self._decode_fits = RecentDecodeFits(self.online)
        self._models = ModelCache(self._decode_model)
        self.pace = StepPace()  # each worker's step period over its model time
        self.store: StoreOwner | None = None  # the box's KV store (the supervisor's)
        # request id -> the prompt tokens its worker's queue grew by (the router's guess of
        # what it computes there), taken off again at its first token
        self._queued: dict[int, int] = {}

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        """Stream one request's chunks; leaving the loop early cancels it on both sides."""
        arrival = time.monotonic()
        request = self.table.add(prompt, params, arrival)
        stream = self._streams[request.request_id] = asyncio.Queue()
        limit = self.settings.server.request_timeout_s
        deadline = None if limit is None else arrival + limit
        # A child of the HTTP request's span (None: tracing is off); the workers' spans
        # hang under it.
        span = start_span("supervisor", current_traceparent(), _request_attributes(request))
        if span is not None:
            self._traces[request.request_id] = traceparent_of(span)
        error = None
        try:
            self.submit(request)
            while True:
                item = await next_item(stream, deadline, limit)
                if isinstance(item, Exception):
                    error = str(item)
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            end_span(span, error, {"appliance.retries": request.retries})
            self.forget(request)

    def put(self, request: Request, item: Chunk | Exception) -> None:
        """Pass a chunk (or the error that ends it) to the request's consumer."""
        stream = self._streams.get(request.request_id)
        if stream is not None:
            stream.put_nowait(item)

    def submit(self, request: Request) -> None:
        """Send a WAITING request's next attempt to a prefill (or colocated) worker; while
        none takes work but one is coming back, it stays WAITING for it."""
        candidates = self._entry_workers()
        if not candidates:
            if not self._entry_coming():
                self.fail_by_fault(request, NO_ENTRY_WORKER)
            return
        holding = self.admission.head() is not None
        candidates = self._admitting(request, candidates)
        if not candidates:
            if not holding and self.admission.last is not None:  # the first one held
                reason = self.admission.last.reason
                self.log.note("admission", f"SLO admission holds prompts: {reason}")
            return  # held: admit_held sends it once a step makes room, or its wait is up
        token_ids, salt = request.tokens, request.attempt_params.cache_salt
        store = self.store
        stored = None if store is None else store.stored_keys  # a prefix every worker loads
        routed = self.router.route(candidates, token_ids, self.tuning(), salt, stored)
        worker = routed.worker
        prefill_only = worker.role == "prefill"  # a colocated worker decodes it too
        wire_id = self.table.submit(request.request_id, worker.worker_id, prefill_only)
        # Queued as what it computes there: a cached prompt holds a queue up little.
        self._queued[request.request_id] = routed.compute
        worker.sent_prompt(routed.compute, time.monotonic())
        hits = None if store is None else store.hits_for(worker.worker_id, wire_id, token_ids, salt)
        if hits is not None:  # on the same queue just before the Submit: loaded at its start
            self.pool.send(worker.worker_id, hits)
        self.pool.send(
            worker.worker_id,
            Submit(
                wire_id,
                token_ids,
                request.attempt_params,
                prefill_only,
                self._traces.get(request.request_id, ""),
            ),
        )

    def awaiting_handoff(self) -> int:
        """Requests sent to a prefill worker that no decode worker has taken yet."""
        before = (Phase.QUEUED, Phase.PREFILLING, Phase.PARKED, Phase.HANDING_OFF)
        return sum(r.prefill_only and r.phase in before for r in self.table.requests.values())

    def rerun(self, request: Request, reason: str) -> None:
        """Run the request again from where its stream stopped: its prompt plus the tokens
        it already sent, for what is left of max_tokens."""
        self._unqueue(request)
        self.table.rerun(request.request_id)
        self.log.note(
            "worker",
            f"request {request.request_id}: {reason}; running it again",
            fault="rerun",
            cause=reason,
            requests=[request.request_id],
        )
        fault_span(self._traces.get(request.request_id, ""), "rerun", reason)
        self.submit(request)

    def retry(self, request: Request, reason: str) -> None:
        """Its current attempt is lost: run it again, or fail it after too many tries."""
        if retry_action(request, self.settings.recovery.max_request_retries) is Action.RERUN:
            self.rerun(request, reason)
        else:
            self.fail_by_fault(request, f"{reason}; retried too often")

    def fail_by_fault(self, request: Request, message: str) -> None:
        """End the request with an error because of a fault (a fault event says so)."""
        self.log.note(
            "worker",
            f"request {request.request_id} failed: {message}",
            fault="request_failed",
            cause=message,
            requests=[request.request_id],
        )
        fault_span(self._traces.get(request.request_id, ""), "request_failed", message)
        self.fail(request, message)

    def fail(self, request: Request, message: str) -> None:
        """End the request with an error its consumer raises."""
        self._unqueue(request)
        self.table.fail(request.request_id)
        self.put(request, RequestFailed(message))

    def fail_all(self, message: str) -> None:
        """End every request (the appliance is stopping)."""
        for request in list(self.table.requests.values()):
            if not request.phase.terminal:
                self.table.fail(request.request_id)
            self.put(request, RequestFailed(message))

    def submit_waiting(self) -> None:
        """Requests WAITING for a worker of their role try again (one may be ready now)."""
        for request in self.table.in_phase(Phase.WAITING):
            self.submit(request)

    def fail_waiting(self, role: Role) -> None:
        """A worker of `role` will not come (back): WAITING requests fail if no prefill or
        colocated worker takes work or is on its way."""
        waiting = self.table.in_phase(Phase.WAITING)
        if role not in ENTRY_ROLES or not waiting or self._entry_workers() or self._entry_coming():
            return
        for request in waiting:
            self.fail_by_fault(request, NO_ENTRY_WORKER)

    def _entry_workers(self) -> list[WorkerHandle]:
        """The workers a prompt may go to now."""
        return [w for w in self.pool.workers.values() if w.role in ENTRY_ROLES and w.routable]

    def _entry_coming(self) -> bool:
        """A prefill or colocated worker is starting, restarting or on its way by a move."""
        return any(self.pool.may_come_back(role) for role in ENTRY_ROLES)

    def on_tokens(self, worker: WorkerHandle, batch: TokenBatch) -> None:
        """Stream a step's tokens; hand off the requests it parked (prefilled). A decode
        worker's step may have freed room for the handoffs waiting."""
        self.table.on_started(batch.started, batch.step_started_at)
        self.online.record(worker_size(worker), batch.timing)
        seconds = batch.timing.seconds if batch.timing is not None else None
        self.pace.record(worker.worker_id, batch.step_started_at, seconds, batch.num_running)
        parked = []
        for out in batch.outputs:
            request = self._on_output(worker, out, batch.step_started_at)
            if request is not None and request.phase is Phase.PARKED:
                parked.append(request)
        for prefilled in parked:  # once the whole step is streamed
            self.handoffs.hand_off(prefilled.kv)
        if worker.role == "decode":
            self.handoffs.retry_waiting()
        self.admit_held()

    def admit_held(self) -> None:
        """Send the held prompts a step made room for (or whose wait is up), oldest first."""
        if self.admission.head() is None:
            return
        while (request_id := self.admission.head()) is not None:
            request = self.table.requests.get(request_id)
            if request is None or request.phase is not Phase.WAITING:
                self.admission.forget(request_id)  # it left, or went by another path
                continue
            self.submit(request)
            if request.phase is Phase.WAITING:
                return  # still held (or no worker takes prompts yet)
        self.log.note("admission", "SLO admission: every held prompt was sent")

    def _admitting(self, request: Request, candidates: list[WorkerHandle]) -> list[WorkerHandle]:
        """The candidates SLO admission (core/admission_queue.py) lets take the prompt now
        (none: it is held), by what each decodes: a colocated worker its own requests, a
        prefill worker the decode pool's lightest worker's, with the prompts the prefill
        pool holds for it spread over the pool."""
        if self.admission.limits is None or request.attempt_params.max_tokens == 1:
            return candidates  # (one token, an embedding's: it never joins a decode batch)
        now = time.monotonic()
        loads, models, paces = [], [], []
        for worker in candidates:
            decoder, load = self._decode_load(worker)
            loads.append(load)
            models.append(self._models.get(worker_size(decoder), now))
            paces.append(self.pace.of(decoder.worker_id))
        waited = now - (request.timing.arrival or now)
        tokens = len(request.tokens)
        allowed = self.admission.admits(request.request_id, tokens, waited, loads, models, paces)
        return [candidates[i] for i in allowed]

    def _decode_load(self, entry: WorkerHandle) -> tuple[WorkerHandle, DecodeLoad]:
        """The worker that decodes what `entry` prefills, and its load."""
        if entry.role != "prefill":
            return entry, load_of(self.table.held_by(entry.worker_id))
        decoders = [w for w in self.pool.workers.values() if w.role == "decode" and w.alive]
        if not decoders:
            return entry, DecodeLoad(0, 0)
        loads = [load_of(self.table.held_by(w.worker_id)) for w in decoders]
        coming = load_of(r for r in self.table.requests.values() if _for_decode_pool(r))
        index, load = pool_load(loads, coming)
        return decoders[index], load

    def _decode_model(self, unit: str) -> StepModel | None:
        """Worker size `unit`'s decode step cost, fitted to its newest decode steps (the
        last fit while none came since)."""
        return self._decode_fits.cost(unit)

    def _on_output(
        self, worker: WorkerHandle, out: Output, step_started_at: float
    ) -> Request | None:
        current = self.table.by_wire(out.request_id)
        first = current is not None and current.phase.awaiting_first  # before it moves on
        request = self.table.on_output(worker.worker_id, out, time.monotonic(), step_started_at)
        if request is None:  # not the worker running its current attempt
            if out.handoff_blocks is not None:  # cancelled while prefilling: nobody pulls
                self.pool.send(worker.worker_id, Release(out.request_id))
            return None
        if first:
            worker.unqueued(self._queued.pop(request.request_id, 0))
        cached = out.cached_tokens if first and request.retries == 0 else 0
        request.cached_tokens += cached
        self.put(request, _chunk(request, out, cached))
        return request

    def forget(self, request: Request) -> None:
        """Its consumer is done with it: drop it, cancelling it where it still runs."""
        if request.request_id not in self.table.requests:
            return
        self.traffic.record(request)
        self.admission.forget(request.request_id)
        self._unqueue(request)
        self._streams.pop(request.request_id, None)
        self._traces.pop(request.request_id, None)
        wire_id = request.wire_id  # None: never sent to a worker
        if self.table.forget(request.request_id) and wire_id is not None:
            # The consumer left early: cancel it wherever it runs.
            self.pool.send(request.prefill_worker, Abort(wire_id))
            self.pool.send(request.decode_worker, Abort(wire_id))
        self.drains.check()

    def _unqueue(self, request: Request) -> None:
        """Its prompt leaves its prefill worker's queue (the router weighs queued tokens)."""
        tokens = self._queued.pop(request.request_id, 0)
        if not request.phase.awaiting_first or request.prefill_worker is None:
            return
        if (worker := self.pool.workers.get(request.prefill_worker)) is not None:
            worker.unqueued(tokens)


def _for_decode_pool(request: Request) -> bool:
    """Prefilled (or prefilling) for the decode pool, and no decode worker has it yet."""
    before = (Phase.QUEUED, Phase.PREFILLING, Phase.PARKED)
    return request.prefill_only and request.phase in before


def _request_attributes(request: Request) -> dict[str, str | int]:
    """The supervisor's span's attributes (OpenTelemetry's gen_ai names where they fit)."""
    return {
        "appliance.request_id": request.request_id,
        "gen_ai.usage.input_tokens": len(request.prompt),
        "gen_ai.request.max_tokens": request.params.max_tokens,
    }


async def next_item(
    stream: asyncio.Queue[Chunk | Exception], deadline: float | None, limit: float | None
) -> Chunk | Exception:
    """The stream's next chunk (or error); past `deadline` (time.monotonic()) the error that
    ends a request that ran past its `limit`. A consumer cancelled here is cancelled, even
    as its chunk arrives: Python 3.11's asyncio.wait_for returned that chunk instead and
    lost the cancellation, so an answer whose client had left ran on to its max_tokens."""
    if deadline is None:
        return await stream.get()
    try:
        async with asyncio.timeout(deadline - time.monotonic()):
            return await stream.get()
    except TimeoutError:
        return RequestFailed(f"the request ran past its deadline of {limit:.0f} s")


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
        out.logprobs,
        out.prompt_logprobs,
        out.embedding,
    )
