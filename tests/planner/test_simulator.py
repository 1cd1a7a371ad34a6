"""The planner's simulator: hand-built profiles whose answers are known in closed form,
the real scheduler's decisions on the same arrivals, and the bench's own requests."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from hand_profiles import SIM_DECODE, SIM_HOST, SIM_PREFILL, hand_profile

from appliance.bench.report import write_json
from appliance.core.goodput import SLO, RequestResult, summarize
from appliance.engine.scheduler import Scheduler, SchedulerLimits
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.kv.block_allocator import BlockAllocator
from appliance.model.tokenizer import Tokenizer
from appliance.planner.layout import Layout, Pool, layout_of_roles
from appliance.planner.profile import (
    HandoffCost,
    HostCost,
    Profile,
    ProfileKey,
    StepCost,
    WorkerCost,
    attended,
)
from appliance.planner.simulator import (
    Policy,
    SimRequest,
    StepRecord,
    requests_from_results,
    requests_from_workload,
    simulate,
)

PREFILL, DECODE = SIM_PREFILL, SIM_DECODE
MIXED = StepCost(base_s=0.030, per_token_s=0.001, per_seq_s=0.001, per_context_s=2e-5)
HOST = SIM_HOST
HANDOFF = HandoffCost(base_s=0.003, per_byte_s=1e-8)
KV_BYTES = 1000

ONE_PLUS_ONE = Layout(mode="disaggregated", prefill=Pool(workers=1), decode=Pool(workers=1))
COLOCATED = Layout(mode="colocated", prefill=Pool(workers=1))
COLOCATED_X2 = Layout(mode="colocated", prefill=Pool(workers=2))


def profile(
    kv_blocks: int = 4096,
    contention: float = 1.0,
    host: HostCost = HOST,
    max_model_len: int = 4096,
    decode: StepCost = DECODE,
) -> Profile:
    worker = WorkerCost(
        prefill=PREFILL, decode=decode, mixed=MIXED, kv_blocks=kv_blocks, contention=contention
    )
    return hand_profile(
        {"1x1": worker},
        key=ProfileKey(model="test", dtype="float32", weights="dense", device_kind="cpu: test"),
        kv_bytes_per_token=KV_BYTES,
        max_model_len=max_model_len,
        handoff=HANDOFF,
        host=host,
    )


def prefill_s(*chunks: tuple[int, int]) -> float:
    """A prefill step of (start, tokens) chunks."""
    tokens = sum(n for _, n in chunks)
    return PREFILL.seconds(tokens, len(chunks), sum(attended(s, n) for s, n in chunks), 0)


def decode_s(lengths: list[int], cost: StepCost = DECODE) -> float:
    """A decode step of sequences of these lengths."""
    return cost.seconds(len(lengths), len(lengths), 0, sum(lengths))


# ---------------------------------------------------------------- closed forms


def test_one_request_alone_on_1p1d() -> None:
    prompt, output = 100, 5
    (result,) = simulate(profile(), ONE_PLUS_ONE, [SimRequest(0.0, prompt, output)])
    step = HOST.per_step_s
    prefilled = prefill_s((0, prompt)) + step
    assert result.ok and result.output_tokens == output
    assert result.ttft == pytest.approx(prefilled + HOST.per_token_s)
    landed = prefilled + HANDOFF.seconds(prompt * KV_BYTES)
    decodes = [decode_s([prompt + 1 + i]) + step for i in range(output - 1)]
    assert result.itl[0] == pytest.approx(landed - prefilled + decodes[0])
    assert result.itl[1:] == pytest.approx(decodes[1:])
    assert result.latency == pytest.approx(landed + sum(decodes) + HOST.per_token_s)
    assert result.tpot == pytest.approx((result.latency - result.ttft) / (output - 1))


def test_one_token_request_finishes_at_the_prefill_worker() -> None:
    trace: list[StepRecord] = []
    (result,) = simulate(profile(), ONE_PLUS_ONE, [SimRequest(1.0, 40, 1)], trace=trace)
    assert result.ok and result.itl == []
    assert result.start == 1.0
    assert (
        result.latency
        == result.ttft
        == pytest.approx(prefill_s((0, 40)) + HOST.per_step_s + HOST.per_token_s)
    )
    assert [r.worker for r in trace] == [0]  # the decode worker never ran


def test_a_saturated_decode_pool_runs_full_batches_at_the_full_batch_cadence() -> None:
    prompt, output, seqs = 16, 30, 4
    requests = [SimRequest(0.0, prompt, output) for _ in range(2 * seqs)]
    trace: list[StepRecord] = []
    results = simulate(profile(), ONE_PLUS_ONE, requests, Policy(max_num_seqs=seqs), trace=trace)
    assert all(r.ok and r.output_tokens == output for r in results)
    decode_steps = [r for r in trace if r.worker == 1]
    assert max(r.decodes for r in decode_steps) == seqs
    # The first four were prefilled in one step and landed together: every decode step
    # holds four sequences of one length, growing by one a step.
    cadence = [decode_s([prompt + 1 + i] * seqs) + HOST.per_step_s for i in range(output - 1)]
    for result in results[:seqs]:
        assert result.itl[1:] == pytest.approx(cadence[1:])
        assert result.tpot == pytest.approx(
            (HANDOFF.seconds(prompt * KV_BYTES) + sum(cadence)) / (output - 1)
        )
    # The next four waited for room: their decoding starts once the first four are done.
    first_done = max(r.start + r.latency for r in results[:seqs])
    for result in results[seqs:]:
        assert result.start + result.ttft < first_done
        assert result.start + result.ttft + result.itl[0] > first_done
        assert result.itl[1:] == pytest.approx(cadence[1:])


def test_a_long_prompt_is_prefilled_in_chunks() -> None:
    trace: list[StepRecord] = []
    (result,) = simulate(profile(), COLOCATED, [SimRequest(0.0, 1200, 2)], trace=trace)
    assert [r.prefill_chunks for r in trace[:3]] == [(512,), (512,), (176,)]
    assert [r.kind for r in trace] == ["prefill"] * 3 + ["decode"]
    steps = [prefill_s((0, 512)), prefill_s((512, 512)), prefill_s((1024, 176))]
    assert result.ttft == pytest.approx(sum(steps) + 3 * HOST.per_step_s + HOST.per_token_s)
    assert result.itl == pytest.approx([decode_s([1201]) + HOST.per_step_s])


def test_a_colocated_step_mixing_a_chunk_and_decodes_costs_mixed() -> None:
    trace: list[StepRecord] = []
    requests = [SimRequest(0.0, 16, 20), SimRequest(0.1, 100, 3)]
    simulate(profile(), COLOCATED, requests, trace=trace)
    (mixed,) = [r for r in trace if r.kind == "mixed"]
    assert mixed.prefill_chunks == (100,) and mixed.decodes == 1
    decodes_before = sum(1 for r in trace if r.kind == "decode" and r.end <= mixed.start)
    length = 16 + 1 + decodes_before  # the decoding sequence's tokens in that step
    expected = MIXED.seconds(101, 2, attended(0, 100), length)
    assert mixed.end - mixed.start == pytest.approx(expected + HOST.per_step_s)


def test_contention_slows_only_the_overlapping_part_of_a_step() -> None:
    quiet = HostCost()
    requests = [SimRequest(0.0, 100, 1), SimRequest(0.1, 100, 1)]
    step = prefill_s((0, 100))  # 0.2155 s: the second arrives mid-step
    results = simulate(profile(contention=1.5, host=quiet), COLOCATED_X2, requests)
    # Alone for 0.1 s, then at 2/3 speed while the other runs.
    first_end = 0.1 + (step - 0.1) * 1.5
    assert results[0].ttft == pytest.approx(first_end)
    done_by_then = (first_end - 0.1) / 1.5
    assert results[1].ttft == pytest.approx(first_end - 0.1 + step - done_by_then)
    alone = simulate(profile(contention=1.5, host=quiet), COLOCATED, requests[:1])
    assert alone[0].ttft == pytest.approx(step)


# ---------------------------------------------------------------- capacity and failures


def test_a_small_colocated_pool_preempts_and_everything_still_completes() -> None:
    requests = [SimRequest(0.01 * i, 60, 80) for i in range(6)]
    trace: list[StepRecord] = []
    results = simulate(profile(kv_blocks=20), COLOCATED, requests, trace=trace)
    assert all(r.ok and r.output_tokens == 80 and len(r.itl) == 79 for r in results)
    assert sum(r.preempted for r in trace) > 0


def test_handoffs_wait_for_decode_room_and_everything_completes() -> None:
    requests = [SimRequest(0.0, 100, 60) for _ in range(6)]
    roomy = simulate(profile(), ONE_PLUS_ONE, requests)
    # 12 blocks: one sequence at a time fits (100 + 60 tokens = 10 blocks).
    tight = simulate(profile(kv_blocks=12), ONE_PLUS_ONE, requests)
    assert all(r.ok and r.output_tokens == 60 for r in roomy + tight)
    ends = sorted(r.start + r.latency for r in tight)
    firsts = sorted(r.start + r.ttft + r.itl[0] for r in tight)
    assert all(second > end for end, second in zip(ends, firsts[1:], strict=False))
    assert max(r.latency for r in tight) > 2 * max(r.latency for r in roomy)


def test_a_small_decode_pool_preempts_and_recomputes_on_the_decode_worker() -> None:
    # Each takes 2 blocks when handed off and grows to 9: four of them outgrow 20 blocks.
    requests = [SimRequest(0.0, 30, 100) for _ in range(4)]
    trace: list[StepRecord] = []
    results = simulate(profile(kv_blocks=20), ONE_PLUS_ONE, requests, trace=trace)
    assert all(r.ok and r.output_tokens == 100 and len(r.itl) == 99 for r in results)
    decode = [r for r in trace if r.worker == 1]
    assert sum(r.preempted for r in decode) > 0
    assert any(r.prefill_chunks for r in decode)  # the recompute runs there


def test_requests_that_cannot_fit_fail_and_the_rest_run() -> None:
    requests = [SimRequest(0.0, 4000, 200), SimRequest(0.0, 50, 10), SimRequest(0.0, 300, 10)]
    results = simulate(profile(kv_blocks=16), COLOCATED, requests)
    assert not results[0].ok and "context" in results[0].error
    assert results[1].ok and results[1].output_tokens == 10
    assert not results[2].ok and "KV blocks" in results[2].error  # 310 tokens > 256
    assert summarize(results, 10.0, SLO()).failed == 2


def test_the_policy_from_settings_is_a_fresh_appliances_tuning() -> None:
    from appliance.settings.config import load_settings

    settings = load_settings()
    policy = Policy.from_settings(settings)
    assert policy.max_num_seqs == settings.batch.max_num_seqs
    assert policy.prefill_token_budget == settings.batch.max_num_batched_tokens
    assert policy.chunk_size == min(settings.batch.chunk_size, policy.prefill_token_budget)
    assert (policy.routing, policy.prefix_caching) == ("least_loaded", settings.kv.prefix_caching)


def test_bad_inputs_raise_value_errors() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        SimRequest(0.0, 0, 1)
    with pytest.raises(ValueError, match="prefix_tokens"):
        SimRequest(0.0, 10, 1, prefix_id=1, prefix_tokens=11)
    with pytest.raises(ValueError, match="chunk_size"):
        Policy(chunk_size=4096)
    with pytest.raises(ValueError, match="routing"):
        Policy(routing="random")
    with pytest.raises(ValueError, match="size 2x1"):
        simulate(profile(), Layout(mode="colocated", device_size=2, prefill=Pool(workers=1)), [])
    with pytest.raises(ValueError, match="colocated"):
        policy = Policy(max_num_seqs=64, prefill_token_budget=32, chunk_size=32)
        simulate(profile(), COLOCATED, [], policy)


# ---------------------------------------------------------------- routing and caching


def _worker_of(trace: list[StepRecord], chunk: int) -> int:
    (worker,) = {r.worker for r in trace if chunk in r.prefill_chunks}
    return worker  # the one worker that prefilled a prompt of `chunk` tokens


def test_least_loaded_routes_around_a_long_prompt_and_round_robin_does_not() -> None:
    requests = [SimRequest(0.0, n, 2) for n in (1000, 60, 61, 62)]
    policy = Policy(prefill_token_budget=256, chunk_size=256)
    least: list[StepRecord] = []
    by_load = simulate(profile(), COLOCATED_X2, requests, policy, trace=least)
    assert [_worker_of(least, n) for n in (60, 61, 62)] == [1, 1, 1]
    assert max(r.ttft for r in by_load[1:]) < by_load[0].ttft
    turns: list[StepRecord] = []
    rr = Policy(prefill_token_budget=256, chunk_size=256, routing="round_robin")
    in_turn = simulate(profile(), COLOCATED_X2, requests, rr, trace=turns)
    assert [_worker_of(turns, n) for n in (60, 62)] == [1, 1]
    assert in_turn[2].ttft > in_turn[0].ttft  # the 61-token prompt waited behind the long one


def test_prefix_caching_skips_the_cached_blocks_of_a_shared_prefix() -> None:
    requests = [SimRequest(0.0, 1100, 2, 7, 1024), SimRequest(5.0, 1090, 2, 7, 1024)]
    cached: list[StepRecord] = []
    hit = simulate(profile(), COLOCATED, requests, trace=cached)
    assert next(r.prefill_chunks for r in cached if r.start >= 5.0) == (66,)
    again: list[StepRecord] = []
    miss = simulate(profile(), COLOCATED, requests, Policy(prefix_caching=False), trace=again)
    assert [r.prefill_chunks for r in again if r.start >= 5.0][:3] == [(512,), (512,), (66,)]
    assert hit[1].ttft == pytest.approx(prefill_s((1024, 66)) + HOST.per_step_s + 0.0005)
    assert miss[1].ttft > 2 * hit[1].ttft
    assert hit[0].ttft == pytest.approx(miss[0].ttft)  # the first one computes it either way


def _entry_workers(gap: float, caching: bool = True, stored: int = 0) -> set[int]:
    """The workers that prefilled two prompts sharing a 512-token prefix, the second
    `gap` seconds after the first (which decodes for about 6 s); `stored`: the prefix
    tokens of the second that the box's KV store serves."""
    requests = [
        SimRequest(0.0, 540, 200, 3, 512),
        SimRequest(gap, 541, 2, 3, 512, stored_tokens=stored),
    ]
    trace: list[StepRecord] = []
    simulate(profile(), COLOCATED_X2, requests, Policy(prefix_caching=caching), trace=trace)
    return {r.worker for r in trace if r.prefill_chunks}


