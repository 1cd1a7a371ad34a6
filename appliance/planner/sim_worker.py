"""One simulated worker: engine/scheduler.py's decisions over SimSeqs, step by step.

Each step gets a token budget; running sequences go first in admission order (one token
each when decoding, a chunk of at most chunk_size otherwise), then waiting ones, FIFO,
while fewer than max_num_seqs run. When the pool runs dry the newest running sequence is
preempted and recomputed later (its full blocks stay cached: it may match them again).

For speed the running list is kept as `lazy + tail`: `lazy` are decoding sequences that
advance one token every step without being touched (their progress is `step - k0`,
materialized when they finish or a step needs them), `tail` the rest, scheduled one by
one. A lazy sequence needs a block at a step known in advance, and finishes at one, so a
step costs O(1) plus O(tail). When the lazy ones cannot all get their block the step
falls back to the scheduler's full loop, preempting as it does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from appliance.core.roles import Role
from appliance.planner.prefix_hits import start_from_store
from appliance.planner.profile import StepCost, WorkerCost, attended
from appliance.planner.sim_pool import KVPool, SimSeq
from appliance.planner.speculation import Speculation


@dataclass(frozen=True)
class Limits:
    """A worker's scheduler limits (tuning.batch_limits for its role)."""

    max_num_seqs: int
    budget: int  # max_num_batched_tokens
    chunk_size: int


@dataclass(frozen=True)
class StepRecord:
    """What one simulated step ran (for tests and traces)."""

    worker: int
    start: float  # when the model step began
    end: float  # when it ended, the host's per-step share included
    kind: str  # "prefill", "decode" or "mixed"
    prefill_chunks: tuple[int, ...]  # tokens of each prompt chunk, in schedule order
    decodes: int  # single-token sequences
    preempted: int


@dataclass(slots=True)
class Step:
    """A step in progress: `lazy` lazy sequences decode, then `chunks` of the tail."""

    lazy: int
    chunks: list[tuple[SimSeq, int]]
    kind: str
    seconds: float  # model time, before contention and the host's share
    prefills: tuple[int, ...]
    preempted: int


@dataclass(slots=True)
class StepOutcome:
    """What a finished step did that the rest of the box must hear of."""

    finished: list[SimSeq] = field(default_factory=list)
    parked: list[SimSeq] = field(default_factory=list)
    first: list[SimSeq] = field(default_factory=list)  # their first token came
    freed: bool = False  # blocks or sequence slots came free


