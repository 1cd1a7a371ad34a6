"""Handoffs: a prompt prefilled in the prefill pool goes on in a decode worker, which pulls
its KV blocks from the prefill worker's tensor, then the prefill worker frees them.

A handoff goes to the decode worker the router picks among those with room. Without one
it waits here, oldest first, and is tried again when something can have changed: a
decode worker reports a step (blocks freed) or becomes ready, or a worker is gone. A
decode worker that refused a handoff (no room after all) is not asked again until its
next report says how much room it has.

The request flow (appliance/pools/request_flow.py) owns the handoffs and hands them each
prompt its workers prefilled; a handoff that cannot go goes back to it (`Attempts`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Protocol

from appliance.core.request_table import ParkedKV, Request, RequestTable
from appliance.core.router import Router
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.pools.wiring import can_pair
from appliance.pools.worker_handle import WorkerHandle, WorkerPool
from appliance.workers.messages import Abort, Handoff, HandoffResult, Release


class Attempts(Protocol):
    """Where a request whose handoff cannot go goes back to: the request flow, which
    holds these handoffs (a Protocol, not an import: the flow imports this module)."""

    def retry(self, request: Request, reason: str, /) -> None:
        """Prefill it again, or fail it after too many tries."""
        ...

    def fail(self, request: Request, reason: str, /) -> None:
        """End it with an error its consumer raises."""
        ...


class Handoffs:
    """The handoffs waiting for room, and the sending of each."""

    def __init__(
        self,
        block_size: int,
        table: RequestTable,
        router: Router,
        pool: WorkerPool,
        attempts: Attempts,
        traces: Mapping[int, str] | None = None,
    ) -> None:
        """`traces`: each traced request's span (a traceparent) by request id, which its
        Handoff carries to the decode worker."""
        self.block_size = block_size
        self.table = table
        self.router = router
        self.pool = pool
        self.attempts = attempts
        self.traces: Mapping[int, str] = traces if traces is not None else {}
        self._waiting: dict[int, ParkedKV] = {}  # wire id -> KV waiting for room, oldest first

    @property
    def waiting(self) -> int:
        """Handoffs waiting for a decode worker with room."""
        return len(self._waiting)

    def hand_off(self, parked: ParkedKV) -> None:
        """Ask the decode worker the router picks to pull a parked prompt's KV, or keep it
        waiting until one has room."""
        self._waiting.pop(parked.wire_id, None)
        request = self.table.by_wire(parked.wire_id)
        if request is None:  # cancelled, failed or running again: nobody wants it now
            self.pool.send(parked.source, Release(parked.wire_id))
            return
        source = self.pool.workers.get(parked.source)
        if source is None or not source.alive:  # its blocks are gone: prefill again
            self.attempts.retry(request, f"prefill worker {parked.source} exited")
            return
        decodes = [
            w for w in self.pool.workers.values() if w.role == "decode" and can_pair(source, w)
        ]
        if source.role != "prefill" and not self._wired_to(source, decodes):
            # It turned decode (or colocated) in place: no decode worker is wired to it
            # from now on, and it cannot pull its own KV, so waiting would only wait out
            # its lease. Prefill it again now.
            self.pool.send(parked.source, Release(parked.wire_id))
            reason = f"its prefill worker {source.worker_id} turned {source.role} in place and "
            reason += "no decode worker left holds its pool"
            self.attempts.retry(request, reason)
            return
        if not any(w.routable_soon for w in decodes) and not self.pool.may_come_back("decode"):
            self.pool.send(parked.source, Release(parked.wire_id))
            reason = "no decode worker is running that this prefill worker can hand off to"
            self.attempts.fail(request, reason)
            return
        decode = self._pick(decodes, source, request)
        if decode is None:
            self._waiting[parked.wire_id] = parked
            return
        decode.sent_handoff(time.monotonic())
        self.table.send_handoff(request.request_id, decode.worker_id, time.monotonic())
        self.pool.send(
            decode.worker_id,
            Handoff(
                parked.wire_id,
                request.tokens,
                request.submitted_len,
                request.attempt_params,
                parked.source,
                parked.blocks,
                self.traces.get(request.request_id, ""),
            ),
        )

    def _pick(
        self, decodes: list[WorkerHandle], source: WorkerHandle, request: Request
    ) -> WorkerHandle | None:
        """The decode worker to send it to now, if one wired to `source` has room."""
        candidates = [
            w for w in decodes if w.routable and source.worker_id in w.peers and not w.refused
        ]
        if not candidates:  # decode workers (re)starting, being wired, or full
            return None
        in_flight, blocks = self._blocks_in_flight(), self._blocks(request)
        decode = self.router.decode(candidates, in_flight, source, blocks)
        room = decode.num_free - in_flight.get(decode.worker_id, 0)
        return decode if room >= blocks else None

    @staticmethod
    def _wired_to(source: WorkerHandle, decodes: list[WorkerHandle]) -> bool:
        """Whether a decode worker that holds `source`'s pool takes work now or soon."""
        return any(source.worker_id in w.peers and w.routable_soon for w in decodes)

    def retry_waiting(self) -> None:
        """Try every waiting handoff again, oldest first (room may have come)."""
        waiting, self._waiting = self._waiting, {}
        for parked in waiting.values():
            self.hand_off(parked)

    def on_result(self, result: HandoffResult) -> None:
        """A decode worker took a handoff (the prefill worker frees its blocks) or had no
        room (it goes to another one, or waits)."""
        request = self.table.on_handoff_result(result, time.monotonic())
        decode = self.pool.workers.get(result.worker_id)
        if request is None:
            if result.accepted:  # a stale answer (from a worker given up on): undo it
                self.pool.send(result.worker_id, Abort(result.request_id))
            return
        if not result.accepted:
            if decode is not None:
                decode.refused_handoff()  # until its next report says it has room
            self.hand_off(request.kv)
            return
        # Its next report holds these blocks: a worker answers before it reports again.
        # (On a GPU its reports during the copy already hold them while the handoff is
        # unanswered: counted twice for those milliseconds, which only errs towards
        # waiting.)
        if decode is not None:
            decode.took_handoff(self._blocks(request))
        self.pool.send(request.prefill_worker, Release(result.request_id))

    def take_back(self, request: Request) -> None:
        """Its decode worker is gone before answering: the KV is still parked, send it on."""
        self.hand_off(self.table.take_back_handoff(request.request_id))

    def sent_to(self, worker_id: int) -> list[Request]:
        """Handoffs sent to this decode worker and not answered."""
        return self.table.handoffs_to(worker_id)

    def _blocks_in_flight(self) -> Counter[int]:
        """Decode worker id -> KV blocks its last report does not show yet: of handoffs sent
        to it and not answered, and of those it took since that report."""
        in_flight: Counter[int] = Counter()
        for worker in self.pool.workers.values():
            sent = self.table.handoffs_to(worker.worker_id)
            in_flight[worker.worker_id] += sum(self._blocks(r) for r in sent)
            in_flight[worker.worker_id] += worker.taken_blocks
        return in_flight

    def _blocks(self, request: Request) -> int:
        """The KV blocks a decode worker holds for a handed-off request."""
        return blocks_for_tokens(request.submitted_len + 1, self.block_size)
