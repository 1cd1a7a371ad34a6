"""The supervisor's side of SLO admission (core/admission.py): the prompts it holds, in
arrival order, and which entry workers may take a prompt now (the router picks among
them: its prefix affinity never sends a prompt to a worker over the limit while another
has room).

A prompt is judged only at the head of the queue: one that arrives while others are held
waits behind them (first come, first served among the held), so each is admitted at the
latest when it has waited the limits' max_wait_s, at the first step report after that.
Pure: plain data in, plain data out; the flow (pools/request_flow.py) does the sending.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from appliance.core.admission import (
    Admission,
    AdmissionLimits,
    DecodeLoad,
    StepModel,
    decide,
    lightest,
)

MODEL_REFRESH_S = 1.0  # a worker size's step-cost fit is read again at most this often
PACE_KEPT = 64  # step periods kept per worker (a few seconds of a busy worker's steps)


class Params(Protocol):
    @property
    def max_tokens(self) -> int: ...


class Decoding(Protocol):
    """What the queue reads of a request in flight (core/request_table.py's Request)."""

    @property
    def prompt(self) -> list[int]: ...
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def params(self) -> Params: ...


def load_of(requests: Iterable[Decoding]) -> DecodeLoad:
    """The decode load of these requests: one sequence each, of its prompt and output,
    with the tokens it has left to make at most."""
    seqs = context = 0
    remaining = []
    for request in requests:
        seqs += 1
        made = len(request.output_ids)
        context += len(request.prompt) + made
        remaining.append(max(0, request.params.max_tokens - made))
    return DecodeLoad(seqs, context, tuple(remaining))


class AdmissionQueue:
    """The prompts held, oldest first; `limits` None: every prompt is admitted at once."""

    def __init__(self, limits: AdmissionLimits | None) -> None:
        self.limits = limits
        self._held: dict[int, None] = {}  # request ids, in the order they were held
        self.last: Admission | None = None  # the latest decision (the admin view, tests)

    @property
    def held(self) -> list[int]:
        """The ids of the prompts held, oldest first."""
        return list(self._held)

    def head(self) -> int | None:
        """The oldest prompt held (None: none is)."""
        return next(iter(self._held), None)

    def admits(
        self,
        request_id: int,
        prompt_tokens: int,
        waited_s: float,
        loads: Sequence[DecodeLoad],
        models: Sequence[StepModel | None],
        paces: Sequence[float] | None = None,
    ) -> list[int]:
        """The entry workers (indices into `loads`, `models`, `paces`: per entry worker;
        paces None: 1, see StepPace) that may take the prompt now: those whose decode step
        with it stays within the limits; every one where no limits are set, its wait is
        up, or no worker expects room before it is (Admission.futile); the router picks
        among them. None may: the prompt is held (behind those held before it) until a
        later call admits it."""
        every = list(range(len(loads)))
        if self.limits is None:
            return every
        head = self.head()
        if head is not None and head != request_id:
            self._held.setdefault(request_id, None)  # behind the ones held before it
            return []
        verdicts = [
            decide(load, prompt_tokens, model, self.limits, waited_s, pace)
            for load, model, pace in zip(loads, models, paces or [1.0] * len(loads), strict=True)
        ]
        allowed = [i for i in every if verdicts[i].admit]
        self.last = verdicts[allowed[0] if allowed else lightest(loads)]
        if not allowed and all(v.futile for v in verdicts):
            allowed = every  # no worker expects room within its wait: holding gains nothing
        if allowed:
            self._held.pop(request_id, None)
        else:
            self._held.setdefault(request_id, None)
        return allowed

    def forget(self, request_id: int) -> None:
        """It left (cancelled, failed, ended): it is held no more."""
        self._held.pop(request_id, None)


class StepPace:
    """Each worker's step period over its model time: what its streams wait per token
    against what the step-cost model (fitted to model time) predicts. Measured between a
    step and the next where the first left sequences running (the worker stepped again at
    once; an idle gap is no period); the median of the last `kept`, at least 1."""

    def __init__(self, kept: int = PACE_KEPT) -> None:
        self.kept = kept
        self._last: dict[int, tuple[float, float, int]] = {}  # worker -> start, seconds, running
        self._ratios: dict[int, deque[float]] = {}

    def record(
        self, worker_id: int, started_at: float, seconds: float | None, running: int
    ) -> None:
        """A step of the worker began at `started_at` (monotonic) and its model ran
        `seconds` (None: the step was not timed); `running`: sequences it still ran after
        it. An untimed step (on CUDA, a prefill chunk that samples nothing and the step
        after it) still ends the period of the step before, but starts none: its own
        period over the timed step before would count two steps against one step's model
        time, a pace about twice too high (admission would hold more than it should)."""
        last = self._last.get(worker_id)
        if last is not None and last[2] > 0 and last[1] > 0 and started_at > last[0]:
            ratios = self._ratios.setdefault(worker_id, deque(maxlen=self.kept))
            ratios.append((started_at - last[0]) / last[1])
        if seconds is None:
            self._last.pop(worker_id, None)
        else:
            self._last[worker_id] = (started_at, seconds, running)

    def of(self, worker_id: int) -> float:
        """The worker's pace (1.0 before any period was measured)."""
        ratios = self._ratios.get(worker_id)
        if not ratios:
            return 1.0
        return max(1.0, statistics.median(ratios))

    def forget(self, worker_id: int) -> None:
        """The worker is gone (a restarted one paces anew)."""
        self._last.pop(worker_id, None)
        self._ratios.pop(worker_id, None)


class ModelCache:
    """Each worker size's step-cost model, fetched at most every `every_s` seconds (an
    online profile refits on each read after new steps: too slow for every prompt)."""

    def __init__(
        self, fetch: Callable[[str], StepModel | None], every_s: float = MODEL_REFRESH_S
    ) -> None:
        self.fetch = fetch
        self.every_s = every_s
        self._models: dict[str, tuple[float, StepModel | None]] = {}

    def get(self, unit: str, now: float) -> StepModel | None:
        """The model of worker size `unit` as of at most every_s ago."""
        cached = self._models.get(unit)
        if cached is not None and now - cached[0] < self.every_s:
            return cached[1]
        model = self.fetch(unit)
        self._models[unit] = (now, model)
        return model