class Worker:
    """A prefill, decode or colocated worker's scheduler and KV pool."""

    def __init__(
        self,
        index: int,
        role: Role,
        cost: WorkerCost,
        pool: KVPool,
        limits: Limits,
        speculation: Speculation | None = None,
    ) -> None:
        """speculation: how its decode-only steps speculate (None: they do not)."""
        self.index = index
        self.speculation = speculation
        self.role = role
        self.cost = cost
        self.pool = pool
        self.limits = limits
        self.lazy: list[SimSeq] = []
        self.tail: list[SimSeq] = []
        self.waiting: deque[SimSeq] = deque()
        self.landed: list[SimSeq] = []  # handed-off sequences: they join the next step
        self.step = 0  # steps run so far
        self.times: list[float] = []  # per step: when its tokens reach the client
        self.context = 0  # sum of the lazy sequences' lengths
        self.crossing: dict[int, list[tuple[SimSeq, int]]] = {}  # step -> (seq, k0) needing a block
        self.finishing: dict[int, list[tuple[SimSeq, int]]] = {}  # step -> (seq, k0) ending
        self.current: Step | None = None
        self.kick_pending = False  # it starts its next step once the events due now ran
        self.queued_tokens = 0  # tokens to compute of prompts routed here, first token not yet made
        self.in_flight = 0  # handoffs on their way here

    @property
    def running(self) -> int:
        return len(self.lazy) + len(self.tail)

    @property
    def busy(self) -> bool:
        return self.current is not None

    def has_work(self) -> bool:
        return bool(self.lazy or self.tail or self.waiting or self.landed)

    # ------------------------------------------------------------ starting a step

    def begin(self) -> Step | None:
        """Decide the next step (None: nothing can run now)."""
        for seq in self.landed:  # they join the end of the running list
            self._join(seq)
        self.landed = []
        if not self.has_work():
            return None
        if not self._lazy_blocks():
            self._materialize_all()
        budget = self.limits.budget - len(self.lazy)
        chunks: list[tuple[SimSeq, int]] = []
        preempted = self._schedule_tail(chunks, budget)
        if not chunks and not self.lazy:
            return None
        return self._plan(chunks, preempted)

    def _join(self, seq: SimSeq) -> None:
        # Behind a sequence that is not decoding it is scheduled one by one, in order.
        if self.tail or not _decoding(seq):
            self.tail.append(seq)
        else:
            self._make_lazy(seq)

    def _lazy_blocks(self) -> bool:
        """Give the lazy sequences the blocks this step needs, if the pool has them all
        (and the budget covers them); False: the full loop must decide."""
        if not self.lazy:
            return True
        if len(self.lazy) > self.limits.budget:
            return False
        entries = self.crossing.get(self.step)
        if not entries:
            return True
        needing = [seq for seq, k0 in entries if seq.k0 == k0]
        if len(needing) > self.pool.free:
            return False
        del self.crossing[self.step]
        size = self.pool.block_size
        for seq in needing:
            self.pool.allocate(seq, 1)
            if self.step + size <= _last_step(seq):
                self._at(self.crossing, self.step + size, seq)
        return True

    def _schedule_tail(self, chunks: list[tuple[SimSeq, int]], budget: int) -> int:
        """scheduler.py's loop over the tail of the running list, then the waiting queue;
        returns how many it preempted."""
        limits, pool, tail = self.limits, self.pool, self.tail
        preempted = 0
        index = 0
        while index < len(tail) and budget > 0:
            seq = tail[index]
            want = min(seq.length - seq.computed, budget, limits.chunk_size)
            while not pool.reserve(seq, want):
                victim = tail[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if index >= len(tail) or tail[index] is not seq:
                break  # seq preempted itself: nothing newer is left to run
            chunks.append((seq, want))
            budget -= want
            index += 1
        waiting = self.waiting
        while waiting and budget > 0 and self.running < limits.max_num_seqs:
            seq = waiting[0]
            if not seq.blocks:  # start on the cached blocks of its prefix
                seq.computed = pool.match(seq, (seq.length - 1) // pool.block_size)
                seq.computed *= pool.block_size
                seq.computed = start_from_store(seq, pool.block_size)  # or the box's store
            want = min(seq.length - seq.computed, budget, limits.chunk_size)
            if not pool.reserve(seq, want):
                pool.release(seq)  # it waits with nothing held
                seq.computed = 0
                break
            waiting.popleft()
            tail.append(seq)
            chunks.append((seq, want))
            budget -= want
        return preempted

    def _preempt(self, seq: SimSeq) -> None:
        self.tail.remove(seq)
        self.pool.release(seq)
        seq.computed = 0
        self.waiting.appendleft(seq)

    def _plan(self, chunks: list[tuple[SimSeq, int]], preempted: int) -> Step:
        """The step's kind and model time from its features (see StepCost)."""
        tokens = seqs = pairs = 0
        context = self.context
        decodes = len(self.lazy)
        prefills = []
        for seq, n in chunks:
            if n == 1:  # one query token attends from the cache: the decode path
                decodes += 1
                context += seq.computed + 1
            else:
                prefills.append(n)
                pairs += attended(seq.computed, n)
            tokens += n
        tokens += len(self.lazy)
        seqs = len(self.lazy) + len(chunks)
        kind = "mixed" if prefills and decodes else "prefill" if prefills else "decode"
        cost: StepCost = getattr(self.cost, kind)
        if kind == "decode" and self.speculation is not None:
            # Per token each sequence makes: a verify step over its tokens, where it pays.
            seconds = self.speculation.step_seconds(cost, seqs, context, tokens)
        else:
            # The prompt chunks' tokens decide the kernel regime (StepCost.gemm_rows).
            seconds = cost.seconds(tokens, seqs, pairs, context, sum(prefills))
        return Step(len(self.lazy), chunks, kind, seconds, tuple(prefills), preempted)

    # ------------------------------------------------------------ ending a step

    def end(self, step: Step, deliver: float) -> StepOutcome:
        """Apply the step's results; its tokens reach the client at `deliver`."""
        out = StepOutcome(freed=step.preempted > 0)
        done = self.step
        self.step += 1
        self.times.append(deliver)
        if step.lazy:
            self.context += step.lazy
            for seq, k0 in self.finishing.pop(done, ()):
                if seq.k0 == k0:
                    self._materialize(seq)
                    self.lazy.remove(seq)
                    self.context -= seq.computed + 1
                    self._finish(seq, out)
        for seq, n in step.chunks:
            seq.computed += n
            self.pool.register_prefix(seq)
            if seq.computed < seq.length:
                continue
            seq.made += 1
            seq.times.append(deliver)
            if seq.made == 1:
                out.first.append(seq)
            if seq.made >= seq.output:
                self.tail.remove(seq)
                self._finish(seq, out)
            elif seq.prefill_only:
                self.tail.remove(seq)
                out.parked.append(seq)
                out.freed = True  # a sequence slot
        self._settle_tail()
        return out

    def _finish(self, seq: SimSeq, out: StepOutcome) -> None:
        self.pool.release(seq)
        out.finished.append(seq)
        out.freed = True

    def _settle_tail(self) -> None:
        """The tail's leading decoding sequences join the lazy ones (order is kept)."""
        tail = self.tail
        count = 0
        while count < len(tail) and _decoding(tail[count]):
            self._make_lazy(tail[count])
            count += 1
        if count:
            del tail[:count]

    def _make_lazy(self, seq: SimSeq) -> None:
        """seq decodes one token every step from the next one on, untouched until it
        finishes or a step falls back to the full loop."""
        seq.k0, seq.c0 = self.step, seq.computed
        self.lazy.append(seq)
        self.context += seq.computed + 1
        last = _last_step(seq)
        self._at(self.finishing, last, seq)
        # The first step whose token needs one more block than it holds.
        cross = self.step + seq.blocks * self.pool.block_size - seq.computed
        if cross <= last:
            self._at(self.crossing, cross, seq)

    @staticmethod
    def _at(table: dict[int, list[tuple[SimSeq, int]]], step: int, seq: SimSeq) -> None:
        entries = table.get(step)
        if entries is None:
            table[step] = [(seq, seq.k0)]
        else:
            entries.append((seq, seq.k0))

    def _materialize(self, seq: SimSeq) -> None:
        """Bring a lazy sequence's counters and streamed tokens up to the steps run."""
        steps = self.step - seq.k0
        seq.computed = seq.c0 + steps
        seq.made = seq.computed + 1 - seq.prompt
        seq.times.extend(self.times[seq.k0 : self.step])
        seq.k0 = -1

    def _materialize_all(self) -> None:
        """Every lazy sequence back to plain state, at the head of the tail."""
        for seq in self.lazy:
            self._materialize(seq)
        self.tail[:0] = self.lazy
        self.lazy = []
        self.context = 0
        self.crossing.clear()
        self.finishing.clear()

    def release_parked(self, seq: SimSeq) -> None:
        """A decode worker has pulled this parked sequence's blocks: free them."""
        self.pool.release(seq)


def _decoding(seq: SimSeq) -> bool:
    """It makes one token a step from now on: its first token came and it has one token
    left to compute (a prompt's last token alone is still its prefill)."""
    return seq.made >= 1 and not seq.prefill_only and seq.computed == seq.length - 1


def _last_step(seq: SimSeq) -> int:
    """The step in which a lazy sequence makes its last token."""
    return seq.k0 + (seq.prompt + seq.output) - seq.c0 - 2
