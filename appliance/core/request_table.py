"""Every request in flight as plain data: its phase, its timestamps, the workers holding it.

No I/O, no processes, no asyncio: the table says what a worker's message means for a
request and moves it on; the supervisor does the sending. A phase changes only along
`TRANSITIONS` (anything else raises `InvalidTransition`: a message out of order is a loud
error, not a quietly wrong state). A request run again after losing its worker (`rerun`)
gets a new wire id, its id in worker messages, so the old attempt's messages are stale.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any, Protocol

from appliance.engine.sequence import SamplingParams


class Output(Protocol):
    """What the table reads of a worker's output message (workers/messages.py Output)."""

    @property
    def request_id(self) -> int: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def finished(self) -> bool: ...
    @property
    def handoff_blocks(self) -> list[int] | None: ...


class HandoffResult(Protocol):
    """A decode worker's answer to a handoff (workers/messages.py HandoffResult)."""

    @property
    def worker_id(self) -> int: ...
    @property
    def request_id(self) -> int: ...
    @property
    def accepted(self) -> bool: ...
    @property
    def bytes_moved(self) -> int: ...


class LeaseExpired(Protocol):
    """A prefill worker freed a parked request's blocks (workers/messages.py LeaseExpired)."""

    @property
    def worker_id(self) -> int: ...
    @property
    def request_id(self) -> int: ...


class Phase(Enum):
    """Where a request is. Disaggregated: WAITING → QUEUED → PREFILLING → PARKED →
    HANDING_OFF → DECODING → FINISHED; colocated goes from PREFILLING to DECODING."""

    WAITING = "waiting"  # no worker of its role takes work yet (one is starting)
    QUEUED = "queued"  # sent to a prefill (or colocated) worker; no step has run it yet
    PREFILLING = "prefilling"  # a step ran it; its first token is not back yet
    PARKED = "parked"  # its KV waits in the prefill worker's blocks for a decode worker
    HANDING_OFF = "handing_off"  # a decode worker was sent the handoff, has not answered
    DECODING = "decoding"  # a decode (or colocated) worker generates its tokens
    FINISHED = "finished"  # its last token came
    FAILED = "failed"  # it ends with an error (its stream says which)
    CANCELLED = "cancelled"  # its consumer left before the end

    @property
    def terminal(self) -> bool:
        """No transition leaves it."""
        return not TRANSITIONS[self]

    @property
    def awaiting_first(self) -> bool:
        """Sent to a prefill (or colocated) worker whose first token is not back."""
        return self in (Phase.QUEUED, Phase.PREFILLING)


_ENDS = frozenset({Phase.FAILED, Phase.CANCELLED})
# A phase with work on a worker may lose that worker: then it runs again from WAITING.
_ON_A_WORKER = _ENDS | {Phase.WAITING}

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.WAITING: _ENDS | {Phase.QUEUED},
    Phase.QUEUED: _ON_A_WORKER | {Phase.PREFILLING},
    Phase.PREFILLING: _ON_A_WORKER | {Phase.PARKED, Phase.DECODING, Phase.FINISHED},
    Phase.PARKED: _ON_A_WORKER | {Phase.HANDING_OFF},
    # Back to PARKED: refused for want of room, or its decode worker is gone.
    Phase.HANDING_OFF: _ON_A_WORKER | {Phase.DECODING, Phase.PARKED},
    Phase.DECODING: _ON_A_WORKER | {Phase.FINISHED},
    Phase.FINISHED: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.CANCELLED: frozenset(),
}

# Timing's fields by the names the last chunk's timing has always carried them under.
_PUBLIC_NAMES = {"handoff_taken": "handoff"}


class InvalidTransition(RuntimeError):
    """A request was asked to move to a phase its current one does not lead to."""


