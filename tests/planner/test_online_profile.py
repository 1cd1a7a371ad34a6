"""The profile refined online (issue 35): the engine times each step with its shape, the
worker's report carries it, the supervisor records it per worker size, and the step-cost
model `appliance profile` fits is fitted to the recent steps."""

import asyncio
import functools
import random
import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from hand_profiles import hand_profile

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.engine.step_timing import StepClock, StepTiming, step_timing
from appliance.planner.online_profile import OnlineProfile, kv_sizes, worker_size
from appliance.planner.profile import (
    HandoffCost,
    Profile,
    ProfileKey,
    StepCost,
    WorkerCost,
    attended,
)
from appliance.pools.supervisor import Supervisor, online_profile
from appliance.pools.worker_handle import WorkerHandle
from appliance.settings.config import load_settings
from appliance.workers.messages import Ready, TokenBatch

# One linear model of a small model's step on a CPU worker; its prefill and decode costs are
# the same model on those steps (a decode step's tokens are its sequences).
TRUE_MIXED = StepCost(
    base_s=6e-3, per_token_s=1e-4, per_seq_s=4e-4, per_attended_s=3e-8, per_context_s=1.5e-6
)
TRUE = WorkerCost(
    prefill=StepCost(base_s=6e-3, per_token_s=1e-4, per_seq_s=4e-4, per_attended_s=3e-8),
    decode=StepCost(base_s=6e-3, per_seq_s=5e-4, per_context_s=1.5e-6),
    mixed=TRUE_MIXED,
    kv_blocks=500,
)
NOISE = 0.03  # multiplicative, uniform


def timed_steps(count: int, seed: int = 0, noise: float = NOISE) -> list[StepTiming]:
    """Steps in the shapes a serving worker runs, timed by TRUE with a little noise."""
    rng = random.Random(seed)
    steps = []
    for i in range(count):
        chunks = []
        decodes: list[int] = []
        kind = ("prefill", "decode", "mixed")[i % 3]
        if kind != "decode":  # 1..4 prompt chunks of 16..512 tokens, some mid-prompt
            chunks = [
                (rng.choice((0, 0, 256, 512)), rng.randint(16, 512))
                for _ in range(rng.randint(1, 4))
            ]
        if kind != "prefill":  # 1..16 decodes of contexts 100..3000
            decodes = [rng.randint(100, 3000) for _ in range(rng.randint(1, 16))]
        tokens = sum(n for _, n in chunks) + len(decodes)
        seqs = len(chunks) + len(decodes)
        pairs = sum(attended(s, n) for s, n in chunks)
        context = sum(decodes)
        seconds = TRUE_MIXED.seconds(tokens, seqs, pairs, context)
        seconds *= 1 + rng.uniform(-noise, noise)
        steps.append(StepTiming(kind, tokens, seqs, pairs, context, seconds))  # type: ignore[arg-type]
    return steps


def recorded(steps: list[StepTiming], unit: str = "2x1", window: int = 2000) -> OnlineProfile:
    online = OnlineProfile(window=window)
    for step in steps:
        online.record(unit, step)
    return online


FIELDS = ("base_s", "per_token_s", "per_seq_s", "per_attended_s", "per_context_s")


def test_the_online_fit_recovers_a_known_step_cost_model() -> None:
    steps = timed_steps(1800)
    cost = recorded(steps).worker_cost("2x1", kv_blocks=500)
    assert cost is not None
    for kind in ("prefill", "decode", "mixed"):
        true, fitted = getattr(TRUE, kind), getattr(cost, kind)
        for name in FIELDS:
            want, got = getattr(true, name), getattr(fitted, name)
            print(f"{kind:8} {name:15} true {want:.3e} fitted {got:.3e}")
            if want == 0:
                assert got == 0, (kind, name)
            else:
                assert got == pytest.approx(want, rel=0.15), (kind, name)
    # Its predictions are within a few percent on fresh steps of every kind.
    for step in timed_steps(300, seed=1, noise=0):
        predicted = getattr(cost, step.kind).seconds(
            step.tokens, step.seqs, step.attended, step.context
        )
        assert predicted == pytest.approx(step.seconds, rel=0.03)
    assert cost.kv_blocks == 500 and cost.contention == 1.0


def test_a_few_slow_steps_do_not_bend_the_fit() -> None:
    steps = timed_steps(900, seed=2)
    # Every 25th step paused (a collection, a neighbour on the core): three times as long.
    slowed = [
        StepTiming(s.kind, s.tokens, s.seqs, s.attended, s.context, s.seconds * 3)
        if i % 25 == 0
        else s
        for i, s in enumerate(steps)
    ]
    cost = recorded(slowed).worker_cost("2x1", kv_blocks=500)
    assert cost is not None
    assert cost.decode.per_context_s == pytest.approx(TRUE.decode.per_context_s, rel=0.15)
    assert cost.prefill.per_token_s == pytest.approx(TRUE.prefill.per_token_s, rel=0.15)


