"""What the simulated workers share: the box's memory bandwidth (contention) and the
supervisor's routing of prompts and handoffs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from appliance.core.prefill_cost import Cost, Load, Routed, cheapest, held_prefix, prompt_cost
from appliance.core.router import PREFIX_KEYS_KEPT
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.planner.sim_pool import SimSeq
from appliance.planner.sim_worker import Worker


class Contention:
    """Model steps slowed while other workers run theirs: a worker's step progresses at
    1/contention of its speed whenever another worker of the box is mid-step, at full
    speed otherwise, so a step that overlaps others for part of its time is slowed for
    that part only. `schedule(at, worker, version)` is told (again) when a step will end;
    only the latest version of a worker's end counts. `boxes`: each worker's box (default
    all on one); only workers of the same box slow each other."""

    def __init__(
        self,
        factors: Sequence[float],
        schedule: Callable[[float, int, int], None],
        boxes: Sequence[int] | None = None,
    ) -> None:
        self.factors = list(factors)
        self.schedule = schedule
        self.boxes = list(boxes) if boxes is not None else [0] * len(self.factors)
        if len(self.boxes) != len(self.factors):
            raise ValueError(f"{len(self.boxes)} boxes given for {len(self.factors)} workers")
        self.active = any(f > 1.0 for f in self.factors)  # else no bookkeeping at all
        self.busy: dict[int, list[float]] = {}  # worker -> [work left (s), since, rate]
        self.versions = [0] * len(self.factors)

    def start(self, worker: int, now: float, work: float) -> None:
        """The worker starts a step of `work` seconds (alone on the box)."""
        if not self.active:
            self._push(worker, now + work)
            return
        self._settle(now)
        self.busy[worker] = [work, now, 0.0]
        self._rerate(now)

    def done(self, worker: int, now: float) -> None:
        """Its step ended (at the time last scheduled for it)."""
        if self.active:
            self._settle(now)
            del self.busy[worker]
            self._rerate(now)

    def current(self, worker: int, version: int) -> bool:
        """Whether a scheduled end is the worker's latest."""
        return self.versions[worker] == version

    def _settle(self, now: float) -> None:
        for state in self.busy.values():
            state[0] = max(0.0, state[0] - (now - state[1]) * state[2])
            state[1] = now

    def _rerate(self, now: float) -> None:
        busy_per_box = Counter(self.boxes[worker] for worker in self.busy)
        for worker, state in self.busy.items():
            shared = busy_per_box[self.boxes[worker]] > 1
            rate = 1.0 / self.factors[worker] if shared else 1.0
            if rate != state[2]:
                state[2] = rate
                self._push(worker, now + state[0] / rate)

    def _push(self, worker: int, at: float) -> None:
        self.versions[worker] += 1
        self.schedule(at, worker, self.versions[worker])


class PromptRouter:
    """router.Router.route's rule (router.least_wait, remember_prefix) over simulated
    workers: the worker where the prompt waits least for its first token, in prompt tokens
    computed (prefill_cost.prompt_cost: the queue ahead, its part not cached there, a row
    per running sequence per step); or in turn. Cached there is the shared prefix the worker
    was sent lately (its last PREFIX_KEYS_KEPT prompt blocks, counted rather than hashed)
    joined by the blocks the box's KV store serves the prompt (loadable by any worker)."""

    def __init__(
        self, workers: list[Worker], budget: int, round_robin: bool, caching: bool
    ) -> None:
        self.workers = workers
        self.budget = budget
        self.round_robin = round_robin
        self.caching = caching
        self.turns = 0
        self.blocks_sent = [0] * len(workers)  # prompt blocks routed to each, ever
        self.prefix_at: list[dict[int, int]] = [{} for _ in workers]  # id -> blocks_sent then

    def pick(self, seq: SimSeq, block_size: int, among: list[Worker] | None = None) -> Worker:
        """The worker that prefills seq (`route`'s)."""
        return self.route(seq, block_size, among).worker

    def route(
        self, seq: SimSeq, block_size: int, among: list[Worker] | None = None
    ) -> Routed[Worker]:
        """The worker that prefills seq (of `among`, default all), with the prompt tokens it
        is expected to compute there; it remembers seq's prefix went there."""
        workers = self.workers if among is None else among
        if self.round_robin:
            routed = Routed(workers[self.turns % len(workers)], seq.prompt)
            self.turns += 1
        else:
            costs = [self._cost(worker, seq, block_size) for worker in workers]
            best = cheapest(costs)
            routed = Routed(workers[best], costs[best].compute)
        self._remember(self.workers.index(routed.worker), seq, block_size)
        return routed

    def _cost(self, worker: Worker, seq: SimSeq, block_size: int) -> Cost:
        """What seq costs on the worker (router.least_wait's cost of one candidate)."""
        if self.caching:  # block i of the prompt is key i: pooled and stored are leading runs
            pooled, stored = range(self._held(worker, seq)), range(seq.stored_blocks)
        else:  # as the router, which hashes no keys without a prefix cache
            pooled = stored = range(0)
        held = held_prefix(range(seq.prompt // block_size), pooled, stored)
        load = Load(worker.queued_tokens, worker.running)
        return prompt_cost(seq.prompt, held, load, block_size, self.budget)

    def _held(self, worker: Worker, seq: SimSeq) -> int:
        """Blocks of seq's prefix the worker was sent lately (0 or all of them)."""
        if seq.prefix_id is None:
            return 0
        index = self.workers.index(worker)
        at = self.prefix_at[index].get(seq.prefix_id)
        if at is None or self.blocks_sent[index] - at + seq.prefix_blocks > PREFIX_KEYS_KEPT:
            return 0
        return seq.prefix_blocks

    def _remember(self, index: int, seq: SimSeq, block_size: int) -> None:
        if not self.caching:
            return
        if seq.prefix_id is not None:
            self.prefix_at[index][seq.prefix_id] = self.blocks_sent[index] + seq.prefix_blocks
        self.blocks_sent[index] += seq.prompt // block_size


def pick_decode(decoders: list[Worker], seq: SimSeq) -> Worker | None:
    """handoffs._pick and router.Router.decode with equal links (a CPU box's, and what a
    profile knows): among the decode workers with room for the handoff (free blocks for
    its prompt and first token, a free sequence slot), the one with the most free blocks,
    then the fewest running; None: it waits for room."""
    size = decoders[0].pool.block_size
    need = blocks_for_tokens(seq.prompt + 1, size)
    best: Worker | None = None
    for worker in decoders:
        slots = worker.limits.max_num_seqs - worker.running - len(worker.landed)
        if worker.pool.free < need or slots - worker.in_flight <= 0:
            continue
        if best is None or (worker.pool.free, -worker.running) > (
            best.pool.free,
            -best.running,
        ):
            best = worker
    return best