@dataclass
class Timing:
    """Monotonic seconds of a request's moments; None until it happens. The first
    attempt's prefill_start and first_token stand (queue time and TTFT are what the
    client saw); handoff_sent and handoff_taken belong to the latest attempt."""

    arrival: float | None = None
    prefill_start: float | None = None  # the first step that ran it: queue time ends
    first_token: float | None = None
    handoff_sent: float | None = None  # the last time a decode worker was asked
    handoff_taken: float | None = None  # that decode worker had copied the KV
    finished: float | None = None

    def once(self, name: str, at: float) -> None:
        """Set moment `name` unless it happened already."""
        if getattr(self, name) is None:
            setattr(self, name, at)

    def as_dict(self) -> dict[str, float]:
        """The moments that happened, by their public names (handoff_taken: "handoff")."""
        pairs = ((_PUBLIC_NAMES.get(f.name, f.name), getattr(self, f.name)) for f in fields(self))
        return {name: at for name, at in pairs if at is not None}

    @classmethod
    def from_dict(cls, moments: dict[str, float]) -> Timing:
        """The inverse of `as_dict`."""
        names = {public: name for name, public in _PUBLIC_NAMES.items()}
        return cls(**{names.get(key, key): at for key, at in moments.items()})

    def time_to_first_token(self, now: float) -> float:
        """From arrival to the first token, or to `now` while there is none."""
        if self.arrival is None:
            return 0.0
        return (now if self.first_token is None else self.first_token) - self.arrival

    @property
    def queue_time(self) -> float | None:
        """From arrival to the first step that ran it (never negative)."""
        if self.arrival is None or self.prefill_start is None:
            return None
        return max(0.0, self.prefill_start - self.arrival)

    @property
    def handoff_latency(self) -> float | None:
        """The accepted handoff's round trip: sent until the decode worker had copied it."""
        if self.handoff_sent is None or self.handoff_taken is None:
            return None
        return self.handoff_taken - self.handoff_sent


@dataclass(frozen=True)
class ParkedKV:
    """A prefilled prompt's KV waiting in prefill worker `source`'s blocks."""

    wire_id: int  # the attempt that computed it
    source: int
    blocks: list[int]


