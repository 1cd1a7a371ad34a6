"""The supervisor's side of SLO admission (core/admission.py): the prompts it holds, in
arrival order, and what each entry worker decodes, read off the request table.

A prompt is judged only at the head of the queue: one that arrives while others are held
waits behind them (first come, first served among the held), so each is admitted at the
latest when it has waited the limits' max_wait_s, at the first step report after that.
Pure: plain data in, plain data out; the flow (pools/request_flow.py) does the sending.
"""

from __future__ import annotations

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


class Decoding(Protocol):
    """What the queue reads of a request in flight (core/request_table.py's Request)."""

    @property
    def prompt(self) -> list[int]: ...
    @property
    def output_ids(self) -> list[int]: ...


def load_of(requests: Iterable[Decoding]) -> DecodeLoad:
    """The decode load of these requests: one sequence each, of its prompt and output."""
    seqs = context = 0
    for request in requests:
        seqs += 1
        context += len(request.prompt) + len(request.output_ids)
    return DecodeLoad(seqs, context)


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
    ) -> bool:
        """Whether the prompt goes to a worker now, judged against the entry worker whose
        decoding is lightest (`loads`, `models`: per entry worker). A prompt not admitted
        is held (behind those held before it) until a later call admits it."""
        if self.limits is None:
            return True
        head = self.head()
        if head is not None and head != request_id:
            self._held.setdefault(request_id, None)  # behind the ones held before it
            return False
        index = lightest(loads)
        self.last = decide(loads[index], prompt_tokens, models[index], self.limits, waited_s)
        if self.last.admit:
            self._held.pop(request_id, None)
            return True
        self._held.setdefault(request_id, None)
        return False

    def forget(self, request_id: int) -> None:
        """It left (cancelled, failed, ended): it is held no more."""
        self._held.pop(request_id, None)


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
