"""SLO admission: whether a new prompt joins a worker's batch now or waits in the queue.

A decode step's time grows with the sequences it runs and the keys they read, and every
stream of the batch waits that long for each token. Near capacity a batch that grew past
the TPOT limit (a backlog left by a slower layout, a burst) can stay there: the slower
steps keep more requests running, which keep the steps slow, and every stream misses the
limit. The time-to-first-token budget is usually far larger than a few steps, so a prompt
that would push the batch over the limit waits in the queue while the batch drains, and
the requests in the batch keep their TPOT (DistServe's and Aladdin's goodput view: serve
first what can still meet its SLO).

Never starved: a prompt that waited `max_wait_s` joins whatever the batch predicts, and
an idle worker, a worker whose smallest batch already misses the limit (holding cannot
help there), or one without a step-cost model yet takes every prompt at once. Pure: the
supervisor and the simulator call the same `decide`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from appliance.settings.planner import PlannerSettings

HEADROOM = 0.8  # a step predicted within this fraction of the TPOT limit admits (noise, stalls)
MAX_WAIT_SHARE = 0.75  # of the TTFT limit: the longest a prompt is held


class StepModel(Protocol):
    """A step-cost model (planner/profile.py's StepCost): seconds of a step."""

    def seconds(
        self, tokens: int, seqs: int, attended: int, context: int, prompt_tokens: int | None = None
    ) -> float: ...


@dataclass(frozen=True)
class DecodeLoad:
    """What a worker decodes, or will once their prompts are prefilled."""

    seqs: int
    context: int  # the sum of their lengths: keys a decode step reads
    # Tokens each has left to make at most (its max_tokens less what it made), where known.
    remaining: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.seqs < 0 or self.context < 0:
            raise ValueError(f"a load is never negative: seqs {self.seqs}, context {self.context}")


@dataclass(frozen=True)
class AdmissionLimits:
    """The TPOT limit a decode step keeps within, and the longest a prompt is held."""

    tpot_s: float
    max_wait_s: float
    headroom: float = HEADROOM

    def __post_init__(self) -> None:
        if not self.tpot_s > 0 or self.max_wait_s < 0 or not 0 < self.headroom <= 1:
            raise ValueError(
                f"admission limits need tpot_s > 0, max_wait_s >= 0 and 0 < headroom <= 1; "
                f"got {self.tpot_s}, {self.max_wait_s}, {self.headroom}"
            )

    @classmethod
    def from_slo(cls, ttft_s: float, tpot_s: float) -> AdmissionLimits:
        """The limits of an SLO: its TPOT; held for at most three quarters of its TTFT, so
        that a held prompt keeps a quarter for its prefill (well under a second of an 8 s
        budget on a CPU box) and still meets it."""
        return cls(tpot_s=tpot_s, max_wait_s=MAX_WAIT_SHARE * ttft_s)


@dataclass(frozen=True)
class Admission:
    """The decision, with the step time it was taken on (None: not predicted)."""

    admit: bool
    reason: str
    predicted_s: float | None = None
    # Held, and no room is expected on this worker within its wait: holding it gains
    # nothing here (the queue admits it where no worker expects room in time).
    futile: bool = False


def admission_limits(planner: PlannerSettings) -> AdmissionLimits | None:
    """The limits the workers' batches keep to under these settings: None (every prompt
    joins at once) with scheduling_policy fcfs, or where no SLO was configured (neither
    slo_ttft_ms nor slo_tpot_ms set by flag, environment or file: their defaults are the
    planner's guesses, not a promise to keep)."""
    configured = {"slo_ttft_ms", "slo_tpot_ms"} & planner.model_fields_set
    if planner.scheduling_policy != "slo" or not configured:
        return None
    return AdmissionLimits.from_slo(planner.slo_ttft_ms / 1000, planner.slo_tpot_ms / 1000)


def lightest(loads: Sequence[DecodeLoad]) -> int:
    """The index of the lightest load (fewest sequences, then fewest keys): the worker a
    prompt is judged against, the one a backlog weighs least on."""
    if not loads:
        raise ValueError("no load to choose from")
    return min(range(len(loads)), key=lambda i: (loads[i].seqs, loads[i].context))


def pool_load(decoders: Sequence[DecodeLoad], coming: DecodeLoad) -> tuple[int, DecodeLoad]:
    """What a prefill worker's next prompt is judged against: the decode pool's lightest
    worker (its index in `decoders`), with `coming` spread evenly over the pool. `coming`:
    the prompts the prefill pool holds for the decode pool, queued, prefilling or parked,
    a handoff waiting for room included (each joins the pool before any newer prompt; one
    being handed counts in its decode worker's load already). The tokens left are not
    kept: a prefill worker's prompt is held up to its wait's end, whatever room the decode
    pool expects (counting the pool's share cut the simulated split's gain, 94% -> 78%
    within the SLO at 1x). The supervisor's flow and the simulator both call this."""
    index = lightest(decoders)
    own, count = decoders[index], len(decoders)
    return index, DecodeLoad(own.seqs + coming.seqs // count, own.context + coming.context // count)


def decode_seconds(model: StepModel, load: DecodeLoad) -> float:
    """A decode step of `load`'s sequences: one token each over their keys."""
    return model.seconds(load.seqs, load.seqs, 0, load.context)


def decide(
    load: DecodeLoad,
    prompt_tokens: int,
    model: StepModel | None,
    limits: AdmissionLimits,
    waited_s: float,
    pace: float = 1.0,
) -> Admission:
    """Whether a prompt of `prompt_tokens` tokens that has waited `waited_s` joins the
    worker decoding `load` now: admitted while the decode step with it is predicted within
    headroom * tpot_s, held otherwise (see the module's docstring for when it always joins).
    `pace`: the worker's step period over its model time (what its streams wait between
    tokens beside the model step: the worker's own work, a busy box), at least 1."""
    if waited_s >= limits.max_wait_s:
        return Admission(True, f"waited {waited_s:.1f} s, the most a prompt is held")
    if model is None:
        return Admission(True, "no step-cost model yet")
    if load.seqs == 0:
        return Admission(True, "the worker decodes nothing")
    bound = limits.headroom * limits.tpot_s
    pace = max(1.0, pace)
    alone = pace * decode_seconds(model, DecodeLoad(1, prompt_tokens))
    if alone > bound:
        return Admission(True, f"a step of one sequence ({alone * 1e3:.0f} ms) misses it already")
    joined = DecodeLoad(load.seqs + 1, load.context + prompt_tokens)
    predicted = pace * decode_seconds(model, joined)
    if predicted <= bound:
        return Admission(
            True, f"{joined.seqs} sequences: {predicted * 1e3:.0f} ms a step", predicted
        )
    over = (
        f"{joined.seqs} sequences would take {predicted * 1e3:.0f} ms a step, over "
        f"{bound * 1e3:.0f} ms ({limits.headroom:.0%} of the TPOT limit)"
    )
    room_in = _room_in(load, prompt_tokens, model, bound, pace)
    if room_in is not None and room_in > limits.max_wait_s - waited_s:
        # Held here, it would join as full a batch at the end of its wait.
        return Admission(False, f"{over}; no room within its wait", predicted, futile=True)
    return Admission(False, over, predicted)


def _room_in(
    load: DecodeLoad, prompt_tokens: int, model: StepModel, bound: float, pace: float
) -> float | None:
    """Seconds until enough of `load`'s sequences have finished for a step with the new
    one to be within `bound`, if they all run to their remaining tokens at today's step
    time (an upper bound: a stop token ends one sooner); None where their remaining tokens
    are not known."""
    if len(load.remaining) != load.seqs:
        return None
    mean = load.context / load.seqs
    step = pace * decode_seconds(model, load)
    finishing = sorted(load.remaining)
    for done in range(1, load.seqs + 1):
        left = load.seqs - done + 1
        if (
            pace * decode_seconds(model, DecodeLoad(left, round(mean * (left - 1)) + prompt_tokens))
            <= bound
        ):
            return finishing[done - 1] * step
    return finishing[-1] * step
