"""One model step's shape and time, as a worker reports it (torch-free).

The shape is in the features of planner/profile.py's StepCost, so the supervisor can fit
the same step-cost model `appliance profile` fits (planner/online_profile.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

StepKind = Literal["prefill", "decode", "mixed"]


class _Chunk(Protocol):
    """What a scheduled chunk (engine/scheduler.py's ScheduledChunk) tells of its work."""

    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


class _Verify(_Chunk, Protocol):
    """A verify chunk: its sequence's one new token and its drafts."""

    @property
    def drafts(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class StepTiming:
    """What one model step ran, and the seconds it took.

    tokens: query tokens (every prompt chunk's, one per decode); seqs: sequences in the
    step; attended: query-key pairs of the prompt chunks (see profile.attended); context:
    keys the decodes read (each decoding sequence's length, its new token included);
    prompt_tokens: the prompt chunks' share of `tokens`; gemm_rows: the worker's
    prefill_gemm_rows, from how many prompt tokens its quantized products run as a GEMM
    (None: they never switch: dense weights, a GPU, or not told).

    A speculative verify chunk counts as a decode (one sequence, its new token one of
    `tokens`) plus `draft_rows`: its drafts' query rows, beside `tokens` (StepCost's
    per_draft_s, what planner/speculation.py charges a draft); each draft row's keys
    (its sequence's, and the drafts before it) are in `context`."""

    kind: StepKind
    tokens: int
    seqs: int
    attended: int
    context: int
    seconds: float
    prompt_tokens: int = 0
    gemm_rows: int | None = None
    draft_rows: int = 0

    @property
    def gemm(self) -> bool:
        """Whether the step ran its products as GEMMs (StepCost's second regime)."""
        return self.gemm_rows is not None and self.prompt_tokens >= self.gemm_rows

    def features(self) -> dict[str, float]:
        """As fitting.fit_step_cost reads a sample (the regime features included)."""
        return {
            "tokens": self.tokens,
            "seqs": self.seqs,
            "attended": self.attended,
            "context": self.context,
            "prompt_tokens": self.prompt_tokens,
            "row_tokens": 0 if self.gemm else self.tokens,
            "gemm_tokens": self.tokens if self.gemm else 0,
            "gemm": 1 if self.gemm else 0,
            "draft_rows": self.draft_rows,
            "seconds": self.seconds,
        }


def step_timing(
    prefills: Iterable[_Chunk],
    decodes: Iterable[_Chunk],
    seconds: float,
    gemm_rows: int | None = None,
    verifies: Iterable[_Verify] = (),
) -> StepTiming:
    """The timing of a step of these prompt chunks, decodes and verify chunks (before the
    step's tokens are counted as computed: a chunk's `start` is where it begins), on a
    worker whose products switch to a GEMM from `gemm_rows` prompt tokens."""
    tokens = seqs = pairs = 0
    for chunk in prefills:
        n, start = chunk.num_tokens, chunk.start
        tokens += n
        seqs += 1
        pairs += n * start + n * (n + 1) // 2  # profile.attended, inlined: no import
    prompt_seqs, prompt_tokens = seqs, tokens
    context = 0
    for chunk in decodes:
        tokens += chunk.num_tokens
        seqs += 1
        context += chunk.start + chunk.num_tokens
    draft_rows = 0
    for chunk in verifies:
        k = len(chunk.drafts)
        tokens += chunk.num_tokens - k
        seqs += 1
        draft_rows += k
        # Row i (0: the new token) reads the keys up to and including its own.
        context += chunk.num_tokens * chunk.start + chunk.num_tokens * (chunk.num_tokens + 1) // 2
    decode_seqs = seqs - prompt_seqs
    kind: StepKind = (
        "mixed" if prompt_seqs and decode_seqs else "decode" if decode_seqs else "prefill"
    )
    return StepTiming(
        kind, tokens, seqs, pairs, context, seconds, prompt_tokens, gemm_rows, draft_rows
    )


class _Step(Protocol):
    """A scheduled step (engine/scheduler.py's SchedulerOutput)."""

    @property
    def prefills(self) -> Sequence[_Chunk]: ...

    @property
    def decodes(self) -> Sequence[_Chunk]: ...

    @property
    def verifies(self) -> Sequence[_Verify]: ...


S = TypeVar("S", bound=_Step)


class StepClock:
    """An engine's record of its last model step, until `pop` (the worker's report).

    The time is the model runner's call: on the CPU it computes the step; on CUDA it waits
    for the device only where it reads sampled tokens back, so a step that samples none
    is not timed, and neither is the next (its time includes the other's device work)."""

    def __init__(self, gemm_rows: int | None = None) -> None:
        self.last: StepTiming | None = None
        self._synced = True  # the last step waited for its device work
        # The model's prefill_gemm_rows (quant.PrefillGemm.rows), which the worker sets
        # once loaded: each timing carries it, so a fit can tell the two kernel regimes.
        self.gemm_rows = gemm_rows

    def run(self, run: Callable[[S], dict[int, int]], out: S, cuda: bool) -> dict[int, int]:
        """`run(out)` (the model runner's step), timed; its sampled tokens."""
        began = time.perf_counter()
        sampled = run(out)
        seconds = time.perf_counter() - began
        synced = bool(sampled) or not cuda
        timed = synced and self._synced
        self.last = (
            step_timing(out.prefills, out.decodes, seconds, self.gemm_rows, out.verifies)
            if timed
            else None
        )
        self._synced = synced
        return sampled

    def pop(self) -> StepTiming | None:
        """The last step's timing, once (None: no step since, or one not timed)."""
        timing, self.last = self.last, None
        return timing
