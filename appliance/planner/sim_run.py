"""The simulator's event loop: arrivals, model steps ending (contention moves them),
handoffs landing; the supervisor's part (routing, handing off, waiting for room) between
them. Events at the same time run in the order they were scheduled: deterministic.

With `Policy.admission` a prompt is held (core/admission.py's `decide`, as the
supervisor's flow holds it) while the worker that would decode it is predicted to step
over the TPOT limit with it; held prompts are admitted oldest first at step ends. `moves`
change a worker's role at a given time, in place as ops/pool_moves.py does: what it runs
goes on there (a former prefill worker still hands off what it prefilled; with no decode
worker left those handoffs go to a colocated one).

A cross-box layout's handoffs cross the one link between its boxes (`Profile.network`)
one after another: each holds the link for its bytes' time, in the order sent (FIFO),
and lands the link's base latency after its last byte; in-box handoffs do not queue."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.core.admission import DecodeLoad, pool_load
from appliance.core.admission_queue import AdmissionQueue
from appliance.core.goodput import RequestResult
from appliance.core.roles import Role
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.planner.layout import Layout
from appliance.planner.profile import HandoffCost, Profile, StepCost
from appliance.planner.sim_box import Contention, PromptRouter, pick_decode
from appliance.planner.sim_pool import KVPool, SimSeq
from appliance.planner.sim_worker import Limits, Step, StepRecord, Worker

if TYPE_CHECKING:
    from appliance.planner.simulator import Policy, SimRequest

ARRIVE, MODEL_DONE, STEP_END, LAND, KICK, MOVE = range(6)


@dataclass(frozen=True)
class Move:
    """At `at_s`, worker `worker` (device order: Simulation._workers) takes `role`."""

    at_s: float
    worker: int
    role: Role


class Simulation:
    """One run of `requests` on `layout` with `profile`'s costs."""

    def __init__(
        self,
        profile: Profile,
        layout: Layout,
        requests: Sequence[SimRequest],
        policy: Policy,
        concurrency: int | None = None,
        trace: list[StepRecord] | None = None,
        moves: Sequence[Move] = (),
    ) -> None:
        self.profile = profile
        self.requests = requests
        self.policy = policy
        self.concurrency = concurrency
        self.trace = trace
        self.network = _network(profile, layout)  # None: handoffs stay in the box
        self.link_free = 0.0  # when the link between the boxes has sent what it was given
        self.workers = self._workers(layout)
        self.entry = [w for w in self.workers if w.role != "decode"]  # prompts go here
        self.decoders = [w for w in self.workers if w.role == "decode"]
        self.sizes = self._one_of_each_role()  # the pools a request must fit
        self.heap: list[tuple[float, int, int, int, Any]] = []
        self.order = itertools.count()
        self.contention = Contention(
            [w.cost.contention for w in self.workers],
            lambda at, worker, version: self._push(at, MODEL_DONE, worker, version),
            # a cross-box layout's decode workers are on the second box: they do not
            # share the prefill box's memory bandwidth
            [int(layout.cross_box and w.role == "decode") for w in self.workers],
        )
        self.router = PromptRouter(
            self.entry,
            policy.prefill_token_budget,
            policy.routing == "round_robin",
            policy.prefix_caching,
        )
        self.started = [0.0] * len(self.workers)  # when each worker's current step began
        self.flying = [0] * len(self.workers)  # keys of the handoffs being copied to each
        self.handoffs: list[tuple[Worker, SimSeq]] = []  # waiting for room, oldest first
        self.arrival = [r.arrival_s for r in requests]
        self.times: list[list[float]] = [[] for _ in requests]
        self.errors: dict[int, str] = {}
        self.next_request = len(requests)  # closed loop: the next one a user sends
        self.moves = list(moves)
        for move in self.moves:
            if not 0 <= move.worker < len(self.workers):
                raise ValueError(
                    f"move of worker {move.worker}: the layout has {len(self.workers)}"
                )
        self.admission = AdmissionQueue(policy.admission)  # held prompts: request indices
        self.held: dict[int, SimSeq] = {}  # request index -> its sequence, while held
        self.queued: dict[SimSeq, int] = {}  # routed, no first token yet -> tokens queued

    def _workers(self, layout: Layout) -> list[Worker]:
        """Every worker, in device order: prefill (colocated in colocated mode), decode,
        then a mixed layout's colocated workers."""
        first: Role = "colocated" if layout.mode == "colocated" else "prefill"
        pools = [(first, layout.prefill_unit(), layout.prefill.workers)]
        if layout.decode is not None:
            pools.append(("decode", layout.decode_unit(), layout.decode.workers))
        if layout.colocated is not None:
            pools.append(("colocated", layout.colocated_unit(), layout.colocated.workers))
        roles = [(role, unit) for role, unit, count in pools for _ in range(count)]
        return [self._worker(i, role, unit) for i, (role, unit) in enumerate(roles)]

    def _worker(self, index: int, role: Role, unit: str) -> Worker:
        cost = self.profile.worker(unit)
        policy = self.policy
        budget = policy.prefill_token_budget
        if role == "decode":  # a decode step needs a token of budget per running sequence
            budget = max(budget, policy.max_num_seqs)
        limits = Limits(policy.max_num_seqs, budget, policy.chunk_size)
        pool = KVPool(cost.kv_blocks, self.profile.block_size, policy.prefix_caching)
        return Worker(index, role, cost, pool, limits, policy.speculation)

    # ------------------------------------------------------------ the loop

    def run(self) -> list[RequestResult]:
        """Run every request to its end; their results in the order given."""
        if self.concurrency is None:
            for index, request in enumerate(self.requests):
                self._push(request.arrival_s, ARRIVE, index, None)
        else:
            self.next_request = min(self.concurrency, len(self.requests))
            for index in range(self.next_request):
                self.arrival[index] = 0.0
                self._push(0.0, ARRIVE, index, None)
        for number, move in enumerate(self.moves):
            self._push(move.at_s, MOVE, number, None)
        heap = self.heap
        while heap:
            now, _, kind, a, b = heapq.heappop(heap)
            if kind == MODEL_DONE:
                self._model_done(self.workers[a], b, now)
            elif kind == STEP_END:
                self._step_end(self.workers[a], now)
            elif kind == ARRIVE:
                self._arrive(a, now)
            elif kind == LAND:
                self._land(self.workers[a], b, now)
            elif kind == MOVE:
                self._move(self.moves[a], now)
            else:
                self.workers[a].kick_pending = False
                self._start(self.workers[a], now)
        return [self._result(i) for i in range(len(self.requests))]

    def _push(self, at: float, kind: int, a: int, b: Any) -> None:
        heapq.heappush(self.heap, (at, next(self.order), kind, a, b))

    # ------------------------------------------------------------ requests

    def _arrive(self, index: int, now: float) -> None:
        request = self.requests[index]
        error = self._rejection(request)
        if error is not None:
            self.errors[index] = error
            self._ended(now)
            return
        size = self.profile.block_size
        shared = request.prefix_id is not None and self.policy.prefix_caching
        seq = SimSeq(
            index,
            request.prompt_tokens,
            request.output_tokens,
            self.times[index],
            request.prefix_id,
            request.prefix_tokens // size if shared else 0,
        )
        seq.stored_blocks = request.stored_tokens // size  # the box's KV store (prefix_hits)
        among = self._admitting(index, seq, now)
        if not among:
            self.held[index] = seq
            return
        self._route(seq, now, among)

    def _route(self, seq: SimSeq, now: float, among: list[Worker]) -> None:
        routed = self.router.route(seq, self.profile.block_size, among)
        worker = routed.worker
        seq.prefill_only = worker.role == "prefill"  # it parks after its first token
        worker.waiting.append(seq)
        # Queued as what it computes there (as request_flow): a cached prompt queues little.
        self.queued[seq] = routed.compute
        worker.queued_tokens += routed.compute
        self._kick(worker, now)

    def _admitting(self, index: int, seq: SimSeq, now: float) -> list[Worker]:
        """The entry workers that may take the prompt now (none: held): the supervisor's
        admission queue decides (core/admission_queue.py), over each one's decoding and
        its decode step cost; the router picks among them."""
        if self.policy.admission is None:
            return self.entry
        loads = [self._decode_load(w) for w in self.entry]
        decode = self._decode_cost()
        models = [w.cost.decode if w.role == "colocated" else decode for w in self.entry]
        waited = now - self.arrival[index]
        allowed = self.admission.admits(index, seq.prompt, waited, loads, models)
        return [self.entry[i] for i in allowed]

    def _admit_held(self, now: float) -> None:
        """Held prompts join, oldest first, until one is still held."""
        while (index := self.admission.head()) is not None:
            seq = self.held[index]
            among = self._admitting(index, seq, now)
            if not among:
                return
            del self.held[index]
            self._route(seq, now, among)

    def _decode_cost(self) -> StepCost | None:
        decoders = self._decoders()
        return decoders[0].cost.decode if decoders else None

    def _decode_load(self, entry: Worker) -> DecodeLoad:
        """What the worker that decodes entry's next prompt decodes, or will: entry itself
        when colocated; else the decode pool's load as the flow weighs it (pool_load):
        its lightest worker, with the prompts the prefill pool holds for it (queued,
        prefilling, or prefilled and waiting for room) spread over it."""
        if entry.role == "colocated":
            return self._worker_load(entry)
        decoders = self._decoders()
        if not decoders:
            return DecodeLoad(0, 0)
        coming = [_load(w) for w in self.entry if w.role == "prefill"]
        coming.append(DecodeLoad(len(self.handoffs), sum(s.length for _, s in self.handoffs)))
        pending = DecodeLoad(sum(c.seqs for c in coming), sum(c.context for c in coming))
        return pool_load([self._worker_load(w) for w in decoders], pending)[1]

    def _worker_load(self, worker: Worker) -> DecodeLoad:
        """The worker's load, the handoffs being copied to it included with their keys
        (the flow's table has them on their decode worker from the moment it is asked)."""
        load = _load(worker)
        flying = self.flying[worker.index]
        if not flying:
            return load
        return DecodeLoad(load.seqs, load.context + flying, load.remaining)

    def _decoders(self) -> list[Worker]:
        """The workers handoffs go to: the decode pool; with none left (moved away while
        a former prefill worker still hands off), the colocated workers."""
        return self.decoders or [w for w in self.workers if w.role == "colocated"]

    def _move(self, move: Move, now: float) -> None:
        """The worker takes its new role in place; prompts route by the new roles."""
        worker = self.workers[move.worker]
        worker.role = move.role
        self.entry = [w for w in self.workers if w.role != "decode"]
        self.decoders = [w for w in self.workers if w.role == "decode"]
        policy = self.policy
        self.router = PromptRouter(
            self.entry,
            policy.prefill_token_budget,
            policy.routing == "round_robin",
            policy.prefix_caching,
        )
        if self.handoffs:
            self._retry_handoffs(now)
        self._admit_held(now)
        self._kick(worker, now)

    def _rejection(self, request: SimRequest) -> str | None:
        """Why the appliance would refuse the request (the server's 400), if it would."""
        total = request.prompt_tokens + request.output_tokens
        limit = self.profile.max_model_len
        if total > limit:
            return (
                f"HTTP 400: {request.prompt_tokens} prompt tokens + {request.output_tokens} "
                f"max_tokens exceed the model's context of {limit} tokens"
            )
        size = self.profile.block_size
        for worker in self.sizes:
            tokens = request.prompt_tokens if worker.role == "prefill" else total
            if blocks_for_tokens(tokens, size) > worker.pool.total:
                return (
                    f"HTTP 400: {tokens} tokens need more than the {worker.pool.total} KV "
                    f"blocks of a {worker.role} worker ({worker.pool.total * size} tokens)"
                )
        return None

    def _one_of_each_role(self) -> list[Worker]:
        """The first entry worker of each role, then the first decode worker if prompts
        can reach it (a decode pool without prefill workers idles)."""
        firsts = {w.role: w for w in reversed(self.entry)}
        sample = sorted(firsts.values(), key=lambda w: w.index)
        if "prefill" in firsts and self.decoders:
            sample.append(self.decoders[0])
        return sample

    def _ended(self, at: float) -> None:
        """A request ended: in a closed loop its user sends the next one then."""
        if self.concurrency is not None and self.next_request < len(self.requests):
            self.arrival[self.next_request] = at
            self._push(at, ARRIVE, self.next_request, None)
            self.next_request += 1

    def _result(self, index: int) -> RequestResult:
        request = self.requests[index]
        start = self.arrival[index]
        result = RequestResult(prompt_tokens=request.prompt_tokens, start=start)
        times = self.times[index]
        if index in self.errors or len(times) != request.output_tokens:
            result.error = self.errors.get(index, "the simulation ended before the request")
            return result
        result.ok = True
        result.output_tokens = len(times)
        result.ttft = times[0] - start
        result.latency = times[-1] - start
        result.itl = [b - a for a, b in itertools.pairwise(times)]
        return result

    # ------------------------------------------------------------ steps

    def _kick(self, worker: Worker, now: float) -> None:
        """Start the worker's next step if it is free and has something to run. Not before
        everything else due now has happened: a worker takes every message waiting for
        it (prompts, handoffs landed) before it steps."""
        if worker.busy or worker.kick_pending:
            return
        if self.heap and self.heap[0][0] <= now:
            worker.kick_pending = True
            self._push(now, KICK, worker.index, None)
            return
        self._start(worker, now)

    def _start(self, worker: Worker, now: float) -> None:
        if worker.busy:
            return
        step = worker.begin()
        if step is None:
            return
        worker.current = step
        self.started[worker.index] = now
        self.contention.start(worker.index, now, step.seconds)

    def _model_done(self, worker: Worker, version: int, now: float) -> None:
        if not self.contention.current(worker.index, version):
            return  # contention moved this step's end
        self.contention.done(worker.index, now)
        host = self.profile.host.per_step_s
        if host > 0:
            self._push(now + host, STEP_END, worker.index, None)
        else:
            self._step_end(worker, now)

    def _step_end(self, worker: Worker, now: float) -> None:
        step = worker.current
        if step is None:
            raise RuntimeError(f"worker {worker.index} ended a step it did not start")
        worker.current = None
        out = worker.end(step, now + self.profile.host.per_token_s)
        if self.trace is not None:
            self.trace.append(self._record(worker, step, now))
        for seq in out.first:
            if worker.role != "decode":
                worker.queued_tokens -= self.queued.pop(seq)
        for seq in out.finished:
            self._ended(seq.times[-1])
        for seq in out.parked:
            self._hand_off(worker, seq, now)
        if out.freed and worker.role == "decode" and self.handoffs:
            self._retry_handoffs(now)
        if self.held:
            self._admit_held(now)
        self._kick(worker, now)

    def _record(self, worker: Worker, step: Step, now: float) -> StepRecord:
        decodes = step.lazy + sum(1 for _, n in step.chunks if n == 1)
        start = self.started[worker.index]
        return StepRecord(
            worker.index, start, now, step.kind, step.prefills, decodes, step.preempted
        )

    # ------------------------------------------------------------ handoffs

    def _hand_off(self, source: Worker, seq: SimSeq, now: float) -> None:
        """Send a parked prompt to the decode worker with most room, or keep it waiting."""
        decode = pick_decode(self._decoders(), seq)
        if decode is None:
            self.handoffs.append((source, seq))
            return
        self._send(source, seq, decode, now)

    def _send(self, source: Worker, seq: SimSeq, decode: Worker, now: float) -> None:
        """The decode worker takes the sequence's blocks now (prompt blocks it has cached
        are not copied) and runs it once the copy has landed."""
        pool, size = decode.pool, self.profile.block_size
        copy = SimSeq(seq.req, seq.prompt, seq.output, seq.times, seq.prefix_id, seq.prefix_blocks)
        copy.made, copy.computed = seq.made, seq.prompt
        cached = pool.match(copy, seq.prompt // size)
        pool.allocate(copy, blocks_for_tokens(seq.prompt + 1, size) - cached)
        pool.register_prefix(copy)
        decode.in_flight += 1
        self.flying[decode.index] += copy.length
        moved = (seq.prompt - cached * size) * self.profile.kv_bytes_per_token
        self._push(self._landing(moved, now), LAND, decode.index, (source, seq, copy))

    def _landing(self, moved: int, now: float) -> float:
        """When a handoff of `moved` bytes sent now lands. Across boxes the link sends
        one handoff's bytes at a time, in the order sent; its base latency (setup and
        notification) does not hold the link."""
        if self.network is None:
            return now + self.profile.handoff.seconds(moved)
        self.link_free = max(now, self.link_free) + self.network.per_byte_s * moved
        return self.link_free + self.network.base_s

    def _land(self, decode: Worker, handoff: tuple[Worker, SimSeq, SimSeq], now: float) -> None:
        source, parked, copy = handoff
        decode.in_flight -= 1
        self.flying[decode.index] -= copy.length
        decode.landed.append(copy)
        source.release_parked(parked)
        self._kick(source, now)
        self._kick(decode, now)

    def _retry_handoffs(self, now: float) -> None:
        """Waiting handoffs try again, oldest first (a later, smaller one may fit)."""
        waiting, self.handoffs = self.handoffs, []
        for index, (source, seq) in enumerate(waiting):
            if not any(self._has_slot(w) for w in self._decoders()):
                self.handoffs.extend(waiting[index:])
                return
            self._hand_off(source, seq, now)

    @staticmethod
    def _has_slot(worker: Worker) -> bool:
        return worker.running + len(worker.landed) + worker.in_flight < worker.limits.max_num_seqs


def _load(worker: Worker) -> DecodeLoad:
    """The sequences a worker runs, holds waiting or is being handed, their lengths (a
    prompt not started counts its prompt) and the tokens each has left to make."""
    pending = [*worker.waiting, *worker.landed]
    context = worker.context + sum(s.length for s in worker.tail) + sum(s.length for s in pending)
    # A lazy sequence's progress is its worker's steps since it turned lazy.
    lazy = [s.output - (s.c0 + worker.step - s.k0 + 1 - s.prompt) for s in worker.lazy]
    others = [s.output - s.made for s in (*worker.tail, *pending)]
    seqs = worker.running + len(pending) + worker.in_flight
    remaining = tuple(lazy + others) if worker.in_flight == 0 else ()
    return DecodeLoad(seqs, context, remaining)


def _network(profile: Profile, layout: Layout) -> HandoffCost | None:
    """The link a cross-box layout's handoffs cross; None for a one-box layout."""
    if not layout.cross_box:
        return None
    if profile.network is None:
        raise ValueError(
            f"layout {layout.label} spans two boxes but the profile has no network link "
            "between boxes (Profile.network; an analytic plan takes --link-gbps)"
        )
    return profile.network
