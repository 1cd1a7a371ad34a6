"""The `shift` workload: traffic that changes its mix and rate in phases, for a server
that rebalances its pools when traffic shifts. A phase is `workload:rate:seconds`; each
sends its own workload's requests with Poisson arrivals at its rate for its seconds, the
next starting where it ends. The whole schedule is data, drawn from the seed alone, so
every server (and the planner's simulator) meets the very same requests at the very
same times."""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from dataclasses import dataclass

from appliance.bench.workloads import RequestSpec, generate
from appliance.model.tokenizer import Tokenizer

PHASE_WORKLOADS = ("chat", "long-burst", "fixed", "shared-prefix")
DEFAULT_PHASES = "chat:2.0:60,long-burst:0.4:60,chat:2.0:60"
_FORM = "expected workload:rate:seconds, e.g. chat:2.0:60"


@dataclass(frozen=True)
class Phase:
    """One stretch of a shift: `workload`'s requests at `rate` req/s for `seconds`."""

    workload: str
    rate: float
    seconds: float

    def label(self, index: int) -> str:
        """How tables name the phase at 0-based `index`, counted from 1: '1 chat @2.0/s'."""
        return f"{index + 1} {self.workload} @{self.rate}/s"


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of a shift: what to send, when (seconds from the run's start), and the
    0-based index of the phase it belongs to."""

    spec: RequestSpec
    arrival_s: float
    phase: int


@dataclass(frozen=True)
class Shift:
    """A shift run as the runner drives it: the phases, their schedule, and how many
    warm-up requests (uncounted, one at a time) go before the schedule's clock starts."""

    phases: tuple[Phase, ...]
    schedule: tuple[ScheduledRequest, ...]
    warmup: int = 2


def parse_phases(text: str) -> list[Phase]:
    """Phases from 'chat:2.0:60,long-burst:0.4:60'; ValueError naming the bad part."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise ValueError(f"no phases given; {_FORM}[,...]")
    return [_parse_phase(number, part) for number, part in enumerate(parts, 1)]


def _parse_phase(number: int, part: str) -> Phase:
    where = f"phase {number} {part!r}"
    fields = [field.strip() for field in part.split(":")]
    if len(fields) != 3:
        raise ValueError(f"{where}: {_FORM}")
    workload, rate, seconds = fields
    if workload not in PHASE_WORKLOADS:
        raise ValueError(
            f"{where}: unknown workload {workload!r}; choose {', '.join(PHASE_WORKLOADS)}"
        )
    return Phase(
        workload,
        _positive(rate, f"{where}: rate must be requests/s > 0"),
        _positive(seconds, f"{where}: seconds must be > 0"),
    )


def _positive(text: str, message: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{message}, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{message}, got {text!r}")
    return value


def phase_starts(phases: list[Phase] | tuple[Phase, ...]) -> list[float]:
    """When each phase starts, seconds from the run's start: where the previous ends."""
    return list(itertools.accumulate((p.seconds for p in phases[:-1]), initial=0.0))


def shift_schedule(
    phases: list[Phase] | tuple[Phase, ...],
    tokenizer: Tokenizer,
    seed: int,
    input_len: int = 128,
    output_len: int = 64,
) -> list[ScheduledRequest]:
    """Every measured request of a shift run, in arrival order. Phase i draws its requests
    from its workload's own generator and its arrivals from a Poisson process at its rate,
    both seeded from (`seed`, i) alone; its arrivals fall in [start, start + seconds).
    `input_len`/`output_len` are the fixed workload's lengths. Two shared-prefix phases
    each have their own system prompt."""
    schedule: list[ScheduledRequest] = []
    for index, (phase, start) in enumerate(zip(phases, phase_starts(phases), strict=True)):
        specs = generate(phase.workload, tokenizer, _seed(seed, index), input_len, output_len)
        arrivals = _arrivals(phase, start, random.Random(f"arrivals:{seed}:{index}"))
        schedule += [ScheduledRequest(next(specs), due, index) for due in arrivals]
    return schedule


def shift_warmup(
    phases: list[Phase] | tuple[Phase, ...],
    tokenizer: Tokenizer,
    seed: int,
    count: int,
    input_len: int = 128,
    output_len: int = 64,
) -> list[RequestSpec]:
    """`count` warm-up requests of the first phase's workload, from a stream of their own:
    the schedule is the same whatever the warm-up."""
    specs = generate(phases[0].workload, tokenizer, _seed(seed, "warmup"), input_len, output_len)
    return list(itertools.islice(specs, count))


def make_shift(
    phases: list[Phase],
    tokenizer: Tokenizer,
    seed: int,
    warmup: int,
    input_len: int = 128,
    output_len: int = 64,
) -> tuple[Shift, list[RequestSpec]]:
    """The shift to drive and its warm-up requests (what the runner takes as `specs`)."""
    if warmup < 0:
        raise ValueError(f"warm-up must be >= 0, got {warmup}")
    schedule = shift_schedule(phases, tokenizer, seed, input_len, output_len)
    if not schedule:
        raise ValueError("these --phases draw no request at all; give higher rates or longer")
    shift = Shift(tuple(phases), tuple(schedule), warmup)
    return shift, shift_warmup(phases, tokenizer, seed, warmup, input_len, output_len)


def _arrivals(phase: Phase, start: float, rng: random.Random) -> list[float]:
    """A Poisson process at the phase's rate over [start, start + seconds)."""
    due, end, times = start, start + phase.seconds, []
    while (due := due + rng.expovariate(phase.rate)) < end:
        times.append(due)
    return times


def _seed(seed: int, part: int | str) -> int:
    """A workload seed for one part of a shift run, the same in every process (unlike
    hash()), and apart from the plain workload's seeds."""
    digest = hashlib.sha256(f"shift:{seed}:{part}".encode()).digest()
    return int.from_bytes(digest[:8], "big")
