"""The online profile learns what a speculative verify step costs (issue 38): a step of b
sequences verifying k drafts each runs b decode rows and b·k draft rows, so the worker's
step timing counts the draft rows apart (StepTiming.draft_rows, their keys in context),
the online fit gives them a cost of their own (StepCost.per_draft_s) once verify steps
and plain ones are both in its window, and planner/speculation.py charges each
simulated draft that cost. On hand-made step records: the fit recovers a known per-row
cost; and on the real model: a verify step's timing carries its draft rows."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.engine.speculative.ngram import NgramProposer
from appliance.engine.speculative.proposer import Drafter
from appliance.engine.step_timing import StepTiming, step_timing
from appliance.planner.online_profile import OnlineProfile
from appliance.planner.profile import StepCost
from appliance.planner.speculation import Speculation, verify_seconds

# A decode step: the weights' read (base) dominates; a row of a sequence and its keys.
TRUE_DECODE = StepCost(base_s=0.020, per_seq_s=0.0006, per_context_s=2e-7)
CHEAP_DRAFT_S = 0.0004  # a draft row's own cost: below a decode row's (no sampling)
COSTLY_DRAFT_S = 0.006  # draft rows that cost more than the bandwidth they share


@dataclass(frozen=True)
class Chunk:
    """A scheduled chunk as step_timing reads it (the scheduler's ScheduledChunk)."""

    start: int
    num_tokens: int
    drafts: tuple[int, ...] = ()


def verify_chunk(start: int, k: int) -> Chunk:
    """A sequence's new token at position `start` and k drafts after it."""
    return Chunk(start, 1 + k, tuple(range(k)))


def test_a_verify_chunk_counts_as_a_decode_plus_its_draft_rows() -> None:
    timing = step_timing([], [Chunk(99, 1)], 0.05, verifies=[verify_chunk(9, 3)])
    # Two sequences, a token each; 3 draft rows; keys: 100 for the decode, and 10 + 11 +
    # 12 + 13 for the verify chunk's rows (each reads its sequence's keys up to its own).
    assert timing == StepTiming("decode", 2, 2, 0, 100 + 46, 0.05, draft_rows=3)
    assert timing.features()["draft_rows"] == 3
    # Verify chunks alone are a decode step, not an empty prefill one.
    alone = step_timing([], [], 0.05, verifies=[verify_chunk(9, 1)])
    assert (alone.kind, alone.tokens, alone.seqs, alone.draft_rows) == ("decode", 1, 1, 1)
    # Beside a prompt chunk: mixed; the prompt's tokens only decide the GEMM regime.
    mixed = step_timing([Chunk(0, 64)], [], 0.2, gemm_rows=48, verifies=[verify_chunk(9, 2)])
    assert (mixed.kind, mixed.tokens, mixed.prompt_tokens, mixed.draft_rows) == (
        "mixed",
        65,
        64,
        2,
    )


def decode_steps(
    draft_s: float, count: int = 300, seed: int = 0, noise: float = 0.03
) -> list[StepTiming]:
    """Decode steps of 1..16 sequences at contexts 100..3000, a third plain, the rest
    verifying 1..8 drafts a sequence, timed by TRUE_DECODE with `draft_s` a draft row."""
    rng = random.Random(seed)
    steps = []
    for i in range(count):
        starts = [rng.randint(100, 3000) for _ in range(rng.randint(1, 16))]
        k = 0 if i % 3 == 0 else rng.randint(1, 8)
        if k:
            timing = step_timing([], [], 1.0, verifies=[verify_chunk(s, k) for s in starts])
        else:
            timing = step_timing([], [Chunk(s, 1) for s in starts], 1.0)
        seconds = TRUE_DECODE.seconds(timing.tokens, timing.seqs, 0, timing.context)
        seconds += draft_s * timing.draft_rows
        seconds *= 1 + rng.uniform(-noise, noise)
        steps.append(replace(timing, seconds=seconds))
    return steps


def fitted_decode(steps: list[StepTiming]) -> StepCost:
    online = OnlineProfile()
    for step in steps:
        online.record("1x1", step)
    cost = online.step_costs("1x1")["decode"]
    assert cost is not None
    return cost


@pytest.mark.parametrize("draft_s", [CHEAP_DRAFT_S, COSTLY_DRAFT_S])
def test_the_fit_recovers_a_known_per_row_verify_cost(draft_s: float) -> None:
    cost = fitted_decode(decode_steps(draft_s))
    assert cost.per_draft_s == pytest.approx(draft_s, rel=0.1)
    assert cost.base_s == pytest.approx(TRUE_DECODE.base_s, rel=0.1)
    assert cost.per_seq_s == pytest.approx(TRUE_DECODE.per_seq_s, rel=0.3)


def test_without_verify_steps_a_draft_row_has_no_fitted_cost() -> None:
    plain = [s for s in decode_steps(CHEAP_DRAFT_S) if s.draft_rows == 0]
    assert fitted_decode(plain).per_draft_s is None


def test_the_planner_charges_each_draft_the_fitted_cost() -> None:
    """At acceptance 0.3 and 4 sequences: speculation pays where draft rows are cheap,
    not where they cost more than the tokens they add; a fitted cost with drafts the
    simulator charges as verify_seconds says, the fitted per-row cost included."""
    seqs, context = 4, 4 * 1500
    decisions = {}
    for draft_s in (CHEAP_DRAFT_S, COSTLY_DRAFT_S):
        cost = fitted_decode(decode_steps(draft_s))
        plain = cost.seconds(seqs, seqs, 0, context, 0)
        spec = Speculation(0.3, draft_tokens=4)
        per_token = spec.step_seconds(cost, seqs, context, seqs)
        best = min(
            [
                plain,
                *(
                    verify_seconds(cost, seqs, context, seqs, k) / spec.made(k)
                    for k in (1, 2, 3, 4)
                ),
            ]
        )
        assert per_token == pytest.approx(best)
        assert verify_seconds(cost, seqs, context, seqs, 2) == pytest.approx(
            cost.seconds(seqs, seqs, 0, context * 3, 0) + cost.draft_s * seqs * 2
        )
        decisions[draft_s] = per_token < plain
    assert decisions == {CHEAP_DRAFT_S: True, COSTLY_DRAFT_S: False}


@pytest.mark.process  # the real model
def test_a_verify_steps_timing_carries_its_draft_rows(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """n-gram drafts on a prompt that repeats itself: the engine's step clock reports
    the verify steps as decode steps with their draft rows."""
    engine = make_engine()
    engine.scheduler.drafter = Drafter(NgramProposer(), 4)
    prompt = list(range(1, 21)) * 3
    engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    timings = []
    while engine.has_unfinished():
        engine.step()
        timing = engine.clock.pop()
        assert timing is not None
        timings.append(timing)
    verifying = [t for t in timings if t.draft_rows]
    assert verifying and all(t.kind == "decode" and t.seqs == 1 for t in verifying)
    assert sum(t.draft_rows for t in timings) == engine.scheduler.acceptance.drafted