def test_routing_weighs_a_cached_prefix_against_the_queue() -> None:
    # As router.least_wait: where the second prompt waits least for its first token, in
    # prompt tokens computed (29 where its prefix is cached, 541 elsewhere). Once the first
    # one has its first token, its worker's load is a row a step: the prefix wins.
    assert _entry_workers(1.0) == {0}
    assert _entry_workers(1.0, caching=False) == {0, 1}  # nothing saved: the idle worker
    # In a burst the first one's 540 queued tokens outweigh the 512 its worker saves.
    assert _entry_workers(0.0) == {0, 1}
    # The store serves the prefix to either worker: load decides, the idle one takes it.
    assert _entry_workers(1.0, stored=512) == {0, 1}


def test_the_decode_worker_copies_only_what_it_has_not_cached() -> None:
    requests = [SimRequest(0.0, 1050, 3, 1, 1024), SimRequest(5.0, 1050, 3, 1, 1024)]
    first, second = simulate(profile(), ONE_PLUS_ONE, requests)
    full = HANDOFF.seconds(1050 * KV_BYTES)
    tail = HANDOFF.seconds((1050 - 1024) * KV_BYTES)
    assert first.itl[0] - second.itl[0] == pytest.approx(full - tail)


# ---------------------------------------------------------------- mixed layouts


