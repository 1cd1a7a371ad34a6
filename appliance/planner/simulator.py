"""A discrete-event simulator of the appliance: a profile's step costs, a layout and a
workload in, the bench's per-request results out (so appliance.core.goodput computes
the percentiles and goodput, as for a measured run).

Each worker runs engine/scheduler.py's decisions (token budget, chunked prefill,
max_num_seqs, preemption of the newest sequence with recompute, prefix cache; tested
step for step against the real Scheduler): sim_worker.py, over sim_pool.py's KV blocks.
Prompts are routed as router.py routes them, handoffs wait for a decode worker with room
as handoffs.py has them wait (sim_box.py); sim_run.py is the event loop. A mixed layout's
prompts go to its prefill and colocated workers alike (one router over both); the
colocated ones decode what they prefilled, the prefill ones hand off. Timing:
- a step costs its StepCost (`.prefill` for prompt chunks alone, `.decode` for decodes
  alone, `.mixed` for both); it runs 1/contention as fast while another worker of the
  box is mid-step, so only the overlapping part of it is slowed; then `host.per_step_s`
  (the worker's report), which neither slows nor is slowed by the others;
- a worker starts its next step at once, after taking every arrival and handoff due
  that instant; each token reaches the client `host.per_token_s` after its step ends;
- a prefill worker's last chunk makes the first token, then the handoff goes to the
  decode worker with the most free blocks among those with room (blocks for the prompt
  and first token, a sequence slot) or waits, oldest first, until one has room; the
  decode worker takes the blocks at once and runs the request from its first step after
  `handoff.seconds(bytes)`, bytes being the prompt's K/V less the blocks its own prefix
  cache holds; the prefill worker's blocks are held until then;
- with `Policy.speculation`, a decode-only step runs as speculation.py has it: as long
  as a verify step divided by the tokens each sequence makes (where that pays);
- in a cross-box layout (`Layout.cross_box`) every handoff crosses the link between the
  boxes: `profile.network` instead of `profile.handoff`, queued behind the handoffs sent
  before it (one link, first in first out; sim_run.py), and the two boxes' workers do
  not slow each other (contention is per box).
Approximations: the supervisor knows every worker's free blocks at once (no report
lag); a handoff's copy does not delay the decode worker's steps (on the CPU it runs in
that worker's loop, between steps); the router's memory of prefixes counts blocks
instead of hashing them. Requests that cannot fit (prompt + output over the model's
context or a worker's pool) fail at once as the server's 400 would.
Pure Python and deterministic: the same inputs give the same results.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.core.admission import AdmissionLimits, admission_limits
from appliance.core.goodput import RequestResult
from appliance.planner.layout import Layout
from appliance.planner.profile import Profile
from appliance.planner.sim_run import Move, Simulation
from appliance.planner.sim_worker import StepRecord
from appliance.planner.speculation import Speculation

if TYPE_CHECKING:
    from appliance.model.tokenizer import Tokenizer
    from appliance.settings.config import Settings

__all__ = [
    "Move",
    "Policy",
    "SimRequest",
    "StepRecord",
    "requests_from_results",
    "requests_from_workload",
    "simulate",
]


@dataclass(frozen=True)
class SimRequest:
    """One request: when it arrives and how many tokens in and out."""

    arrival_s: float  # from the run's start
    prompt_tokens: int
    output_tokens: int  # generated exactly this many (the bench sends ignore_eos)
    prefix_id: int | None = None  # requests with the same id share their first prefix_tokens
    prefix_tokens: int = 0
    stored_tokens: int = 0  # served by the box's KV store (planner/prefix_hits.py)

    def __post_init__(self) -> None:
        checks = [
            (
                math.isfinite(self.arrival_s) and self.arrival_s >= 0,
                f"arrival_s must be a finite number >= 0, got {self.arrival_s}",
            ),
            (self.prompt_tokens >= 1, f"prompt_tokens must be >= 1, got {self.prompt_tokens}"),
            (self.output_tokens >= 1, f"output_tokens must be >= 1, got {self.output_tokens}"),
            (
                0 <= self.prefix_tokens <= self.prompt_tokens,
                f"prefix_tokens must be in [0, prompt_tokens={self.prompt_tokens}], "
                f"got {self.prefix_tokens}",
            ),
            (
                0 <= self.stored_tokens < self.prompt_tokens,
                f"stored_tokens must be in [0, prompt_tokens={self.prompt_tokens}), "
                f"got {self.stored_tokens}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class Policy:
    """The knobs the appliance schedules with."""

    max_num_seqs: int = 64  # decode_max_seqs
    prefill_token_budget: int = 2048  # max_num_batched_tokens of prefill/colocated steps
    chunk_size: int = 512
    routing: str = "least_loaded"  # or "round_robin"
    prefix_caching: bool = True
    # Speculative decoding at a measured acceptance (planner/speculation.py); None: off.
    speculation: Speculation | None = None
    # SLO admission (core/admission.py): prompts held while their decode step would miss
    # the TPOT limit; None: every prompt joins at once (no SLO configured, or fcfs).
    admission: AdmissionLimits | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "prefill_token_budget", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.chunk_size > self.prefill_token_budget:
            raise ValueError(
                f"chunk_size ({self.chunk_size}) must not exceed prefill_token_budget "
                f"({self.prefill_token_budget})"
            )
        if self.routing not in ("least_loaded", "round_robin"):
            raise ValueError(f"routing must be least_loaded or round_robin, got {self.routing!r}")

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        """The policy a fresh appliance with these settings starts with."""
        from appliance.core.tuning import initial_tuning

        tuning = initial_tuning(settings.batch)
        return cls(
            max_num_seqs=tuning.decode_max_seqs,
            prefill_token_budget=tuning.prefill_token_budget,
            chunk_size=tuning.chunk_size,
            routing=tuning.routing,
            prefix_caching=settings.kv.prefix_caching,
            admission=admission_limits(settings.planner),
        )


def simulate(
    profile: Profile,
    layout: Layout,
    requests: Sequence[SimRequest],
    policy: Policy = Policy(),  # frozen: one shared default is safe
    *,
    concurrency: int | None = None,
    trace: list[StepRecord] | None = None,
    moves: Sequence[Move] = (),
) -> list[RequestResult]:
    """Per request (in the order given): start = arrival, ttft, latency, the gaps between
    its tokens (itl), output_tokens, prompt_tokens, ok (False with an error for a request
    the appliance would refuse).

    concurrency: a closed loop of that many users instead of the arrival times (each
    sends its next request when its last one ends; `start` says when). trace: if given,
    every step is appended to it. moves: devices that change role while it runs (as
    ops/pool_moves.py moves them in place: what a worker runs goes on there). ValueError
    for a cross-box layout on a profile without a network link."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if layout.colocated_workers and policy.max_num_seqs > policy.prefill_token_budget:
        raise ValueError(  # tuning.check_for_mode refuses it too
            f"with colocated workers max_num_seqs ({policy.max_num_seqs}) must not exceed "
            f"prefill_token_budget ({policy.prefill_token_budget})"
        )
    return Simulation(profile, layout, requests, policy, concurrency, trace, moves).run()