@dataclass
class Request:
    """One generation in flight."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    attempt_params: SamplingParams  # this attempt's: max_tokens is what params' has left
    timing: Timing
    phase: Phase = Phase.WAITING
    previous: Phase = Phase.WAITING  # the phase before this one (a terminal one's last)
    output_ids: list[int] = field(default_factory=list)
    prefill_worker: int | None = None  # the current (or last) attempt's workers
    decode_worker: int | None = None
    wire_id: int | None = None  # the current (or last) attempt's id in worker messages
    submitted_len: int = 0  # tokens the current attempt prefills: prompt + output so far
    retries: int = 0
    parked: ParkedKV | None = None  # while PARKED or HANDING_OFF
    prefill_only: bool = False  # this attempt was sent to a prefill worker: it parks
    handoff_bytes: int = 0  # KV bytes the accepted handoff copied
    cached_tokens: int = 0  # prompt tokens the first attempt's prefix cache supplied

    @property
    def tokens(self) -> list[int]:
        """What an attempt prefills: the prompt and every token streamed so far."""
        return self.prompt + self.output_ids

    @property
    def kv(self) -> ParkedKV:
        """Its parked KV; only PARKED and HANDING_OFF requests have one."""
        if self.parked is None:
            raise LookupError(f"request {self.request_id} has no parked KV ({self.phase.name})")
        return self.parked

    @property
    def holders(self) -> frozenset[int]:
        """The workers whose work or KV blocks this request needs now."""
        return frozenset(w for w in self._holders() if w is not None)

    def _holders(self) -> tuple[int | None, ...]:
        phase = self.phase
        if phase.awaiting_first:
            return (self.prefill_worker,)
        if phase is Phase.PARKED:
            return (self.kv.source,)
        if phase is Phase.HANDING_OFF:
            return (self.kv.source, self.decode_worker)
        if phase is Phase.DECODING:  # a colocated worker decodes what it prefilled
            return (self.prefill_worker if self.decode_worker is None else self.decode_worker,)
        return ()


class RequestTable:
    """The requests in flight, the attempt each wire id names, and who holds what."""

    def __init__(self) -> None:
        self.requests: dict[int, Request] = {}  # request id -> request, oldest first
        self._ids = itertools.count()  # request ids and wire ids: never the same number
        self._wire: dict[int, int] = {}  # wire id -> request id, current attempts only
        self._held: dict[int, set[int]] = {}  # worker id -> ids of the requests it holds

    # ------------------------------------------------------------ reading

    def by_wire(self, wire_id: int) -> Request | None:
        """The request whose current attempt has this id (None: stale or unknown)."""
        request_id = self._wire.get(wire_id)
        return None if request_id is None else self.requests.get(request_id)

    def held_by(self, worker_id: int) -> list[Request]:
        """The requests that need this worker now, oldest first."""
        return [self.requests[i] for i in sorted(self._held.get(worker_id, ()))]

    def in_phase(self, phase: Phase) -> list[Request]:
        """The requests in `phase`, oldest first."""
        return [r for r in self.requests.values() if r.phase is phase]

    def waiting_at(self, worker_id: int) -> int:
        """Work sent to this worker that it has not started: prompts no step has run,
        handoffs not yet answered."""
        return sum(1 for r in self.held_by(worker_id) if _sent_to(r, worker_id, _NOT_STARTED))

    def owes_answer(self, worker_id: int) -> bool:
        """Whether this worker was sent work it has not answered: a prompt's first token
        or a handoff's result (a worker silent for long with such work is stalled)."""
        return any(_sent_to(r, worker_id, _NO_FIRST_TOKEN) for r in self.held_by(worker_id))

    def handoffs_to(self, worker_id: int) -> list[Request]:
        """Requests whose handoff was sent to this decode worker and not answered."""
        return [r for r in self.held_by(worker_id) if _handing_to(r, worker_id)]

    # ------------------------------------------------------------ the supervisor's moves

    def add(self, prompt: list[int], params: SamplingParams, now: float) -> Request:
        """A new request, WAITING until `submit` gives it to a worker."""
        request = Request(next(self._ids), list(prompt), params, params, Timing(arrival=now))
        self.requests[request.request_id] = request
        return request

    def submit(self, request_id: int, worker_id: int, prefill_only: bool = False) -> int:
        """WAITING → QUEUED at (prefill or colocated) worker `worker_id`; the new wire id."""
        request = self.requests[request_id]
        request.prefill_only = prefill_only
        wire_id = next(self._ids)
        self._move(
            request,
            Phase.QUEUED,
            wire_id=wire_id,
            prefill_worker=worker_id,
            submitted_len=len(request.tokens),
        )
        self._wire[wire_id] = request_id
        return wire_id

    def send_handoff(self, request_id: int, decode_worker: int, now: float) -> None:
        """PARKED → HANDING_OFF: decode worker `decode_worker` is asked to pull the KV."""
        request = self.requests[request_id]
        self._move(request, Phase.HANDING_OFF, decode_worker=decode_worker)
        request.timing.handoff_sent = now

    def take_back_handoff(self, request_id: int) -> ParkedKV:
        """HANDING_OFF → PARKED: its decode worker refused it or is gone; the KV is still
        parked in the prefill pool, to be sent again."""
        request = self.requests[request_id]
        self._move(request, Phase.PARKED, decode_worker=None)  # nobody holds it meanwhile
        return request.kv

    def rerun(self, request_id: int) -> None:
        """→ WAITING for a new attempt: its prompt plus the tokens already streamed, for
        what is left of max_tokens. The old attempt's messages are stale from now on."""
        request = self.requests[request_id]
        left = request.params.max_tokens - len(request.output_ids)
        params = replace(request.params, max_tokens=max(1, left))
        # The tokens already streamed stay output for the penalties, min_tokens and the
        # grammar (its matcher replays them), though the new attempt's prompt holds them.
        params = replace(params, emitted=len(request.output_ids))
        if request.output_ids:  # its first chunk carried them; the new prompt is longer
            params = replace(params, prompt_logprobs=None)
        self._move(
            request,
            Phase.WAITING,
            prefill_worker=None,
            decode_worker=None,
            parked=None,
            attempt_params=params,
        )
        request.retries += 1
        request.timing.handoff_sent = request.timing.handoff_taken = None  # handed off anew
        self._unwire(request)

    def fail(self, request_id: int) -> None:
        """→ FAILED (from any phase that is not an end): its stream carries the error."""
        self._move(self.requests[request_id], Phase.FAILED)

    def forget(self, request_id: int) -> bool:
        """Drop a request its consumer is done with. Returns True if it had not finished:
        then it is CANCELLED (unless FAILED) and its workers may still be running it."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if not request.phase.terminal:
            self._move(request, Phase.CANCELLED)
        return request.phase is not Phase.FINISHED

    # ------------------------------------------------------------ worker messages

    def on_started(self, wire_ids: list[int], step_started_at: float) -> None:
        """A worker's step ran these attempts for the first time: QUEUED → PREFILLING."""
        for wire_id in wire_ids:
            request = self.by_wire(wire_id)
            if request is not None and request.phase is Phase.QUEUED:
                self._start(request, step_started_at)

    def on_output(
        self, worker_id: int, out: Output, now: float, step_started_at: float
    ) -> Request | None:
        """Tokens from `worker_id`. A first token ends the prefill: the request is then
        FINISHED, PARKED (the output has handoff blocks) or DECODING (colocated). Returns
        None for an output about no current attempt of this worker (stale)."""
        request = self.by_wire(out.request_id)
        if request is None or worker_id not in (request.prefill_worker, request.decode_worker):
            return None
        target = _after_output(out)
        if request.phase is Phase.QUEUED:  # started and answered in one report
            self._start(request, step_started_at)
        if (request.phase, target) != (Phase.DECODING, Phase.DECODING):  # more tokens: stay
            self._check(request, target)  # before anything changes
        if request.phase is Phase.PREFILLING:
            request.timing.once("first_token", now)
        request.output_ids += out.token_ids
        if target is Phase.FINISHED:
            request.timing.finished = now
        blocks = out.handoff_blocks
        kv = None if blocks is None else ParkedKV(out.request_id, worker_id, blocks)
        if target is not request.phase:
            self._move(request, target, parked=kv)
        return request

    def on_handoff_result(self, result: HandoffResult, now: float) -> Request | None:
        """A decode worker's answer to a handoff: accepted, HANDING_OFF → DECODING (the
        prefill worker may free the blocks); refused, → PARKED to be sent again. Returns
        None for an answer nobody waits for (an accepted one must be undone)."""
        request = self.by_wire(result.request_id)
        if request is None or not _handing_to(request, result.worker_id):
            return None
        if not result.accepted:
            self.take_back_handoff(request.request_id)
            return request
        self._move(request, Phase.DECODING, parked=None, handoff_bytes=result.bytes_moved)
        request.timing.handoff_taken = now
        return request

    def on_lease_expired(self, message: LeaseExpired) -> Request | None:
        """The request whose parked KV its prefill worker freed before a decode worker
        pulled it (it must run again); None if nobody waits for those blocks."""
        request = self.by_wire(message.request_id)
        parked = request.parked if request is not None else None
        return request if parked is not None and parked.source == message.worker_id else None

    # ------------------------------------------------------------ bookkeeping

    def _start(self, request: Request, step_started_at: float) -> None:
        self._move(request, Phase.PREFILLING)
        request.timing.once("prefill_start", step_started_at)

    def _check(self, request: Request, phase: Phase) -> None:
        if phase not in TRANSITIONS[request.phase]:
            raise InvalidTransition(
                f"request {request.request_id} cannot go from {request.phase.name} to {phase.name}"
            )

    def _move(self, request: Request, phase: Phase, **changes: Any) -> None:
        """The one place a phase changes: checked, `changes` applied to the request's
        fields, and the worker index kept in step."""
        self._check(request, phase)
        self._unindex(request)
        for name, value in changes.items():
            setattr(request, name, value)
        request.previous, request.phase = request.phase, phase
        for worker_id in request.holders:
            self._held.setdefault(worker_id, set()).add(request.request_id)
        if phase.terminal:
            self._unwire(request)

    def _unindex(self, request: Request) -> None:
        for worker_id in request.holders:
            held = self._held[worker_id]
            held.discard(request.request_id)
            if not held:
                del self._held[worker_id]

    def _unwire(self, request: Request) -> None:
        wire_id = request.wire_id
        if wire_id is not None and self._wire.get(wire_id) == request.request_id:
            del self._wire[wire_id]


def _after_output(out: Output) -> Phase:
    """The phase an output leads to (DECODING: it stays, or a colocated first token)."""
    if out.finished:
        return Phase.FINISHED
    return Phase.DECODING if out.handoff_blocks is None else Phase.PARKED


_NOT_STARTED = frozenset({Phase.QUEUED})
_NO_FIRST_TOKEN = frozenset({Phase.QUEUED, Phase.PREFILLING})


def _sent_to(request: Request, worker_id: int, prompt_phases: frozenset[Phase]) -> bool:
    """Its prompt (in one of `prompt_phases`) or its handoff waits on this worker."""
    if request.phase in prompt_phases:
        return request.prefill_worker == worker_id
    return _handing_to(request, worker_id)


def _handing_to(request: Request, worker_id: int) -> bool:
    return request.phase is Phase.HANDING_OFF and request.decode_worker == worker_id