def test_a_mixed_colocated_worker_takes_every_prompt_and_the_decode_worker_idles() -> None:
    layout = layout_of_roles(["colocated", "decode"])  # worker 0 decodes, 1 is colocated
    requests = [SimRequest(0.02 * i, 100 + i, 8) for i in range(6)]
    trace: list[StepRecord] = []
    results = simulate(profile(), layout, requests, trace=trace)
    assert all(r.ok and r.output_tokens == 8 for r in results)
    assert {r.worker for r in trace} == {1}
    alone = simulate(profile(), COLOCATED, requests)  # the same as one colocated worker
    assert [r.latency for r in results] == pytest.approx([r.latency for r in alone])


def test_a_mixed_layout_routes_to_both_entry_workers_and_only_prefill_hands_off() -> None:
    layout = layout_of_roles(["prefill", "decode", "colocated"])
    slow_handoff = profile().model_copy(update={"handoff": HandoffCost(base_s=0.5, per_byte_s=0)})
    requests = [SimRequest(0.0, 100 + i, 4) for i in range(6)]
    trace: list[StepRecord] = []
    results = simulate(slow_handoff, layout, requests, trace=trace)
    assert all(r.ok and r.output_tokens == 4 for r in results)
    entry = [_worker_of(trace, 100 + i) for i in range(6)]
    assert set(entry) == {0, 2}
    for worker, result in zip(entry, results, strict=True):
        assert (result.itl[0] > 0.5) == (worker == 0)  # handed off: waited for the copy
    assert {r.kind for r in trace if r.worker == 0} == {"prefill"}
    decode = [r for r in trace if r.worker == 1]
    assert decode and not any(r.prefill_chunks for r in decode)
    assert any(r.decodes for r in trace if r.worker == 2)  # it decodes its own