def test_too_few_steps_or_too_little_spread_fit_nothing() -> None:
    online = recorded(timed_steps(60))  # 20 of each kind: under MIN_SAMPLES
    fits = online.step_costs("2x1")
    assert fits["prefill"] is None and fits["decode"] is None
    assert fits["mixed"] is not None  # 60 steps of every kind together
    # No base: prefill and decode take the mixed fit.
    cost = online.worker_cost("2x1", kv_blocks=10)
    assert cost is not None and cost.prefill == cost.mixed == cost.decode
    # A base supplies the kinds not fitted yet.
    refined = online.worker_cost("2x1", base=TRUE)
    assert refined is not None and refined.prefill == TRUE.prefill
    assert refined.decode == TRUE.decode and refined.kv_blocks == TRUE.kv_blocks
    # One sequence at a time, every decode at one context: no spread to fit.
    flat = OnlineProfile()
    for _ in range(100):
        flat.record("1x1", StepTiming("decode", 1, 1, 0, 500, 0.01))
    assert flat.step_costs("1x1") == {"prefill": None, "decode": None, "mixed": None}
    assert flat.worker_cost("1x1", kv_blocks=10) is None
    assert OnlineProfile().worker_cost("1x1", kv_blocks=10) is None  # nothing recorded
    assert recorded(timed_steps(300)).worker_cost("2x1") is None  # no KV pool size known


def test_the_window_keeps_the_newest_steps_only() -> None:
    online = recorded(timed_steps(3000), window=100)
    assert online.counts("2x1") == {"prefill": 100, "decode": 100, "mixed": 100}
    kept = online.steps("2x1", "decode")
    assert kept == [s for s in timed_steps(3000) if s.kind == "decode"][-100:]
    # The fit follows the box: steps twice as slow replace the old ones.
    for step in timed_steps(300, seed=3):
        doubled = StepTiming(
            step.kind, step.tokens, step.seqs, step.attended, step.context, 2 * step.seconds
        )
        online.record("2x1", doubled)
    cost = online.worker_cost("2x1", kv_blocks=1)
    assert cost is not None
    assert cost.decode.per_context_s == pytest.approx(2 * TRUE.decode.per_context_s, rel=0.15)
    online.record("2x1", None)  # a step not timed is left out
    online.record("2x1", StepTiming("decode", 1, 1, 0, 10, 0.0))
    assert online.counts("2x1") == {"prefill": 100, "decode": 100, "mixed": 100}


def base_profile(workers: dict[str, WorkerCost]) -> Profile:
    return hand_profile(
        workers,
        key=ProfileKey(model="m", dtype="float32", weights="dense", device_kind="cpu: test"),
        atoms=4,
        kv_bytes_per_token=1000,
        max_model_len=2048,
        handoff=HandoffCost(base_s=1e-3, per_byte_s=1e-9),
        assumptions=("measured",),
    )


def test_a_base_profile_is_refined_by_the_units_that_fit() -> None:
    slow = TRUE.model_copy(update={"mixed": TRUE.decode, "kv_blocks": 7})
    base = base_profile({"1x1": slow, "2x1": slow})
    online = recorded(timed_steps(600))
    refined = online.profile(base, {"2x1": 300})
    assert refined.workers["1x1"] == slow  # no steps of that size: as it was
    assert refined.workers["2x1"].kv_blocks == 300
    assert refined.workers["2x1"].mixed.per_attended_s == pytest.approx(3e-8, rel=0.15)
    assert refined.assumptions[0] == "measured"
    assert refined.assumptions[1].startswith("online 2x1: fitted from the last steps")
    assert OnlineProfile().profile(base) is base  # nothing to refine it with
    # A size the base lacks joins it once every kind fits.
    joined = recorded(timed_steps(600), unit="4x1").profile(base, {"4x1": 50})
    assert set(joined.workers) == {"1x1", "2x1", "4x1"}


@pytest.mark.process  # a child python, whose modules start empty
def test_the_online_profile_imports_no_torch() -> None:
    code = "import sys, appliance.planner.online_profile; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- the engine's timing