def requests_from_workload(
    workload: str,
    tokenizer: Tokenizer,
    seed: int,
    num_requests: int,
    *,
    rate: float | None,
    warmup: int = 2,
    input_len: int = 128,
    output_len: int = 64,
    jsonl: Path | None = None,
) -> list[SimRequest]:
    """The very requests `appliance bench --workload W --seed S --request-rate R
    --num-requests N --warmup K` sends: the same generator, warm-up requests skipped (they
    go first, one at a time, uncounted), the same Poisson arrival stream; rate None or
    inf: all at 0."""
    from appliance.bench.runner import poisson_gaps
    from appliance.bench.workloads import SHARED_PREFIX_TOKENS, generate

    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    specs = generate(workload, tokenizer, seed, input_len, output_len, jsonl)
    measured = itertools.islice(specs, warmup, warmup + num_requests)
    gaps = poisson_gaps(rate or math.inf, random.Random(f"arrivals:{seed}"))
    shared = workload == "shared-prefix"
    requests, due = [], 0.0
    for spec in measured:  # the first goes at once, each next after a gap
        requests.append(
            SimRequest(
                due,
                spec.prompt_tokens,
                spec.max_tokens,
                0 if shared else None,
                SHARED_PREFIX_TOKENS if shared else 0,
            )
        )
        due += next(gaps)
    return requests


def requests_from_results(path: Path, run: str | None = None) -> list[SimRequest]:
    """The requests of a recorded run, in the order they were sent: a bench result.json,
    or one run of a compare.json (`run`: its label; default the first). Each arrives at
    its recorded `start` and makes its recorded output_tokens; failed ones (no output
    recorded) are left out. A shared-prefix run's requests share its prefix."""
    from appliance.bench.workloads import SHARED_PREFIX_TOKENS

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read results from {path}: {exc}") from None
    results = _recorded_results(data, path, run)
    shared = isinstance(data.get("args"), dict) and data["args"].get("workload") == "shared-prefix"
    requests = []
    for number, item in enumerate(results):
        try:
            start, prompt, output = (
                float(item["start"]),
                item["prompt_tokens"],
                item["output_tokens"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: result {number} lacks {exc}") from None
        if output < 1:
            continue
        prefix = min(SHARED_PREFIX_TOKENS, prompt) if shared else 0
        requests.append(SimRequest(max(0.0, start), prompt, output, 0 if shared else None, prefix))
    return sorted(requests, key=lambda r: r.arrival_s)


def _recorded_results(data: Any, path: Path, run: str | None) -> list[dict[str, Any]]:
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds no bench results")
    if "results" in data and run is None:
        return list(data["results"])
    runs = data.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{path} holds neither 'results' nor 'runs'")
    if run is None:
        return list(runs[0]["results"])
    for item in runs:
        if item.get("label") == run:
            return list(item["results"])
    labels = ", ".join(str(item.get("label")) for item in runs)
    raise ValueError(f"{path} has no run {run!r} (it has {labels})")