def test_mixed_layouts_keep_the_colocated_batch_check() -> None:
    policy = Policy(max_num_seqs=64, prefill_token_budget=32, chunk_size=32)
    with pytest.raises(ValueError, match="colocated"):
        simulate(profile(), layout_of_roles(["prefill", "decode", "colocated"]), [], policy)
    assert simulate(profile(), ONE_PLUS_ONE, [], policy) == []


# ---------------------------------------------------------------- closed loop, traces


def test_closed_loop_sends_each_next_request_when_one_ends() -> None:
    requests = [SimRequest(0.0, 20, n) for n in (5, 30, 10, 10)]
    results = simulate(profile(), COLOCATED, requests, concurrency=2)
    ends = [r.start + r.latency for r in results]
    assert results[0].start == results[1].start == 0.0
    assert results[2].start == pytest.approx(ends[0])  # the shorter first one ended first
    assert results[3].start == pytest.approx(min(ends[1], ends[2]))


def test_requests_from_a_recorded_result_file(tmp_path: Path) -> None:
    recorded = [
        RequestResult(prompt_tokens=30, output_tokens=7, ok=True, start=0.5),
        RequestResult(prompt_tokens=40, output_tokens=0, ok=False, start=0.7),
        RequestResult(prompt_tokens=50, output_tokens=9, ok=True, start=0.1),
    ]
    write_json(tmp_path / "result.json", {"args": {"workload": "chat"}, "results": recorded})
    requests = requests_from_results(tmp_path / "result.json")
    assert requests == [SimRequest(0.1, 50, 9), SimRequest(0.5, 30, 7)]
    runs = [{"label": "a", "results": recorded[:1]}, {"label": "b", "results": recorded[2:]}]
    write_json(tmp_path / "compare.json", {"args": {"workload": "shared-prefix"}, "runs": runs})
    assert requests_from_results(tmp_path / "compare.json", run="b") == [
        SimRequest(0.1, 50, 9, 0, 50)
    ]
    with pytest.raises(ValueError, match="no run 'c'"):
        requests_from_results(tmp_path / "compare.json", run="c")
    (tmp_path / "bad.json").write_text(json.dumps([1]))
    with pytest.raises(ValueError, match="no bench results"):
        requests_from_results(tmp_path / "bad.json")