def test_the_engine_times_each_step_with_its_shape(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(list(range(1, 21)), params)
    engine.step()
    first = engine.clock.pop()
    assert first is not None and first.seconds > 0
    assert (first.kind, first.tokens, first.seqs, first.attended, first.context) == (
        "prefill",
        20,
        1,
        attended(0, 20),
        0,
    )
    assert engine.clock.pop() is None  # once
    engine.step()
    decode = engine.clock.pop()
    assert decode is not None
    # Its 21st token's step reads 21 keys.
    assert (decode.kind, decode.tokens, decode.seqs, decode.attended, decode.context) == (
        "decode",
        1,
        1,
        0,
        21,
    )
    engine.add_request(list(range(1, 11)), params)  # a prompt beside the running decode
    engine.step()
    mixed = engine.clock.pop()
    assert mixed is not None
    assert (mixed.kind, mixed.tokens, mixed.seqs, mixed.attended, mixed.context) == (
        "mixed",
        11,
        2,
        attended(0, 10),
        22,
    )
    while engine.has_unfinished():
        engine.step()
    assert engine.clock.pop() is not None  # the last step's, until popped
    assert engine.step() == [] and engine.clock.pop() is None  # nothing ran


def test_a_chunk_mid_prompt_counts_its_pairs_from_where_it_starts(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_engine(chunk_size=16, max_num_batched_tokens=16)
    engine.add_request(list(range(1, 41)), SamplingParams(max_tokens=1))
    shapes = []
    while engine.has_unfinished():
        engine.step()
        timing = engine.clock.pop()
        assert timing is not None
        shapes.append((timing.kind, timing.tokens, timing.attended))
    assert shapes == [
        ("prefill", 16, attended(0, 16)),
        ("prefill", 16, attended(16, 16)),
        ("prefill", 8, attended(32, 8)),
    ]


def test_step_timing_reads_the_chunks_before_they_count_as_computed() -> None:
    class Chunk:
        def __init__(self, start: int, num_tokens: int) -> None:
            self.start, self.num_tokens = start, num_tokens

    timing = step_timing([Chunk(100, 50)], [Chunk(9, 1), Chunk(99, 1)], 0.5)
    assert timing == StepTiming("mixed", 52, 3, attended(100, 50), 110, 0.5, prompt_tokens=50)


def _same(sampled: dict[int, int], step: object) -> dict[int, int]:
    return sampled


def test_on_cuda_only_steps_that_waited_for_the_device_are_timed() -> None:
    class Chunk:
        def __init__(self, start: int, num_tokens: int) -> None:
            self.start, self.num_tokens = start, num_tokens

    step = SimpleNamespace(prefills=[Chunk(0, 8)], decodes=[], verifies=[])
    cuda, cpu = StepClock(), StepClock()
    timed = []
    # A prompt chunk that samples nothing (no read back), the next chunk, two decodes.
    for sampled in ({}, {1: 5}, {1: 6}, {1: 7}):
        run = functools.partial(_same, sampled)
        assert cuda.run(run, step, cuda=True) == sampled
        cpu.run(run, step, cuda=False)
        timed.append((cuda.pop() is not None, cpu.pop() is not None))
    # On CUDA the first ran on unseen, and the second's time holds the first's work.
    assert timed == [(False, True), (False, True), (True, True), (True, True)]


# ---------------------------------------------------------------- the supervisor records


def test_the_supervisor_records_each_step_under_its_worker_size() -> None:
    supervisor = Supervisor(load_settings(device="cpu", cpu_devices=1, mode="colocated"))
    loop = asyncio.new_event_loop()
    try:
        supervisor.processes.all_ready = loop.create_future()
        worker = WorkerHandle(0, "colocated", 0, "cpu0", (0,), None, None)  # type: ignore[arg-type]
        supervisor.workers[0] = worker
        supervisor._dispatch(Ready(0, 182))
        unit = worker_size(worker)
        assert unit == "1x1"  # the one core the handle names
        assert kv_sizes(supervisor.workers.values()) == {unit: 182}
        assert online_profile(supervisor) is None  # no step yet
        for step in timed_steps(600):
            supervisor._dispatch(TokenBatch(0, num_free_blocks=182, timing=step))
        supervisor._dispatch(TokenBatch(0, num_free_blocks=182))  # a report without a step
    finally:
        loop.close()
    assert sum(supervisor.flow.online.counts(unit).values()) == 600
    refined = online_profile(supervisor, base_profile({}))
    assert refined is not None and refined.workers[unit].kv_blocks == 182
    assert refined.workers[unit].decode.per_context_s == pytest.approx(1.5e-6, rel=0.15)
    alone = online_profile(supervisor)  # no base: the box's facts from its settings
    assert alone is not None and set(alone.workers) == {unit}
    assert alone.key.device_kind == "cpu (online)" and alone.block_size == 16
    assert alone.kv_bytes_per_token > 0 and alone.max_model_len > 0
    assert any("not measured" in line for line in alone.assumptions)


def test_a_worker_size_counts_cores_of_a_cpu_device_and_gpus() -> None:
    cpu = WorkerHandle(0, "decode", 0, "cpu0", (0, 1, 2, 3), None, None)  # type: ignore[arg-type]
    gpus = WorkerHandle(1, "decode", 1, "cuda1", (), None, None, devices=(1, 2))  # type: ignore[arg-type]
    assert (worker_size(cpu), worker_size(gpus)) == ("4x1", "1x2")
    cpu.loaded, cpu.num_blocks = True, 90
    assert kv_sizes([cpu, gpus]) == {"4x1": 90}  # the GPUs have not loaded yet