# ---------------------------------------------------------------- against the real scheduler


def _replay_on_the_scheduler(
    requests: list[SimRequest], trace: list[StepRecord], blocks: int, policy: Policy
) -> list[tuple[tuple[int, ...], int, int]]:
    """Drive engine/scheduler.py through the simulated steps' start times, adding each
    request once it has arrived; what each step scheduled."""
    limits = SchedulerLimits(
        policy.max_num_seqs, policy.prefill_token_budget, policy.chunk_size, 4096
    )
    scheduler = Scheduler(BlockAllocator(blocks), 16, limits, policy.prefix_caching)
    rng = random.Random(1)
    pending = list(enumerate(requests))
    steps = []
    for record in trace:
        while pending and pending[0][1].arrival_s <= record.start:
            index, request = pending.pop(0)
            tokens = [rng.randrange(1000) for _ in range(request.prompt_tokens)]
            params = SamplingParams(max_tokens=request.output_tokens, ignore_eos=True)
            scheduler.add(Sequence(index, tokens, params))
        out = scheduler.schedule()
        steps.append(
            (tuple(c.num_tokens for c in out.prefills), len(out.decodes), len(out.preempted))
        )
        sampled = {c.seq.seq_id: 0 for c in out.chunks if c.completes}
        scheduler.update_from_output(out, sampled)
    assert not scheduler.has_unfinished()
    return steps


@pytest.mark.parametrize("caching", [True, False])
def test_a_colocated_worker_schedules_as_the_real_scheduler_does(caching: bool) -> None:
    rng = random.Random(5)
    requests = [
        SimRequest(
            round(i * 0.07 + rng.random() * 0.01, 4), rng.randint(20, 150), rng.randint(5, 60)
        )
        for i in range(14)
    ]
    policy = Policy(max_num_seqs=6, prefill_token_budget=128, chunk_size=64, prefix_caching=caching)
    trace: list[StepRecord] = []
    results = simulate(profile(kv_blocks=30), COLOCATED, requests, policy, trace=trace)
    assert all(r.ok for r in results)
    ours = [(r.prefill_chunks, r.decodes, r.preempted) for r in trace]
    assert ours == _replay_on_the_scheduler(requests, trace, 30, policy)
    assert sum(r.preempted for r in trace) > 0  # the case exercises preemption


def test_lazy_decoding_gives_what_scheduling_every_sequence_every_step_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker advances decoding sequences without touching them (sim_worker.py);
    with that turned off every sequence goes through the scheduler's loop every step."""
    from appliance.planner.sim_worker import Worker

    rng = random.Random(11)
    requests = [
        SimRequest(round(rng.random() * 2, 4), rng.randint(1, 300), rng.randint(1, 120))
        for _ in range(40)
    ]
    two_by_two = Layout(mode="disaggregated", prefill=Pool(workers=2), decode=Pool(workers=2))
    policy = Policy(max_num_seqs=8, prefill_token_budget=128, chunk_size=64)
    cases = [(two_by_two, 40), (COLOCATED_X2, 30)]
    lazy = [
        simulate(profile(blocks, contention=1.3), layout, requests, policy)
        for layout, blocks in cases
    ]
    monkeypatch.setattr(Worker, "_join", lambda self, seq: self.tail.append(seq))
    monkeypatch.setattr(Worker, "_settle_tail", lambda self: None)
    eager = [
        simulate(profile(blocks, contention=1.3), layout, requests, policy)
        for layout, blocks in cases
    ]
    assert lazy == eager
    assert all(r.ok for results in lazy for r in results)


# ---------------------------------------------------------------- the bench's workloads


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from appliance.model.model_source import prepare_tokenizer
    from appliance.settings.config import load_settings

    return prepare_tokenizer(None, load_settings().cache_dir)[1]


def test_requests_from_workload_are_the_benchs(tokenizer: Tokenizer) -> None:
    from appliance.bench.runner import poisson_gaps
    from appliance.bench.workloads import generate

    requests = requests_from_workload("chat", tokenizer, 3, 20, rate=4.0, warmup=2)
    specs = list(itertools.islice(generate("chat", tokenizer, 3), 2, 22))
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [
        (s.prompt_tokens, s.max_tokens) for s in specs
    ]
    gaps = poisson_gaps(4.0, random.Random("arrivals:3"))
    arrivals = list(itertools.accumulate((next(gaps) for _ in range(19)), initial=0.0))
    assert [r.arrival_s for r in requests] == pytest.approx(arrivals)
    burst = requests_from_workload("shared-prefix", tokenizer, 0, 3, rate=None)
    assert {(r.arrival_s, r.prefix_id, r.prefix_tokens) for r in burst} == {(0.0, 0, 1024)}


def test_a_simulated_workload_is_deterministic(tokenizer: Tokenizer) -> None:
    def run() -> list[RequestResult]:
        requests = requests_from_workload("long-burst", tokenizer, 7, 40, rate=8.0)
        return simulate(profile(contention=1.2), ONE_PLUS_ONE, requests)

    first, second = run(), run()
    assert first == second
    assert all(r.ok for r in first)
